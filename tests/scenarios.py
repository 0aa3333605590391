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
