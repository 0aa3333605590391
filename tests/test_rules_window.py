"""The window property: a trace cut at any time (tests/windowed.py: what a flight-recorder dump or `pdtrace analyze
--since` holds) gives no finding the cut itself made, and keeps the findings whose evidence lies inside it.

On every sample trace and every scenario of tests/scenarios*.py (the stripped-fields property's set), cut at EVEN
evenly spaced times plus right after the first event of each NOTABLE kind, with the cut marked as a window:
(a) every error of the window is an error of the uncut trace (same rule, subrule and request; or a
    re-classification named in RECLASSIFIED, with its reason);
(b) every finding of the uncut trace whose evidence lies inside the window (every row it cites, its moment, and the
    whole life of every request it names: each one's first event at or after the cut) is in the window's findings
    with the same rule, subrule, request and blocks, at the same severity or a lower one that says why
    (`extra.downgraded`), except those AGGREGATE rules measure over the trace's span and the EXCEPTIONS below.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import scenarios_preemption
from test_rules_stripped import TRACES as STRIPPED_TRACES
from windowed import cut_times
from pdtrace.analysis import analyze
from pdtrace.analysis.config import AnalysisConfig
from pdtrace.trace.model import Trace

#: (not `from conftest import`: in a whole-suite run `conftest` may be tests/vllm_tier's by the time a test runs)
SAMPLE_TRACES = Path(__file__).resolve().parents[1] / "sample_traces"
SEVERITY = {"info": 0, "warning": 1, "error": 2}
#: the stripped-fields property's traces (samples, tests/scenarios.py, the PP runs) and the preemption scenarios
TRACES = {**STRIPPED_TRACES, **{f"preemption:{k}": v for k, v in scenarios_preemption.all_scenarios().items()}}

#: one thread per analysis: many small traces, where the rule threads cost more than they save
CONFIG = AnalysisConfig(jobs=1)

#: rules whose findings measure the analysed span (idle fractions of a rank, stretches of steps), so a window
#: measures its own: compared for (a) only
AGGREGATE = {"pipeline_bubble": "idle fractions over the analysed span", "no_progress": "stretches of steps"}

#: (rule, subrule in the window) -> (subrule of the uncut trace's error it stands for, why)
RECLASSIFIED: dict[tuple[str, str], tuple[str, str]] = {
    ("double_free", "unknown_id"): (
        "completion_after_free", "the final free that explains the completion lies before the window; the "
        "completion's recorded status `unknown` still proves vLLM's assert"),
}


def _excepted(rec: dict[str, Any]) -> str | None:
    """Why a finding of the uncut trace may be missing from a window although its rows lie inside it."""
    extra = rec.get("extra") or {}
    if rec["rule"] == "premature_free" and rec["subrule"] == "quorum" and \
            str(extra.get("ranks_source", "")).startswith("the ranks that reported for other requests"):
        return "the expected rank count came from other requests' reports, which may lie before the window"
    return None


@lru_cache(maxsize=None)
def table_of(name: str) -> Any:
    return TRACES[name]().table


@lru_cache(maxsize=None)
def findings_of(name: str, cut: int | None) -> pd.DataFrame:
    trace = Trace.from_table(table_of(name))
    return analyze(trace if cut is None else trace.cut(cut), config=CONFIG)


@lru_cache(maxsize=None)
def first_event(name: str) -> dict[tuple[str, str], int]:
    """(instance, req) -> ts_ns of the request id's first event in the uncut trace."""
    frame = table_of(name).select(["ts_ns", "instance", "req"]).to_pandas()
    frame = frame[frame["req"].notna()]
    frame["instance"] = frame["instance"].astype(str)
    return frame.groupby(["instance", "req"])["ts_ns"].min().to_dict()


def inside(name: str, rec: dict[str, Any], cut: int) -> bool:
    """Whether a finding of the uncut trace has all its evidence inside the window that starts at cut."""
    first = first_event(name)
    refs = [r for r in rec.get("evidence") or [] if isinstance(r, dict)]
    times = [r.get("ts_ns") for r in refs] + [rec.get("ts_ns")]
    if any(t is not None and not pd.isna(t) and int(t) < cut for t in times):
        return False
    named = [(str(rec["instance"]), rec["req"])] + [(str(r.get("instance") or rec["instance"]), r.get("req"))
                                                   for r in refs]
    return all(first.get((inst, req), cut) >= cut for inst, req in named if req is not None and not pd.isna(req))


