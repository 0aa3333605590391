"""request_phases and block_usage (pdtrace/analysis/timelines.py) on hand-made P/D scenarios."""

from __future__ import annotations

import numpy as np
import pandas.testing as pd_testing
import pytest

from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.timelines import BLOCK_STATES, block_usage, request_phases
from pdtrace.trace.builder import EventBuilder

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def pd_scenario() -> EventBuilder:
    """A prefill instance (PP=2, batch queue 2) sending two requests' KV to a decode instance.

    r1 is sent and freed; r2 waits for a transfer that never completes within the trace; r3 finishes without a
    delayed free and never frees its block (a definite leak); d1 on D receives r1's KV and runs.
    """
    b = EventBuilder(instance="prefill-0", role="prefill", pid=100, start_ns=T0)

    def p(kind: str, t_ms: float, **kw: object) -> None:
        b.add(kind, ts=T0 + int(t_ms * MS), instance="prefill-0", role="prefill", pid=100, **kw)

    def d(kind: str, t_ms: float, **kw: object) -> None:
        b.add(kind, ts=T0 + int(t_ms * MS), instance="decode-0", role="decode", pid=200, **kw)

    def w(inst: str, pid: int, role: str, kind: str, t_ms: float, **kw: object) -> None:
        b.add(kind, ts=T0 + int(t_ms * MS), instance=inst, role=role, pid=pid, component="worker", tp_rank=0, **kw)

    p("engine_config", 0, n=64, detail={"pp": 2, "tp": 1, "batch_queue_size": 2, "block_size": 16})
    d("engine_config", 0, n=32, detail={"pp": 1, "tp": 1, "batch_queue_size": 1, "block_size": 16})
    p("req_add", 1, req="r1", n=40, detail={"remote_decode": True})
    p("req_add", 1.1, req="r2", n=20, detail={"remote_decode": True})
    p("req_add", 1.2, req="r3", n=10)
    # P step 0: all three run, PP lanes 0 then 1
    p("sched", 2, step=0, n=70, detail={"running": 3, "waiting": 0, "waiting_kv": 0, "free_blocks": 58,
                                         "dur_ns": 300_000})
    for req, n in (("r1", 40), ("r2", 20), ("r3", 10)):
        p("req_sched", 2.1, step=0, req=req, n=n)
    p("blocks_alloc", 2.2, step=0, req="r1", blocks=[1, 2, 3])
    p("blocks_alloc", 2.2, step=0, req="r2", blocks=[4, 5])
    p("blocks_alloc", 2.2, step=0, req="r3", blocks=[6])
    p("step_submit", 2.3, step=0, n=1, component="engine")
    w("prefill-0", 101, "prefill", "exec_begin", 2.4, step=0, n=70, pp_rank=0)
    w("prefill-0", 101, "prefill", "exec_end", 4.4, step=0, n=70, pp_rank=0)
    w("prefill-0", 102, "prefill", "exec_begin", 4.5, step=0, n=70, pp_rank=1)
    w("prefill-0", 102, "prefill", "exec_end", 6.5, step=0, n=70, pp_rank=1)
    p("step_output", 6.6, step=0, component="engine", detail={"wait_ns": 4_000_000})
    p("req_finish", 6.7, step=0, req="r1", reason="length", status="RUNNING", delay_free=True)
    p("req_finish", 6.7, step=0, req="r2", reason="length", status="RUNNING", delay_free=True)
    p("req_finish", 6.8, step=0, req="r3", reason="stop", status="RUNNING", delay_free=False)
    # P step 1: empty
    p("sched", 7, step=1, n=0, detail={"running": 0, "waiting": 0, "waiting_kv": 0, "free_blocks": 58,
                                        "dur_ns": 100_000})
    # D: d1 receives r1's KV
    d("req_add", 8, req="d1", n=40, detail={"remote_prefill": True, "remote_instance": "prefill-0",
                                             "remote_req": "r1", "remote_blocks": [1, 2, 3]})
    d("sched", 8.5, step=0, n=0, detail={"running": 0, "waiting": 1, "waiting_kv": 0, "free_blocks": 32,
                                          "dur_ns": 200_000})
    d("req_wait_kv", 8.6, step=0, req="d1", blocks=[7, 8, 9], n=40)
    d("blocks_alloc", 8.6, step=0, req="d1", blocks=[7, 8, 9])
    d("kv_recv_done", 19, step=3, req="d1", status="WAITING_FOR_REMOTE_KVS")
    p("kv_send_done", 20, step=2, req="r1", status="FINISHED_LENGTH_CAPPED")
    p("blocks_free", 20, step=2, req="r1", blocks=[1, 2, 3], reason="sent", deferred=False)
    p("blocks_pool_free", 20, step=2, req="r1", blocks=[1, 2, 3])
    d("sched", 21, step=4, n=1, detail={"running": 1, "waiting": 0, "waiting_kv": 0, "free_blocks": 29,
                                         "dur_ns": 250_000})
    d("req_sched", 21.1, step=4, req="d1", n=1)
    d("step_submit", 21.2, step=4, n=1, component="engine")
    w("decode-0", 201, "decode", "exec_begin", 21.3, step=4, n=1, pp_rank=0)
    w("decode-0", 201, "decode", "exec_end", 23.3, step=4, n=1, pp_rank=0)
    d("step_output", 23.4, step=4, component="engine", detail={"wait_ns": 2_000_000})
    d("req_finish", 25, step=4, req="d1", reason="stop", status="RUNNING", delay_free=False)
    d("blocks_free", 25, step=4, req="d1", blocks=[7, 8, 9], reason="finished", deferred=False)
    d("blocks_pool_free", 25, step=4, req="d1", blocks=[7, 8, 9])
    p("sched", 30, step=3, n=0, detail={"running": 0, "waiting": 0, "waiting_kv": 0, "free_blocks": 61,
                                         "dur_ns": 100_000})
    return b


