"""Normal vLLM lifecycles as event tables, for the analysis, show and plot tests (and anyone else's).

`Engine` drives one scheduler (instance, dp_rank) through EventBuilder in the order vLLM 0.33 emits events:
`schedule()` writes `sched`, the allocations and `req_sched`; the engine writes `step_submit`; `update_from_output`
writes `step_output`, then the finishes (an immediate free: `blocks_free`, `blocks_pool_free`, then `req_finish`,
because the recorder reads delay_free after `_free_request` returns), then the transfer completions. Workers write
`exec_begin` / `exec_end` per PP rank when `exec_spans` is on.

Healthy scenarios (each a function returning a Trace; `HEALTHY` maps names to them) must give no error from any
rule. Tests build faulty variants by calling the same Engine methods in a wrong order.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.model import Trace

START_NS = 1_700_000_000_000_000_000
STEP_NS = 1_000_000  # 1 ms per scheduler step


class Engine:
    """One scheduler plus its engine loop and workers, writing into a shared EventBuilder."""

    def __init__(self, builder: EventBuilder, instance: str = "engine-0", role: str = "both", pid: int = 1000,
                 dp_rank: int = 0, pp: int = 1, tp: int = 1, num_blocks: int = 64, defer_block_free: bool = False,
                 kv_role: str | None = None, exec_spans: bool = False, config: bool = True) -> None:
        self.b = builder
        self.instance = instance
        self.role = role
        self.pid = pid
        self.dp_rank = dp_rank
        self.pp = pp
        self.tp = tp
        self.exec_spans = exec_spans
        self.defer_block_free = defer_block_free
        self.next_step = 0
        self.in_flight: deque[int] = deque()
        self.tokens: dict[int, int] = {}
        self.held: dict[str, list[int]] = {}
        self.fence = 0
        if config:
            self.ev("engine_config", n=num_blocks, detail={
                "block_size": 16, "pp": pp, "tp": tp, "dp": 1, "batch_queue_size": pp,
                "async_scheduling": False, "defer_block_free": defer_block_free,
                "kv_role": kv_role or {"prefill": "kv_producer", "decode": "kv_consumer"}.get(role, "kv_both"),
                "connector": "NixlConnector", "runner": "v1", "max_num_seqs": 64, "max_num_batched_tokens": 2048})

    # -- raw events --------------------------------------------------------------------------------------------
    def ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        fields.setdefault("instance", self.instance)
        fields.setdefault("role", self.role)
        fields.setdefault("pid", self.pid)
        fields.setdefault("dp_rank", self.dp_rank)
        return self.b.add(kind, **fields)

    # -- scheduler ---------------------------------------------------------------------------------------------
    def add(self, req: str, n: int = 32, **detail: Any) -> None:
        self.ev("req_add", req=req, n=n, detail=detail or None)

    def step(self, sched: dict[str, int] | None = None, alloc: dict[str, list[int]] | None = None,
             wait_kv: dict[str, list[int]] | None = None, preempt: dict[str, list[int]] | None = None,
             hits: dict[str, int] | None = None) -> int:
        """One `schedule()` call and its submission: preemptions (with their frees), allocations, requests that
        start waiting for remote KV, then the scheduled requests. Returns the step id."""
        k = self.next_step
        self.next_step += 1
        sched = sched or {}
        for req, blocks in (preempt or {}).items():
            self.ev("req_preempt", step=k, req=req)
            self.free(req, blocks, reason="preempted", step=k)
        for req, blocks in (wait_kv or {}).items():
            self.ev("blocks_alloc", step=k, req=req, blocks=blocks, detail={"hit": 0})
            self.ev("req_wait_kv", step=k, req=req, blocks=blocks, n=16 * len(blocks))
            self.held.setdefault(req, []).extend(blocks)
        for req, blocks in (alloc or {}).items():
            self.ev("blocks_alloc", step=k, req=req, blocks=blocks, detail={"hit": (hits or {}).get(req, 0)})
            self.held.setdefault(req, []).extend(blocks)
        total = sum(sched.values())
        self.ev("sched", step=k, n=total, detail={"running": len(sched), "waiting": 0, "waiting_kv": 0,
                                                  "free_blocks": 32, "dur_ns": 50_000})
        for req, n in sched.items():
            self.ev("req_sched", step=k, req=req, n=n)
        self.b.advance(STEP_NS // 10)
        self.in_flight.append(k)
        self.tokens[k] = total
        self.ev("step_submit", step=k, n=len(self.in_flight))
        if self.exec_spans:
            self._exec(k, total)
        self.b.advance(STEP_NS // 2)
        return k

    def _exec(self, k: int, n: int) -> None:
        for pp_rank in range(self.pp):
            for tp_rank in range(self.tp):
                pid = self.pid + 1 + pp_rank * self.tp + tp_rank
                self.ev("exec_begin", component="worker", pid=pid, pp_rank=pp_rank, tp_rank=tp_rank, step=k, n=n)
            self.b.advance(STEP_NS // (2 * self.pp))
            for tp_rank in range(self.tp):
                pid = self.pid + 1 + pp_rank * self.tp + tp_rank
                self.ev("exec_end", component="worker", pid=pid, pp_rank=pp_rank, tp_rank=tp_rank, step=k, n=n,
                        detail={"rpc": "execute_model"})

    def output(self) -> int:
        """`update_from_output` of the oldest step in flight (FIFO). Returns its id."""
        k = self.in_flight.popleft()
        self.ev("step_output", step=k, detail={"wait_ns": 1000})
        self._current = k
        return k

    def free(self, req: str, blocks: list[int] | None = None, reason: str = "finished", step: int | None = None,
             deferred: bool | None = None, pool: bool = True, pool_blocks: list[int] | None = None) -> None:
        """`blocks_free` (and its `blocks_pool_free` when the free is immediate and `pool`)."""
        blocks = list(self.held.get(req, []) if blocks is None else blocks)
        if deferred is None:
            deferred = False
        step = self._current_step() if step is None else step
        if deferred:
            self.fence += 1
            self.ev("blocks_free", step=step, req=req, blocks=blocks, reason=reason, deferred=True,
                    detail={"fence": self.fence})
        else:
            self.ev("blocks_free", step=step, req=req, blocks=blocks, reason=reason, deferred=False)
            if pool and (pool_blocks is None or pool_blocks):
                self.ev("blocks_pool_free", step=step, req=req, blocks=pool_blocks or blocks)
        held = self.held.get(req, [])
        self.held[req] = [b for b in held if b not in blocks]

    def drain(self, blocks: list[int]) -> None:
        """A deferred free reaching the pool (req null), in the update of a later non-empty step."""
        self.ev("blocks_pool_free", step=self._current_step(), blocks=blocks, detail={"fence": self.fence})

    def finish(self, req: str, reason: str = "stop", status: str = "RUNNING", delay_free: bool = False,
               free: bool = True, deferred: bool = False, step: int | None = None,
               pool_blocks: list[int] | None = None) -> None:
        """`_free_request`: the immediate free (unless delay_free), then `req_finish`."""
        step = self._current_step() if step is None else step
        if free and not delay_free:
            self.free(req, reason="aborted" if reason == "abort" else "finished", step=step, deferred=deferred,
                      pool_blocks=pool_blocks)
        self.ev("req_finish", step=step, req=req, reason=reason, status=status, delay_free=delay_free)

    def send_done(self, req: str, status: str = "FINISHED_LENGTH_CAPPED", free: bool = True, **kw: Any) -> None:
        step = self._current_step()
        self.ev("kv_send_done", step=step, req=req, status=status, **kw)
        if free:
            self.free(req, reason="sent", step=step)

    def recv_done(self, req: str, status: str = "WAITING_FOR_REMOTE_KVS") -> None:
        self.ev("kv_recv_done", step=self._current_step(), req=req, status=status)

    def _current_step(self) -> int | None:
        return getattr(self, "_current", None)

    def run_out(self) -> None:
        """Output every step still in flight."""
        while self.in_flight:
            self.output()


def builder(start_ns: int = START_NS) -> EventBuilder:
    return EventBuilder(start_ns=start_ns, tick_ns=1_000)


# -- healthy lifecycles ----------------------------------------------------------------------------------------
def prefill_lifecycle(p: Engine, req: str, blocks: list[int], prompt: int = 40) -> None:
    """P side: prefill in one step, finish with delay_free (length cap after one token), send, free."""
    p.add(req, n=prompt, remote_decode=True)
    p.step({req: prompt}, alloc={req: blocks})
    p.output()
    p.finish(req, reason="length", status="RUNNING", delay_free=True)
    p.step({})
    p.output()
    p.send_done(req)


def decode_lifecycle(d: Engine, req: str, blocks: list[int], extra: list[int] | None = None,
                     decode_steps: int = 3) -> None:
    """D side: wait for remote KV, receive, decode a few steps, stop, free."""
    d.add(req, n=40, remote_prefill=True, remote_instance="P", remote_req=req, remote_blocks=len(blocks))
    d.step({}, wait_kv={req: blocks})
    d.output()
    d.step({})
    d.output()
    d.recv_done(req)
    for i in range(decode_steps):
        alloc = {req: extra} if (extra and i == 0) else None
        d.step({req: 1}, alloc=alloc)
        d.output()
    d.finish(req, reason="stop", status="RUNNING")


def healthy_prefill() -> Trace:
    b = builder()
    p = Engine(b, instance="P", role="prefill")
    prefill_lifecycle(p, "r1", [1, 2, 3])
    prefill_lifecycle(p, "r2", [4, 5, 6])
    return b.trace()


def healthy_decode() -> Trace:
    b = builder()
    d = Engine(b, instance="D", role="decode")
    decode_lifecycle(d, "r1", [1, 2, 3], extra=[4])
    return b.trace()


def healthy_pd() -> Trace:
    """P and D side by side (two instances, one trace)."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    p.add("r1", n=40, remote_decode=True)
    p.step({"r1": 40}, alloc={"r1": [1, 2, 3]})
    p.output()
    p.finish("r1", reason="length", delay_free=True)
    d.add("r1", n=40, remote_prefill=True, remote_instance="P", remote_req="r1", remote_blocks=3)
    d.step({}, wait_kv={"r1": [7, 8, 9]})
    d.output()
    b.add("remote_read", instance="D", role="decode", pid=2000, component="connector", req="r1",
          blocks=[1, 2, 3], detail={"remote_instance": "P"})
    p.step({})
    p.output()
    p.send_done("r1")
    d.step({})
    d.output()
    d.recv_done("r1")
    for _ in range(2):
        d.step({"r1": 1})
        d.output()
    d.finish("r1")
    return b.trace()


