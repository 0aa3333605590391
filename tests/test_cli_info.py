"""`pdtrace info` through the real entry point: table and JSON output, and bad input as one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pdtrace import __version__
from pdtrace.format import file_metadata
from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.reader import find_part_files

START = 1_700_000_000_000_000_000


def build() -> EventBuilder:
    """P (dp 0 and 1, a TP-2 worker pair) and D (dp 0): known counts for every summary field."""
    b = EventBuilder(instance="P", role="prefill", pid=10, start_ns=START, tick_ns=1_000)
    b.add("engine_config", n=100, detail={"block_size": 16})
    for step in range(4):
        b.add("sched", step=step, n=32)
        b.add("req_sched", step=step, req=f"p{step % 3}", n=32)
        for tp in (0, 1):
            b.add("exec_begin", pid=11 + tp, step=step, pp_rank=0, tp_rank=tp, n=32)
            b.add("exec_end", pid=11 + tp, step=step, pp_rank=0, tp_rank=tp, n=32)
    b.add("sched", step=4, n=0, detail={"empty_run": 10})
    b.add("sched", dp_rank=1, pid=20, step=7, n=1)
    b.add("req_add", dp_rank=1, pid=20, req="p0", n=1)  # same id on another dp rank: one distinct request
    b.add("req_add", instance="D", role="decode", pid=30, req="d1", n=8)
    b.add("req_finish", instance="D", role="decode", pid=30, step=0, req="d1", reason="stop")
    b.add("kv_teleport", instance="D", role="decode", pid=30, req="d1")
    return b


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    return build().write(tmp_path / "trace", rows_per_file=5)


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert lines[0].startswith("pdtrace: error: ")
    return lines[0]


def test_version_and_help(cli):
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"pdtrace {__version__}"
    result = cli("info", "--help")
    assert result.exit_code == 0 and "--format" in result.stdout


def test_json_counts(cli, trace_dir):
    result = cli("info", trace_dir, "--format", "json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["events"] == 31
    assert summary["files"] == len(find_part_files(trace_dir))
    assert summary["skipped_files"] == [] and summary["dropped_events"] == 0
    assert summary["sources"] == ["synthetic"] and summary["schema_versions"] == ["1"]
    assert summary["time"]["start_ns"] == START
    assert summary["time"]["duration_ns"] == 30_000  # 31 events, 1 µs apart
    assert summary["time"]["start"] == "2023-11-14T22:13:20.000000000Z"
    by_instance = {i["instance"]: i for i in summary["instances"]}
    assert set(by_instance) == {"P", "D"}
    assert by_instance["P"] == {"instance": "P", "name": "P", "roles": ["prefill"], "pids": [10, 11, 12, 20],
                                "dp_ranks": [0, 1], "pp_ranks": [0], "tp_ranks": [0, 1], "events": 28, "requests": 3}
    assert by_instance["D"]["requests"] == 1 and by_instance["D"]["events"] == 3
    assert summary["requests"] == 4
    assert summary["schedulers"] == [
        {"instance": "D", "name": "D",
         "dp_rank": 0, "steps": 0, "sched_events": 0, "first_step": None, "last_step": None},
        {"instance": "P", "name": "P",
         "dp_rank": 0, "steps": 4 + 10, "sched_events": 5, "first_step": 0, "last_step": 4},
        {"instance": "P", "name": "P",
         "dp_rank": 1, "steps": 1, "sched_events": 1, "first_step": 7, "last_step": 7},
    ]
    # format kinds in the format's order, then unknown kinds
    assert list(summary["kinds"].items()) == [("engine_config", 1), ("req_add", 2), ("sched", 6), ("req_sched", 4),
                                              ("req_finish", 1), ("exec_begin", 8), ("exec_end", 8),
                                              ("kv_teleport", 1)]
    assert summary["manifest"] is None
    assert len(summary["warnings"]) == 1 and "kv_teleport" in summary["warnings"][0]
    # the unknown kind is reported on stderr, once, as a warning
    assert result.stderr.count("pdtrace: warning:") == 1


def test_table_output(cli, trace_dir):
    result = cli("info", trace_dir)
    assert result.exit_code == 0, result.stderr
    for text in ("instances", "schedulers", "events per kind", "prefill", "decode", "engine_config", "synthetic"):
        assert text in result.stdout
    assert any(line.split() == ["events", "31"] for line in result.stdout.splitlines())
    assert any(line.split() == ["dropped", "events", "0"] for line in result.stdout.splitlines())


def test_manifest_and_skipped_file(cli, trace_dir):
    (trace_dir / "_manifest.json").write_text(json.dumps(
        {"command": ["vllm", "serve", "m"], "vllm_version": "0.33.0"}))
    (trace_dir / "P" / "bad.parquet").write_text("not parquet")
    result = cli("info", trace_dir, "-f", "json")
    assert result.exit_code == 0
    summary = json.loads(result.stdout)
    assert summary["manifest"] == {"command": "vllm serve m", "vllm_version": "0.33.0", "vllm_table": None,
                                   "created": None}
    assert [Path(s["path"]).name for s in summary["skipped_files"]] == ["bad.parquet"]
    assert summary["events"] == 31
    assert "bad.parquet: skipped: not a Parquet file" in result.stderr
    table = cli("info", trace_dir)
    assert "vllm serve m" in table.stdout and "0.33.0" in table.stdout and "skipped files" in table.stdout


def test_missing_dir(cli, tmp_path):
    line = one_error_line(cli("info", tmp_path / "nope"))
    assert line.endswith("nope: no such file or directory")


def test_empty_dir(cli, tmp_path):
    assert "no Parquet files in this directory" in one_error_line(cli("info", tmp_path))


def test_non_parquet_file(cli, tmp_path):
    path = tmp_path / "events.parquet"
    path.write_text("ts_ns,kind\n1,sched\n")
    assert one_error_line(cli("info", path)).endswith("events.parquet: not a Parquet file (no Parquet magic bytes "
                                                      "at the start)")


def test_truncated_file(cli, trace_dir, tmp_path):
    part = find_part_files(trace_dir)[0]
    data = part.read_bytes()
    cut = tmp_path / "cut" / "part-000000.parquet"
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) - 100])
    line = one_error_line(cli("info", cut.parent))
    assert f"{cut}: truncated Parquet file" in line


def write_part(path: Path, table: pa.Table, metadata: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata(metadata), path)


def test_missing_column(cli, tmp_path):
    path = tmp_path / "t" / "part-000000.parquet"
    write_part(path, build().table().drop_columns(["component"]), file_metadata("t", "synthetic", 0))
    line = one_error_line(cli("info", tmp_path / "t"))
    assert line == f"pdtrace: error: {path}: missing column 'component' (expected dictionary<string>)"


def test_unknown_schema_version(cli, tmp_path):
    metadata = file_metadata("t", "synthetic", 0)
    metadata[b"pdtrace.schema_version"] = b"2"
    path = tmp_path / "t" / "part-000000.parquet"
    write_part(path, build().table(), metadata)
    line = one_error_line(cli("info", tmp_path / "t"))
    assert f"{path}: unknown trace schema version '2'" in line


def test_bad_value(cli, tmp_path):
    table = build().table()
    roles = table.column("role").to_pylist()
    roles[3] = "primary"
    path = tmp_path / "t" / "part-000000.parquet"
    write_part(path, table.set_column(3, "role", pa.array(roles).dictionary_encode()),
               file_metadata("t", "synthetic", 0))
    assert f"{path}: row 3, column 'role'" in one_error_line(cli("info", path))


def test_bad_format_option_is_a_usage_error(cli, trace_dir):
    result = cli("info", trace_dir, "--format", "xml")
    assert result.exit_code == 2 and "Traceback" not in result.stderr


def test_reads_a_trace_the_recorder_wrote(cli, tmp_path):
    recorder_module = pytest.importorskip("pdtrace.recording.recorder")
    ticks = iter(range(START, START + 10_000_000, 1_000))
    rec = recorder_module.Recorder(tmp_path / "rec", instance="prefill-0", role="prefill", source="dryrun",
                                   dp_rank=0, clock=lambda: next(ticks))
    sched = rec.channel("scheduler")
    worker = rec.channel("worker", pp_rank=0, tp_rank=0)
    rec.emit("engine_config", n=64, detail={"block_size": 16})
    sched.emit("req_add", req="r1", n=40, detail={"remote_decode": True})
    sched.emit("sched", step=0, n=40)
    sched.emit_many("req_sched", step=0, reqs=["r1", "r2"], ns=[32, 8])
    sched.emit("blocks_alloc", step=0, req="r1", blocks=[1, 2, 3])
    worker.emit("exec_begin", step=0, n=40)
    worker.emit("exec_end", step=0, n=40)
    sched.emit("req_finish", step=1, req="r1", reason="stop", status="RUNNING", delay_free=True)
    rec.close()

    result = cli("info", tmp_path / "rec", "--format", "json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["events"] == 9
    assert summary["sources"] == ["dryrun"] and summary["schema_versions"] == ["1"]
    assert summary["kinds"] == {"engine_config": 1, "req_add": 1, "sched": 1, "req_sched": 2, "req_finish": 1,
                                "blocks_alloc": 1, "exec_begin": 1, "exec_end": 1}
    [instance] = summary["instances"]
    assert instance["instance"] == "prefill-0" and instance["roles"] == ["prefill"]
    assert instance["requests"] == 2 and instance["tp_ranks"] == [0]
    assert summary["schedulers"] == [{"instance": "prefill-0", "name": "prefill-0", "dp_rank": 0, "steps": 1,
                                      "sched_events": 1, "first_step": 0, "last_step": 0}]
    # emit_many takes one timestamp for its rows: 8 clock readings for 9 events
    assert summary["time"]["start_ns"] == START and summary["time"]["duration_ns"] == 7_000
    assert result.stderr == ""
