"""pipeline_bubble: where each pipeline stage sat idle, how much of its time that cost, and why.

Algorithm (over `pdtrace.analysis.steps`: `busy_spans`, `gap_frame`, `bubbles`; no loop per event):

1. Only schedulers with a pipeline (p = engine_config `pp`, else the PP ranks seen executing, greater than 1). With
   p = 1 the idle time between steps is host overhead, not a pipeline bubble; it stays visible in `bubbles()`.
2. Per lane (instance, dp_rank, pp_rank, tp_rank): wall = last busy end - first busy begin; the idle gaps inside it
   (every gap, however short; `gap_frame`) summed by cause. Each gap has one cause (see steps.py):
   `idle_no_requests`, `kv_transfer`, `stage_imbalance`, `scheduler_cpu`, `queue_not_full`, and
   `sampled_token_wait` (the time a non-last stage sat inside `sample_tokens`, which computes nothing there: it
   waits for the last stage's broadcast of the sampled tokens; vllm-ascend#10855, vllm#42187); and, where the
   workers recorded their waits inside an RPC (`exec_wait_*`), `pp_recv_wait` (a later stage blocked receiving the
   previous stage's tensors) and `pp_send_wait` (a stage blocked until the next one took its tensors): that time is
   cut out of the RPC's busy span. Both are charged and avoidable as `stage_imbalance` is (another stage held the
   step), and appear in `idle_ns_by_cause` only where the trace has such time.
3. vLLM pipelines continuously, so in steady state the ideal idle time is 0. The fill/drain cost (p-1)/(m+p-1) of m
   micro-batches applies per burst: bursts are the runs of busy spans between `idle_no_requests` gaps, m the
   distinct steps in a burst; the burst ideal is that fraction of the burst's wall time, summed.
4. Lost time = idle that is neither `idle_no_requests` (no work: not a bubble) nor `kv_transfer` (waiting on a peer:
   reported, not charged to the pipeline), minus the burst ideal. `queue_not_full` gaps are *avoidable* when at
   least p requests were runnable at the gap start (p micro-batches could have been formed) and
   *workload-limited* otherwise (fewer ready requests than stages). An avoidable gap is *unfilled* when some
   runnable request that the running set could hold was not in a step in flight (`min(runnable, max_num_seqs) >
   in_flight_requests`, max_num_seqs from engine_config: the scheduler could have formed another micro-batch then
   and did not: vLLM #28270), and *packed* otherwise: every runnable request already was (the scheduler had put
   them all into fewer than p micro-batches, and a decode in flight has nothing to schedule until its token is
   back: vLLM #41682, one micro-batch for all sequences), or the steps in flight held max_num_seqs requests and the
   others waited for a seat (the real-engine test's PP=2 run: max_num_seqs 16, 24 requests, 16 in one
   micro-batch). The fraction is lost time over the active wall (wall minus `idle_no_requests`).
5. Per (instance, dp_rank, pp_rank), summing its TP lanes: severity `error` when the unfilled `queue_not_full`
   time alone is at least half the active time (`ERROR_FRACTION`): the pipeline is not pipelining although the
   work to fill it is waiting, vLLM #28270's signature. When unfilled and packed time together reach that, it is
   a `warning` with subrule `single_micro_batch`: the stages do not overlap because every runnable request rides
   in one micro-batch (vLLM #41682; at most N/p requests a step, `max_num_seqs`, would let them overlap), a cost
   of vLLM's scheduling, not a fault. Host time (`scheduler_cpu`), `stage_imbalance` and `sampled_token_wait`
   (avoidable: the stage could run a queued step, were it not blocked on the broadcast) are at most `warning`,
   given when all lost time is at least `config.bubble_warn_fraction`; `info` below.
   extra: p, pp_rank, wall_ns, idle_fraction, lost_fraction, avoidable_fraction, unfilled_fraction,
   packed_fraction, idle_ns_by_cause, intervals (gaps of at
   least bubble_min_ns), burst_ideal, bursts, tp_lanes. Evidence: the exec_end / exec_begin around the longest
   bubbles.
6. `not_measured` (info): a scheduler that pipelines (engine_config `pp` > 1; without engine_config `pp`, a
   `step_submit` with n > 1) on an instance with no exec spans at all: nothing to measure, said rather than
   silently absent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (BUBBLE_CAUSES, AnalysisContext, FindingsBuilder, Rule, busy_spans, columns,
                                      config_numbers, engine_configs, gap_frame, instances, pipeline_sizes, sizes_of,
                                      sk_instance)

ERROR_FRACTION = 0.5
_CHARGED = ("queue_not_full", "scheduler_cpu", "stage_imbalance", "sampled_token_wait", "pp_recv_wait", "pp_send_wait")
#: Causes only a trace with `exec_wait_*` rows has: reported in idle_ns_by_cause only where there was such time, so
#: that a trace without those rows is reported as before they existed.
_RECORDED_WAITS = ("pp_recv_wait", "pp_send_wait")


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def rank_summary(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per (inst, dp, pp) of a pipelined scheduler: p, wall_ns, idle ns per cause, avoidable, workload,
    unfilled, burst_ideal_ns, interval (count), bursts, tp_lanes (the numbers the findings report). Sums per lane are
    np.bincount over lane indexes (busy_spans is sorted by lane), minima and maxima per lane or burst reduceat."""

    def build() -> pd.DataFrame:
        busy = busy_spans(ctx)
        if len(busy) == 0:
            return pd.DataFrame()
        sizes = pipeline_sizes(ctx)
        lane = busy["lane"].to_numpy()
        new_lane = np.r_[True, lane[1:] != lane[:-1]]
        lane_idx = np.cumsum(new_lane) - 1
        starts = np.flatnonzero(new_lane)
        n_lanes = len(starts)
        b = busy["b"].to_numpy()
        e = busy["e"].to_numpy()
        inst = busy["inst"].to_numpy()[starts]
        dp = busy["dp"].to_numpy()[starts]
        pp = busy["pp"].to_numpy()[starts]
        p_lane = sizes_of(sizes, inst, dp)
        wall = np.maximum.reduceat(e, starts) - np.minimum.reduceat(b, starts)

        gaps = gap_frame(ctx)
        g_lane = lane_idx[gaps["span_row"].to_numpy()]
        cause = gaps["cause"].cat.codes.to_numpy().astype(np.int64)
        dur = gaps["dur_ns"].to_numpy().astype(np.float64)
        p_gap = p_lane[g_lane]
        n_causes = len(BUBBLE_CAUSES)
        by_cause = np.bincount(g_lane * n_causes + cause, weights=dur,
                               minlength=n_lanes * n_causes).reshape(n_lanes, n_causes)
        code = {c: BUBBLE_CAUSES.index(c) for c in BUBBLE_CAUSES}
        queue = cause == code["queue_not_full"]
        runnable = gaps["runnable"].to_numpy()
        in_flight_requests = gaps["in_flight_requests"].to_numpy()
        starved_queue = queue & (runnable >= p_gap)
        # what the running set can hold: past max_num_seqs the waiting requests cannot be admitted into a step
        seats = sizes_of(config_numbers(ctx, "max_num_seqs"), gaps["inst"].to_numpy(), gaps["dp"].to_numpy(),
                         fill=np.iinfo(np.int64).max)
        unfilled_queue = starved_queue & (np.minimum(runnable, seats) > in_flight_requests)
        avoidable_mask = ((cause == code["scheduler_cpu"]) | (cause == code["stage_imbalance"])
                          | (cause == code["sampled_token_wait"]) | (cause == code["pp_recv_wait"])
                          | (cause == code["pp_send_wait"]) | starved_queue)
        min_ns = max(int(ctx.config.bubble_min_ns), 1)

        def per_lane(weights: np.ndarray) -> np.ndarray:
            return np.bincount(g_lane, weights=weights, minlength=n_lanes)

        avoidable = per_lane(np.where(avoidable_mask, dur, 0.0))
        workload = per_lane(np.where(queue & ~starved_queue, dur, 0.0))
        unfilled = per_lane(np.where(unfilled_queue, dur, 0.0))
        packed = per_lane(np.where(starved_queue & ~unfilled_queue, dur, 0.0))
        # packed because the running set was full: runnable requests waited for a seat (max_num_seqs)
        seated = per_lane(np.where(starved_queue & ~unfilled_queue & (runnable > in_flight_requests), dur, 0.0))
        interval = per_lane((dur >= min_ns).astype(np.float64))

        # bursts: runs of busy spans between idle_no_requests gaps; m = distinct steps in the burst
        starts_burst = np.zeros(len(busy), bool)
        starts_burst[gaps["span_row"].to_numpy()[cause == code["idle_no_requests"]]] = True
        burst = np.cumsum(new_lane | starts_burst) - 1
        burst_starts = np.flatnonzero(new_lane | starts_burst)
        step = busy["step"].to_numpy()
        pair = np.sort(burst.astype(np.int64) * (int(step.max(initial=0)) + 2) + step + 1)
        pair = pair[np.r_[True, pair[1:] != pair[:-1]]]  # distinct (burst, step): a sort, not numpy's hash unique
        m = np.bincount(pair // (int(step.max(initial=0)) + 2), minlength=len(burst_starts))
        burst_wall = np.maximum.reduceat(e, burst_starts) - np.minimum.reduceat(b, burst_starts)
        burst_lane = lane_idx[burst_starts]
        p_b = p_lane[burst_lane].astype(np.float64)
        ideal = np.bincount(burst_lane, weights=(p_b - 1) / (m + p_b - 1) * burst_wall, minlength=n_lanes)
        bursts = np.bincount(burst_lane, minlength=n_lanes)

        lanes = pd.DataFrame({"inst": inst, "dp": dp, "pp": pp, "p": p_lane, "wall_ns": wall,
                              "avoidable": avoidable, "workload": workload, "unfilled": unfilled, "packed": packed,
                              "seat_limited": seated,
                              "interval": interval, "burst_ideal_ns": ideal, "bursts": bursts, "tp_lanes": 1})
        for i, name in enumerate(BUBBLE_CAUSES):
            lanes[name] = by_cause[:, i]
        lanes = lanes[lanes["p"] > 1]
        if len(lanes) == 0:
            return pd.DataFrame()
        summed = ["wall_ns", *BUBBLE_CAUSES, "avoidable", "workload", "unfilled", "packed", "seat_limited",
                  "interval", "burst_ideal_ns", "tp_lanes"]
        agg: dict[str, str] = {c: "sum" for c in summed}
        agg["bursts"] = "max"
        agg["p"] = "first"
        return lanes.groupby(["inst", "dp", "pp"]).agg(agg).reset_index()  # a few rows: lanes, not events

    return ctx.cached("pipeline_bubble:ranks", build)


def _not_measured(ctx: AnalysisContext, found: FindingsBuilder) -> None:
    """An info finding per scheduler that pipelines (engine_config `pp` > 1; without an engine_config saying `pp`,
    a `step_submit` with more than one step in flight) on an instance without `exec_begin` / `exec_end` rows: the
    bubbles come from worker spans, so none can be measured there (a recording without worker hooks, a trace
    stripped of them), and the report says so rather than looking like a full pipeline."""
    cols = columns(ctx)
    subs = cols.rows_of("step_submit")
    deep = np.zeros(len(cols.sk_names), bool)
    deep[cols.sk[subs[cols.ints_at("n", subs) > 1]]] = True
    for sk, cfg in engine_configs(ctx).items():
        try:
            deep[sk] = int(cfg["pp"]) > 1
        except (KeyError, TypeError, ValueError):
            pass
    measured = np.zeros(len(deep), bool)
    measured[cols.sk[cols.rows_of("exec_begin", "exec_end")]] = True
    for sk in np.flatnonzero(deep & ~measured).tolist():  # one per pipelining scheduler
        first = subs[cols.sk[subs] == sk]
        found.add("not_measured", "info",
                  f"{sk_instance(cols, sk)[0]} may pipeline (pp > 1 or several steps in flight) but the trace has no "
                  "exec_begin / exec_end rows for it: its pipeline bubbles cannot be measured",
                  sk=sk, req=None, step=None,
                  ts_ns=int(cols.ts[first[0]]) if len(first) else int(cols.ts.min()),
                  extra={"reason": "no worker exec spans"})


def run(ctx: AnalysisContext) -> pd.DataFrame:
    ranks = rank_summary(ctx)
    found = FindingsBuilder(ctx, "pipeline_bubble")
    if len(ranks) == 0:
        _not_measured(ctx, found)
        return found.frame()
    names = instances(ctx)
    bubbles = gap_frame(ctx)
    min_ns = max(int(ctx.config.bubble_min_ns), 1)
    warn = float(ctx.config.bubble_warn_fraction)
    for r in ranks.itertuples(index=False):  # one row per (instance, dp_rank, pp_rank): a handful
        r = r._asdict()
        wall = float(r["wall_ns"])
        if wall <= 0:
            continue
        idle = {c: int(r[c]) for c in BUBBLE_CAUSES if c not in _RECORDED_WAITS or r[c]}
        total_idle = sum(idle.values())
        active = max(wall - idle["idle_no_requests"], 1.0)
        ideal = float(r["burst_ideal_ns"])
        workload = float(r["workload"])
        avoidable = float(r["avoidable"])
        ideal_left = max(ideal - workload, 0.0)
        lost = max(avoidable + workload - ideal, 0.0)
        lost_avoidable = max(avoidable - ideal_left, 0.0)
        lost_unfilled = max(float(r["unfilled"]) - ideal_left, 0.0)
        lost_starved = max(float(r["unfilled"]) + float(r["packed"]) - ideal_left, 0.0)
        lost_fraction = lost / active
        avoidable_fraction = lost_avoidable / active
        packed_only = False
        if lost_unfilled / active >= ERROR_FRACTION:
            severity = "error"
        elif lost_starved / active >= ERROR_FRACTION:
            severity, packed_only = "warning", True
        elif lost_fraction >= warn:
            severity = "warning"
        else:
            severity = "info"
        instance = names[int(r["inst"])]
        dp = int(r["dp"]) if r["dp"] >= 0 else None
        mine = bubbles[(bubbles["inst"] == r["inst"]) & (bubbles["dp"] == r["dp"]) & (bubbles["pp"] == r["pp"])
                       & (bubbles["dur_ns"] >= min_ns)]
        longest = mine.nlargest(3, "dur_ns")
        evidence: list[dict[str, Any]] = []
        for b in longest.itertuples(index=False):
            note = (f"idle {_ms(b.dur_ns)} ({b.cause}, {b.in_flight} steps in flight with {b.in_flight_requests} "
                    f"requests, {b.runnable} runnable requests)")
            recorded = b.cause in _RECORDED_WAITS  # a wait the rank recorded inside its RPC: its own rows
            evidence.append({"kind": "exec_wait_begin" if recorded else "exec_end", "ts_ns": int(b.start_ns),
                             "seq": None, "req": None,
                             "step": int(b.step_before), "instance": instance, "pp_rank": int(b.pp),
                             "tp_rank": int(b.tp), "note": note})
            evidence.append({"kind": "exec_wait_end" if recorded else "exec_begin", "ts_ns": int(b.end_ns),
                             "seq": None, "req": None,
                             "step": int(b.step_after), "instance": instance, "pp_rank": int(b.pp),
                             "tp_rank": int(b.tp)})
        charged = {c: idle[c] for c in _CHARGED if idle.get(c)}
        others = {c: v for c, v in idle.items() if v}
        dominant = max(charged, key=charged.get) if charged else (max(others, key=others.get) if others else None)
        parts = ", ".join(f"{c} {100.0 * v / wall:.1f}%" for c, v in sorted(idle.items(), key=lambda kv: -kv[1])
                          if v)
        message = (f"PP rank {int(r['pp'])}/{int(r['p'])} of {instance} idle {100.0 * total_idle / wall:.1f}% of "
                   f"{_ms(wall)} ({parts or 'no idle time'}); {100.0 * lost_fraction:.1f}% of the active time lost "
                   f"to the pipeline ({100.0 * avoidable_fraction:.1f}% avoidable), fill/drain ideal "
                   f"{100.0 * ideal / active:.1f}%; {int(r['interval'])} idle intervals >= {_ms(min_ns)}")
        if packed_only:
            dominant = "single_micro_batch"
            if 2 * float(r["seat_limited"]) >= float(r["packed"]):
                message += ("; every runnable request the running set could hold was already in a step in flight "
                            "(the steps in flight held max_num_seqs requests, the others waited for a seat)")
            else:
                message += "; every runnable request was already in a step in flight"
            message += (f": vLLM scheduled them in fewer than {int(r['p'])} micro-batches, so the stages could not "
                        f"overlap (vllm#41682; at most 1/{int(r['p'])} of the requests per step, e.g. a lower "
                        f"max_num_seqs, lets them)")
        first = longest.iloc[0] if len(longest) else None
        # the evidence is the measured idle intervals (no row of the trace): the finding's fields are given
        found.add(dominant, severity, message, evidence, instance=instance, dp_rank=dp, req=None,
                  step=int(first["step_after"]) if first is not None else None,
                  ts_ns=int(first["start_ns"]) if first is not None else None,
                  context=f"pipeline_bubble:{dominant or 'no_idle'}",
                  extra={"p": int(r["p"]), "pp_rank": int(r["pp"]), "wall_ns": int(wall),
                         "idle_fraction": total_idle / wall, "lost_fraction": lost_fraction,
                         "avoidable_fraction": avoidable_fraction, "unfilled_fraction": lost_unfilled / active,
                         "packed_fraction": max(lost_starved - lost_unfilled, 0.0) / active,
                         "seat_limited_fraction": float(r["seat_limited"]) / active,
                         "idle_ns_by_cause": idle,
                         "intervals": int(r["interval"]), "burst_ideal": ideal / active, "bursts": int(r["bursts"]),
                         "tp_lanes": int(r["tp_lanes"])})
    _not_measured(ctx, found)  # after the measured ones, as ever
    return found.frame()


RULE = Rule(
    id="pipeline_bubble",
    summary="idle intervals of each pipeline stage, their causes and the fraction of time lost",
    run=run,
    subrules=("queue_not_full", "single_micro_batch", "scheduler_cpu", "stage_imbalance", "sampled_token_wait",
              "kv_transfer", "idle_no_requests", "not_measured", "pp_recv_wait", "pp_send_wait"),
    needs=(gap_frame,),
    cost=0.03,
    per_window="idle fractions measured over each window's own span",
)
