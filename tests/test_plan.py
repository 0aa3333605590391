"""One engine under two planners (pdtrace.analysis.plan): the plan decided once from the footers and the config,
printed by `pdtrace analyze --plan` without analysing, and carried out as printed: every slice (the whole trace, a
partition, a window) goes through `engine.analyze_slice`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import scenarios
from pdtrace.analysis import AnalysisConfig, analyze, engine, plan as P
from pdtrace.analysis.partitions import plan_partitions
from pdtrace.trace.builder import write_table
from pdtrace.trace.reader import open_trace


@pytest.fixture
def pd_dir(tmp_path: Path) -> Path:
    """A P/D trace: two instances, each in its own files."""
    return write_table(scenarios.healthy_pd().table, tmp_path / "pd")


def _rows(path: Path) -> dict[str, int]:
    trace = open_trace(path)
    counts = trace.table.column("instance").to_pandas().astype(str).value_counts()
    return {str(k): int(v) for k, v in counts.items()}


def test_plan_prints_the_slices_and_runner_and_does_not_analyse(cli, pd_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("--plan analysed the trace")

    monkeypatch.setattr(P, "analyze_slice", refuse)
    result = cli("analyze", pd_dir, "--plan", "--partitions", "--jobs", "2")
    assert result.exit_code == 0, result.stderr
    rows = _rows(pd_dir)
    lines = result.stdout.splitlines()
    assert lines[0] == f"trace:   {pd_dir} ({sum(rows.values()):,} events per the footers)"
    assert lines[1].startswith("mode:    partitioned (asked for)")
    assert lines[2] == "runner:  2 worker processes, 1 rule thread per slice"
    assert lines[3] == "slices:  2"
    for name, n in rows.items():
        assert f"  {name}: {n:,} rows, 1 file; whole" in lines
    assert "ERROR SUMMARY" not in result.stdout


def test_without_plan_the_same_command_analyses(cli, pd_dir, monkeypatch):
    """The twin of the test above: the same patch fails an analysis, so --plan passing proves it analysed
    nothing."""
    def refuse(*args, **kwargs):
        raise AssertionError("analysed")

    monkeypatch.setattr(engine, "analyze_slice", refuse)
    monkeypatch.setattr(P, "analyze_slice", refuse)
    from pdtrace.analysis import partitions

    monkeypatch.setattr(partitions, "run_partition", refuse)
    result = cli("analyze", pd_dir, "--partitions", "--jobs", "1")
    assert result.exit_code != 0 and "analysed" in result.stderr, (result.exit_code, result.stderr)


def test_plan_json_rows_come_from_the_footers_and_windows_from_the_window_size(cli, pd_dir):
    rows = _rows(pd_dir)
    window = min(rows.values()) // 2
    result = cli("analyze", pd_dir, "--plan", "--format", "json", "--window-events", window, "--jobs", "1")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    footers = plan_partitions(pd_dir)
    assert doc["events"] == footers.events == sum(rows.values())
    assert doc["mode"] == "partitioned" and doc["why"] == "an instance above the window size"
    assert doc["runner"] == {"kind": "this process", "workers": 1, "threads_per_slice": 1, "dask": None}
    assert {tuple(s["instances"]): s["rows"] for s in doc["slices"]} == {(k,): v for k, v in rows.items()}
    for s in doc["slices"]:
        assert s["window_events"] == window and s["windows"] == math.ceil(s["rows"] / window)
        assert s["files"] == 1 and s["shared"] is False


def test_plan_of_a_small_trace_is_whole_and_of_one_instance_windowed(cli, pd_dir):
    doc = json.loads(cli("analyze", pd_dir, "--plan", "--format", "json").stdout)
    assert doc["mode"] == "whole" and doc["runner"]["kind"] == "this process"
    assert doc["why"] == "under 2,000,000 events"
    assert doc["slices"] == [{"instances": [], "rows": doc["events"], "files": 2, "shared": False,
                              "window_events": 0, "windows": 1}]
    rows = _rows(pd_dir)
    doc = json.loads(cli("analyze", pd_dir, "--plan", "--format", "json", "--instance", "D",
                         "--window-events", rows["D"] // 3).stdout)
    assert doc["mode"] == "windowed" and doc["instances"] == ["D"]
    (only,) = doc["slices"]
    assert only["instances"] == ["D"] and only["windows"] == math.ceil(rows["D"] / (rows["D"] // 3))


def test_plan_with_dask_names_the_cluster_without_connecting(cli, pd_dir):
    pytest.importorskip("distributed")
    result = cli("analyze", pd_dir, "--plan", "--dask", "tcp://127.0.0.1:1")  # nothing listens there
    assert result.exit_code == 0, result.stderr
    assert "runner:  Dask cluster tcp://127.0.0.1:1, 1 rule thread per slice" in result.stdout
    assert "mode:    partitioned (on a Dask cluster)" in result.stdout


def test_plan_bad_input_is_one_line_exit_2(cli, pd_dir):
    result = cli("analyze", pd_dir, "--plan", "--instance", "nope")
    assert result.exit_code == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "nope" in result.stderr


@pytest.mark.parametrize("how", ["whole", "partitioned", "windowed"])
def test_the_run_follows_the_plan_through_one_slice_function(pd_dir, monkeypatch, how):
    """Every slice, whatever the mode, is analysed by engine.analyze_slice: once for the whole trace, once per
    partition, once per window; and the findings are those of the whole trace."""
    rows = _rows(pd_dir)
    config = {"whole": AnalysisConfig(jobs=1),
              "partitioned": AnalysisConfig(jobs=1),
              "windowed": AnalysisConfig(jobs=1, window_events=rows["D"] // 3, instances=("D",))}[how]
    plan = P.plan_analysis(pd_dir, config, partitioned={"whole": False, "partitioned": True, "windowed": None}[how])
    assert plan.mode == how
    calls: list[int] = []
    real = engine.analyze_slice

    def counted(ctx, *args, **kwargs):
        calls.append(len(ctx.trace))
        return real(ctx, *args, **kwargs)

    for module in (engine, P):
        monkeypatch.setattr(module, "analyze_slice", counted)
    findings = analyze(pd_dir, plan=plan)
    if how == "whole":
        assert calls == [sum(rows.values())]
    elif how == "partitioned":
        assert sorted(calls) == sorted(rows.values())
        assert sorted(findings.attrs["partitions"]) == sorted(s.instances[0] for s in plan.slices) == ["D", "P"]
    else:
        assert len(calls) == findings.attrs["windows"]["D"]["windows"] == plan.slices[0].windows
    whole = analyze(pd_dir, config=config, partitioned=False)
    assert findings[["rule", "subrule", "severity", "req"]].equals(whole[["rule", "subrule", "severity", "req"]])


def test_a_loaded_trace_is_planned_by_its_own_rows(pd_dir):
    trace = open_trace(pd_dir)
    rows = _rows(pd_dir)
    plan = P.plan_analysis(trace, AnalysisConfig(window_events=max(rows.values()) - 1))
    assert plan.mode == "partitioned" and plan.runner == "this process"
    assert {s.instances[0]: (s.rows, s.window_events) for s in plan.slices} == {
        k: (v, max(rows.values()) - 1 if v > max(rows.values()) - 1 else 0) for k, v in rows.items()}
    assert P.plan_analysis(trace).mode == "whole"
    with pytest.raises(Exception, match="takes a trace path"):
        P.plan_analysis(trace, dask="tcp://127.0.0.1:1")


def test_the_partitions_are_windowed_as_the_plan_says(pd_dir):
    """The plan's per-slice decision is the one the run takes (no second reading of the rows): a plan edited to
    window one partition runs that partition window by window, and only it."""
    import dataclasses

    rows = _rows(pd_dir)
    plan = P.plan_analysis(pd_dir, AnalysisConfig(jobs=1), partitioned=True)
    assert [s.window_events for s in plan.slices] == [0, 0]
    assert analyze(pd_dir, plan=plan).attrs["windows"] == {}
    at = next(i for i, s in enumerate(plan.slices) if s.instances == ("D",))
    plan.slices[at] = dataclasses.replace(plan.slices[at], window_events=rows["D"] // 3)
    windows = analyze(pd_dir, plan=plan).attrs["windows"]
    assert list(windows) == ["D"] and windows["D"]["windows"] > 1