def test_request_phases_follow_the_lifecycle() -> None:
    ctx = AnalysisContext(pd_scenario().trace())
    ph = request_phases(ctx)
    end = T0 + 30 * MS

    def phases(req: str) -> list[tuple[str, int, int]]:
        rows = ph[ph["req"] == req].sort_values("start_ns")
        spans = zip(rows["phase"], rows["start_ns"], rows["end_ns"], strict=True)
        return [(str(r), (s - T0), (e - T0)) for r, s, e in spans]

    assert phases("r1") == [("waiting", 1 * MS, int(2.1 * MS)), ("running", int(2.1 * MS), int(6.7 * MS)),
                            ("finished_holding", int(6.7 * MS), 20 * MS), ("freed", 20 * MS, end - T0)]
    # r2's transfer never completes: it holds its blocks to the end.
    assert phases("r2")[-1] == ("finished_holding", int(6.7 * MS), end - T0)
    # r3 finished without a delayed free: freed at once (its block leak is block_usage's business).
    assert [x[0] for x in phases("r3")] == ["waiting", "running", "freed"]
    assert [x[0] for x in phases("d1")] == ["waiting", "waiting_kv", "waiting", "running", "freed"]
    assert phases("d1")[1][1:] == (int(8.6 * MS), 19 * MS)
    assert set(ph.loc[ph["req"] == "d1", "instance"]) == {"decode-0"}
    assert (ph["end_ns"] > ph["start_ns"]).all()


