"""premature_free on sliding-window trims (issue 22, item 1): vLLM never fences a trim (`blocks_free
reason=skipped`), so `not_deferred` must not fire on one; a trim is premature only when the step in flight still
reads the trimmed blocks and an asynchronous load writes them (vllm#47282, trimming on the optimistic token count
under async scheduling, fixed by vllm#47728), which `async_load_reuse` reports from the trim's recorded facts."""

from __future__ import annotations

import json

from pdtrace.analysis import analyze
from scenarios import not_deferred_trace, sliding_window_async


def _subrules(df):
    return sorted(set(zip(df["rule"], df["subrule"], df["severity"])))


def test_a_healthy_sliding_window_engine_under_async_scheduling_is_clean():
    """vLLM 0.33 (after #47728): trims on the processed count; the trimmed blocks go to asynchronous loads while
    the previous step is in flight, and that step never reads them. Every trim was an error before (not_deferred
    and async_load_reuse, 8 on this trace)."""
    trace = sliding_window_async()
    trims = [json.loads(d) for k, r, d in zip(trace.table.column("kind").to_pylist(),
                                              trace.table.column("reason").to_pylist(),
                                              trace.table.column("detail").to_pylist())
             if k == "blocks_free" and r == "skipped"]
    assert len(trims) == 4 and all(t["tokens"] < t["computed"] for t in trims)  # each under a step in flight
    assert len(analyze(trace)) == 0


def test_trimming_on_the_optimistic_count_is_found_as_async_load_reuse():
    """vllm#47282: each trim comes one token early and takes a block the step in flight still attends to; the
    load handed those blocks writes them under that read."""
    df = analyze(sliding_window_async(optimistic=True))
    assert _subrules(df) == [("premature_free", "async_load_reuse", "error")]
    assert len(df) == 5 and set(df["req"]) == {"long"}
    assert sorted(r for reqs in df["requests"] for r in reqs) == [f"load{i}" for i in range(1, 6)]
    assert all(e["trim"] is True and "downgraded" not in e for e in df["extra"])
    assert df["message"].str.contains("still reads them").all()


def test_without_the_trim_facts_a_reused_trim_is_a_warning_that_says_why():
    """A trace whose trims carry no window or token counts (a recorder before them): the rule cannot tell a safe
    trim from vllm#47282's, so it reports each reused trim one level lower, never not_deferred."""
    for optimistic in (False, True):
        df = analyze(sliding_window_async(optimistic=optimistic, facts=False))
        assert _subrules(df) == [("premature_free", "async_load_reuse", "warning")]
        assert all(e["downgraded"] == "no_trim_window" for e in df["extra"])


def test_not_deferred_still_fires_on_a_request_free():
    """The healthy look-alike of a trim that is a bug: an immediate finish free under defer_block_free with the
    request's step in flight."""
    df = analyze(not_deferred_trace(deferred=False), rules=["premature_free"])
    assert _subrules(df) == [("premature_free", "not_deferred", "error")]