def deferred_frees() -> Trace:
    """A KV consumer with two batches in flight (PP=2, defer_block_free): frees are parked and drain later."""
    b = builder()
    d = Engine(b, instance="D", role="decode", pp=2, defer_block_free=True)
    d.add("r1", n=16)
    d.add("r2", n=16)
    d.step({"r1": 16}, alloc={"r1": [1, 2]})
    d.step({"r2": 16}, alloc={"r2": [3, 4]})
    d.output()            # step 0
    d.finish("r1", reason="length", deferred=True)   # step 1 still in flight
    d.step({})
    d.output()            # step 1
    d.finish("r2", reason="length", deferred=True)
    d.add("r3", n=16)
    d.step({"r3": 16}, alloc={"r3": [5]})
    d.output()            # step 2 (empty)
    d.output()            # step 3 non-empty: drain
    d.drain([1, 2, 3, 4])
    d.finish("r3", reason="length")
    return b.trace()


def shared_prefix() -> Trace:
    """Two requests share prefix blocks 1, 2 (a prefix-cache hit); the pool sees them only after both free."""
    b = builder()
    e = Engine(b, instance="E", role="both")
    e.add("a", n=48)
    e.step({"a": 48}, alloc={"a": [1, 2, 3]})
    e.output()
    e.add("b", n=48)
    e.step({"b": 16, "a": 1}, alloc={"b": [1, 2, 4]}, hits={"b": 2})
    e.output()
    e.finish("a", reason="length", pool_blocks=[3])
    e.step({"b": 1})
    e.output()
    e.finish("b", reason="length", pool_blocks=[4, 2, 1])
    return b.trace()


