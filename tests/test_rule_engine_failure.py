"""The crash policy (rulekit.engine_failures) in leaked_blocks and unscheduled_request, and the per-rank reports
(rulekit.rank_report) that name the ranks an indirect leak waits for. EventBuilder scenarios, each with its
negative control."""

from __future__ import annotations

from scenarios import Engine, builder
from pdtrace.analysis import analyze
from pdtrace.analysis.config import AnalysisConfig
from pdtrace.trace.model import Trace

S = 1_000_000_000


def crash(e: Engine, error: str = "AssertionError: ") -> None:
    e.ev("engine_error", component="engine", step=e._current_step(), detail={"error": error, "where": "step"})


def decode_waiting_for_kv(b, **engine) -> Engine:
    """Decode instance D, one step in, with r1 waiting for its KV (blocks 7 and 8) from P's r1."""
    d = Engine(b, instance="D", role="decode", **engine)
    d.add("r1", n=40, remote_prefill=True, remote_instance="P", remote_req="r1")
    d.step({}, wait_kv={"r1": [7, 8]})
    return d


def one(df, rule: str, subrule: str):
    rows = df[(df["rule"] == rule) & (df["subrule"] == subrule)]
    assert len(rows) == 1, df[["rule", "subrule", "severity", "req"]]
    return rows.iloc[0]


# -- leaked_blocks: definitely ------------------------------------------------------------------------------------
def send_done_then_crash(with_error: bool, early_leak: bool = False) -> Trace:
    """The duplicate_completion shape: b's kv_send_done is recorded in the update whose handling then fails (the
    engine dies before it frees b); optionally an unrelated request c leaked well before the crash."""
    b = builder()
    p = Engine(b, instance="P", role="prefill")
    if early_leak:
        p.add("c")
        p.step({"c": 32}, alloc={"c": [20, 21]})
        p.output()
        p.finish("c", reason="stop", free=False)  # finished, no transfer, never freed: a leak of its own
    p.add("b", remote_decode=True)
    p.step({"b": 32}, alloc={"b": [1, 2, 3]})
    p.output()
    p.finish("b", reason="length", delay_free=True)
    p.step({})
    p.output()
    p.send_done("b", free=False)
    if with_error:
        crash(p)
    return b.trace()


def test_leak_after_engine_error_in_the_same_update_is_a_crash_consequence():
    df = analyze(send_done_then_crash(True), rules=["leaked_blocks"])
    f = one(df, "leaked_blocks", "definitely")
    assert f["severity"] == "info"
    assert f["message"].startswith("engine failed at step 1 (engine_error AssertionError) before b gave them up")
    assert f["extra"]["downgraded"] == "engine_error"
    assert f["extra"]["engine_failed"]["step"] == 1 and f["extra"]["engine_failed"]["error"] == "AssertionError"
    assert f["evidence"][-1]["kind"] == "engine_error" and f["evidence"][-1]["note"] == "the engine failed here"


def test_same_leak_without_engine_error_stays_an_error():
    f = one(analyze(send_done_then_crash(False), rules=["leaked_blocks"]), "leaked_blocks", "definitely")
    assert f["severity"] == "error" and "engine failed" not in f["message"]
    assert "engine_failed" not in f["extra"]


def test_leak_overdue_before_the_crash_keeps_its_severity():
    df = analyze(send_done_then_crash(True, early_leak=True), rules=["leaked_blocks"])
    by_req = {r["req"]: r for r in df.to_dict("records")}
    assert by_req["c"]["severity"] == "error" and "engine failed" not in by_req["c"]["message"]
    assert by_req["b"]["severity"] == "info"


# -- leaked_blocks: indirectly, and a peer that outlives the crash ------------------------------------------------
def delay_free_then_crash(wait_before_crash_s: float, with_error: bool = True) -> Trace:
    """P finishes a with delay_free, waits, fails; D keeps stepping 600 s after, so the trace ends past grace."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    p.add("a", remote_decode=True)
    p.step({"a": 32}, alloc={"a": [5, 6]})
    p.output()
    p.finish("a", reason="length", delay_free=True)
    b.advance(int(wait_before_crash_s * S))
    p.step({})
    p.output()
    if with_error:
        crash(p)
    b.advance(600 * S)
    d.step({})
    d.output()
    return b.trace()


def test_transfer_wait_cut_by_the_crash_is_info():
    f = one(analyze(delay_free_then_crash(1.0), rules=["leaked_blocks"]), "leaked_blocks", "indirectly")
    assert f["severity"] == "info" and "engine failed at step 1" in f["message"]
    assert any(e["kind"] == "engine_error" for e in f["evidence"])


def test_transfer_wait_without_crash_or_already_past_grace_is_an_error():
    f = one(analyze(delay_free_then_crash(1.0, with_error=False), rules=["leaked_blocks"]),
            "leaked_blocks", "indirectly")
    assert f["severity"] == "error"
    f = one(analyze(delay_free_then_crash(500.0), rules=["leaked_blocks"]), "leaked_blocks", "indirectly")
    assert f["severity"] == "error" and "engine failed" not in f["message"]


# -- unscheduled_request ------------------------------------------------------------------------------------------
def waiting_kv_then_crash(wait_before_crash_s: float, with_error: bool = True) -> Trace:
    """D waits for remote KV, then its engine fails; P keeps going 600 s."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = decode_waiting_for_kv(b, pid=2000)
    d.output()
    b.advance(int(wait_before_crash_s * S))
    d.step({})
    d.output()
    if with_error:
        crash(d, "RuntimeError: connector died")
    b.advance(600 * S)
    p.step({})
    p.output()
    return b.trace()