def test_request_phases_after_finish_ignore_queue_events_but_not_reuse() -> None:
    b = EventBuilder(instance="e", start_ns=T0)
    b.add("req_add", ts=T0, req="x", n=4)
    b.add("req_sched", ts=T0 + 10, step=0, req="x", n=4)
    b.add("req_preempt", ts=T0 + 20, step=1, req="x")
    b.add("req_sched", ts=T0 + 30, step=2, req="x", n=4)
    b.add("req_finish", ts=T0 + 40, step=2, req="x", reason="stop", delay_free=True)
    b.add("kv_recv_done", ts=T0 + 45, step=3, req="x")          # after the finish: no phase change
    b.add("blocks_free", ts=T0 + 50, step=3, req="x", blocks=[1], reason="sent")
    b.add("req_add", ts=T0 + 60, req="x", n=4)                  # the id is reused: a new lifecycle
    b.add("req_preempt", ts=T0 + 70, step=4, req="x")
    ph = request_phases(AnalysisContext(b.trace()))
    got = [(str(p), s - T0, e - T0) for p, s, e in zip(ph["phase"], ph["start_ns"], ph["end_ns"], strict=True)]
    assert got == [("waiting", 0, 10), ("running", 10, 20), ("waiting", 20, 30), ("running", 30, 40),
                   ("finished_holding", 40, 50), ("freed", 50, 60), ("waiting", 60, 70)]


def blocks_in_use_by_instance(trace) -> dict[str, list[tuple[int, int]]]:
    """Independent count (plain Python over the events, in time order): distinct blocks with at least one owner,
    after each event, per instance."""
    rows = trace.table.select(["ts_ns", "seq", "pid", "instance", "kind", "req", "blocks"]).to_pylist()
    rows.sort(key=lambda r: (r["ts_ns"], r["pid"], r["seq"]))
    owners: dict[tuple[str, int], set[str]] = {}
    series: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        if r["kind"] not in ("blocks_alloc", "blocks_free") or r["req"] is None:
            continue
        for blk in r["blocks"] or []:
            held = owners.setdefault((r["instance"], blk), set())
            (held.add if r["kind"] == "blocks_alloc" else held.discard)(r["req"])
        count = sum(1 for (inst, _), o in owners.items() if inst == r["instance"] and o)
        series.setdefault(r["instance"], []).append((r["ts_ns"], count))
    return series


def test_block_usage_splits_by_owner_state() -> None:
    from pdtrace.analysis.findings import findings_frame

    ctx = AnalysisContext(pd_scenario().trace())
    leak = findings_frame([{"rule": "leaked_blocks", "severity": "error", "instance": "prefill-0", "dp_rank": 0,
                            "req": "r3", "blocks": [6], "ts_ns": T0 + int(6.8 * MS)}])
    u = block_usage(ctx, findings=leak)
    p = u[u["instance"] == "prefill-0"]
    got = [((t - T0) / MS, r, f, lk, pool) for t, r, f, lk, pool in
           zip(p["ts_ns"], p["running"], p["finished_awaiting_transfer"], p["leaked"], p["pool_blocks"], strict=True)]
    assert got == [(2.2, 6, 0, 0, 64), (6.7, 1, 5, 0, 64), (6.8, 0, 5, 1, 64), (20.0, 0, 2, 1, 64)]
    d = u[u["instance"] == "decode-0"]
    assert list(zip(d["in_use"], d["pool_blocks"], strict=True)) == [(3, 32), (0, 32)]
    assert (u["in_use"] == u[list(BLOCK_STATES)].sum(axis=1)).all()
    # Without the leak finding, r3's block is only "finished" (leaks are the leaked_blocks rule's call).
    from pdtrace.analysis.findings import empty_findings

    plain = block_usage(AnalysisContext(pd_scenario().trace()), findings=empty_findings())
    assert plain["leaked"].max() == 0
    assert plain.loc[plain["instance"] == "prefill-0", "finished_awaiting_transfer"].max() == 6


