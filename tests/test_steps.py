"""steps.py: the step table, exec spans and bubbles, checked against hand-built events."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.steps import (BUBBLE_COLUMNS, SPAN_COLUMNS, STEP_COLUMNS, StepCount, bubbles, exec_spans,
                                    step_table)
from pdtrace.trace.builder import EventBuilder
from scenarios import HEALTHY
from scenarios_pipeline import MS, few_requests_pp4, healthy_pp4, simulate_pipeline

T0 = 1_700_000_000_000_000_123  # not a multiple of 256: float64 would round it


def ctx_of(b: EventBuilder, **config) -> AnalysisContext:
    return AnalysisContext(b.trace(), AnalysisConfig().with_overrides(**config))


def test_step_table_joins_sched_submit_output():
    b = EventBuilder(instance="E", start_ns=T0)
    b.add("sched", step=0, n=48, detail={"running": 2, "waiting": 3, "waiting_kv": 1, "free_blocks": 17,
                                         "dur_ns": 1234})
    b.add("step_submit", component="engine", step=0, n=1)
    b.add("sched", step=1, n=0, detail={"running": 2, "empty_run": 5})
    b.add("step_output", component="engine", step=0, detail={"wait_ns": 999})
    b.add("step_submit", component="engine", step=7, n=2)  # a submit without sched (dropped sched row)
    b.add("sched", step=0, n=48, instance="F", dp_rank=1)
    t = step_table(ctx_of(b))
    assert list(t.columns) == list(STEP_COLUMNS)
    e0 = t[(t["instance"] == "E") & (t["step"] == 0)].iloc[0]
    assert e0["sched_ts"] == T0 and e0["submit_ts"] == T0 + 1000 and e0["output_ts"] == T0 + 3000
    assert (e0["tokens"], e0["running"], e0["waiting"], e0["waiting_kv"], e0["free_blocks"], e0["dur_ns"]) == \
        (48, 2, 3, 1, 17, 1234)
    assert e0["in_flight"] == 1 and e0["wait_ns"] == 999 and e0["empty_run"] == 1
    e1 = t[(t["instance"] == "E") & (t["step"] == 1)].iloc[0]
    assert e1["empty_run"] == 5 and pd.isna(e1["submit_ts"]) and pd.isna(e1["free_blocks"])
    e7 = t[(t["instance"] == "E") & (t["step"] == 7)].iloc[0]
    assert pd.isna(e7["sched_ts"]) and e7["in_flight"] == 2
    f0 = t[t["instance"] == "F"].iloc[0]
    assert f0["dp_rank"] == 1 and f0["tokens"] == 48
    assert len(t) == 4


def test_exec_spans_pairing_rpc_and_gpu_times():
    b = EventBuilder(instance="E", start_ns=T0)
    w0 = dict(pid=2000, pp_rank=0, tp_rank=0)
    b.add("exec_begin", step=0, n=8, **w0)
    b.add("exec_end", step=0, n=8, detail={"gpu_begin_ns": T0 + 10, "gpu_end_ns": T0 + 5_000_017}, **w0)
    b.add("exec_begin", step=0, n=8, **w0)
    b.add("exec_end", step=0, n=8, **w0)  # second RPC of the step, no rpc detail: sample_tokens
    b.add("exec_begin", step=1, n=4, **w0)
    b.add("exec_end", step=1, n=4, detail={"rpc": "execute_model"}, **w0)
    b.add("exec_begin", step=2, n=4, **w0)  # never ends (trace cut)
    b.add("exec_end", step=0, n=8, pid=2001, pp_rank=1, tp_rank=0)  # begin lost
    s = exec_spans(ctx_of(b))
    assert list(s.columns) == list(SPAN_COLUMNS)
    r0 = s[s["pp_rank"] == 0].reset_index(drop=True)
    assert list(r0["step"]) == [0, 0, 1, 2]
    assert list(r0["rpc"]) == ["execute_model", "sample_tokens", "execute_model", "execute_model"]
    assert r0.loc[0, "gpu_begin_ns"] == T0 + 10 and r0.loc[0, "gpu_end_ns"] == T0 + 5_000_017
    assert r0.loc[0, "begin_ts"] == T0 and r0.loc[0, "end_ts"] == T0 + 1000
    assert pd.isna(r0.loc[3, "end_ts"]) and r0.loc[3, "begin_ts"] == T0 + 6000
    r1 = s[s["pp_rank"] == 1].iloc[0]
    assert pd.isna(r1["begin_ts"]) and r1["end_ts"] == T0 + 7000


def test_bubbles_gaps_exact_and_min_ns():
    b = EventBuilder(instance="E", start_ns=T0)
    b.add("req_add", req="a", n=16)
    w = dict(pid=2000, pp_rank=0, tp_rank=0)
    b.add("exec_begin", step=0, n=16, ts=T0 + 10, **w)
    b.add("exec_end", step=0, n=16, ts=T0 + 1_000_010, **w)
    b.add("exec_begin", step=1, n=1, ts=T0 + 3_000_010, **w)  # 2 ms gap
    b.add("exec_end", step=1, n=1, ts=T0 + 3_500_010, **w)
    b.add("exec_begin", step=2, n=1, ts=T0 + 3_600_010, **w)  # 0.1 ms gap: below the 1 ms default
    b.add("exec_end", step=2, n=1, ts=T0 + 4_000_010, **w)
    bub = bubbles(ctx_of(b))
    assert list(bub.columns) == list(BUBBLE_COLUMNS)
    assert len(bub) == 1
    row = bub.iloc[0]
    assert row["start_ns"] == T0 + 1_000_010 and row["end_ns"] == T0 + 3_000_010 and row["dur_ns"] == 2_000_000
    assert (row["step_before"], row["step_after"]) == (0, 1)
    assert len(bubbles(ctx_of(b, bubble_min_ns=50_000))) == 2


def test_empty_steps_are_not_busy_and_overlaps_merge():
    b = EventBuilder(instance="E", start_ns=T0)
    b.add("req_add", req="a", n=16)
    w = dict(pid=2000, pp_rank=0, tp_rank=0)
    b.add("exec_begin", step=0, n=16, ts=T0, **w)
    b.add("exec_end", step=0, n=16, ts=T0 + 2 * MS, **w)
    b.add("exec_begin", step=1, n=0, ts=T0 + 3 * MS, **w)  # an empty step's no-forward RPC: idle, not busy
    b.add("exec_end", step=1, n=0, ts=T0 + 3 * MS + 10, **w)
    b.add("exec_begin", step=2, n=8, ts=T0 + 5 * MS, **w)
    b.add("exec_end", step=2, n=8, ts=T0 + 6 * MS, **w)
    bub = bubbles(ctx_of(b))
    assert list(bub["dur_ns"]) == [3 * MS]
    assert list(bub["step_after"]) == [2]


def test_no_requests_between_waves():
    b = EventBuilder(instance="E", start_ns=T0)
    w = dict(pid=2000, pp_rank=0, tp_rank=0)
    b.add("req_add", req="a", n=16, ts=T0)
    b.add("exec_begin", step=0, n=16, ts=T0 + 10, **w)
    b.add("exec_end", step=0, n=16, ts=T0 + MS, **w)
    b.add("req_finish", step=0, req="a", reason="stop", ts=T0 + MS + 10)
    b.add("req_add", req="b", n=16, ts=T0 + 50 * MS)
    b.add("exec_begin", step=1, n=16, ts=T0 + 50 * MS + 100, **w)
    b.add("exec_end", step=1, n=16, ts=T0 + 51 * MS, **w)
    bub = bubbles(ctx_of(b))
    assert list(bub["cause"]) == ["idle_no_requests"]
    assert list(bub["runnable"]) == [1]  # a had not finished yet at the gap start


def test_pipeline_model_causes():
    b = bubbles(AnalysisContext(few_requests_pp4()))
    assert set(b["cause"]) == {"queue_not_full"}
    assert set(b["pp_rank"]) == {0, 1, 2, 3}
    full = bubbles(AnalysisContext(healthy_pp4()))
    assert len(full) == 0  # gaps of 0.1 ms only, below bubble_min_ns


def test_healthy_scenarios_build_every_table():
    for make in HEALTHY.values():
        ctx = AnalysisContext(make())
        assert len(step_table(ctx)) > 0
        exec_spans(ctx)
        bubbles(ctx)


def test_empty_trace_tables():
    b = EventBuilder(instance="E")
    b.add("req_add", req="a", n=1)
    ctx = ctx_of(b)
    assert len(step_table(ctx)) == 0 and len(exec_spans(ctx)) == 0 and len(bubbles(ctx)) == 0


def test_step_count_function():
    c = StepCount(np.array([10, 20, 20, 40]), np.array([1, 1, -1, -1]))
    assert list(c.at(np.array([0, 10, 15, 20, 39, 40, 50]))) == [0, 1, 1, 1, 1, 0, 0]
    # zero between 0 and 10 (before the first event) and from 40 on
    assert list(c.zero_between(np.array([0, 15, 30]), np.array([50, 25, 45]))) == [20, 0, 5]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.integers(1, 4), n=st.integers(1, 6), cap=st.integers(1, 3), tp=st.integers(1, 2))
def test_busy_plus_idle_is_the_lane_wall(pp, n, cap, tp):
    ctx = AnalysisContext(simulate_pipeline(pp=pp, n_requests=n, batch_cap=cap, tp=tp, tokens=4),
                          AnalysisConfig().with_overrides(bubble_min_ns=1))
    spans = exec_spans(ctx)
    busy = spans[spans["n"] > 0]
    bub = bubbles(ctx)
    for (p, t), lane in busy.groupby(["pp_rank", "tp_rank"]):
        wall = int(lane["end_ts"].max() - lane["begin_ts"].min())
        work = int((lane["end_ts"] - lane["begin_ts"]).sum())
        idle = int(bub[(bub["pp_rank"] == p) & (bub["tp_rank"] == t)]["dur_ns"].sum())
        assert work + idle == wall


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), which=st.sampled_from(["pp4", "few", "pd", "preempt", "deferred"]))
def test_random_corruptions_never_crash(data, which):
    """Drop rows, null out steps and details, repeat rows: every table, both rules and the stories still run."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pdtrace.analysis.rules import pipeline_bubble, unscheduled_request
    from pdtrace.analysis.story import request_story, step_ranks, step_story
    from pdtrace.trace.model import Trace
    from scenarios import deferred_frees, healthy_pd, preempt_resume

    make = {"pp4": healthy_pp4, "few": few_requests_pp4, "pd": healthy_pd, "preempt": preempt_resume,
            "deferred": deferred_frees}[which]
    table = make().table
    n = table.num_rows
    keep = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    table = table.filter(pa.array(keep))
    if table.num_rows and data.draw(st.booleans()):
        nulls = pa.array(data.draw(st.lists(st.booleans(), min_size=table.num_rows, max_size=table.num_rows)))
        for name in ("step", "detail", "n"):
            col = table.column(name)
            table = table.set_column(table.column_names.index(name), name,
                                     pc.if_else(nulls, pa.nulls(len(col), col.type), col))
    if table.num_rows and data.draw(st.booleans()):
        table = pa.concat_tables([table, table.slice(0, data.draw(st.integers(0, table.num_rows)))])
    trace = Trace.from_table(table)
    ctx = AnalysisContext(trace)
    step_table(ctx)
    exec_spans(ctx)
    bubbles(ctx)
    pipeline_bubble.run(ctx)
    unscheduled_request.run(ctx)
    request_story(trace, "r1")
    step_story(trace, 3)
    step_ranks(trace, 3)
