"""open_trace: round trip with EventBuilder.write, projection and filters, manifest, skipped parts, bad input."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pdtrace import open_trace as package_open_trace
from pdtrace.errors import TraceError, UsageError
from pdtrace.format import SCHEMA, file_metadata
from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.reader import find_part_files, open_trace
from pdtrace.trace.validate import TraceWarning

START = 1_700_000_000_000_000_000


def build() -> EventBuilder:
    """Two instances, a scheduler and a worker process each; 3 requests per instance."""
    b = EventBuilder(instance="prefill-0", role="prefill", start_ns=START)
    for instance, role, pid in (("prefill-0", "prefill", 100), ("decode-0", "decode", 200)):
        for step in range(3):
            req = f"{instance}-r{step}"
            b.add("req_add", instance=instance, role=role, pid=pid, req=req, n=16)
            b.add("sched", instance=instance, role=role, pid=pid, step=step, n=16)
            b.add("blocks_alloc", instance=instance, role=role, pid=pid, step=step, req=req, blocks=[step + 1])
            b.add("exec_begin", instance=instance, role=role, pid=pid + 1, step=step, pp_rank=0, tp_rank=0)
            b.add("req_finish", instance=instance, role=role, pid=pid, step=step, req=req, reason="stop")
    return b


def rows_by_writer(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: (r["instance"], r["pid"], r["seq"]))


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    return build().write(tmp_path / "trace", rows_per_file=2)


def test_round_trip_keeps_every_event_and_the_format_schema(trace_dir):
    trace = open_trace(trace_dir)
    expected = build().table()
    assert trace.table.schema.equals(SCHEMA)
    assert rows_by_writer(trace.table) == rows_by_writer(expected)
    assert trace.path == str(trace_dir)
    assert trace.skipped == [] and trace.warnings == [] and trace.manifest is None
    # per instance: a scheduler writer with 12 rows (6 files of 2) and a worker writer with 3 rows (2 files)
    assert len(trace.files) == 2 * (6 + 2)
    assert sum(f.rows for f in trace.files) == 30
    assert {f.source for f in trace.files} == {"synthetic"} and trace.sources == ["synthetic"]
    assert all(f.schema_version == "1" for f in trace.files)


def test_rows_come_in_file_order_and_seq_order_within_a_writer(trace_dir):
    trace = open_trace(trace_dir)
    files = [Path(f.path) for f in trace.files]
    assert files == sorted(files)
    pids = trace.column("pid")
    seqs = trace.column("seq")
    writers_in_order = [int(p.parent.name) for p in files]
    change = [0] + [i for i in range(1, len(pids)) if pids[i] != pids[i - 1]]
    assert [int(pids[i]) for i in change] == sorted(set(writers_in_order), key=writers_in_order.index)
    for i in range(1, len(pids)):
        if pids[i] == pids[i - 1]:
            assert seqs[i] > seqs[i - 1]


def test_dictionaries_are_unified_across_files(trace_dir):
    table = open_trace(trace_dir).table
    for name in ("instance", "kind", "role", "component"):
        chunks = table.column(name).chunks
        assert len(chunks) > 1
        assert all(c.dictionary.equals(chunks[0].dictionary) for c in chunks)


def test_package_entry_point_delegates(trace_dir):
    assert len(package_open_trace(trace_dir)) == 30


def test_a_single_part_file_opens(trace_dir):
    first = find_part_files(trace_dir)[0]
    trace = open_trace(first)
    assert len(trace) == pq.read_metadata(first).num_rows == 2
    assert [f.path for f in trace.files] == [str(first)]


def test_projection_keeps_the_requested_columns_in_format_order(trace_dir):
    trace = open_trace(trace_dir, columns=["kind", "ts_ns", "blocks"])
    assert trace.table.column_names == ["ts_ns", "kind", "blocks"]
    assert trace.table.schema.field("kind").type == SCHEMA.field("kind").type
    assert len(trace) == 30


def test_unknown_column_is_a_usage_error(trace_dir):
    with pytest.raises(UsageError, match="unknown trace column"):
        open_trace(trace_dir, columns=["ts_ns", "gpu"])


def test_instance_filter(trace_dir):
    trace = open_trace(trace_dir, instances="decode-0")
    assert len(trace) == 15
    assert set(trace.table.column("instance").to_pylist()) == {"decode-0"}
    both = open_trace(trace_dir, instances=["decode-0", "prefill-0"], columns=["instance"])
    assert len(both) == 30 and both.table.column_names == ["instance"]
    assert len(open_trace(trace_dir, instances=["nobody"])) == 0


def test_instance_filter_does_not_read_other_instances_files(trace_dir, monkeypatch):
    import pdtrace.trace.reader as reader

    read: list[str] = []
    original = reader._read_files

    def spy(paths, columns, expression, *rest):
        read.extend(paths)
        return original(paths, columns, expression, *rest)

    monkeypatch.setattr(reader, "_read_files", spy)
    trace = open_trace(trace_dir, instances="decode-0")
    assert len(trace) == 15
    assert read and all(Path(p).relative_to(trace_dir).parts[0] == "decode-0" for p in read)
    # every file's metadata is still listed (dropped events, sources)
    assert len(trace.files) == len(find_part_files(trace_dir))


def test_time_window_is_half_open(trace_dir):
    all_ts = sorted(open_trace(trace_dir).table.column("ts_ns").to_pylist())
    since, until = all_ts[5], all_ts[12]
    trace = open_trace(trace_dir, since_ns=since, until_ns=until)
    assert sorted(trace.table.column("ts_ns").to_pylist()) == all_ts[5:12]
    only_since = open_trace(trace_dir, since_ns=all_ts[-1])
    assert only_since.table.column("ts_ns").to_pylist() == [all_ts[-1]]


def test_filters_combine(trace_dir):
    full = open_trace(trace_dir)
    ts = full.table.column("ts_ns")
    middle = sorted(ts.to_pylist())[15]
    trace = open_trace(trace_dir, instances="prefill-0", until_ns=middle)
    mask = pc.and_(pc.equal(full.table.column("instance"), "prefill-0"), pc.less(ts, middle))
    assert len(trace) == pc.sum(pc.cast(mask, pa.int64())).as_py() > 0


def test_manifest_is_read(trace_dir):
    (trace_dir / "_manifest.json").write_text(json.dumps({"command": ["vllm", "serve"], "vllm_version": "0.33.0"}))
    trace = open_trace(trace_dir)
    assert trace.manifest == {"command": ["vllm", "serve"], "vllm_version": "0.33.0"}
    assert len(trace) == 30


def test_bad_manifest_is_a_warning(trace_dir):
    (trace_dir / "_manifest.json").write_text("{not json")
    with pytest.warns(TraceWarning, match="_manifest.json: not valid JSON"):
        trace = open_trace(trace_dir)
    assert trace.manifest is None and len(trace) == 30
    assert len(trace.warnings) == 1


def test_underscore_and_dot_names_are_skipped_at_any_level(trace_dir):
    first = find_part_files(trace_dir)[0]
    hidden = [trace_dir / "_tmp" / "x.parquet", trace_dir / "prefill-0" / ".part-9.parquet",
              trace_dir / "prefill-0" / "100" / "_part.parquet", trace_dir / ".cache" / "a" / "b.parquet"]
    for path in hidden:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(first, path)
    found = find_part_files(trace_dir)
    assert not set(found) & set(hidden)
    assert len(open_trace(trace_dir)) == 30


def test_corrupt_parts_are_skipped_with_a_warning(trace_dir):
    first = find_part_files(trace_dir)[0]
    data = first.read_bytes()
    truncated = first.parent / "part-999998.parquet"
    truncated.write_bytes(data[: len(data) // 2])
    text = first.parent / "part-999999.parquet"
    text.write_text("ts_ns,kind\n1,sched\n")
    with pytest.warns(TraceWarning) as caught:
        trace = open_trace(trace_dir)
    assert len(trace) == 30
    reasons = {Path(s.path).name: s.reason for s in trace.skipped}
    assert set(reasons) == {"part-999998.parquet", "part-999999.parquet"}
    assert reasons["part-999998.parquet"].startswith("truncated Parquet file")
    assert reasons["part-999999.parquet"].startswith("not a Parquet file")
    assert len(caught) == 2 and all("skipped" in str(w.message) for w in caught)
    assert str(truncated) not in {f.path for f in trace.files}


def test_corrupt_data_page_with_an_intact_footer_is_skipped(trace_dir):
    victim = find_part_files(trace_dir)[3]
    table = pq.read_table(victim)
    pq.write_table(table, victim, compression="zstd", use_dictionary=False)
    data = bytearray(victim.read_bytes())
    for offset in range(8, len(data) // 3):  # scramble the first column chunks, keep the footer
        data[offset] = 0xFF
    victim.write_bytes(bytes(data))
    with pytest.warns(TraceWarning):
        trace = open_trace(trace_dir)
    assert [s.path for s in trace.skipped] == [str(victim)]
    assert trace.skipped[0].reason.startswith("corrupt Parquet file")
    assert str(victim) not in {f.path for f in trace.files}
    assert len(trace) == 30 - table.num_rows


def test_no_warning_issued_when_warn_is_false(trace_dir):
    (find_part_files(trace_dir)[0].parent / "part-999999.parquet").write_text("hello")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = open_trace(trace_dir, warn=False)
    assert len(trace.skipped) == 1 and len(trace.warnings) == 1


def test_all_parts_bad_is_an_error(tmp_path):
    (tmp_path / "a.parquet").write_text("one")
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(TraceError, match=r"none of the 2 Parquet files could be read \(first: .*a\.parquet: not a"):
        open_trace(tmp_path)


@pytest.mark.parametrize(
    "setup, pattern",
    [
        (lambda p: p / "missing", r"missing: no such file or directory$"),
        (lambda p: p, r": no Parquet files in this directory"),
        (lambda p: (p / "t.parquet", (p / "t.parquet").write_text("x"))[0], r"t\.parquet: not a Parquet file"),
    ],
)
def test_bad_input_is_one_line(tmp_path, setup, pattern):
    with pytest.raises(TraceError, match=pattern) as info:
        open_trace(setup(tmp_path))
    assert "\n" not in str(info.value)


def write_part(path: Path, table: pa.Table, metadata: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata(metadata or file_metadata("t", "synthetic", 0)), path)
    return path


def test_missing_column_names_the_file(trace_dir):
    bad = write_part(trace_dir / "x" / "part-000000.parquet", build().table().drop_columns(["seq"]))
    with pytest.raises(TraceError, match=f"^{bad}: missing column 'seq'"):
        open_trace(trace_dir)


def test_unknown_schema_version_names_the_file(trace_dir):
    metadata = file_metadata("9.0", "synthetic", 0)
    metadata[b"pdtrace.schema_version"] = b"7"
    bad = write_part(trace_dir / "x" / "part-000000.parquet", build().table(), metadata)
    with pytest.raises(TraceError, match=f"^{bad}: unknown trace schema version '7'"):
        open_trace(trace_dir)


def test_value_violation_names_the_file_and_its_row(trace_dir):
    table = build().table().slice(0, 4)
    roles = table.column("role").to_pylist()
    roles[2] = "leader"
    table = table.set_column(3, "role", pa.array(roles).dictionary_encode())
    bad = write_part(trace_dir / "zz" / "part-000000.parquet", table)
    with pytest.raises(TraceError, match=f"^{bad}: row 2, column 'role'.*found 'leader'$"):
        open_trace(trace_dir)
    assert len(open_trace(trace_dir, validate=False)) == 34


def test_unknown_kinds_load_with_a_warning(trace_dir):
    b = EventBuilder(instance="x", pid=5)
    b.add("kv_teleport", req="r")
    b.write(trace_dir / "extra")
    with pytest.warns(TraceWarning, match="kv_teleport"):
        trace = open_trace(trace_dir)
    assert len(trace) == 31


def test_files_with_other_accepted_types_are_normalised(trace_dir):
    table = build().table().slice(0, 3)
    plain = pa.table({name: (table.column(name).cast(pa.string()) if pa.types.is_dictionary(field.type)
                             else table.column(name).cast(pa.int64()) if name == "pid" else table.column(name))
                      for name, field in zip(SCHEMA.names, SCHEMA, strict=True)})
    write_part(trace_dir / "plain" / "part-000000.parquet", plain)
    trace = open_trace(trace_dir)
    assert trace.table.schema.equals(SCHEMA)
    assert len(trace) == 33
    assert trace.table.column("instance").to_pylist().count("prefill-0") == 15 + 3


def test_a_value_that_does_not_fit_the_format_type_names_its_file(trace_dir):
    table = build().table().slice(0, 2)
    big_pids = pa.array([5, 2**40], pa.int64())
    # the same schema as the bad file (pid int64), before it: both are read as one dataset
    write_part(trace_dir / "prefill-0" / "zz" / "part-000000.parquet",
               table.set_column(4, "pid", pa.array([5, 6], pa.int64())))
    bad = write_part(trace_dir / "prefill-0" / "zz" / "part-000001.parquet",
                     table.set_column(4, "pid", big_pids))
    with pytest.raises(TraceError, match=f"^{bad}: column 'pid' cannot be read as int32"):
        open_trace(trace_dir)


def test_a_note_shared_by_many_files_is_said_once(tmp_path):
    table = build().table()
    for index in range(3):
        write_part(tmp_path / f"part-{index}.parquet",
                   table.slice(index * 10, 10).append_column("gpu", pa.array([0] * 10)))
    with pytest.warns(TraceWarning) as caught:
        trace = open_trace(tmp_path)
    assert trace.warnings == [f"{tmp_path / 'part-0.parquet'}: columns unknown to this pdtrace ignored: gpu "
                              "(and 2 more files)"]
    assert len(caught) == 1
    assert trace.table.column_names == list(SCHEMA.names) and len(trace) == 30


def test_dropped_events_and_sources_come_from_the_metadata(tmp_path):
    table = build().table()
    write_part(tmp_path / "a" / "part-0.parquet", table.slice(0, 10), file_metadata("0.1.0", "vllm-0.33.0", 7))
    write_part(tmp_path / "b" / "part-0.parquet", table.slice(10), file_metadata("0.1.0", "dryrun", 5))
    trace = open_trace(tmp_path)
    assert trace.dropped_events == 12
    assert trace.sources == ["dryrun", "vllm-0.33.0"]
    assert [f.rows for f in trace.files] == [10, 20]
    assert trace.filter(pc.equal(trace.table.column("kind"), "sched")).files == trace.files


def test_dropped_events_take_each_writers_running_total() -> None:
    """A file's pdtrace.dropped_events is its writer's running total: sum the last total of each writer folder."""
    from pdtrace.trace.model import Trace, TraceFile

    def part(path: str, dropped: int) -> TraceFile:
        return TraceFile(path=path, rows=1, schema_version="1", pdtrace_version="t", source="s", dropped_events=dropped)

    trace = Trace(table=EventBuilder().table(), files=[
        part("T/P/1/part-000000.parquet", 3), part("T/P/1/part-000001.parquet", 5),
        part("T/D/2/part-000000.parquet", 2),
    ])
    assert trace.dropped_events == 7
