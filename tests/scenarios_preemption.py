"""Preemption incidents from vLLM's tracker as event tables, with negative controls, for `preemption_race` and
`no_progress` (and anyone else's tests).

Built with `scenarios.Engine` in vLLM's order of events (see its docstring). Each builder's docstring names the
tracker threads it follows; block ids and steps are illustrative. `RACES` / `LIVELOCKS` map names to the faulty
traces, `CONTROLS` to the healthy twins every rule must stay silent on (no error from any rule).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.model import Trace, TraceFile
from scenarios import Engine, builder


def store_engine(b: EventBuilder, connector: str, tp: int = 1, pp: int = 1, async_scheduling: bool = False,
                 defer_block_free: bool = False, num_blocks: int = 16) -> Engine:
    """An Engine whose engine_config names a KV store / offload connector (`kv_both`)."""
    e = Engine(b, instance="E", role="both", pp=pp, tp=tp, num_blocks=num_blocks, config=False,
               defer_block_free=defer_block_free)
    e.ev("engine_config", n=num_blocks, detail={
        "block_size": 16, "pp": pp, "tp": tp, "dp": 1, "batch_queue_size": pp, "async_scheduling": async_scheduling,
        "defer_block_free": defer_block_free, "kv_role": "kv_both", "connector": connector, "runner": "v1",
        "max_num_seqs": 64, "max_num_batched_tokens": 2048})
    return e


def rank_report(e: Engine, kind: str, req: str, step: int, tp_rank: int = 0) -> None:
    """One rank's `kv_send_rank` / `kv_recv_rank` (a store or load of `req` finished on that rank)."""
    e.ev(kind, component="worker", pid=e.pid + 1 + tp_rank, pp_rank=0, tp_rank=tp_rank, step=step, req=req)


def set_queue(e: Engine, step: int, waiting: int, free_blocks: int) -> None:
    """Rewrite the `sched` detail of `step`: the waiting queue and the free pool the scheduler saw."""
    for row in e.b.rows:
        if row["kind"] == "sched" and row["step"] == step and row["instance"] == e.instance:
            detail = json.loads(row["detail"])
            detail.update(waiting=waiting, free_blocks=free_blocks)
            row["detail"] = json.dumps(detail, separators=(",", ":"))


def retable(table: pa.Table) -> Trace:
    """A Trace of an edited event table (as EventBuilder.trace makes one)."""
    return Trace.from_table(table, files=[TraceFile(path="<memory>", rows=table.num_rows, schema_version="1",
                                                    pdtrace_version="test", source="synthetic", dropped_events=0)])


def without(trace: Trace, kinds: tuple[str, ...] = (), req: str | None = None) -> Trace:
    """The trace without the rows of these kinds (only those of request `req` when given)."""
    table = trace.table
    drop = pc.is_in(pc.cast(table.column("kind"), pa.string()), pa.array(list(kinds), pa.string()))
    if req is not None:
        drop = pc.and_(drop, pc.fill_null(pc.equal(pc.cast(table.column("req"), pa.string()), req), False))
    return retable(table.filter(pc.invert(drop)))


def _pressure(e: Engine) -> None:
    """a and b prefill and decode one step; then c arrives and b, the last running, is preempted for a's block: c
    gets b's blocks 3, 4 in the same schedule() (a prefill: it writes them)."""
    e.add("a", n=32)
    e.add("b", n=32)
    e.step({"a": 32, "b": 32}, alloc={"a": [1, 2], "b": [3, 4]})
    e.output()
    e.step({"a": 1, "b": 1})


def _finish_all(e: Engine) -> None:
    """a and c finish, b resumes (recompute) with new blocks and finishes."""
    e.run_out()
    e.step({"a": 1, "c": 1})
    e.output()
    e.finish("a", reason="length")
    e.finish("c", reason="length")
    e.step({"b": 34}, alloc={"b": [1, 2, 5]})
    e.output()
    e.step({"b": 1})
    e.output()
    e.finish("b", reason="stop")