def preempt_resume() -> Trace:
    """A request is preempted (blocks freed), then resumes with new blocks and finishes."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=8)
    e.add("a", n=32)
    e.add("b", n=32)
    e.step({"a": 32, "b": 32}, alloc={"a": [1, 2], "b": [3, 4]})
    e.output()
    e.step({"a": 1}, alloc={"a": [5, 6]}, preempt={"b": [3, 4]})
    e.output()
    e.step({"a": 1})
    e.output()
    e.finish("a", reason="length")
    e.step({"b": 32}, alloc={"b": [4, 1]})
    e.output()
    e.step({"b": 1})
    e.output()
    e.finish("b", reason="stop")
    return b.trace()


def chunked_prefill() -> Trace:
    """A long prompt prefilled in three chunks, allocating blocks as it goes."""
    b = builder()
    e = Engine(b, instance="E", role="both")
    e.add("long", n=96)
    e.step({"long": 32}, alloc={"long": [1, 2]})
    e.output()
    e.step({"long": 32}, alloc={"long": [3, 4]})
    e.output()
    e.step({"long": 32}, alloc={"long": [5, 6]})
    e.output()
    e.step({"long": 1}, alloc={"long": [7]})
    e.output()
    e.finish("long", reason="stop")
    return b.trace()


def abort_immediate() -> Trace:
    """A running request is aborted between steps (step null): its blocks are freed at once."""
    b = builder()
    e = Engine(b, instance="E", role="both")
    e.add("a", n=32)
    e.step({"a": 32}, alloc={"a": [1, 2]})
    e.output()
    e._current = None
    e.finish("a", reason="abort", status="RUNNING")
    e.step({})
    e.output()
    return b.trace()


def pp4_pipeline(n_steps: int = 12) -> Trace:
    """PP=4 with four disjoint micro-batches in flight, exec spans on every rank, requests finishing as they go."""
    b = builder()
    e = Engine(b, instance="E", role="both", pp=4, exec_spans=True)
    reqs = [f"q{i}" for i in range(8)]
    for i, r in enumerate(reqs):
        e.add(r, n=16)
    for k in range(n_steps):
        pair = reqs[(2 * k) % 8:(2 * k) % 8 + 2]
        alloc = {r: [1 + reqs.index(r)] for r in pair} if k < 4 else None
        e.step({r: 16 if k < 4 else 1 for r in pair}, alloc=alloc)
        if len(e.in_flight) == 4:
            e.output()
    while e.in_flight:
        e.output()
    for r in reqs:
        e.finish(r, reason="length")
    return b.trace()


def failed_load(freed_at_failure: bool = False) -> Trace:
    """vLLM 0.33, kv_load_failure_policy "fail" (test_kv_load_failure_recovery::
    test_failed_receive_completion_honors_failure_policy[fail]): a D request's async load fails (`failed_recving`),
    the scheduler finishes it with an error while it still waits for remote KV; `finish_requests` delays the free
    (the load started and has not reported done), and the worker's `finished_recving` later frees the blocks
    (reason `received`). No send anywhere: the delay_free is the receive's. `freed_at_failure`: the blocks are
    freed at the error finish instead, while the worker still writes them (kv_recv_done only later): a
    premature_free/recv_open."""
    b = builder()
    d = Engine(b, instance="D", role="decode")
    d.add("r1", n=32, remote_prefill=True, remote_instance="P", remote_req="r1", remote_blocks=2)
    d.step({}, wait_kv={"r1": [11, 12]})
    d.output()
    d.step({})
    d.output()
    d.ev("kv_recv_fail", step=d._current_step(), req="r1")
    d.finish("r1", reason="error", status="WAITING_FOR_REMOTE_KVS", delay_free=not freed_at_failure)
    d.step({})
    d.output()
    d.recv_done("r1", status="unknown" if freed_at_failure else "FINISHED_ERROR")
    if not freed_at_failure:
        d.free("r1", reason="received")
        d.step({})
        d.output()
    return b.trace()


def failed_load_waits_for_receive() -> Trace:
    """`failed_load`: the healthy order (freed when the receive reports done)."""
    return failed_load()


def abort_deferred_load() -> Trace:
    """vLLM 0.33 with deferred frees and deferred async loads (test_deferred_block_free::
    test_abort_deferred_async_load_frees_after_inflight_step): a KV consumer with two steps in flight allocates for a
    request's remote KV while step 0 is still running, so its load is deferred until that step's update; the client
    aborts it first. The load never started, so `finish_requests` frees at once (delay_free false), deferred behind
    the step in flight; the next non-empty update drains the blocks to the pool."""
    b = builder()
    d = Engine(b, instance="D", role="decode", pp=2, defer_block_free=True)
    d.add("a", n=16)
    d.step({"a": 16}, alloc={"a": [1]})                     # step 0 in flight
    d.add("r1", n=32, remote_prefill=True, remote_instance="P", remote_req="r1", remote_blocks=2)
    d.step({"a": 1}, wait_kv={"r1": [5, 6]})                 # step 1: r1's load deferred behind step 0
    d._current = None
    d.finish("r1", reason="abort", status="WAITING_FOR_REMOTE_KVS", deferred=True)  # abort between steps
    d.output()                                                # step 0's update: drains the deferred free
    d.drain([5, 6])
    d.output()                                                # step 1
    d.finish("a", reason="length", deferred=True)
    d.add("c", n=16)
    d.step({"c": 16}, alloc={"c": [7]})
    d.output()
    d.drain([1])
    d.finish("c", reason="length", deferred=True)
    d.step({})
    d.output()
    return b.trace()


def id_reuse() -> Trace:
    """Request ids reused after the earlier requests with those ids finished and were freed (vLLM's own tests call
    `create_requests` twice; clients that send their own ids do it in production): r1 and r2 allocate, finish and
    free; then new requests r1 and r2 arrive, allocate other blocks, and the trace ends while the new r1 still runs
    (it holds its blocks legitimately: it is alive, not the finished r1)."""
    b = builder()
    e = Engine(b, instance="E", role="both")
    e.add("r1", n=32)
    e.add("r2", n=16)
    e.step({"r1": 32, "r2": 16}, alloc={"r1": [1, 2], "r2": [3]})
    e.output()
    e.step({"r1": 1, "r2": 1})
    e.output()
    e.finish("r1", reason="length")
    e.finish("r2", reason="stop")
    e.add("r1", n=16)
    e.add("r2", n=16)
    e.step({"r1": 16, "r2": 16}, alloc={"r1": [4], "r2": [5, 6]})
    e.output()
    e.step({"r1": 1, "r2": 1})
    e.output()
    e.finish("r2", reason="stop")
    e.step({"r1": 1})
    e.output()
    return b.trace()


def receive_again_after_preemption(free_during_second_wait: bool = False) -> Trace:
    """vLLM 0.33's test_kv_connector_handles_preemption: a D request receives its KV, runs, is preempted, and waits
    for remote KV a second time (a second req_wait_kv and kv_recv_done) before it resumes and finishes.
    `free_during_second_wait`: it is aborted and freed at once while the second receive is open (recv_open)."""
    b = builder()
    d = Engine(b, instance="D", role="decode")
    d.add("r1", n=40, remote_prefill=True, remote_instance="P", remote_req="r1", remote_blocks=1)
    d.step({}, wait_kv={"r1": [2]})
    d.output()
    d.recv_done("r1")
    d.step({"r1": 3}, alloc={"r1": [5, 6]})
    d.output()
    d.step({}, preempt={"r1": [2, 5, 6]})
    d.output()
    d.step({}, wait_kv={"r1": [2, 5, 6]})
    d.output()
    if free_during_second_wait:
        d._current = None
        d.finish("r1", reason="abort", status="WAITING_FOR_REMOTE_KVS")
        return b.trace()
    d.step({})
    d.output()
    d.recv_done("r1")
    d.step({"r1": 1}, alloc={"r1": [4]})
    d.output()
    d.finish("r1", reason="length")
    return b.trace()


def second_wait_after_preemption(second_receive: bool = False, steps: int = 60) -> Trace:
    """vllm#53250 (MoRIIO write mode): a D request receives its KV (P writes it once, reports the send done and
    frees), decodes, is preempted under pressure, and on re-admission asks for the same one-shot transfer again:
    its second req_wait_kv never closes while the engine keeps serving another request. `second_receive`: the
    healthy look-alike, whose second receive completes (a connector that can read again)."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    p.add("r1", n=40, remote_decode=True)
    p.step({"r1": 40}, alloc={"r1": [1, 2, 3]})
    p.output()
    p.finish("r1", reason="length", delay_free=True)
    d.add("r1", n=40, remote_prefill=True, remote_instance="P", remote_req="r1", remote_blocks=3)
    d.add("other", n=16)
    d.step({"other": 16}, wait_kv={"r1": [7, 8, 9]}, alloc={"other": [20]})
    d.output()
    p.step({})
    p.output()
    p.send_done("r1")
    d.step({"other": 1})
    d.output()
    d.recv_done("r1")
    d.step({"r1": 1, "other": 1}, alloc={"r1": [10]})
    d.output()
    d.step({"other": 1}, preempt={"r1": [7, 8, 9, 10]})
    d.output()
    d.step({"other": 1}, wait_kv={"r1": [7, 8, 9]})
    d.output()
    for i in range(steps):
        d.step({"other": 1})
        d.output()
        if second_receive and i == 3:
            d.recv_done("r1")
            d.step({"r1": 1, "other": 1}, alloc={"r1": [10]})
            d.output()
            d.finish("r1", reason="stop")
    return b.trace()


