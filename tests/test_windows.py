"""The windowed analysis (pdtrace.analysis.windows) reports what the whole-trace analysis reports.

On every sample trace and every scenario the window property uses (tests/test_rules_window.py: the stripped-fields
property's set and the preemption scenarios), cut into windows of 200, 700 and 2000 events (CUTS):
- with an unbounded lookback (every window's analysis starts at the oldest request or step open at its cut), the
  findings equal the whole-trace analysis's, every column (evidence and extra included), except `pipeline_bubble`,
  which the windowed path measures per window (`windows.PER_WINDOW`) and marks so;
- with the default lookback (half a window), the same, except the findings about a request carried alone into
  its window, which are marked `extra.windowed` with the reason (`windows.CARRIED_WHY`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pytest

from test_rules_window import TRACES
from pdtrace.analysis import analyze
from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.registry import load_rules
from pdtrace.analysis.windows import CARRIED_WHY, PER_WINDOW, plan_windows
from pdtrace.trace.model import Trace

ROOT = Path(__file__).resolve().parents[1]
UNBOUNDED = 10**12
#: (events per window, lookback): unbounded, and the default (half a window: requests carried alone)
CUTS = ((200, UNBOUNDED), (200, 0), (700, UNBOUNDED), (2000, 0))
COMPARED = ("rule", "subrule", "severity", "instance", "dp_rank", "req", "blocks", "step", "ts_ns", "message",
            "evidence", "context", "extra", "requests")


def _record(rec: dict[str, Any]) -> str:
    return json.dumps({c: rec[c] for c in COMPARED}, sort_keys=True, default=str)


@lru_cache(maxsize=None)
def whole(name: str) -> pd.DataFrame:
    return analyze(TRACES[name](), config=AnalysisConfig(jobs=1, window_events=0))


def windowed(name: str, size: int, lookback: int) -> pd.DataFrame:
    trace = TRACES[name]()
    return analyze(Trace.from_table(trace.table), config=AnalysisConfig(jobs=1, window_events=size,
                                                                        window_lookback=lookback))


def _marked(rec: dict[str, Any]) -> dict[str, Any] | None:
    return (rec.get("extra") or {}).get("windowed")


def _differences(name: str, size: int, lookback: int) -> tuple[list[str], pd.DataFrame]:
    got = windowed(name, size, lookback)
    base = [r for r in whole(name).to_dict("records") if r["rule"] not in PER_WINDOW]
    mine = [r for r in got.to_dict("records") if r["rule"] not in PER_WINDOW]
    carried = {(r["rule"], r["subrule"], str(r["req"])) for r in mine if _marked(r)}
    expected = sorted(_record(r) for r in base if (r["rule"], r["subrule"], str(r["req"])) not in carried)
    found = sorted(_record(r) for r in mine if not _marked(r))
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    out = [f"only whole: {m[:300]}" for m in missing] + [f"only windowed: {m[:300]}" for m in extra]
    if len(expected) != len(found) and not out:
        out.append(f"counts differ: {len(expected)} whole, {len(found)} windowed (a finding reported twice?)")
    return out, got


@pytest.mark.parametrize("name", sorted(TRACES))
def test_windows_give_the_whole_trace_findings(name: str) -> None:
    instances = TRACES[name]().table.column("instance").cast("string").value_counts()
    largest = max(int(c) for c in instances.field("counts").to_pylist())
    for size, lookback in CUTS:
        if largest > size:
            problems, got = _differences(name, size, lookback)
            assert problems == [], (size, lookback)
            windows = got.attrs["windows"]
            assert windows and max(w["windows"] for w in windows.values()) >= 2
            marked = [r for r in got.to_dict("records") if _marked(r) and r["rule"] not in PER_WINDOW]
            if lookback == UNBOUNDED:
                assert marked == [] and all(w["carried"] == 0 for w in windows.values())
            for rec in marked:  # a carried request's finding says so, and names it
                named = {str(rec["req"]), *map(str, rec["requests"] or ())}
                assert _marked(rec)["why"] == CARRIED_WHY
                assert named & set(_marked(rec)["carried"]) or any(
                    isinstance(ev, dict) and ev.get("req") in _marked(rec)["carried"] for ev in rec["evidence"])


def test_the_windows_cut_through_open_requests_and_steps() -> None:
    # the property is only as strong as its cuts: on a P/D sample the small windows cut through many requests
    trace = TRACES["sample:healthy_pd_pp1"]()
    table = trace.table.filter(pc.equal(trace.table.column("instance").cast("string"), "decode-0"))
    plan = plan_windows([table.select(["ts_ns", "req", "step", "dp_rank", "kind"])], 200, lookback=UNBOUNDED)
    assert len(plan) >= 4 and int(plan.events.sum()) == table.num_rows and plan.events.max() <= 200 + 50
    assert (plan.starts[1:] < plan.cuts[1:-1]).all()  # every window starts before its cut: something was open
    assert all(not c for c in plan.carried)
    tight = plan_windows([table.select(["ts_ns", "req", "step", "dp_rank", "kind"])], 200, lookback=10)
    assert any(tight.carried) and (tight.starts >= plan.starts).all()


def test_a_sampled_plan_cuts_windows_of_about_the_asked_size_and_counts_them_exactly(monkeypatch: Any) -> None:
    # a long trace's plan keeps every stride-th ts, each weighing the events it stands for; a small SAMPLE makes
    # this sample trace's plan sample (stride > 1), and the windows its cuts give still report the whole trace's
    # findings, each counting its own events exactly
    from pdtrace.analysis import windows as W

    trace = TRACES["sample:healthy_pd_pp1"]()
    table = trace.table.filter(pc.equal(trace.table.column("instance").cast("string"), "decode-0"))
    columns = table.select(list(W.PLAN_COLUMNS))
    exact = plan_windows([columns], 200, lookback=UNBOUNDED)
    monkeypatch.setattr(W, "SAMPLE", 64)
    stride = table.num_rows // 64
    assert stride > 1
    sampled = plan_windows([columns.slice(0, 700), columns.slice(700)], 200, lookback=UNBOUNDED)  # two batches
    ts = table.column("ts_ns").to_numpy()
    counts = [int(((ts >= a) & (ts < b)).sum()) for a, b in zip(sampled.cuts[:-1], sampled.cuts[1:])]
    assert sum(counts) == int(sampled.events.sum()) == table.num_rows
    assert abs(len(sampled) - len(exact)) <= 1
    assert all(abs(c - 200) <= 2 * stride + 50 for c in counts[:-1])  # ties of equal ts stay in one window
    assert all(abs(e - c) <= 2 * stride for e, c in zip(sampled.events.tolist(), counts))  # estimates
    assert sampled.last_ts == exact.last_ts and (sampled.every_ts == exact.every_ts).all()

    source = W.MemorySource(Trace.from_table(table))
    used = plan_windows(source.plan_groups(), 200, lookback=UNBOUNDED, rows=source.plan_rows)
    seen: list[Any] = []
    got = W.analyze_windows(source, list(load_rules().values()), AnalysisConfig(jobs=1), None, "decode-0",
                            window_events=200, lookback=UNBOUNDED, progress=lambda info, _: seen.append(info))
    assert [info.events for info in seen] == [int(((ts >= a) & (ts < b)).sum())
                                              for a, b in zip(used.cuts[:-1], used.cuts[1:])]
    assert got.events == table.num_rows
    problems, _ = _differences("sample:healthy_pd_pp1", 200, UNBOUNDED)
    assert problems == []


def test_the_plan_read_on_threads_is_the_plan_read_in_order() -> None:
    # PathSource hands the plan one call per file; on two threads they complete out of order, and the merge
    # (earliest first, latest last, any finish) does not depend on it
    from pdtrace.analysis.windows import PathSource

    path = ROOT / "sample_traces" / "healthy_pd_pp1" / "trace"
    source = PathSource(str(path), ["decode-0"], None, AnalysisConfig())
    assert len(source.plan_groups()) > 1
    one, two = (plan_windows(source.plan_groups(), 300, rows=source.plan_rows, jobs=jobs) for jobs in (1, 2))
    for name in ("cuts", "events", "starts", "every_ts"):
        assert (getattr(one, name) == getattr(two, name)).all(), name
    assert one.carried == two.carried and one.last_ts == two.last_ts and len(one) >= 2


def test_a_request_that_never_finishes_is_open_to_the_end() -> None:
    # sample `starve`: requests admitted early and never scheduled have no row after their req_add; the window
    # that owns their finding is the last one, which holds them (lookback unbounded) and counts every step
    problems, got = _differences("sample:starve", 200, UNBOUNDED)
    assert problems == []
    starved = got[got["subrule"] == "starved"]
    assert len(starved) and starved["message"].str.contains("waited 278 steps").any()


def test_pipeline_bubble_is_measured_per_window_and_says_so() -> None:
    got = windowed("sample:healthy_pp4", 700, UNBOUNDED)
    bubbles = got[got["rule"] == "pipeline_bubble"]
    assert len(bubbles) > len(whole("sample:healthy_pp4").query("rule == 'pipeline_bubble'"))
    assert all(_marked(r)["why"] == PER_WINDOW["pipeline_bubble"] for r in bubbles.to_dict("records"))


def test_a_small_trace_is_analysed_whole() -> None:
    got = analyze(TRACES["sample:healthy_pd_pp1"](), config=AnalysisConfig(jobs=1))
    assert not got.attrs.get("windows")


def test_analyze_takes_the_windowed_path_with_window_events(tmp_path: Any) -> None:
    sample = ROOT / "sample_traces" / "lost_send_completion" / "trace"
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdtrace", "analyze", str(sample), "--format", "json", *args],
                              env=env, capture_output=True, text=True, timeout=300)

    plain, split = run(), run("--window-events", "300", "--jobs", "1")  # one process: progress per window
    assert plain.returncode == split.returncode == 1, split.stderr[-2000:]
    assert "window 2/" in split.stderr and "window" not in plain.stderr
    one, two = json.loads(plain.stdout), json.loads(split.stdout)
    assert two["summary"]["windows"] and not one["summary"].get("windows")

    def ids(doc: dict[str, Any]) -> list[str]:
        return sorted(json.dumps({k: v for k, v in f.items() if k != "extra"}, sort_keys=True)
                      for f in doc["findings"] if f["rule"] not in PER_WINDOW)

    assert ids(one) == ids(two) and ids(one)
    bad = subprocess.run([sys.executable, "-m", "pdtrace", "analyze", str(sample), "--window-events", "-3"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


SAMPLES = sorted(p.parent.name for p in (ROOT / "sample_traces").glob("*/trace"))


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_trace_read_window_by_window_from_its_files_gives_the_same_findings(sample: str) -> None:
    # the files' path (PathSource: each window's rows read by their ts, the configuration and the carried requests
    # added) against the whole trace, also with a --since cut
    from test_rules_window import cut_times, table_of

    path = ROOT / "sample_traces" / sample / "trace"
    counts = table_of(f"sample:{sample}").column("instance").cast("string").value_counts()
    largest = max(int(c) for c in counts.field("counts").to_pylist())
    for since in (None, cut_times(table_of(f"sample:{sample}"))[2]):
        base = AnalysisConfig(jobs=1, since_ns=since)
        expected = analyze(path, config=replace(base, window_events=0), partitioned=False)
        for size, lookback in ((300, UNBOUNDED), (1000, 0)):
            got = analyze(path, config=replace(base, window_events=size, window_lookback=lookback))
            mine = [r for r in got.to_dict("records") if r["rule"] not in PER_WINDOW]
            carried = {(r["rule"], r["subrule"], str(r["req"])) for r in mine if _marked(r)}
            assert sorted(_record(r) for r in mine if not _marked(r)) == sorted(
                _record(r) for r in expected.to_dict("records")
                if r["rule"] not in PER_WINDOW and (r["rule"], r["subrule"], str(r["req"])) not in carried)
            assert got.attrs["window"] == expected.attrs["window"]
            assert bool(got.attrs.get("windows")) == (since is None and largest > size) or since is not None


@pytest.mark.parametrize("how", ["metadata", "manifest"])
@pytest.mark.parametrize("sample", ["starve", "lost_send_completion", "few_requests_pp"])
def test_a_flight_dump_read_window_by_window_gives_the_dumps_findings(tmp_path: Path, sample: str, how: str) -> None:
    # a dump starts mid-run (its window in the files' metadata or the manifest): window 1 of its windowed analysis
    # keeps the dump's window, later windows start at their cuts, and together they report what the whole dump does
    from test_rules_window import _window_dir, cut_times, table_of

    name = f"sample:{sample}"
    cut = cut_times(table_of(name))[1]
    path = _window_dir(tmp_path, name, cut, how)
    whole = analyze(path, config=AnalysisConfig(jobs=1, window_events=0), partitioned=False)
    got = analyze(path, config=AnalysisConfig(jobs=1, window_events=150, window_lookback=UNBOUNDED))
    assert max(w["windows"] for w in got.attrs["windows"].values()) >= 4
    assert got.attrs["window"]["start_ns"] == whole.attrs["window"]["start_ns"] == cut
    assert got.attrs["window"]["source"] == how
    assert sorted(_record(r) for r in got.to_dict("records") if r["rule"] not in PER_WINDOW) == sorted(
        _record(r) for r in whole.to_dict("records") if r["rule"] not in PER_WINDOW)


def _leak_then_traffic(gap: bool) -> Trace:
    """A request that finishes and never frees its blocks (leaked_blocks `definitely`), then 40 steps of healthy
    requests, and, with `gap`, a recorder_gap near the end: the gap lies in a later window than the leak, yet lowers
    it (a gap between the moment and the end of the trace)."""
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="e")
    b.add("engine_config", n=64, detail={"block_size": 16, "pp": 1, "tp": 1, "defer_block_free": False})
    b.add("req_add", req="leak", n=16)
    b.add("sched", step=0, n=1)
    b.add("blocks_alloc", step=0, req="leak", blocks=[1])
    b.add("req_sched", step=0, req="leak", n=16)
    b.add("step_submit", component="engine", step=0, n=1)
    b.add("step_output", component="engine", step=0)
    b.add("req_finish", step=0, req="leak", reason="length", status="FINISHED_LENGTH_CAPPED", delay_free=False)
    for step in range(1, 41):
        req = f"r{step}"
        b.add("req_add", req=req, n=16)
        b.add("sched", step=step, n=1)
        b.add("blocks_alloc", step=step, req=req, blocks=[2 + step % 8])
        b.add("req_sched", step=step, req=req, n=16)
        b.add("step_submit", component="engine", step=step, n=1)
        b.add("step_output", component="engine", step=step)
        b.add("req_finish", step=step, req=req, reason="length", status="FINISHED_LENGTH_CAPPED", delay_free=False)
        b.add("blocks_free", step=step, req=req, blocks=[2 + step % 8], reason="finished", deferred=False)
        if gap and step == 38:
            b.add("recorder_gap", n=5)
    return b.trace()


@pytest.mark.parametrize("gap", [True, False])
def test_a_recorder_gap_in_a_later_window_lowers_a_leak_as_on_the_whole_trace(gap: bool) -> None:
    trace = _leak_then_traffic(gap)
    expected = analyze(trace, config=AnalysisConfig(jobs=1, window_events=0))
    got = analyze(Trace.from_table(trace.table), config=AnalysisConfig(jobs=1, window_events=60))
    assert got.attrs["windows"]["e"]["windows"] >= 4
    leaks = [r for r in expected.to_dict("records") if r["rule"] == "leaked_blocks" and r["req"] == "leak"]
    assert [r["severity"] for r in leaks] == (["warning"] if gap else ["error"])
    assert sorted(map(_record, got.to_dict("records"))) == sorted(map(_record, expected.to_dict("records")))


def test_step_spans_are_reduced_densely_or_by_a_sort_alike() -> None:
    # `_key_spans`: a dp_rank's steps over a dense range go through offsets, sparse ones through np.unique; both
    # give each key's least first and greatest last, keys ascending, dp_ranks apart
    from pdtrace.analysis import windows as W

    rng = np.random.default_rng(7)
    dense = (1 << 40) + rng.integers(1000, 1400, 3000)  # dp_rank 0: 400 steps, each in several runs
    sparse = (3 << 40) + rng.choice(np.arange(0, 10**9, 997), 500)  # dp_rank 2: spread far apart
    keys = np.concatenate([dense, sparse])
    first = rng.integers(0, 10**6, len(keys))
    last = first + rng.integers(0, 1000, len(keys))
    got = W._key_spans(keys, first, last)
    distinct, at = np.unique(keys, return_inverse=True)
    want_first = np.full(len(distinct), W.LO)
    want_last = np.full(len(distinct), W.HI)
    np.minimum.at(want_first, at, first)
    np.maximum.at(want_last, at, last)
    for g, w in zip(got, (distinct, want_first, want_last)):
        np.testing.assert_array_equal(g, w)
    empty = W._key_spans(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    assert all(len(a) == 0 for a in empty)
