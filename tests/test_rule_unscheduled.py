"""unscheduled_request: each subrule on a scenario that has it and on a healthy twin that does not."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.rules.unscheduled_request import RULE, run
from pdtrace.trace.model import Trace
from scenarios import HEALTHY, Engine, builder
from scenarios_pipeline import few_requests_pp4, healthy_pp4, one_microbatch_pp4


def findings(trace, **config):
    return run(AnalysisContext(trace, AnalysisConfig().with_overrides(**config)))


def by_sub(frame, subrule):
    return frame[frame["subrule"] == subrule]


def engine(**kw) -> tuple[object, Engine]:
    b = builder()
    return b, Engine(b, instance="E", role="both", **kw)


def run_steps(e: Engine, n: int, sched: dict[str, int]) -> None:
    for _ in range(n):
        e.step(dict(sched))
        e.output()


def test_rule_object():
    assert RULE.id == "unscheduled_request"
    assert set(RULE.subrules) == {"never_scheduled", "starved", "stuck_waiting_kv", "preempted_not_resumed",
                                  "dropped_from_batch", "zombie"}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_scenarios_give_nothing(name):
    assert len(findings(HEALTHY[name]())) == 0


@pytest.mark.parametrize("make", [healthy_pp4, few_requests_pp4, one_microbatch_pp4])
def test_pipeline_runs_give_nothing(make):
    assert len(findings(make())) == 0


def head_of_line(small_served_after: int | None, small_aborted: bool = False) -> object:
    """`big` (40 blocks) cannot fit in 32 free blocks and blocks the FCFS queue; `small` (1 block) could (and is
    aborted by its client, still waiting, after 55 steps with `small_aborted`)."""
    b, e = engine()
    e.add("runner", n=16)
    e.add("big", n=640)
    e.add("small", n=16)
    e.step({"runner": 16}, alloc={"runner": [1]})
    e.output()
    for i in range(60):
        if small_served_after is not None and i == small_served_after:
            e.step({"runner": 1, "small": 16}, alloc={"small": [2]})
        elif small_aborted and i == 55:
            e.step({"runner": 1})
            e.finish("small", reason="abort", status="WAITING", free=False)
        else:
            e.step({"runner": 1})
        e.output()
    return b.trace()


def test_starved_by_head_of_line_blocker():
    f = findings(head_of_line(None))
    starved = by_sub(f, "starved")
    assert list(starved["req"]) == ["small"]
    row = starved.iloc[0]
    assert row["severity"] == "error"  # still waiting at the end
    assert row["extra"]["head_of_line"] == "big"
    assert row["extra"]["steps_with_room"] >= 50
    assert "big" in row["message"]
    # the blocker itself never had room: never_scheduled, a warning, not starved
    never = by_sub(f, "never_scheduled")
    assert list(never["req"]) == ["big"] and never.iloc[0]["severity"] == "warning"
    assert any(ev["kind"] == "req_add" and ev["req"] == "small" for ev in row["evidence"])


def test_starved_then_served_is_a_warning():
    f = by_sub(findings(head_of_line(55)), "starved")
    assert list(f["req"]) == ["small"]
    assert f.iloc[0]["severity"] == "warning"
    assert f.iloc[0]["extra"]["open_at_end"] is False


def test_starved_then_aborted_says_it_was_never_scheduled():
    row = by_sub(findings(head_of_line(None, small_aborted=True)), "starved").iloc[0]
    assert row["req"] == "small" and row["severity"] == "warning"
    assert "then finished without being scheduled" in row["message"] and "then scheduled" not in row["message"]
    assert [ev.get("note") for ev in row["evidence"] if ev["kind"] == "req_finish"] == ["waiting ended here"]


def fcfs_queue(head_admitted_at: int | None) -> object:
    """`head` (40 blocks) is added first and does not fit the 32 free blocks; `small` (1 block) behind it could.
    With `head_admitted_at`, the runner finishes at that step and head is admitted, then small: vLLM's FCFS queue
    held small behind a head that fits later, not a starvation."""
    b, e = engine()
    e.add("runner", n=16)
    e.add("head", n=640)
    e.add("small", n=16)
    e.step({"runner": 16}, alloc={"runner": [1]})
    e.output()
    for i in range(70):
        if head_admitted_at is not None and i == head_admitted_at:
            e.finish("runner")
            e.step({"head": 640}, alloc={"head": list(range(2, 42))})
        elif head_admitted_at is not None and i == head_admitted_at + 1:
            e.step({"head": 1, "small": 16}, alloc={"small": [42]})
        elif head_admitted_at is not None and i > head_admitted_at:
            e.step({"head": 1, "small": 1})
        else:
            e.step({"runner": 1})
        e.output()
    return b.trace()


def test_a_request_queued_behind_a_head_that_fits_later_is_not_starved():
    f = findings(fcfs_queue(60))
    assert len(by_sub(f, "starved")) == 0, f[["subrule", "req", "message"]].to_string()
    # its twin: the same head never admitted is the starvation of what waits behind it
    starved = by_sub(findings(fcfs_queue(None)), "starved")
    assert list(starved["req"]) == ["small"] and starved.iloc[0]["extra"]["head_of_line"] == "head"


def test_served_quickly_is_not_starved():
    f = findings(head_of_line(3))
    assert len(by_sub(f, "starved")) == 0


def test_threshold_comes_from_config():
    assert len(by_sub(findings(head_of_line(None), starve_steps=100), "starved")) == 0
    assert len(by_sub(findings(head_of_line(20)), "starved")) == 0
    assert len(by_sub(findings(head_of_line(20), starve_steps=10), "starved")) == 1


def test_no_room_in_the_token_budget_is_not_starvation():
    b, e = engine()
    e.add("runner", n=16)
    e.add("small", n=16)
    e.step({"runner": 16}, alloc={"runner": [1]})
    e.output()
    for _ in range(60):  # every step uses the whole budget of 2048 tokens
        e.step({"runner": 2048})
        e.output()
    f = findings(b.trace())
    assert len(by_sub(f, "starved")) == 0
    never = by_sub(f, "never_scheduled")
    assert list(never["req"]) == ["small"]
    # a full batch at every step of the wait but the first (room, too little to be starved): the queue of a loaded
    # engine that the trace's end cuts, not a fault
    assert never.iloc[0]["severity"] == "info" and never.iloc[0]["extra"]["steps_batch_full"] == 60
    assert "a queue, not a fault" in never.iloc[0]["message"]


def test_never_scheduled_with_room_in_the_batch_but_not_the_pool_stays_a_warning():
    # 20 of the wait's steps had token budget left; what kept the request out then was the pool, not the batch
    b, e = engine()
    e.add("runner", n=16)
    e.add("big", n=640)  # 40 blocks: never fits in the 32-block pool
    e.step({"runner": 16}, alloc={"runner": [1]})
    e.output()
    for i in range(60):
        e.step({"runner": 2048 if i < 40 else 1})
        e.output()
    never = by_sub(findings(b.trace()), "never_scheduled")
    assert list(never["req"]) == ["big"] and never.iloc[0]["severity"] == "warning"
    assert never.iloc[0]["extra"]["steps_batch_full"] == 40 and never.iloc[0]["extra"]["steps_short_of_blocks"] == 21


def preempted(resume_after: int | None) -> object:
    b, e = engine(num_blocks=8)
    e.add("a", n=32)
    e.add("b", n=32)
    e.step({"a": 32, "b": 32}, alloc={"a": [1, 2], "b": [3, 4]})
    e.output()
    e.step({"a": 1}, alloc={"a": [5, 6]}, preempt={"b": [3, 4]})
    e.output()
    for i in range(60):
        if resume_after is not None and i == resume_after:
            e.step({"a": 1, "b": 32}, alloc={"b": [3, 4]})
        elif resume_after is not None and i > resume_after:
            e.step({"a": 1, "b": 1})
        else:
            e.step({"a": 1})
        e.output()
    return b.trace()


def test_preempted_not_resumed():
    f = findings(preempted(None))
    p = by_sub(f, "preempted_not_resumed")
    assert list(p["req"]) == ["b"]
    assert p.iloc[0]["severity"] == "error"  # room existed (32 free blocks)
    assert p.iloc[0]["evidence"][0]["kind"] == "req_preempt"
    assert len(by_sub(f, "zombie")) == 0  # preempted: out of the running set


def test_preemption_then_resume_is_not_preempted_not_resumed():
    f = findings(preempted(2))
    assert len(f) == 0
    late = findings(preempted(55))
    assert len(by_sub(late, "preempted_not_resumed")) == 0
    assert list(by_sub(late, "starved")["severity"]) == ["warning"]


def waiting_kv(recv: bool, later_recv: bool = False, steps: int = 60) -> object:
    b = builder()
    d = Engine(b, instance="D", role="decode")
    d.add("runner", n=16)
    d.add("r1", n=40, remote_prefill=True, remote_instance="P", remote_req="r1", remote_blocks=3)
    d.step({"runner": 16}, alloc={"runner": [1]}, wait_kv={"r1": [2, 3, 4]})
    d.output()
    if later_recv:
        d.add("r2", n=40, remote_prefill=True, remote_instance="P", remote_req="r2", remote_blocks=3)
        d.step({"runner": 1}, wait_kv={"r2": [5, 6, 7]})
        d.output()
        d.step({"runner": 1})
        d.output()
        d.recv_done("r2")
        d.step({"runner": 1, "r2": 1})
        d.output()
        d.finish("r2", reason="length")
    for i in range(steps):
        d.step({"runner": 1, "r1": 1} if recv and 3 < i < 8 else {"runner": 1})
        d.output()
        if recv and i == 3:
            d.recv_done("r1")
        if recv and i == 7:
            d.finish("r1", reason="length")
    return b.trace()


def test_stuck_waiting_kv_severities():
    plain = by_sub(findings(waiting_kv(recv=False)), "stuck_waiting_kv")
    assert list(plain["req"]) == ["r1"] and plain.iloc[0]["severity"] == "info"
    overtaken = by_sub(findings(waiting_kv(recv=False, later_recv=True)), "stuck_waiting_kv")
    assert list(overtaken["req"]) == ["r1"] and overtaken.iloc[0]["severity"] == "warning"
    assert overtaken.iloc[0]["extra"]["overtaken_by"] == 1
    past_grace = by_sub(findings(waiting_kv(recv=False), grace_s=0.01), "stuck_waiting_kv")
    assert past_grace.iloc[0]["severity"] == "error"
    assert "grace" in past_grace.iloc[0]["message"]


def test_received_kv_is_not_stuck():
    assert len(findings(waiting_kv(recv=True))) == 0
    # received, but only after the grace period: a warning
    late = by_sub(findings(waiting_kv(recv=True), grace_s=0.001), "stuck_waiting_kv")
    assert list(late["severity"]) == ["warning"]


def test_a_second_wait_never_closed_is_stuck():
    """vllm#53250 (MoRIIO write mode): received, preempted, re-admitted, and waiting for the one-shot transfer a
    second time while the engine keeps serving another request; the first (completed) wait is not reported."""
    from scenarios import second_wait_after_preemption

    f = findings(second_wait_after_preemption())
    stuck = by_sub(f, "stuck_waiting_kv")
    assert list(stuck["req"]) == ["r1"] and stuck.iloc[0]["severity"] == "error"  # P reported its send done
    row = stuck.iloc[0]
    assert row["extra"]["receive"] == 2 and row["extra"]["remote_sent"] is True
    assert "receive #2" in row["message"]
    notes = [ev.get("note") for ev in row["evidence"]]
    assert "waiting for remote KV again" in notes and "its first receive" in notes
    assert row["step"] == 4  # the second req_wait_kv, not the first (step 0)
    assert len(f) == 1


def test_a_second_wait_that_completes_and_a_first_wait_are_not_stuck():
    from scenarios import second_wait_after_preemption

    assert len(findings(second_wait_after_preemption(second_receive=True))) == 0
    assert len(findings(HEALTHY["receive_again_after_preemption"]())) == 0
    assert len(findings(waiting_kv(recv=True))) == 0  # one wait, completed normally


def test_short_wait_at_end_is_not_reported():
    assert len(findings(waiting_kv(recv=False, steps=10))) == 0


def zombie(rescheduled_at: int | None, gap_marker: bool = False) -> object:
    b, e = engine()
    e.add("a", n=16)
    e.add("b", n=16)
    e.step({"a": 16, "b": 16}, alloc={"a": [1], "b": [2]})
    e.output()
    for i in range(60):
        if gap_marker and i == 10:
            e.ev("recorder_gap", n=100)
        e.step({"b": 1, "a": 1} if i == rescheduled_at else {"b": 1})
        e.output()
    return b.trace()


def test_zombie_open_at_end_is_an_error():
    z = by_sub(findings(zombie(None)), "zombie")
    assert list(z["req"]) == ["a"]
    assert z.iloc[0]["severity"] == "error" and z.iloc[0]["extra"]["steps"] >= 59


def test_zombie_that_came_back_is_a_warning_and_short_gaps_are_fine():
    z = by_sub(findings(zombie(55)), "zombie")
    assert list(z["severity"]) == ["warning"]
    assert len(by_sub(findings(zombie(20)), "zombie")) == 0


def test_recorder_gap_downgrades():
    z = by_sub(findings(zombie(None, gap_marker=True)), "zombie")
    assert z.iloc[0]["severity"] == "warning"
    assert z.iloc[0]["extra"]["downgraded"] == "recorder_gap"


def dropped(re_add: bool, scheduled_again: bool = True) -> object:
    b, e = engine()
    e.add("a", n=16)
    e.add("b", n=16)
    e.step({"a": 16, "b": 16}, alloc={"a": [1], "b": [2]})
    e.output()
    w = dict(component="worker", pid=1001, pp_rank=0, tp_rank=0)
    e.ev("batch_add", step=0, req="a", reason="new", **w)
    k = e.step({"b": 1})
    e.ev("batch_remove", step=k, req="a", reason="unscheduled", **w)
    e.ev("exec_begin", step=k, n=1, **w)
    e.ev("exec_end", step=k, n=1, **w)
    e.output()
    k = e.step({"a": 1, "b": 1} if scheduled_again else {"b": 1})
    if re_add:
        e.ev("batch_add", step=k, req="a", reason="resumed", **w)
    e.ev("exec_begin", step=k, n=2, **w)
    e.ev("exec_end", step=k, n=2, **w)
    e.output()
    if not scheduled_again:
        run_steps(e, 55, {"b": 1})
    return b.trace()


def test_dropped_from_batch():
    d = by_sub(findings(dropped(re_add=False)), "dropped_from_batch")
    assert list(d["req"]) == ["a"] and d.iloc[0]["severity"] == "error"
    kinds = [ev["kind"] for ev in d.iloc[0]["evidence"]]
    assert kinds == ["batch_remove", "req_sched"]


def test_dropped_and_never_back_is_a_warning():
    d = by_sub(findings(dropped(re_add=False, scheduled_again=False)), "dropped_from_batch")
    assert list(d["severity"]) == ["warning"]


def test_re_added_is_not_dropped():
    assert len(by_sub(findings(dropped(re_add=True)), "dropped_from_batch")) == 0


# -- random well-formed schedules ----------------------------------------------------------------------------
@st.composite
def schedules(draw):
    """A fair FCFS engine: requests arrive, are scheduled within a few steps, run a few steps (some preempted and
    resumed at once, some waiting briefly for remote KV), and finish."""
    n_req = draw(st.integers(1, 8))
    plan = [(draw(st.integers(0, 20)), draw(st.integers(1, 6)), draw(st.booleans()), draw(st.booleans()))
            for _ in range(n_req)]
    return plan


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_random_well_formed_schedules_never_error(plan):
    b, e = engine()
    state: dict[str, dict] = {}
    for step in range(40):
        sched: dict[str, int] = {}
        alloc: dict[str, list[int]] = {}
        wait: dict[str, list[int]] = {}
        preempt: dict[str, list[int]] = {}
        for i, (arrive, length, remote, gets_preempted) in enumerate(plan):
            r = f"r{i}"
            s = state.get(r)
            if s is None and step == arrive:
                e.add(r, n=16, **({"remote_prefill": True} if remote else {}))
                state[r] = s = {"left": length, "phase": "wait_kv" if remote else "ready", "t": step}
                if remote:
                    wait[r] = [100 + i]
                    continue
            if s is None or s["phase"] == "done":
                continue
            if s["phase"] == "wait_kv":
                if step - s["t"] >= 2:
                    e.recv_done(r)
                    s["phase"] = "ready"
                continue
            if gets_preempted and s["left"] == 1 and not s.get("was_preempted"):
                preempt[r] = []
                s["was_preempted"] = True
                continue
            sched[r] = 1
            if not s.get("alloc"):
                alloc[r] = [1 + i]
                s["alloc"] = True
            s["left"] -= 1
        e.step(sched, alloc=alloc, wait_kv=wait, preempt=preempt)
        e.output()
        for r in list(sched):
            if state[r]["left"] <= 0:
                e.finish(r, reason="length")
                state[r]["phase"] = "done"
    f = findings(b.trace())
    assert not (f["severity"] == "error").any(), f[["subrule", "message"]].to_string()


def test_zombie_counts_coalesced_empty_steps():
    b, e = engine()
    e.add("a", n=16)
    e.step({"a": 16}, alloc={"a": [1]})
    e.output()
    # one sched row standing for 80 empty schedule() calls: step ids jump by 80
    e.ev("sched", step=e.next_step, n=0, detail={"running": 1, "empty_run": 80})
    e.next_step += 80
    e.step({})
    e.output()
    z = by_sub(findings(b.trace()), "zombie")
    assert list(z["req"]) == ["a"] and z.iloc[0]["extra"]["steps"] >= 80


def test_zombie_ended_by_an_abort_between_steps():
    b, e = engine()
    e.add("a", n=16)
    e.add("b", n=16)
    e.step({"a": 16, "b": 16}, alloc={"a": [1], "b": [2]})
    e.output()
    run_steps(e, 60, {"b": 1})
    e._current = None
    e.finish("a", reason="abort")  # step null: counted with the sched-row prefix sums
    z = by_sub(findings(b.trace()), "zombie")
    assert list(z["severity"]) == ["warning"] and z.iloc[0]["extra"]["steps"] == 60


@pytest.mark.parametrize("remote", ["send_done", "expire", None])
def test_stuck_waiting_kv_with_the_prefill_side_in_the_trace(remote):
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    p.add("x1", n=40, remote_decode=True)
    p.step({"x1": 40}, alloc={"x1": [1, 2, 3]})
    p.output()
    p.finish("x1", reason="length", delay_free=True)
    d.add("y1", n=40, remote_prefill=True, remote_instance="P", remote_req="x1", remote_blocks=3)
    d.add("runner", n=16)
    d.step({"runner": 16}, alloc={"runner": [1]}, wait_kv={"y1": [4, 5, 6]})
    d.output()
    p.step({})
    p.output()
    if remote == "send_done":
        p.send_done("x1")
    elif remote == "expire":
        p.ev("kv_expire", req="x1", step=1)
    run_steps(d, 60, {"runner": 1})
    s = by_sub(findings(b.trace()), "stuck_waiting_kv")
    assert list(s["req"]) == ["y1"]
    row = s.iloc[0]
    if remote is None:
        assert row["severity"] == "info"
        return
    assert row["severity"] == "error"
    assert "P already" in row["message"]
    kinds = [ev["kind"] for ev in row["evidence"]]
    assert ("kv_send_done" if remote == "send_done" else "kv_expire") in kinds


def test_zombie_when_a_request_rows_are_not_in_time_order_in_the_files():
    """Rows of one request out of time order in load order (e.g. two writers): the exact sorted search decides."""
    b, e = engine()
    e.add("a", n=16)
    e.add("b", n=16)
    now = b.now
    e.ev("req_sched", step=61, req="a", n=1, ts=now + 10 * 1_000_000_000)  # written first, happens last
    b.at(now)
    e.step({"a": 16, "b": 16}, alloc={"a": [1], "b": [2]})
    e.output()
    run_steps(e, 61, {"b": 1})
    z = by_sub(findings(b.trace()), "zombie")
    assert list(z["req"]) == ["a"]
    assert z.iloc[0]["extra"]["steps"] == 60 and z.iloc[0]["severity"] == "warning"


def test_a_preemption_in_a_trace_without_any_sched_or_finish_is_judged_not_crashed() -> None:
    """A damaged or cut trace: a request preempted, then nothing of any request scheduled or finished (found by
    tests/test_steps.py's random corruptions: an IndexError in the search for each preemption's end). The
    preemption waits to the end, and the rule reports what it can."""
    b = builder()
    e = Engine(b, instance="E", role="both")
    e.add("a", n=32)
    e.add("w", n=32)
    k = e.step({})
    e.ev("req_preempt", step=k, req="a")
    e.output()
    table = b.trace().table
    kinds = pc.cast(table.column("kind"), pa.string())
    trimmed = table.filter(pc.invert(pc.is_in(kinds, value_set=pa.array(["req_sched", "req_finish"]))))
    found = run(AnalysisContext(Trace.from_table(trimmed)))
    assert {"w", "a"} >= set(found["req"])