def not_deferred_trace(deferred: bool) -> Trace:
    """An abort that frees at once (`deferred` false) on a scheduler that defers frees, a step of the request in
    flight: premature_free/not_deferred; `deferred`: the fenced free vLLM makes."""
    b = builder()
    d = Engine(b, instance="D", role="decode", pp=2, defer_block_free=True)
    d.add("a", n=32)
    d.add("b", n=32)
    d.step({"a": 32}, alloc={"a": [1, 2]})
    d._current = None
    d.finish("a", reason="abort", deferred=deferred)
    d.step({"b": 32}, alloc={"b": [3]})
    d.output()
    d.output()
    if deferred:
        d.drain([1, 2])
    d.finish("b", reason="length")
    return b.trace()


def sliding_window_async(optimistic: bool = False, facts: bool = True, decode_steps: int = 64,
                         window: int = 32) -> Trace:
    """A decode instance serving a model with sliding-window layers (the hybrid KV cache manager trims the blocks
    that left the window, `blocks_free reason=skipped`) under async scheduling (one step in flight when the next is
    scheduled) with deferred frees (defer_block_free, a KV consumer): `long` decodes from a 64-token prompt, its
    trimmed blocks go back to the pool at once (vLLM never fences a trim), and each is handed to a request that
    waits for remote KV (an asynchronous load) in the same schedule(), while `long`'s previous step is in flight.
    vLLM 0.33 (after vllm#47728) trims on the processed count (num_computed_tokens less the tokens in flight): the
    step in flight never reads a trimmed block. `optimistic`: vllm#47282, trimming on the optimistic count, so the
    first trim comes one step early and takes blocks the step in flight still attends to, which the load then
    overwrites. `facts`: the trim rows carry the detail the vLLM hooks record (window, block_size, upto, tokens,
    computed); without it (a recorder that cannot read them) the rule cannot tell."""
    b = builder()
    e = Engine(b, instance="D", role="decode", num_blocks=64, defer_block_free=True, config=False)
    e.ev("engine_config", n=64, detail={
        "block_size": 16, "pp": 1, "tp": 1, "dp": 1, "batch_queue_size": 1, "async_scheduling": True,
        "defer_block_free": True, "kv_role": "kv_consumer", "connector": "NixlConnector", "runner": "v1",
        "max_num_seqs": 64, "max_num_batched_tokens": 2048})
    prompt = 64
    e.add("long", n=prompt)
    table = [1, 2, 3, 4]
    free_ids = list(range(40, 64))
    e.step({"long": prompt}, alloc={"long": list(table)})
    computed, in_flight = prompt, [prompt]  # optimistic count; tokens of the steps in flight, oldest first
    trimmed = 0  # table entries trimmed so far
    loads = 0
    for _ in range(decode_steps):
        k = e.next_step
        basis = computed if optimistic else computed - sum(in_flight)
        skipped = max(0, basis - window + 1) // 16
        give_up = [blk for blk in table[trimmed:skipped]]
        wait_kv = None
        if give_up:
            detail = {"window": window, "block_size": 16, "upto": skipped * 16, "tokens": basis,
                      "computed": computed} if facts else None
            e.ev("blocks_free", step=k, req="long", blocks=give_up, reason="skipped", deferred=False, detail=detail)
            e.ev("blocks_pool_free", step=k, req="long", blocks=give_up)
            e.held["long"] = [blk for blk in e.held["long"] if blk not in give_up]
            trimmed = skipped
            loads += 1
            name = f"load{loads}"
            e.add(name, n=16 * len(give_up), remote_prefill=True, remote_instance="P", remote_req=name,
                  remote_blocks=len(give_up))
            wait_kv = {name: give_up}
        alloc = None
        if computed % 16 == 0:
            table.append(free_ids.pop(0))
            alloc = {"long": [table[-1]]}
        e.step({"long": 1}, alloc=alloc, wait_kv=wait_kv)
        computed += 1
        in_flight.append(1)
        e.output()  # the previous step's output comes after the next step was scheduled
        in_flight.pop(0)
        if wait_kv:
            name = next(iter(wait_kv))
            e.recv_done(name)
            e.finish(name, reason="abort", status="WAITING_FOR_REMOTE_KVS", free=False)
            e.free(name, reason="aborted")
    e.run_out()
    e.finish("long", reason="length")
    return b.trace()