@pytest.mark.parametrize("name", ["shared_prefix", "preempt_resume", "pd", "deferred_frees", "chunked_prefill"])
def test_block_usage_matches_an_independent_count(name: str) -> None:
    from scenarios import HEALTHY

    from pdtrace.analysis.findings import empty_findings

    trace = HEALTHY[name]()
    u = block_usage(AnalysisContext(trace), findings=empty_findings())
    expected = blocks_in_use_by_instance(trace)
    for inst, series in expected.items():
        mine = u[u["instance"] == inst]
        # The count after the last event at each instant equals ours at that instant.
        last = {}
        for ts, count in series:
            last[ts] = count
        ours = dict(zip(mine["ts_ns"], mine["in_use"], strict=True))
        times = np.array(sorted(ours))
        for ts, count in last.items():
            before = times[times <= ts]
            assert (ours[before[-1]] if len(before) else 0) == count, (inst, ts)
        assert mine["in_use"].max() == max(c for _, c in series)


def test_block_usage_counts_a_shared_block_once() -> None:
    from scenarios import shared_prefix

    from pdtrace.analysis.findings import empty_findings

    u = block_usage(AnalysisContext(shared_prefix()), findings=empty_findings())
    # a holds 1,2,3; b adds 1,2 (shared) and 4: four distinct blocks, not six.
    assert u["in_use"].max() == 4
    assert u["in_use"].iloc[-1] == 0


def _sample_traces() -> list:
    from pathlib import Path

    from pdtrace.trace.reader import open_trace

    root = Path(__file__).resolve().parent.parent / "sample_traces"
    return [open_trace(p, warn=False) for p in sorted(root.glob("*/trace"))]


def test_block_usage_of_blocks_with_one_holder_at_a_time_equals_the_per_block_count(monkeypatch) -> None:
    """Blocks never held twice at once take a fast path (their holdings' segments are the changes); counting
    holders per state for every block, as for shared blocks, gives the same table."""
    from scenarios import HEALTHY

    from pdtrace.analysis.blocks import Ownership, ownership

    traces = [make() for make in HEALTHY.values()] + [pd_scenario().trace()] + _sample_traces()
    fast = [block_usage(AnalysisContext(trace)) for trace in traces]
    # both paths are exercised: the scenarios include prefix sharing
    assert any(ownership(AnalysisContext(trace)).shared_blocks().any() for trace in traces)
    monkeypatch.setattr(Ownership, "shared_blocks", lambda self: np.ones(len(self), bool))
    for trace, expected in zip(traces, fast, strict=True):
        pd_testing.assert_frame_equal(block_usage(AnalysisContext(trace)), expected)


def test_shared_blocks_are_the_blocks_two_holdings_held_at_once() -> None:
    from scenarios import HEALTHY

    from pdtrace.analysis.blocks import ownership

    marked = 0
    for trace in [make() for make in HEALTHY.values()] + _sample_traces():
        own = ownership(AnalysisContext(trace))
        end = np.where(own.free_row >= 0, own.free_pos, np.iinfo(np.int64).max)
        expected = np.zeros(len(own), bool)
        for i, j in zip(*np.triu_indices(len(own), 1)):  # every pair of holdings (few)
            if own.pool_key[i] == own.pool_key[j] and own.alloc_pos[i] < end[j] and own.alloc_pos[j] < end[i]:
                expected |= own.pool_key == own.pool_key[i]
        np.testing.assert_array_equal(own.shared_blocks(), expected)
        marked += int(expected.sum())
    assert marked > 0


def test_block_usage_takes_leaks_from_the_leaked_blocks_rule() -> None:
    from pdtrace.analysis import analyze

    trace = pd_scenario().trace()
    leaks = analyze(trace, rules=["leaked_blocks"])
    # r3 finished without freeing; r2's transfer is within the grace period: still held (info), not leaked
    assert set(leaks["req"]) == {"r2", "r3"}
    assert set(leaks[leaks["subrule"] == "still_held"]["req"]) == {"r2"}
    u = block_usage(AnalysisContext(trace))  # runs the rule itself
    assert u.equals(block_usage(AnalysisContext(trace), findings=analyze(trace)))
    p = u[u["instance"] == "prefill-0"]
    assert p["leaked"].max() == 1
    assert int(p.loc[p["leaked"] > 0, "ts_ns"].min()) == T0 + int(6.8 * MS)  # from r3's finish