def _key(rec: dict[str, Any]) -> tuple:
    return rec["rule"], rec["subrule"], str(rec["req"]), tuple(rec["blocks"] or ())


def problems(name: str, cut: int) -> list[str]:
    base = findings_of(name, None).to_dict("records")
    got = findings_of(name, cut).to_dict("records")
    out = []
    base_errors = {(r["rule"], r["subrule"], str(r["req"])) for r in base if r["severity"] == "error"}
    for rec in got:  # (a)
        if rec["severity"] != "error":
            continue
        rule, subrule, req = rec["rule"], rec["subrule"], str(rec["req"])
        if (rule, subrule, req) in base_errors:
            continue
        stands_for = RECLASSIFIED.get((rule, subrule))
        if stands_for and (rule, stands_for[0], req) in base_errors:
            continue
        out.append(f"(a) error from the cut: {rule}/{subrule} {req}: {rec['message']}")
    available = Counter(_key(r) for r in got)
    by_key: dict[tuple, list[dict[str, Any]]] = {}
    for rec in got:
        by_key.setdefault(_key(rec), []).append(rec)
    for rec in base:  # (b)
        if rec["rule"] in AGGREGATE or not inside(name, rec, cut) or _excepted(rec):
            continue
        key = _key(rec)
        match = [g for g in by_key.get(key, []) if SEVERITY[g["severity"]] == SEVERITY[rec["severity"]]
                 or (SEVERITY[g["severity"]] < SEVERITY[rec["severity"]] and (g.get("extra") or {}).get("downgraded"))]
        if available[key] and match:
            available[key] -= 1
            continue
        out.append(f"(b) lost though inside the window: {rec['severity']} {key}: {rec['message']}")
    return out


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_window_gives_no_finding_from_the_cut_and_keeps_the_rest(name: str) -> None:
    cuts = cut_times(table_of(name))
    assert len(cuts) >= 6
    found = {cut: problems(name, cut) for cut in cuts}
    assert {cut: p for cut, p in found.items() if p} == {}


def test_the_cuts_start_windows_with_history_behind_them() -> None:
    # the property is only as good as its cuts: most of them must leave requests, blocks and steps before the window
    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.analysis.history import history

    touched = Counter()
    for name in ("sample:healthy_pd_pp1", "scenario:pd", "sample:lost_send_completion"):
        for cut in cut_times(table_of(name)):
            hist = history(AnalysisContext(trace=Trace.from_table(table_of(name)).cut(cut)))
            assert hist is not None and hist.window.source == "since" and hist.window.start_ns == cut
            touched["requests"] += bool(hist.requests)
            touched["blocks"] += bool(hist.blocks)
            touched["steps"] += bool(hist.in_flight_until)
    assert min(touched.values()) >= 5, touched


# --- how a window is known, and what a report says about it ------------------------------------------------------

def _window_dir(tmp_path: Any, name: str, cut: int, how: str) -> Any:
    """The uncut rows from `cut` on (engine_config kept) written as a trace, the window said by `how`: the files'
    metadata, the manifest, or nothing."""
    import json

    import pyarrow.parquet as pq

    from pdtrace.format import META_WINDOW_START, MANIFEST_NAME
    from pdtrace.trace.builder import write_table
    from pdtrace.trace.model import since_mask

    table = table_of(name)
    out = write_table(table.filter(since_mask(table, cut)), tmp_path / how)
    if how == "metadata":
        for path in out.rglob("*.parquet"):
            part = pq.read_table(path)
            meta = dict(part.schema.metadata or {})
            meta[META_WINDOW_START.encode()] = str(cut).encode()
            pq.write_table(part.replace_schema_metadata(meta), path)
    elif how == "manifest":
        (out / MANIFEST_NAME).write_text(json.dumps({"flight": True, "window_start_ns": cut}))
    return out


def _ids(frame: pd.DataFrame) -> list[tuple]:
    return sorted(zip(frame["rule"], frame["subrule"], frame["severity"], frame["req"].astype(str)))


@pytest.mark.parametrize("how", ["metadata", "manifest"])
def test_the_reader_takes_the_window_from_a_dump(tmp_path: Any, how: str) -> None:
    from pdtrace.trace.reader import open_trace

    name = "faulty:abort_received_then_second_completion"
    cut = cut_times(table_of(name))[0]
    trace = open_trace(_window_dir(tmp_path, name, cut, how))
    assert (trace.window_start_ns, trace.window_source) == (cut, how)
    got = analyze(trace, config=CONFIG)
    assert got.attrs["window"]["start_ns"] == cut and got.attrs["window"]["source"] == how
    assert _ids(got) == _ids(findings_of(name, cut))


