"""Partitioned analysis (pdtrace.analysis.partitions) reports exactly what the whole-trace analysis reports: the JSON
report is the same string, on every sample, every scenario, and traces whose findings need the cross-instance step
(a remote read of freed blocks, a decode request stuck on a prefill instance that died)."""

from __future__ import annotations

import inspect
import json

import pyarrow as pa
from pathlib import Path

import pytest

import scenarios
import scenarios_pipeline
from scenarios import Engine, builder
from pdtrace.analysis import AnalysisConfig, analyze, summarize_findings
from pdtrace.analysis.partitions import plan_partitions
from pdtrace.report.json_report import render_json
from pdtrace.trace.model import Trace
from pdtrace import open_trace as pdtrace_open

REPO = Path(__file__).resolve().parents[1]
SAMPLES = sorted(p / "trace" for p in (REPO / "sample_traces").iterdir() if (p / "trace").is_dir())
S = 1_000_000_000


def report(findings, path) -> str:
    return render_json(findings, summarize_findings(findings), str(path))


def same_report(source, config: AnalysisConfig | None = None) -> tuple[str, str]:
    whole = analyze(source, partitioned=False, config=config)
    parts = analyze(source, partitioned=True, config=config)
    return report(whole, "t"), report(parts, "t")


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.parent.name)
def test_every_sample_reports_the_same_by_partitions(sample: Path) -> None:
    whole, parts = same_report(sample, config=AnalysisConfig(jobs=1))
    assert parts == whole


def _scenario_functions() -> list:
    out = []
    for module in (scenarios, scenarios_pipeline):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ != module.__name__ or name.startswith("_"):
                continue
            sig = inspect.signature(fn)
            if sig.return_annotation not in ("Trace", Trace):
                continue
            if any(p.default is inspect.Parameter.empty for p in sig.parameters.values()):
                if name == "random_healthy":
                    out.extend((f"random_healthy_{seed}", lambda seed=seed, fn=fn: fn(seed, pp=1 + seed % 2))
                               for seed in range(4))
                continue
            out.append((name, fn))
    return out


SCENARIOS = _scenario_functions()


def test_the_scenario_list_is_complete() -> None:
    names = {name for name, _ in SCENARIOS}
    assert {"healthy_pd", "pp4_pipeline", "healthy_pp4", "slow_stage_pp4", "random_healthy_0"} <= names
    assert len(names) >= 15


@pytest.mark.parametrize("name,make", SCENARIOS, ids=[n for n, _ in SCENARIOS])
def test_every_scenario_reports_the_same_by_partitions(name: str, make) -> None:
    trace = make()
    whole, parts = same_report(trace)
    assert parts == whole


def cross_instance_trace() -> Trace:
    """Two P/D pairs and a bystander: D0 reads P0's blocks after P0 freed them (use_after_free remote_read, found
    only by joining D0's read with P0's gap); D1 waits for KV from P1, whose engine died (stuck_waiting_kv citing
    the peer failure); E runs a healthy request. Each instance writes its own folder."""
    b = builder()
    p0 = Engine(b, instance="P0", role="prefill", pid=1000)
    p0.add("r1", n=32, remote_decode=True)
    p0.step({"r1": 32}, alloc={"r1": [5, 6]})
    p0.output()
    p0.finish("r1", reason="length", delay_free=False)
    b.add("remote_read", instance="D0", role="decode", pid=2000, component="connector", req="r1", blocks=[5, 6],
          detail={"remote_instance": "P0"})
    p1 = Engine(b, instance="P1", role="prefill", pid=3000)
    d1 = Engine(b, instance="D1", role="decode", pid=4000)
    d1.add("q1", n=40, remote_prefill=True, remote_instance="P1", remote_req="q1")
    d1.step({}, wait_kv={"q1": [7, 8]})
    d1.output()
    p1.step({})
    p1.ev("engine_error", component="engine", step=p1._current_step(), detail={"error": "AssertionError: x",
                                                                                  "where": "step"})
    e = Engine(b, instance="E", pid=5000)
    scenarios.prefill_lifecycle(e, "e1", [1, 2])
    b.advance(600 * S)
    d1.step({})
    d1.output()
    return b.trace()