def hand_over(e: Engine, hits: int = 0) -> None:
    """c arrives; a needs a block, so b, the last running, is preempted and c gets b's blocks 3, 4 in the same
    schedule() (a prefill: it writes them; `hits` of them as prefix-cache hits, which only read)."""
    e.add("c", n=32)
    e.step({"a": 1, "c": 32}, alloc={"a": [5], "c": [3, 4]}, preempt={"b": [3, 4]}, hits={"c": hits})


def late_report(connector: str, kind: str = "kv_send_rank", tp: int = 1, early_rank: int | None = None,
                late_rank: int | None = 0, report_step: int = 3, hits: int = 0) -> Trace:
    """b's KV is being stored (or loaded, `kind` kv_recv_rank) by `connector` when b is preempted and c takes its
    blocks: rank `early_rank` reports it before the preemption (step 1), rank `late_rank` at `report_step` (2: in
    the step of c's first write, 3: the step after); None: no report."""
    b = builder()
    e = store_engine(b, connector, tp=tp)
    _pressure(e)
    if early_rank is not None:
        rank_report(e, kind, "b", step=1, tp_rank=early_rank)
    e.output()
    hand_over(e, hits)
    if late_rank is not None and report_step == 2:
        rank_report(e, kind, "b", step=2, tp_rank=late_rank)
    e.output()
    e.step({"a": 1, "c": 1})
    if late_rank is not None and report_step == 3:
        rank_report(e, kind, "b", step=3, tp_rank=late_rank)
    e.output()
    _finish_all(e)
    return b.trace()


# -- preemption races ---------------------------------------------------------------------------------------------
def store_outlives_preemption(report_step: int = 3, hits: int = 0) -> Trace:
    """MooncakeStoreConnector: the store job of b's KV, queued on the sending thread, completes (b's
    `kv_send_rank`) a step after b was preempted and c's prefill began writing b's old blocks: c's KV is stored
    under b's keys. vllm #52360 (the bug), #52470 (abort the store jobs on preemption), LMCache #4955 (the same
    block-lifetime race for LMCache's MP STORE), DingoCache #76 (fence the saves before the next forward).
    `report_step` moves the completion (2: in the step of c's first write), `hits` makes c's allocation of the
    blocks prefix-cache hits."""
    return late_report("MooncakeStoreConnector", report_step=report_step, hits=hits)


def straggler_rank_after_preemption() -> Trace:
    """OffloadingConnector, TP=2: rank 0 reports b's offload store finished before b is preempted, rank 1 only after
    c's prefill wrote the blocks: that rank's job still read them. vllm #29870 (OffloadingConnector: fail stores of
    preempted requests, `handle_preemptions` waits for the pending jobs), vllm-ascend #10820 (preempt-offload
    stores aggregated over every rank before the request may resume), vllm #51637 (MooncakeStore async store job
    accounting across preemption)."""
    return late_report("OffloadingConnector", tp=2, early_rank=0, late_rank=1)


def preempted_under_step_in_flight() -> Trace:
    """LMCacheConnectorV1 with async scheduling and no step fence: b is preempted while step 1, which scheduled it
    (and whose save job copies its blocks), is still in flight, and c's prefill is scheduled into b's blocks before
    step 1's output. vllm-ascend #14055 (preempted requests return blocks while an async step is in flight),
    LMCache #5248 and #4955 (the store of a preempted request still reading freed blocks), vllm #48245 (the stale
    in-flight output of a preempted request)."""
    b = builder()
    e = store_engine(b, "LMCacheConnectorV1", async_scheduling=True)
    _pressure(e)  # step 1 submitted, step 0 done
    hand_over(e)
    e.output()  # step 1, after c's write was scheduled
    _finish_all(e)
    return b.trace()


# -- negative controls of the races -----------------------------------------------------------------------------
def store_done_before_preemption() -> Trace:
    """The store_outlives_preemption order with the store finished on every rank before b is preempted: the
    hand-over is safe (vllm #52470's intended order)."""
    return late_report("MooncakeStoreConnector", early_rank=0, late_rank=None)