def test_a_since_cut_is_a_window_and_a_whole_trace_is_not(tmp_path: Any) -> None:
    from pdtrace.trace.reader import open_trace

    name = "faulty:abort_received_then_second_completion"
    cut = cut_times(table_of(name))[0]
    path = _window_dir(tmp_path, name, int(table_of(name).column("ts_ns").to_numpy().min()), "plain")
    assert open_trace(path).window_start_ns is None
    assert open_trace(path, since_ns=cut).window_source == "since"
    assert analyze(path, config=AnalysisConfig(jobs=1)).attrs["window"] is None
    got = analyze(path, config=AnalysisConfig(jobs=1, since_ns=cut))
    assert got.attrs["window"]["source"] == "since" and _ids(got) == _ids(findings_of(name, cut))


def test_a_trace_whose_first_step_is_above_zero_is_an_inferred_window() -> None:
    name = "faulty:abort_received_then_second_completion"
    table = table_of(name)
    cut = 134_912 + int(table.column("ts_ns").to_numpy().min())  # after step 0's sched, before its output
    unmarked = Trace.from_table(table.filter(pa_greater_equal(table, cut)))  # no engine_config, no mark
    assert unmarked.window_start_ns is None
    got = analyze(unmarked, config=CONFIG)
    assert got.attrs["window"]["source"] == "inferred"
    assert _ids(got[got["severity"] == "error"]) == [("double_free", "unknown_id", "error", "r1")]
    assert not (got["subrule"] == "not_owned").any()


def pa_greater_equal(table: Any, cut: int) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.greater_equal(table.column("ts_ns"), pa.scalar(cut, pa.int64()))


def test_a_whole_trace_keeps_its_findings_about_ids_and_blocks_it_never_saw() -> None:
    # no window: a free of blocks never allocated and a completion for an unknown id are what the rules exist for
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="e")
    b.add("req_add", req="a", n=10)
    b.add("sched", step=0, n=10)
    b.add("req_sched", step=0, req="a", n=10)
    b.add("blocks_free", step=0, req="a", blocks=[7], reason="preempted", deferred=False)
    b.add("step_submit", component="engine", step=0, n=1)
    b.add("step_output", component="engine", step=0)
    got = analyze(b.trace(), config=CONFIG)
    assert got.attrs["window"] is None
    assert ("double_free", "not_owned", "error", "a") in _ids(got)


def test_a_finding_that_rests_on_history_before_the_window_is_downgraded_and_says_why() -> None:
    # r2 is added before the window and finishes inside it; one of its two ranks never reports before the
    # completion: the quorum finding stays, one lower, since what the ranks did before the window is unknown
    name = "faulty:quorum_tp2"
    cut = int(table_of(name).column("ts_ns").to_numpy().min()) + 1_300_000
    assert ("premature_free", "quorum", "error", "r2") in _ids(findings_of(name, None))
    got = findings_of(name, cut)
    weaker = got[got["extra"].map(lambda e: (e or {}).get("downgraded") == "window")]
    assert _ids(weaker) == [("premature_free", "quorum", "warning", "r2")]
    rec = weaker.iloc[0]
    assert rec["message"].startswith("history before the window unknown (request r2 began before the window")
    assert rec["extra"]["window"] == {"start_ns": cut, "source": "since",
                                      "before": ["request r2 began before the window"]}


def test_what_the_windows_own_rows_prove_stays_an_error() -> None:
    # the final free that explains the second completion lies before the window; its recorded status `unknown`
    # still says vLLM's assert fires
    name = "faulty:abort_received_then_second_completion"
    cut = cut_times(table_of(name))[0]
    got = findings_of(name, cut)
    assert _ids(got[got["severity"] == "error"]) == [("double_free", "unknown_id", "error", "r1")]
    assert got[got["severity"] == "error"].iloc[0]["extra"]["window"]["before"]


def test_analyze_says_in_its_report_that_the_trace_is_a_window(tmp_path: Any) -> None:
    import json
    import os
    import subprocess
    import sys

    sample = SAMPLE_TRACES / "lost_send_completion" / "trace"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdtrace", "analyze", str(sample), *args], env=env,
                              capture_output=True, text=True, timeout=120)

    window = run("--since", "0.02")
    assert "WINDOW: the trace starts mid-run at ts_ns" in window.stdout and "--since cut" in window.stdout
    assert "+0.020000 s from the trace's start" in window.stdout and "see only the window" in window.stdout
    assert "WINDOW:" not in run().stdout
    doc = json.loads(run("--since", "0.02", "--format", "json").stdout)
    assert doc["summary"]["window"]["source"] == "since" and "meaning" in doc["summary"]["window"]
    assert "window" not in json.loads(run("--format", "json").stdout)["summary"]