def test_cross_instance_findings_need_and_get_phase_two(tmp_path: Path) -> None:
    trace = cross_instance_trace()
    trace_dir = tmp_path / "trace"
    from pdtrace.trace.builder import write_table

    write_table(trace.table, trace_dir)
    plan = plan_partitions(trace_dir)
    assert sorted(plan.instances) == ["D0", "D1", "E", "P0", "P1"] and not any(p.shared for p in plan.partitions)
    whole = analyze(trace_dir, partitioned=False)
    # the findings that only the join across instances can give
    read = whole[(whole["rule"] == "use_after_free") & (whole["subrule"] == "remote_read")]
    assert list(read["instance"]) == ["P0"]
    stuck = whole[whole["subrule"] == "stuck_waiting_kv"]
    assert len(stuck) == 1 and stuck.iloc[0]["extra"]["peer_engine_failed"]["instance"] == "P1"
    seen = []
    parts = analyze(trace_dir, partitioned=True, config=AnalysisConfig(jobs=2),
                    progress=lambda task, result: seen.append(task.instances))
    assert report(parts, trace_dir) == report(whole, trace_dir)
    # five partitions, then one re-run per linked pair
    assert sorted(seen[:5]) == [("D0",), ("D1",), ("E",), ("P0",), ("P1",)]
    assert sorted(seen[5:]) == [("D0", "P0"), ("D1", "P1")]
    assert parts.attrs["events"] == whole.attrs["events"] == len(trace)


def test_phase_one_alone_misses_them(tmp_path: Path) -> None:
    """The partitions by themselves do not see the cross-instance findings: phase 2 is what finds them."""
    from pdtrace.analysis.partitions import LocalRunner, analyze_partitioned, link_groups
    from pdtrace.analysis import available_rules
    from pdtrace.trace.builder import write_table

    trace_dir = tmp_path / "trace"
    write_table(cross_instance_trace().table, trace_dir)
    rules = list(available_rules()[0].values())
    plan = plan_partitions(trace_dir)
    from pdtrace.analysis.partitions import PartitionTask, analysed_span, run_partition

    span = analysed_span(plan, plan.partitions, AnalysisConfig())
    results = [run_partition(PartitionTask(path=str(trace_dir), instances=(p.instance,), files=p.files,
                                           filter_instances=False, rules=tuple(r.id for r in rules),
                                           config=AnalysisConfig(jobs=1), span_ns=span)) for p in plan.partitions]
    subrules = {(f["rule"], f["subrule"]) for r in results for frame in r.frames for f in frame.to_dict("records")}
    assert ("use_after_free", "remote_read") not in subrules
    stuck = [f for r in results for frame in r.frames for f in frame.to_dict("records")
             if f["subrule"] == "stuck_waiting_kv"]
    assert len(stuck) == 1 and "peer_engine_failed" not in stuck[0]["extra"]
    assert link_groups([r.summary for r in results]) == {"use_after_free": [("D0", "P0")],
                                                         "unscheduled_request": [("D1", "P1")]}
    frames, events, _, _, _ = analyze_partitioned(trace_dir, rules, AnalysisConfig(jobs=1), LocalRunner(), plan)
    assert events == sum(r.events for r in results)