def store_done_before_reuse() -> Trace:
    """b's store completes after its preemption but before anyone writes its old blocks: c is admitted a step
    later (vllm #29870: the worker waits for the preempted request's jobs before the blocks are overwritten)."""
    b = builder()
    e = store_engine(b, "OffloadingConnector")
    _pressure(e)
    e.output()
    e.step({"a": 1}, alloc={"a": [5]}, preempt={"b": [3, 4]})
    rank_report(e, "kv_send_rank", "b", step=2)
    e.output()
    e.add("c", n=32)
    e.step({"a": 1, "c": 32}, alloc={"c": [3, 4]})
    e.output()
    _finish_all(e)
    return b.trace()


def fenced_preemption() -> Trace:
    """vLLM 0.33's fix (#45357's defer_block_free): with two steps in flight b's preemption free is deferred behind
    the fence and drains at the next update; c gets the blocks only after step 1's output. Silent although the
    connector stores."""
    b = builder()
    e = store_engine(b, "LMCacheConnectorV1", pp=2, defer_block_free=True)
    _pressure(e)  # step 1 in flight
    e.ev("req_preempt", step=2, req="b")
    e.free("b", [3, 4], reason="preempted", step=2, deferred=True)
    e.step({"a": 1}, alloc={"a": [5]})
    e.output()  # step 1: b's last step is done
    e.drain([3, 4])
    e.add("c", n=32)
    e.step({"a": 1, "c": 32}, alloc={"c": [3, 4]})
    _finish_all(e)
    return b.trace()