HEALTHY: dict[str, Callable[[], Trace]] = {
    "prefill": healthy_prefill,
    "decode": healthy_decode,
    "pd": healthy_pd,
    "deferred_frees": deferred_frees,
    "shared_prefix": shared_prefix,
    "preempt_resume": preempt_resume,
    "chunked_prefill": chunked_prefill,
    "abort_immediate": abort_immediate,
    "pp4_pipeline": pp4_pipeline,
    "failed_load_waits_for_receive": failed_load_waits_for_receive,
    "abort_deferred_load": abort_deferred_load,
    "id_reuse": id_reuse,
    "receive_again_after_preemption": receive_again_after_preemption,
    "second_receive_completes": lambda: second_wait_after_preemption(second_receive=True),
    "sliding_window_async": sliding_window_async,
}


# -- random well-formed lifecycles (for property tests) ----------------------------------------------------------
def random_healthy(seed: int, n_requests: int = 12, num_blocks: int = 48, pp: int = 1) -> Trace:
    """A random but well-formed run of one scheduler: plain requests, P-side requests with a delayed free and a
    send, D-side requests that wait for remote KV, preemption and resume, aborts, prefix hits on a block still
    held. Every request ends finished and freed (the run goes on until all are done)."""
    import random

    rng = random.Random(seed)
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=num_blocks, pp=pp)
    free_pool = list(range(1, num_blocks))
    kinds = {f"r{i}": rng.choice(["plain", "plain", "send", "recv", "abort"]) for i in range(n_requests)}
    pending = list(kinds)
    state: dict[str, str] = {}
    sending: list[str] = []
    receiving: list[str] = []
    steps = 0

    def take(n: int) -> list[int] | None:
        if len(free_pool) < n:
            return None
        got = [free_pool.pop(rng.randrange(len(free_pool))) for _ in range(n)]
        return got

    # freed blocks go back to the pool only once every step in flight at the free has its output, as vLLM 0.33's
    # defer_block_free fence guarantees for a KV consumer (async loads must not race a running step)
    quarantine: list[tuple[int, list[int]]] = []

    def give(req: str) -> None:
        quarantine.append((e.next_step - 1, list(e.held.get(req, []))))

    def release(done_step: int) -> None:
        for item in [q for q in quarantine if q[0] <= done_step]:
            quarantine.remove(item)
            free_pool.extend(item[1])

    while (pending or state or sending or receiving) and steps < 400:
        steps += 1
        sched: dict[str, int] = {}
        alloc: dict[str, list[int]] = {}
        wait_kv: dict[str, list[int]] = {}
        preempt: dict[str, list[int]] = {}
        running = [r for r, s in state.items() if s == "running"]
        if running and rng.random() < 0.1:
            victim = running[-1]
            preempt[victim] = list(e.held.get(victim, []))
            quarantine.append((e.next_step - 1, preempt[victim]))
            state[victim] = "preempted"
            running.remove(victim)
        for r in running:
            if rng.random() < 0.3:
                got = take(1)
                if got is None:
                    continue
                alloc[r] = got
            sched[r] = 1
        for r in [r for r, s in state.items() if s in ("preempted", "ready")]:
            got = take(rng.randint(1, 3))
            if got is None:
                continue
            alloc[r] = got
            sched[r] = 16
            state[r] = "running"
        if pending and rng.random() < 0.6:
            r = pending.pop(0)
            kind = kinds[r]
            got = take(rng.randint(1, 3))
            if got is None:
                pending.insert(0, r)
            else:
                e.add(r, n=16 * len(got), remote_prefill=kind == "recv", remote_decode=kind == "send")
                if kind == "recv":
                    wait_kv[r] = got
                    state[r] = "waiting_kv"
                    receiving.append(r)
                else:
                    alloc[r] = got
                    sched[r] = 16 * len(got)
                    state[r] = "running"
        e.step(sched, alloc=alloc, wait_kv=wait_kv, preempt=preempt)
        while len(e.in_flight) >= pp:
            release(e.output())
            done_recv = [r for r in receiving if state.get(r) == "waiting_kv" and rng.random() < 0.4]
            for r in done_recv:
                receiving.remove(r)
                e.recv_done(r)
                state[r] = "ready"
            for r in list(state):
                if state[r] == "running" and r in sched and rng.random() < 0.25:
                    kind = kinds[r]
                    if kind == "send":
                        e.finish(r, reason="length", delay_free=True)
                        sending.append(r)
                        state.pop(r)
                    elif kind == "abort":
                        give(r)
                        e.finish(r, reason="abort")
                        state.pop(r)
                    else:
                        give(r)
                        e.finish(r, reason="stop")
                        state.pop(r)
            for r in [r for r in sending if rng.random() < 0.5]:
                sending.remove(r)
                give(r)
                e.send_done(r)
    e.run_out()
    return b.trace()