def test_one_file_holding_every_instance(tmp_path: Path) -> None:
    """Partitions that share a file are read with an instance filter; same report."""
    import pyarrow.parquet as pq

    from pdtrace.format import file_metadata

    trace = cross_instance_trace()
    path = tmp_path / "one"
    path.mkdir()
    pq.write_table(trace.table.replace_schema_metadata(file_metadata("test", "synthetic", 0)), path / "all.parquet",
                   row_group_size=7)
    plan = plan_partitions(path)
    assert all(p.shared for p in plan.partitions) and len(plan.partitions) == 5
    whole, parts = same_report(path, config=AnalysisConfig(jobs=1))
    assert parts == whole
    # an instance selection and a time window are applied the same way
    pair = AnalysisConfig(jobs=1, instances=("D1", "P1"))
    whole, parts = same_report(path, config=pair)
    assert parts == whole and '"peer_engine_failed"' in parts
    early = AnalysisConfig(jobs=1, until_ns=int(trace.table.column("ts_ns")[len(trace) * 2 // 3].as_py()))
    whole, parts = same_report(path, config=early)
    assert parts == whole and json.loads(parts)["summary"]["events"] < len(trace)


def test_bad_partition_is_one_line_exit_2(tmp_path: Path, cli) -> None:
    """A truncated file or a missing column in one partition: one line on stderr, exit 2, also from a worker."""
    import pyarrow.parquet as pq

    from pdtrace.trace.builder import write_table

    trace_dir = tmp_path / "trace"
    write_table(cross_instance_trace().table, trace_dir)
    victim = next((trace_dir / "D1").rglob("*.parquet"))
    table = pq.read_table(victim)
    pq.write_table(table.drop_columns(["kind"]).replace_schema_metadata(table.schema.metadata), victim)
    res = cli("analyze", trace_dir, "--jobs", "2", "--partitions")
    assert res.exit_code == 2 and "kind" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    # found only when a worker process reads the rows: seq going backwards inside one file
    table = table.set_column(table.schema.get_field_index("seq"), "seq",
                             pa.array(list(reversed(table.column("seq").to_pylist())), table.schema.field("seq").type))
    pq.write_table(table, victim)
    res = cli("analyze", trace_dir, "--jobs", "2", "--partitions")
    errors = [line for line in res.stderr.splitlines() if line.startswith("pdtrace: error:")]
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(errors) == 1 and "seq" in errors[0] and "D1" in errors[0], res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    res = cli("analyze", empty, "--partitions")
    assert res.exit_code == 2 and "no Parquet files" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def corrupt_data_pages(victim: Path) -> "pq.FileMetaData":
    """Rewrite a part file so that the last bytes of each column chunk's compressed data are garbage, its footer
    intact (a corrupt page: the footer reads, the data does not); returns the footer."""
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(victim), victim, compression="zstd", use_dictionary=False)
    footer = pq.ParquetFile(victim).metadata
    data = bytearray(victim.read_bytes())
    for column in range(footer.num_columns):
        chunk = footer.row_group(0).column(column)
        end = chunk.data_page_offset + chunk.total_compressed_size
        data[end - 6:end] = b"\x5a" * 6
    victim.write_bytes(bytes(data))
    return footer


def test_an_instance_whose_only_file_is_corrupt_is_skipped_as_in_a_whole_trace_run(tmp_path: Path, cli) -> None:
    """A data page of D1's only part file is corrupt, its footer intact: the whole-trace read skips the file with a
    warning, and so do the partitioned runs (in process and in workers), with the same report."""
    import pyarrow.parquet as pq

    from pdtrace.trace.builder import write_table

    trace_dir = tmp_path / "trace"
    write_table(cross_instance_trace().table, trace_dir)
    victim = next((trace_dir / "D1").rglob("*.parquet"))
    footer = corrupt_data_pages(victim)
    assert pq.ParquetFile(victim).metadata.num_rows == footer.num_rows  # the footer still reads

    outputs = []
    for flags in (["--whole"], ["--partitions", "--jobs", "1"], ["--partitions", "--jobs", "2"]):
        res = cli("analyze", trace_dir, "--format", "json", *flags)
        assert res.exit_code == 1 and "Traceback" not in res.stderr, res.stderr
        warnings = [line for line in res.stderr.splitlines() if line.startswith("pdtrace: warning:")]
        assert len(warnings) == 1 and str(victim) in warnings[0] and "corrupt" in warnings[0], res.stderr
        outputs.append(json.loads(res.stdout)["findings"])
    assert outputs[0] and outputs[0] == outputs[1] == outputs[2]


def test_a_corrupt_file_of_an_instance_read_window_by_window_is_skipped_as_in_a_whole_trace_run(
        tmp_path: Path, cli) -> None:
    """One of several part files of a windowed instance has a corrupt data page under an intact footer: the windowed
    path (its plan reads every file, on one thread or two) skips the file with the whole-trace read's warning, and
    reports what the whole-trace analysis reports; it used to stop with an internal error."""
    from pdtrace.trace.builder import write_table

    sample = Path(__file__).resolve().parents[1] / "sample_traces" / "lost_send_completion" / "trace"
    trace_dir = write_table(pdtrace_open(sample).table, tmp_path / "trace", rows_per_file=200)
    victim = sorted((trace_dir / "prefill-0").rglob("*.parquet"))[2]
    corrupt_data_pages(victim)

    def findings(doc: dict) -> list[tuple]:
        return sorted((f["rule"], f["subrule"], f["severity"], f["req"]) for f in doc["findings"]
                      if f["rule"] != "pipeline_bubble")  # measured per window

    reports = []
    for flags in (["--whole"], ["--window-events", "300", "--jobs", "1"], ["--window-events", "300", "--jobs", "2"]):
        res = cli("analyze", trace_dir, "--format", "json", *flags)
        assert res.exit_code == 1 and "Traceback" not in res.stderr, res.stderr
        warnings = [line for line in res.stderr.splitlines() if line.startswith("pdtrace: warning:")]
        assert len(warnings) == 1 and str(victim) in warnings[0] and "corrupt" in warnings[0], res.stderr
        reports.append(json.loads(res.stdout))
    assert reports[1]["summary"]["windows"] and not reports[0]["summary"].get("windows")
    assert findings(reports[0]) and findings(reports[0]) == findings(reports[1]) == findings(reports[2])
    assert reports[0]["summary"]["events"] == reports[1]["summary"]["events"] == reports[2]["summary"]["events"]


def test_instance_selection_marks_the_findings_of_the_whole_trace(tmp_path: Path) -> None:
    """plot/export --instance X read X's partition and those of its linked peers: the findings marked on X's
    requests are those of the whole trace, the cross-instance ones included (P0's use after free needs D0's read;
    D1's stuck wait names P1's engine failure), and no other instance is drawn."""
    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.analysis.partitions import instance_links, linked_instances
    from pdtrace.cli.app import load_instances
    from pdtrace.plot import Window, build_figure
    from pdtrace.trace.builder import write_table

    trace_dir = tmp_path / "trace"
    write_table(cross_instance_trace().table, trace_dir)
    plan = plan_partitions(trace_dir)
    assert instance_links(plan) == {("D0", "P0"), ("D1", "P1")}
    assert [linked_instances(plan, [name]) for name in ("P0", "D1", "E")] == [["D0"], ["P1"], []]

    whole = analyze(trace_dir, partitioned=False)
    whole = whole[whole["req"].notna() & whole["ts_ns"].notna() & (whole["rule"] != "pipeline_bubble")]
    for name in ("P0", "D1", "E"):
        expected = whole[whole["instance"] == name]
        trace, span = load_instances(trace_dir, [name], with_links=True)
        fig = build_figure(AnalysisContext(trace, span_ns=span), "requests", Window(instances=(name,)), dpi=50)
        lanes = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert lanes and all(lane.endswith(f"({name})") for lane in lanes), lanes
        marks = [a for ax in fig.axes for a in ax.get_children() if a.get_gid() == "findings"]
        assert sum(len(m.get_offsets()) for m in marks) == len(expected), name
    assert {"use_after_free", "unscheduled_request"} <= set(whole["rule"])
    alone, _ = load_instances(trace_dir, ["P0"])  # info: the instance alone
    assert set(alone.table.column("instance").to_pylist()) == {"P0"}