def test_a_send_that_never_completes_for_a_request_begun_before_the_window_is_still_a_leak() -> None:
    # lost_send_completion: r00004-p is allocated before the window and finishes inside it, waiting for a send
    # that never completes; the window cannot name its blocks but still reports the leak, one lower, saying why
    from pdtrace.trace.reader import open_trace

    trace = open_trace(SAMPLE_TRACES / "lost_send_completion" / "trace")
    start = int(trace.table.column("ts_ns").to_numpy().min())
    whole = analyze(trace, config=CONFIG)
    assert ("leaked_blocks", "indirectly", "error", "r00004-p") in _ids(whole)
    got = analyze(trace.cut(start + 30_000_000), config=CONFIG)
    leak = got[(got["rule"] == "leaked_blocks") & (got["req"] == "r00004-p")]
    assert _ids(leak) == [("leaked_blocks", "indirectly", "warning", "r00004-p")]
    assert "allocated before the window: ids and count unknown" in leak.iloc[0]["message"]
    assert leak.iloc[0]["extra"]["downgraded"] == "window"
    # a whole trace never takes this path: its requests all have their req_add
    assert not whole["message"].str.contains("before the window").any()


@pytest.mark.parametrize("sample", ["slow_transfer", "duplicate_completion_tp2"])
def test_a_since_window_gives_the_same_findings_partitioned(sample: str) -> None:
    path = SAMPLE_TRACES / sample / "trace"
    table = table_of(f"sample:{sample}")
    for cut in cut_times(table)[::3]:
        config = AnalysisConfig(jobs=1, since_ns=cut)
        whole = analyze(path, config=config, partitioned=False)
        parts = analyze(path, config=config, partitioned=True)
        assert whole.attrs["window"] == parts.attrs["window"] and whole.attrs["window"]["source"] == "since"
        assert _ids(whole) == _ids(parts)
        assert list(whole["message"]) == list(parts["message"])


def _freed_while_running() -> tuple[Any, int]:
    """A request added, scheduled, then giving its blocks up with reason `finished` two steps before its
    req_finish: premature_free/unfinished. Returns the builder and the ts of step 1's sched (a cut after the add)."""
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="e")
    b.add("engine_config", n=64, detail={"block_size": 16, "pp": 1, "tp": 1, "defer_block_free": False})
    b.add("req_add", req="a", n=32)
    for step in range(4):
        sched = b.add("sched", step=step, n=1)
        if step == 1:
            cut = sched["ts_ns"]
        if step == 0:
            b.add("blocks_alloc", step=0, req="a", blocks=[1, 2])
        b.add("req_sched", step=step, req="a", n=1)
        b.add("step_submit", component="engine", step=step, n=1)
        b.add("step_output", component="engine", step=step)
        if step == 1:
            b.add("blocks_free", step=1, req="a", blocks=[1, 2], reason="finished", deferred=False)
    b.add("req_finish", step=3, req="a", reason="length", status="RUNNING", delay_free=False)
    return b, cut


def test_a_premature_free_the_window_sees_before_the_finish_is_kept_one_lower() -> None:
    b, cut = _freed_while_running()
    whole = analyze(b.trace(), config=CONFIG)
    assert ("premature_free", "unfinished", "error", "a") in _ids(whole)
    got = analyze(b.trace().cut(cut), config=CONFIG)
    mine = got[(got["rule"] == "premature_free")]
    assert _ids(mine) == [("premature_free", "unfinished", "warning", "a")]
    assert mine.iloc[0]["extra"]["downgraded"] == "window"


def test_an_unfinished_free_whose_finish_the_window_does_not_hold_is_left_out() -> None:
    # the same request with its req_finish removed: in the window nothing says it had not finished before
    import pyarrow as pa
    import pyarrow.compute as pc

    b, cut = _freed_while_running()
    table = b.table()
    table = table.filter(pc.not_equal(table.column("kind").cast(pa.string()), "req_finish"))
    got = analyze(Trace.from_table(table).cut(cut), config=CONFIG)
    assert not (got["rule"] == "premature_free").any()
    assert not (got["severity"] == "error").any()