def test_stuck_waiting_kv_cut_by_the_crash_is_info():
    df = analyze(waiting_kv_then_crash(1.0), rules=["unscheduled_request", "leaked_blocks"])
    stuck = one(df, "unscheduled_request", "stuck_waiting_kv")
    assert stuck["severity"] == "info"
    assert stuck["message"].startswith("engine failed at step 1 (engine_error RuntimeError: connector died) "
                                       "before r1 its KV arrived")
    assert stuck["evidence"][-1]["kind"] == "engine_error"
    assert one(df, "leaked_blocks", "indirectly")["severity"] == "info"


def test_stuck_waiting_kv_without_crash_or_past_grace_before_it_is_an_error():
    for trace in (waiting_kv_then_crash(1.0, with_error=False), waiting_kv_then_crash(500.0)):
        stuck = one(analyze(trace, rules=["unscheduled_request"]), "unscheduled_request", "stuck_waiting_kv")
        assert stuck["severity"] == "error" and "engine failed" not in stuck["message"]


def never_scheduled_until_crash(steps_before: int, with_error: bool = True) -> Trace:
    """Request w waits while `steps_before` steps run with room, then one more step fails."""
    b = builder()
    e = Engine(b, instance="E")
    e.add("w", n=32)
    for _ in range(steps_before):
        e.step({})
        e.output()
    e.step({})  # the failing step: scheduled, never output
    if with_error:
        e._current = e.next_step - 1
        crash(e)
    return b.trace()


def test_starvation_reaching_the_threshold_only_with_the_failing_step_is_a_crash_consequence():
    cfg = AnalysisConfig(starve_steps=3)
    f = one(analyze(never_scheduled_until_crash(2), rules=["unscheduled_request"], config=cfg),
            "unscheduled_request", "starved")
    assert f["severity"] == "info" and "before w was scheduled" in f["message"]
    f = one(analyze(never_scheduled_until_crash(2, with_error=False), rules=["unscheduled_request"], config=cfg),
            "unscheduled_request", "starved")
    assert f["severity"] == "error"


def test_starvation_before_the_crash_keeps_its_severity():
    f = one(analyze(never_scheduled_until_crash(5), rules=["unscheduled_request"],
                    config=AnalysisConfig(starve_steps=3)), "unscheduled_request", "starved")
    assert f["severity"] == "error" and "engine failed" not in f["message"]


# -- per-rank reports -----------------------------------------------------------------------------------------
def tp2_send(ranks: list[int], other_ranks: list[int] | None = None, expected_ranks: int | None = None) -> Trace:
    """TP=2 prefill; r1's send is reported by `ranks` and never aggregated; the trace ends 600 s later. `other_ranks`:
    an earlier request r0 whose send completed with these ranks reporting."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", tp=2)

    def finish_and_report(req: str, blocks: list[int], reporting: list[int]) -> None:
        """Prefill `req`, finish it with delay_free, then the next step's workers `reporting` its send."""
        p.add(req, remote_decode=True)
        p.step({req: 32}, alloc={req: blocks})
        p.output()
        p.finish(req, reason="length", delay_free=True)
        p.step({})
        for tp in reporting:
            p.ev("kv_send_rank", component="worker", pid=1001 + tp, pp_rank=0, tp_rank=tp, step=p.next_step - 1,
                 req=req)
        p.output()

    if other_ranks is not None:
        finish_and_report("r0", [1, 2], other_ranks)
        p.send_done("r0", **({"detail": {"expected_ranks": expected_ranks}} if expected_ranks else {}))
    finish_and_report("r1", [3, 4], ranks)
    b.advance(600 * S)
    p.step({})
    p.output()
    return b.trace()


def test_indirect_leak_names_the_rank_that_never_reported():
    f = one(analyze(tp2_send([0], other_ranks=[0, 1]), rules=["leaked_blocks"]), "leaked_blocks", "indirectly")
    assert f["severity"] == "error" and f["req"] == "r1"
    assert "rank(s) pp0/tp1 never reported the send (kv_send_rank from pp0/tp0 only; 2 expected" in f["message"]
    assert f["extra"]["missing_ranks"] == ["pp0/tp1"] and f["extra"]["ranks_reported"] == ["pp0/tp0"]
    assert f["extra"]["ranks_expected"] == 2
    assert f["context"].endswith(":missing_rank")
    rank_ev = [e for e in f["evidence"] if e["kind"] == "kv_send_rank"]
    assert [(e["req"], e["tp_rank"]) for e in rank_ev] == [("r1", 0)]