def in_flight_plain_compute() -> Trace:
    """preempted_under_step_in_flight's order with NixlConnector and no store job: compute on one CUDA stream is
    ordered, the hand-over under a step in flight is normal (vllm_internals.md, preemption hazard)."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=16)
    _pressure(e)
    hand_over(e)
    e.output()
    _finish_all(e)
    return b.trace()


# -- livelocks ------------------------------------------------------------------------------------------------------
def deferred_free_cascade(cycles: int = 20, recover: bool = False) -> Trace:
    """Async KV consumer with two batches in flight and deferred frees (MooncakeStore kv pool): each schedule()
    preempts the request the step before re-admitted (its free is fenced behind that step, so the pool does not
    grow) and re-admits the next victim; every schedule is thrown away before its output, no token comes out while
    two requests wait; the trace ends with the last step in flight. vllm #49674 (zero-progress preemption cascades
    with deferred frees), #49675 (the fix: stop the retry when the victim is fenced), vllm-ascend #16315 (0 tok/s
    with async scheduling + kv pool).
    `recover`: afterwards the last admitted request runs alone and produces (the fix's behaviour)."""
    b = builder()
    e = store_engine(b, "MooncakeStoreConnector", pp=2, defer_block_free=True, num_blocks=4)
    reqs = ["a", "b", "c"]
    block = {"a": 1, "b": 2, "c": 3}
    for r in reqs:
        e.add(r, n=16)
    k = e.step({"a": 16}, alloc={"a": [1]})
    set_queue(e, k, waiting=2, free_blocks=0)
    for i in range(1, cycles):
        victim, cur = reqs[(i - 1) % 3], reqs[i % 3]
        k = e.next_step
        e.ev("req_preempt", step=k, req=victim)
        e.free(victim, [block[victim]], reason="preempted", step=k, deferred=True)
        k = e.step({cur: 16}, alloc={cur: [block[cur]]})
        set_queue(e, k, waiting=2, free_blocks=0)
        e.output()
        e.drain([block[victim]])
    if recover:
        e.run_out()
        last = reqs[(cycles - 1) % 3]
        for _ in range(3):
            e.step({last: 1})
            e.output()
        e.finish(last, reason="length")
    return b.trace()


def recompute_thrash(cycles: int = 16) -> Trace:
    """A pool too small for two long prompts (vLLM 0.10 style, immediate frees, one step in flight): a and b
    (64-token prompts, chunked 32 a step) preempt each other before either finishes its prefill; each resume
    recomputes from 0, so neither ever produces a token. vllm #49674 (a preemption that frees nothing usable
    cascades), HabanaAI/vllm-fork #2247 (hang after preemption with chunked prefill), inference-sim #297
    (evict -> requeue -> re-prefill -> evict, forever)."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=4)
    e.add("a", n=64)
    e.add("b", n=64)
    k = e.step({"a": 32}, alloc={"a": [1, 2]})
    set_queue(e, k, waiting=1, free_blocks=1)
    e.output()
    for i in range(1, cycles):
        cur, victim = ("b", "a") if i % 2 else ("a", "b")
        k = e.step({cur: 32}, alloc={cur: [1, 2]}, preempt={victim: [1, 2]})
        set_queue(e, k, waiting=1, free_blocks=1)
        e.output()
    return b.trace()


def never_fits_self_preemption(cycles: int = 6, chunks: int = 4) -> Trace:
    """A request that can never fit (vllm#52520: Mamba align mode, where the startup check accepts a pool one block
    short of one request): its 160-token prompt prefills in chunks of 32 tokens (two blocks each) into a pool of
    nine blocks; the fifth chunk cannot be allocated, so the scheduler preempts the request itself (the last
    running), frees its eight blocks, re-admits it the next step and restarts from token 0, forever, while two
    requests wait behind it. Each cycle throws away `chunks` schedules; no token ever comes out."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=9)
    e.add("long", n=32 * (chunks + 1))
    e.add("w1", n=16)
    e.add("w2", n=16)
    for _ in range(cycles):
        for c in range(chunks):
            k = e.step({"long": 32}, alloc={"long": [1 + 2 * c, 2 + 2 * c]})
            set_queue(e, k, waiting=2, free_blocks=9 - 2 * (c + 1))
            e.output()
        k = e.step({}, preempt={"long": list(e.held["long"])})
        set_queue(e, k, waiting=3, free_blocks=9)
        e.output()
    return b.trace()


# -- negative controls of the livelocks --------------------------------------------------------------------------
def slow_progress_under_preemption(steps: int = 24) -> Trace:
    """A busy scheduler that keeps preempting (every fourth step a victim goes, and comes back) while one decoder
    produces a token every step: slow, not stuck."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=8)
    e.add("d", n=16)
    e.add("v", n=16)
    e.step({"d": 16, "v": 16}, alloc={"d": [1], "v": [2]})
    e.output()
    held = True
    for i in range(steps):
        sched = {"d": 1}
        if i % 4 == 0 and held:
            k = e.step(sched, preempt={"v": list(e.held["v"])})
            held = False
        elif i % 4 == 2 and not held:
            sched["v"] = 17
            k = e.step(sched, alloc={"v": [2, 3]})
            held = True
        else:
            if held:
                sched["v"] = 1
            k = e.step(sched)
        set_queue(e, k, waiting=0 if held else 1, free_blocks=1)
        e.output()
    e.finish("d", reason="length")
    if not held:
        e.step({"v": 17}, alloc={"v": [2, 3]})
        e.output()
    e.finish("v", reason="length")
    return b.trace()


def preempt_and_resume_under_pressure(rounds: int = 3, chunks: int = 4) -> Trace:
    """A healthy engine under memory pressure: a long prompt prefills in chunks while a decoder produces a token
    every step; twice per round the long request is preempted mid-prefill to make room for the decoder's growth
    and resumes (recomputing from 0) once the decoder's blocks are back, until it completes its prefill and
    produces. Preemptions discard every chunk since the last restart, but tokens keep coming: load, not a
    livelock (the healthy look-alike of vllm#52520)."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=16)
    e.add("d", n=16)
    e.add("long", n=32 * chunks)
    e.step({"d": 16}, alloc={"d": [1]})
    e.output()
    for r in range(rounds):
        for c in range(chunks - 1):
            k = e.step({"d": 1, "long": 32}, alloc={"long": [2 + 2 * c, 3 + 2 * c]})
            set_queue(e, k, waiting=0, free_blocks=8)
            e.output()
        k = e.step({"d": 1}, preempt={"long": list(e.held["long"])})
        set_queue(e, k, waiting=1, free_blocks=14)
        e.output()
    for c in range(chunks):
        k = e.step({"d": 1, "long": 32}, alloc={"long": [2 + 2 * c, 3 + 2 * c]})
        set_queue(e, k, waiting=0, free_blocks=6)
        e.output()
    e.step({"d": 1, "long": 1})
    e.output()
    e.finish("d", reason="length")
    e.finish("long", reason="length")
    return b.trace()


def long_prefill_preempts_decoders(chunks: int = 12) -> Trace:
    """A 384-token prompt is prefilled in 12 chunks; to fit it the scheduler preempts both decoders at once. No
    token for 12 steps and two preemptions, but the prefill keeps its work, then produces, and the decoders come
    back: load, not a livelock."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=32)
    e.add("d1", n=16)
    e.add("d2", n=16)
    e.step({"d1": 16, "d2": 16}, alloc={"d1": [1], "d2": [2]})
    e.output()
    e.add("big", n=32 * chunks)
    for i in range(chunks):
        preempt = {"d1": [1], "d2": [2]} if i == 0 else None
        k = e.step({"big": 32}, alloc={"big": [3 + 2 * i, 4 + 2 * i]}, preempt=preempt)
        set_queue(e, k, waiting=2, free_blocks=2)
        e.output()
    e.step({"big": 1})
    e.output()
    e.finish("big", reason="length")
    e.step({"d1": 17, "d2": 17}, alloc={"d1": [1, 3], "d2": [2, 4]})
    e.output()
    e.finish("d1", reason="length")
    e.finish("d2", reason="length")
    return b.trace()


RACES: dict[str, Callable[[], Trace]] = {
    "store_outlives_preemption": store_outlives_preemption,
    "straggler_rank_after_preemption": straggler_rank_after_preemption,
    "preempted_under_step_in_flight": preempted_under_step_in_flight,
}
LIVELOCKS: dict[str, Callable[[], Trace]] = {
    "deferred_free_cascade": deferred_free_cascade,
    "recompute_thrash": recompute_thrash,
    "never_fits_self_preemption": never_fits_self_preemption,
}
CONTROLS: dict[str, Callable[[], Trace]] = {
    "store_done_before_preemption": store_done_before_preemption,
    "store_done_before_reuse": store_done_before_reuse,
    "fenced_preemption": fenced_preemption,
    "in_flight_plain_compute": in_flight_plain_compute,
    "slow_progress_under_preemption": slow_progress_under_preemption,
    "long_prefill_preempts_decoders": long_prefill_preempts_decoders,
    "preempt_and_resume_under_pressure": preempt_and_resume_under_pressure,
}

#: The tracker threads each scenario follows, and the finding it must give (rule, subrule, severity).
EXPECTED: dict[str, tuple[str, str, str]] = {
    "store_outlives_preemption": ("preemption_race", "async_store", "error"),
    "straggler_rank_after_preemption": ("preemption_race", "late_rank_report", "error"),
    "preempted_under_step_in_flight": ("preemption_race", "step_in_flight", "warning"),
    "deferred_free_cascade": ("no_progress", "livelock", "warning"),
    "recompute_thrash": ("no_progress", "livelock", "warning"),
    "never_fits_self_preemption": ("no_progress", "livelock", "warning"),
}


def all_scenarios() -> dict[str, Callable[[], Any]]:
    return {**RACES, **LIVELOCKS, **CONTROLS}


def quiet_scenarios() -> dict[str, Callable[[], Trace]]:
    """Every trace neither preemption rule may report: the controls above, the healthy lifecycles of
    tests/scenarios.py and every PP run of tests/scenarios_pipeline.py (bubbles, no preemption)."""
    import scenarios_pipeline as sp
    from scenarios import HEALTHY

    pipeline = {f.__name__: f for f in (sp.healthy_pp4, sp.few_requests_pp4, sp.one_microbatch_pp4, sp.slow_stage_pp4,
                                        sp.slow_scheduler_pp4, sp.two_waves_pp4)}
    return {**CONTROLS, **{f"healthy_{k}": v for k, v in HEALTHY.items()}, **pipeline}