# -- faulty lifecycles (named, for the stripped-field property and the before/after table) ------------------------
def quorum_tp2(config: bool = True, declared: bool = False) -> Trace:
    """TP=2 P instance: r1's send is reported by both ranks before its aggregated kv_send_done; r2's by tp0 only
    (the aggregated completion came after one of two ranks: premature_free/quorum). `config=False`: no
    engine_config (recording started late), the expected count comes from the ranks that reported for r1;
    `declared`: the completions carry detail `expected_ranks`."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", tp=2, config=config)
    for req, blocks in (("r1", [1, 2]), ("r2", [3, 4])):
        p.add(req, n=32, remote_decode=True)
        p.step({req: 32}, alloc={req: blocks})
        p.output()
        p.finish(req, reason="length", delay_free=True)
        k = p.step({})
        for tp in ((0, 1) if req == "r1" else (0,)):
            p.ev("kv_send_rank", component="worker", pid=p.pid + 1 + tp, pp_rank=0, tp_rank=tp, step=k, req=req)
        p.output()
        p.send_done(req, **({"detail": {"expected_ranks": 2}} if declared else {}))
    return b.trace()


def abort_while_waiting_kv(receive: bool = True, delay_free: bool = True) -> tuple[EventBuilder, Engine]:
    """D aborts r1 while its KV is being received; vLLM 0.33 keeps the blocks (delay_free) and frees them once the
    receive completes (healthy). `receive=False`: the trace ends before the receive's completion;
    `delay_free=False`: the blocks are freed at the abort (what vLLM 0.10 does while the read still writes)."""
    b = builder()
    d = Engine(b, instance="D", role="decode")
    d.add("r1", n=32, remote_prefill=True)
    d.step({}, wait_kv={"r1": [50, 51]})
    d.output()
    d._current = None
    d.finish("r1", reason="abort", status="WAITING_FOR_REMOTE_KVS", delay_free=delay_free)
    d.step({})
    d.output()
    if receive:
        d.recv_done("r1", status="FINISHED_ABORTED")
        d.free("r1", reason="received")
    return b, d


def abort_received_then_second_completion() -> Trace:
    """abort_while_waiting_kv; the receive's completion freed the blocks (the final free: vLLM forgets r1), then a
    send completion for r1 arrives in the same update: double_free/completion_after_free."""
    b, d = abort_while_waiting_kv()
    d.ev("kv_send_done", step=d._current_step(), req="r1", status="unknown")
    return b.trace()


def send_never_completes(hold_s: float) -> Trace:
    """P finishes r1 with delay_free and the peer's read never completes; the trace ends hold_s later (a lost
    completion past the 480 s grace period: leaked_blocks/indirectly; within it: leaked_blocks/still_held, info)."""
    b = builder()
    p = Engine(b, instance="P", role="prefill")
    p.add("r1", n=32, remote_decode=True)
    p.step({"r1": 32}, alloc={"r1": [7, 8]})
    p.output()
    p.finish("r1", reason="length", delay_free=True)
    b.advance(int(hold_s * 1e9))
    p.step({})
    p.output()
    return b.trace()


def id_reuse_leak() -> Trace:
    """r1 finishes and frees; a new r1 (the id reused) finishes and never frees: the leak is the second lifetime's,
    its blocks only."""
    b = builder()
    e = Engine(b, instance="E", role="both")
    e.add("r1", n=32)
    e.step({"r1": 32}, alloc={"r1": [1, 2]})
    e.output()
    e.finish("r1", reason="length")
    e.add("r1", n=16)
    e.step({"r1": 16}, alloc={"r1": [3]})
    e.output()
    e.finish("r1", reason="length", free=False)
    e.step({})
    e.output()
    return b.trace()


def abort_started_load() -> Trace:
    """abort_deferred_load, but the step in flight had its (non-empty) update before the abort, so the deferred
    load started: freeing at the abort races the KV write (premature_free/recv_open)."""
    b = builder()
    d = Engine(b, instance="D", role="decode", pp=2, defer_block_free=True)
    d.add("a", n=16)
    d.step({"a": 16}, alloc={"a": [1]})
    d.add("r1", n=32, remote_prefill=True, remote_instance="P", remote_req="r1", remote_blocks=2)
    d.step({"a": 1}, wait_kv={"r1": [5, 6]})
    d.output()                                                # step 0's update: the deferred load starts
    d._current = None
    d.finish("r1", reason="abort", status="WAITING_FOR_REMOTE_KVS", deferred=True)
    d.output()
    d.drain([5, 6])
    d.finish("a", reason="length", deferred=True)
    d.step({})
    d.output()
    return b.trace()


FAULTY: dict[str, Callable[[], Trace]] = {
    "quorum_tp2": quorum_tp2,
    "quorum_tp2_no_config": lambda: quorum_tp2(config=False),
    "quorum_tp2_declared": lambda: quorum_tp2(config=False, declared=True),
    "abort_received_then_second_completion": abort_received_then_second_completion,
    "send_lost": lambda: send_never_completes(600),
    "send_still_held": lambda: send_never_completes(60),
    "id_reuse_leak": id_reuse_leak,
    "failed_load_freed_before_receive": lambda: failed_load(freed_at_failure=True),
    "abort_started_load": abort_started_load,
    "freed_during_second_receive": lambda: receive_again_after_preemption(free_during_second_wait=True),
    "second_wait_stuck": second_wait_after_preemption,
    "sliding_window_optimistic_trim": lambda: sliding_window_async(optimistic=True),
}