def test_missing_rank_from_the_config_grid_and_from_expected_ranks():
    # no other request: the engine_config grid (tp=2) names tp1
    f = one(analyze(tp2_send([1]), rules=["leaked_blocks"]), "leaked_blocks", "indirectly")
    assert f["extra"]["missing_ranks"] == ["pp0/tp0"] and "engine_config tp*pp" in f["message"]
    # the instance's completions say 3 ranks are expected: one more than the grid and the reports name
    f = one(analyze(tp2_send([0], other_ranks=[0, 1], expected_ranks=3), rules=["leaked_blocks"]),
            "leaked_blocks", "indirectly")
    assert f["extra"]["ranks_expected"] == 3 and f["extra"]["missing_ranks"] == ["pp0/tp1"]
    assert "pp0/tp1, 1 more never reported" in f["message"]


def test_every_rank_reported_or_no_rank_rows_is_a_plain_leak():
    for trace in (tp2_send([0, 1], other_ranks=[0, 1]), tp2_send([], other_ranks=[0, 1])):
        f = one(analyze(trace, rules=["leaked_blocks"]), "leaked_blocks", "indirectly")
        assert "never reported" not in f["message"] and "missing_ranks" not in f["extra"]
        assert not f["context"].endswith(":missing_rank")


def test_receive_side_names_the_missing_rank():
    b = builder()
    d = decode_waiting_for_kv(b, tp=2)
    d.ev("kv_recv_rank", component="worker", pid=2002, pp_rank=0, tp_rank=1, step=0, req="r1")
    d.output()
    b.advance(600 * S)
    d.step({})
    d.output()
    f = one(analyze(b.trace(), rules=["leaked_blocks"]), "leaked_blocks", "indirectly")
    assert f["extra"]["missing_ranks"] == ["pp0/tp0"]
    assert "never reported the receive (kv_recv_rank from pp0/tp1 only" in f["message"]


def test_idle_request_on_a_failed_engine_is_info_not_possibly_lost():
    def trace(with_error: bool) -> Trace:
        b = builder()
        p = Engine(b, instance="P", role="prefill", pid=1000)
        d = Engine(b, instance="D", role="decode", pid=2000)
        p.add("a")
        p.step({"a": 32}, alloc={"a": [9]})
        if with_error:
            p._current = 0
            crash(p)  # step 0 never comes back: a stays allocated, alive
        b.advance(600 * S)
        d.step({})
        d.output()
        return b.trace()
    f = one(analyze(trace(True), rules=["leaked_blocks"]), "leaked_blocks", "possibly")
    assert f["severity"] == "info" and f["message"].startswith("engine failed at step 0")
    f = one(analyze(trace(False), rules=["leaked_blocks"]), "leaked_blocks", "possibly")
    assert f["severity"] == "warning"


def test_leak_summary_leaves_out_crash_consequences():
    from pdtrace.analysis import summarize_findings

    crashed = summarize_findings(analyze(send_done_then_crash(True, early_leak=True), rules=["leaked_blocks"]))
    assert [(e["instance"], e["definitely"], e["requests"]) for e in crashed["leaks"]] == [("P", 2, 1)]  # c only
    plain = summarize_findings(analyze(send_done_then_crash(False, early_leak=True), rules=["leaked_blocks"]))
    assert [(e["instance"], e["definitely"], e["requests"]) for e in plain["leaks"]] == [("P", 5, 2)]


def test_a_peer_of_the_failed_engine_keeps_its_findings():
    """P fails; D, still waiting for P's KV 600 s later, is not excused: the policy is per scheduler."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = decode_waiting_for_kv(b, pid=2000)
    d.output()
    p.step({})
    p._current = 0
    crash(p)
    crash(p, "RuntimeError: second")  # only the first engine_error of a scheduler counts
    b.advance(600 * S)
    d.step({})
    d.output()
    df = analyze(b.trace(), rules=["unscheduled_request", "leaked_blocks"])
    assert set(df["instance"]) == {"D"} and set(df["severity"]) == {"error"}
    assert not df["message"].str.startswith("engine failed").any()  # not rewritten as a crash consequence
    # ...but the wait names its dead KV source, with P's first engine_error as evidence
    stuck = one(df, "unscheduled_request", "stuck_waiting_kv")
    assert "its KV source P engine failed at step" in stuck["message"] and "AssertionError" in stuck["message"]
    assert stuck["extra"]["peer_engine_failed"]["instance"] == "P"
    assert any(e["kind"] == "engine_error" and e.get("note") == "P failed here" for e in stuck["evidence"])


def test_a_wait_on_a_live_peer_does_not_cite_a_failure():
    b = builder()
    Engine(b, instance="P", role="prefill", pid=1000).step({})
    d = decode_waiting_for_kv(b, pid=2000)
    d.output()
    b.advance(600 * S)
    d.step({})
    d.output()
    stuck = one(analyze(b.trace(), rules=["unscheduled_request"]), "unscheduled_request", "stuck_waiting_kv")
    assert "its KV source" not in stuck["message"] and "peer_engine_failed" not in stuck["extra"]
