"""Real vLLM tracker incidents rendered as pdtrace event traces (trace format v1), plus healthy look-alikes.

Each function returns a `pdtrace.trace.model.Trace` of one or two instances, written the way pdtrace's vLLM hooks
would record the incident on a V1-engine vLLM (0.33-like unless the docstring says which release the incident
needs): `engine_config` first, `req_add` between steps, each `schedule()` as preemptions / allocations /
`req_wait_kv` / `sched` / `req_sched`, `step_submit`, the workers' `exec_begin` / `exec_end` with their per-rank
transfer reports (`kv_send_rank` / `kv_recv_rank`) at the end of the rank's RPC, then `update_from_output`:
`step_output`, the finishes (immediate free, then `req_finish`), then `_update_from_kv_xfer_finished`'s
completions (receives before sends) and the frees they cause. Healthy bystander requests run beside every fault.
Nothing here was tuned to pdtrace's rules: the traces follow the incidents' public descriptions (cited per function)
and docs/trace-format.md's vocabulary.

    INCIDENTS = {name: (fn, instance, req, description)}   # a correct detector names (instance, req) at warning+
    CONTROLS = {name: fn}                                  # correct vLLM behaviour: no warning or error expected

Simplifications, the same for every trace (a real recording has more rows, never other ones):
* Idle stretches: vLLM 0.33 steps at ~1 kHz while it has work it cannot schedule (a KV wait, a delayed free), and
  the recorder folds runs of identical empty steps into one `sched` row with detail `empty_run` (< 0.25 s each);
  `Sim.idle` writes exactly those rows. The workers' `exec_begin` / `exec_end` rows of the folded steps (the worker
  processes record every step) are left out; the run's head step keeps its spans.
* Steps of a busy engine take `step_ns` (15 ms by default); the V1 runner's `batch_add` / `batch_remove` rows and
  `sample_tokens` spans are not written.

Do not assert detection results here (tests that do live elsewhere); `python tests/incidents_lifecycle.py` prints
each trace's size and validates it.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `scenarios` as the tests import it (rootdir tests/)

from scenarios import Engine, builder  # noqa: E402

from pdtrace.trace.model import Trace  # noqa: E402

MS = 1_000_000
S = 1_000_000_000
BLOCK = 16


# -- a small model of one vLLM scheduler, writing through tests/scenarios.Engine ----------------------------------
@dataclass
class Req:
    """One request as the scheduler sees it. kind: `D` (decode side of P/D: `remote_prefill`, waits for remote KV),
    `P` (prefill side: `remote_decode`, one token then a delayed free until the peer read it), `L` (local)."""

    name: str
    kind: str
    prompt: int = 64
    out: int = 8                      # tokens to generate (D, L)
    recv_after: int | None = 3        # D: steps from the wait until the read completes (None: never)
    send_after: int | None = 3        # P: steps from the finish until the peer's read completes (None: never)
    hit: list[int] = field(default_factory=list)   # local prefix-cache hit blocks (already cached in the pool)
    external: int | None = None       # D: external tokens to load (default: the prompt less the hit, full blocks)
    remote: str = "prefill-0"
    remote_req: str | None = None
    # runtime state
    state: str = "new"                # waiting, wait_kv, ready, running, sending, done
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    generated: int = 0
    t: int = 0
    in_step: int | None = None
    reported: bool = False            # its transfer's completion is already on its way (a step in flight)


class Sim(Engine):
    """One scheduler (instance, dp_rank 0) with its block pool, request queues and workers.

    The scenario drives it step by step: `schedule()` then `update()` (or `step()` for both), `idle(seconds)` for
    folded empty runs, and writes its fault rows between them with `ev` / `rank` / `free_req`."""

    def __init__(self, b, instance: str, role: str, pid: int, num_blocks: int = 512, connector: str | None =
                 "NixlConnector", kv_role: str | None = None, tp: int = 1, pp: int = 1, version: str = "0.33.0",
                 async_scheduling: bool = False, defer_block_free: bool = False, max_num_seqs: int = 64,
                 step_ns: int = 15 * MS) -> None:
        super().__init__(b, instance=instance, role=role, pid=pid, pp=pp, tp=tp, num_blocks=num_blocks,
                         defer_block_free=defer_block_free, config=False)
        queue = pp if pp > 1 else (2 if async_scheduling else 1)
        table = "v0_33" if version.startswith("0.33") or version.startswith("0.32") else {
            "0.21.0": "v0_18", "0.18.0": "v0_18", "0.28.0": "v0_28"}.get(version, "v0_33")
        self.ev("engine_config", n=num_blocks, detail={
            "block_size": BLOCK, "pp": pp, "tp": tp, "dp": 1, "batch_queue_size": queue,
            "async_scheduling": async_scheduling, "defer_block_free": defer_block_free,
            "kv_role": kv_role if connector else None, "connector": connector, "runner": "v1",
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048, "vllm_version": version, "table": table})
        self.num_blocks = num_blocks
        self.pool: deque[int] = deque(range(1, num_blocks))   # free queue (head: next to hand out)
        self.ref: dict[int, int] = {}
        self.parked: list[tuple[int, list[int]]] = []          # deferred frees: (fence step, blocks)
        self.reqs: dict[str, Req] = {}
        self.order: list[str] = []                             # FCFS queue order
        self.max_num_seqs = max_num_seqs
        self.step_ns = step_ns
        self.sched_of: dict[int, dict[str, int]] = {}
        self.done_at: dict[int, tuple[list[str], list[str]]] = {}
        self.rank_done: dict[int, dict[str, list[int]]] = {}   # step -> req -> tp ranks that report (default all)
        self.admit = True                                      # False: the admission loop admits nothing

    # -- block pool ----------------------------------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        got = []
        for _ in range(n):
            blk = self.pool.popleft()
            self.ref[blk] = 1
            got.append(blk)
        return got

    def touch(self, blocks: list[int]) -> None:
        for blk in blocks:
            if self.ref.get(blk, 0) == 0 and blk in self.pool:
                self.pool.remove(blk)
            self.ref[blk] = self.ref.get(blk, 0) + 1

    def release(self, blocks: list[int]) -> list[int]:
        """Ref counts down; returns the blocks back in the free queue (tail: still revivable by a prefix hit)."""
        back = []
        for blk in reversed(blocks):
            self.ref[blk] -= 1
            if self.ref[blk] == 0:
                back.append(blk)
                self.pool.append(blk)
        return back

    def free_blocks(self) -> int:
        return len(self.pool)

    def free_req(self, r: Req, reason: str, step: int | None = None, deferred: bool = False) -> None:
        """`KVCacheManager.free` (or `pop_blocks_for_free` when deferred): blocks_free then blocks_pool_free."""
        step = self._current_step() if step is None else step
        blocks = list(r.blocks)
        r.blocks = []
        self.held[r.name] = []
        if deferred:
            fence = self.in_flight[-1] if self.in_flight else step
            self.ev("blocks_free", step=step, req=r.name, blocks=blocks, reason=reason, deferred=True,
                    detail={"fence": fence})
            self.parked.append((fence, blocks))
            return
        self.ev("blocks_free", step=step, req=r.name, blocks=blocks, reason=reason, deferred=False)
        back = self.release(blocks)
        if back:
            self.ev("blocks_pool_free", step=step, req=r.name, blocks=back)

    # -- requests ------------------------------------------------------------------------------------------------
    def add_req(self, r: Req) -> Req:
        detail: dict[str, Any] = {"remote_prefill": r.kind == "D", "remote_decode": r.kind == "P"}
        if r.kind == "D":
            detail.update(remote_instance=r.remote, remote_req=r.remote_req or r.name,
                          remote_blocks=math.ceil(r.prompt / BLOCK))
        self.ev("req_add", req=r.name, n=r.prompt, detail=detail)
        r.state = "waiting"
        self.reqs[r.name] = r
        self.order.append(r.name)
        return r

    def live(self, *states: str) -> list[Req]:
        return [self.reqs[n] for n in self.order if self.reqs[n].state in states]

    def counts(self) -> dict[str, int]:
        running = len(self.live("running"))
        wait_kv = len(self.live("wait_kv", "ready"))   # held aside in skipped_waiting until promoted
        waiting = len(self.live("waiting")) + wait_kv
        return {"running": running, "waiting": waiting, "waiting_kv": wait_kv, "free_blocks": self.free_blocks()}

    # -- one schedule() and its submission -----------------------------------------------------------------------
    def schedule(self, preempt: list[str] = (), hold: set[str] = frozenset()) -> int:
        """`schedule()`: preemptions, running requests (decode), promotions of received ones, then the waiting
        queue (D requests start waiting for remote KV, P / L requests prefill). `hold`: requests left out."""
        k = self.next_step
        self.next_step += 1
        sched: dict[str, int] = {}
        for name in preempt:
            r = self.reqs[name]
            self.ev("req_preempt", step=k, req=name)
            self.free_req(r, "preempted", step=k, deferred=self.defer_block_free)
            r.state, r.computed = "waiting", 0
        for r in self.live("running"):
            if r.name in hold or r.in_step is not None:
                continue
            need = r.prompt - r.computed if r.computed < r.prompt else 1
            if (r.computed + need) > len(r.blocks) * BLOCK:
                grow = math.ceil((r.computed + need) / BLOCK) - len(r.blocks)
                new = self.take(grow)
                r.blocks += new
                self.ev("blocks_alloc", step=k, req=r.name, blocks=new, detail={"hit": 0})
            sched[r.name] = need
        if self.admit:
            for r in self.live("ready"):
                if r.name in hold:
                    continue
                # promoted: the last prompt token is computed locally (num_computed_tokens = prompt - 1)
                r.state = "running"
                r.computed = r.prompt - 1
                if r.prompt + 1 > len(r.blocks) * BLOCK:
                    new = self.take(1)
                    r.blocks += new
                    self.ev("blocks_alloc", step=k, req=r.name, blocks=new, detail={"hit": 0})
                sched[r.name] = 1
            for r in self.live("waiting"):
                if r.name in hold or len(self.live("running")) >= self.max_num_seqs:
                    continue
                hits = list(r.hit)
                if r.kind != "D" and math.ceil(r.prompt / BLOCK) - len(hits) > self.free_blocks():
                    break                              # allocate_slots fails: FCFS stops at the head
                self.touch(hits)
                if r.kind == "D":
                    ext = r.external if r.external is not None else r.prompt - len(hits) * BLOCK
                    new = self.take(math.ceil(ext / BLOCK)) if ext > 0 else []
                    r.blocks = hits + new
                    self.ev("blocks_alloc", step=k, req=r.name, blocks=hits + new,
                            detail={"hit": len(hits), "external": len(new)})
                    self.ev("req_wait_kv", step=k, req=r.name, blocks=new, n=ext)
                    r.state, r.t = "wait_kv", 0
                    continue
                new = self.take(math.ceil(r.prompt / BLOCK) - len(hits))
                r.blocks = hits + new
                r.computed = len(hits) * BLOCK
                self.ev("blocks_alloc", step=k, req=r.name, blocks=hits + new, detail={"hit": len(hits)})
                r.state = "running"
                sched[r.name] = r.prompt - r.computed
        self.held.update({r.name: list(r.blocks) for r in self.reqs.values()})
        detail = dict(self.counts(), dur_ns=60_000)
        total = sum(sched.values())
        self.ev("sched", step=k, n=total, detail=detail)
        for name, n in sched.items():
            self.ev("req_sched", step=k, req=name, n=n)
            self.reqs[name].in_step = k
        self.sched_of[k] = sched
        # transfers the workers report at the end of this step's execution
        recvs = [r.name for r in self.live("wait_kv")
                 if r.recv_after is not None and r.t + 1 >= r.recv_after and not r.reported]
        sends = [r.name for r in self.live("sending")
                 if r.send_after is not None and r.t + 1 >= r.send_after and not r.reported]
        for name in recvs + sends:
            self.reqs[name].reported = True
        self.done_at[k] = (recvs, sends)
        self.b.advance(100_000)
        self.in_flight.append(k)
        self.ev("step_submit", step=k, n=len(self.in_flight))
        self._exec(k, total, recvs, sends)
        return k

    def _exec(self, k: int, n: int, recvs: list[str] = (), sends: list[str] = (), dur: int | None = None) -> None:
        dur = (self.step_ns if n else 1 * MS) if dur is None else dur
        for pp_rank in range(self.pp):
            for tp_rank in range(self.tp):
                self.ev("exec_begin", component="worker", pid=self.wpid(pp_rank, tp_rank), pp_rank=pp_rank,
                        tp_rank=tp_rank, step=k, n=n)
            self.b.advance(dur // self.pp)
            for tp_rank in range(self.tp):
                self.ev("exec_end", component="worker", pid=self.wpid(pp_rank, tp_rank), pp_rank=pp_rank,
                        tp_rank=tp_rank, step=k, n=n, detail={"rpc": "execute_model"})
                for kind, names in (("kv_recv_rank", recvs), ("kv_send_rank", sends)):
                    for name in names:
                        if tp_rank in self.rank_done.get(k, {}).get(name, range(self.tp)):
                            self.rank(kind, name, k, tp_rank, pp_rank)

    def wpid(self, pp_rank: int = 0, tp_rank: int = 0) -> int:
        return self.pid + 1 + pp_rank * self.tp + tp_rank

    def rank(self, kind: str, req: str, step: int, tp_rank: int = 0, pp_rank: int = 0, **kw: Any) -> None:
        """A worker rank's own report (`kv_send_rank` / `kv_recv_rank` / `kv_expire`), connector component."""
        self.ev(kind, component="connector", pid=self.wpid(pp_rank, tp_rank), pp_rank=pp_rank, tp_rank=tp_rank,
                step=step, req=req, **kw)

    # -- update_from_output --------------------------------------------------------------------------------------
    def update(self, completions: bool = True) -> int:
        """`update_from_output` of the oldest step in flight: step_output, finishes, then transfer completions."""
        self.b.advance(200_000)
        k = self.output()
        for name, n in self.sched_of.get(k, {}).items():
            r = self.reqs[name]
            if r.in_step == k:
                r.in_step = None
            if r.state != "running":
                continue           # finished or preempted while the step was in flight: its output is dropped
            r.computed += n
            if r.computed >= r.prompt:
                r.generated += 1
            if r.kind == "P" and r.generated >= 1:
                # max_tokens=1: FINISHED_LENGTH_CAPPED; NIXL's request_finished delays the free for D's read
                self.ev("req_finish", step=k, req=name, reason="length", status="RUNNING", delay_free=True)
                r.state, r.t = "sending", 0
            elif r.kind in "DL" and r.generated >= r.out:
                self.free_req(r, "finished", step=k, deferred=self.defer_block_free and len(self.in_flight) > 0)
                self.ev("req_finish", step=k, req=name, reason="stop", status="RUNNING", delay_free=False)
                r.state = "done"
        if completions:
            recvs, sends = self.done_at.get(k, ([], []))
            for name in recvs:
                r = self.reqs[name]
                self.ev("kv_recv_done", step=k, req=name, status="WAITING_FOR_REMOTE_KVS")
                r.state, r.reported = "ready", False
            for name in sends:
                r = self.reqs[name]
                self.ev("kv_send_done", step=k, req=name, status="FINISHED_LENGTH_CAPPED")
                self.free_req(r, "sent", step=k)
                r.state = "done"
        for r in self.live("wait_kv", "sending"):
            r.t += 1
        if self.sched_of.get(k):
            for fence, blocks in [p for p in self.parked if p[0] <= k]:
                self.parked.remove((fence, blocks))
                back = self.release(blocks)
                if back:
                    self.ev("blocks_pool_free", step=k, blocks=back, detail={"fence": fence})
        self.b.advance(300_000)
        return k

    def step(self, **kw: Any) -> int:
        k = self.schedule(**kw)
        self.update()
        return k

    def busy(self) -> bool:
        return bool(self.live("waiting", "wait_kv", "ready", "running", "sending"))

    def run(self, steps: int, arrivals: dict[int, list[Req]] | None = None, gap_ns: int = 0) -> None:
        """`steps` synchronous steps; `arrivals[i]` are added before the i-th; `gap_ns` idle time after each."""
        for i in range(steps):
            for r in (arrivals or {}).get(i, []):
                self.add_req(r)
            self.step()
            if gap_ns:
                self.b.advance(gap_ns)

    def idle(self, seconds: float, step_ns: int = 1 * MS, run_span_ns: int = 240 * MS) -> None:
        """Empty steps at ~1 kHz for `seconds`, as the recorder folds them: one `sched` row (detail `empty_run`)
        with its `step_submit` / `step_output` per run of < 0.25 s; step ids advance by the run's length."""
        end = self.b.now + int(seconds * S)
        per_run = run_span_ns // step_ns
        while self.b.now < end:
            k = self.next_step
            left = max(1, (end - self.b.now) // step_ns)
            runs = int(min(per_run, left))
            self.ev("sched", step=k, n=0, detail=dict(self.counts(), dur_ns=40_000 * runs, empty_run=runs))
            self.b.advance(100_000)
            self.ev("step_submit", step=k, n=1)
            self._exec(k, 0, dur=step_ns // 2)
            self.ev("step_output", step=k, detail={"wait_ns": 2000})
            self._current = k
            self.next_step = k + runs
            self.b.advance(runs * step_ns)
            for r in self.live("wait_kv", "sending"):
                r.t += runs


def decoders(prefix: str, n: int, out: int = 24, recv_after: int = 3, prompt: int = 80) -> list[Req]:
    return [Req(f"{prefix}{i}", "D", prompt=prompt + 16 * i, out=out, recv_after=recv_after) for i in range(n)]


def prefills(prefix: str, n: int, send_after: int = 3, prompt: int = 96) -> list[Req]:
    return [Req(f"{prefix}{i}", "P", prompt=prompt + 16 * i, send_after=send_after) for i in range(n)]


def drain(sim: Sim, limit: int = 400, gap_ns: int = 0) -> None:
    """Step until the scheduler has nothing left (its bystanders all finished and freed)."""
    for _ in range(limit):
        if not sim.busy():
            return
        sim.step()
        if gap_ns:
            sim.b.advance(gap_ns)


def engine_error(sim: Sim, step: int, error: str, where: str = "step") -> None:
    sim.ev("engine_error", component="engine", step=step, detail={"error": error, "where": where})


_MULTI_NIXL_STORE = "MultiConnector(NixlConnector,LMCacheConnectorV1)"
_ASSERT_IN_REQUESTS = "AssertionError: assert req_id in self.requests (scheduler.py:_update_from_kv_xfer_finished)"


# == incidents ====================================================================================================
def _abort_both(second_later: bool) -> Trace:
    b = builder()
    d = Sim(b, "decode-0", "decode", 2000, connector=_MULTI_NIXL_STORE, kv_role="kv_both", num_blocks=1024)
    d.run(6, arrivals={0: decoders("chat-", 2), 2: decoders("chat-b", 1)})
    fault = d.add_req(Req("cmpl-46240-0", "D", prompt=96, recv_after=None, remote_req="cmpl-46240-0-p"))
    d.step()                                   # the request starts waiting for NIXL's read (req_wait_kv)
    d.run(2, arrivals={0: decoders("chat-c", 1)})
    # The client aborts between steps: finish_requests keeps the blocks (delay_free) because a receive is open;
    # MultiConnector.request_finished: the store child (LMCache) also has an async save pending.
    d._current = None
    d.ev("req_finish", req=fault.name, reason="abort", status="WAITING_FOR_REMOTE_KVS", delay_free=True)
    fault.state = "aborted"
    d.run(2)
    k = d.schedule()
    d.rank("kv_recv_rank", fault.name, k)                  # NIXL's read ends on the worker ...
    if not second_later:
        d.rank("kv_send_rank", fault.name, k)              # ... and LMCache's save in the same step
    d.update()
    d.ev("kv_recv_done", step=k, req=fault.name, status="FINISHED_ABORTED")
    d.free_req(fault, "received", step=k)                  # _free_blocks: blocks back, del self.requests[id]
    if second_later:
        k = d.schedule()
        d.rank("kv_send_rank", fault.name, k)
        d.update()
    d.ev("kv_send_done", step=k, req=fault.name, status="unknown")
    engine_error(d, k, _ASSERT_IN_REQUESTS)
    return b.trace()


def abort_both_completions_same_step() -> Trace:
    """vllm#46240 (also #43226, #48615/#48616, #48821; fix in review #56089). Decode side of P/D with
    MultiConnector(NIXL + a KV store, LMCache), kv_both. A request waiting for NIXL's read
    (WAITING_FOR_REMOTE_KVS) is aborted by the client; finish_requests delays its free because the read is open,
    and MultiConnector's request_finished also holds it for the store's async save.

    Order: req_add -> blocks_alloc + req_wait_kv -> req_finish(abort, WAITING_FOR_REMOTE_KVS, delay_free, step
    null) -> (a later step) kv_recv_rank and kv_send_rank on the worker -> step_output -> kv_recv_done
    (FINISHED_ABORTED) -> blocks_free(received) + blocks_pool_free (vLLM forgets the request) -> kv_send_done
    (status unknown) -> engine_error (assert req_id in self.requests). Healthy decode requests run beside it."""
    return _abort_both(second_later=False)


def abort_completion_after_free() -> Trace:
    """vllm#46240's second order (comment of 2026-09-09, vLLM 0.28 with MultiConnector(Nixl, LMCacheMP)): as
    `abort_both_completions_same_step`, but the store's completion comes in the update one step after the
    receive's completion freed the request: kv_recv_done -> blocks_free(received) -> (next step) kv_send_rank ->
    step_output -> kv_send_done (unknown) -> engine_error."""
    return _abort_both(second_later=True)


def prefix_fully_cached_waits_forever() -> Trace:
    """vllm PR #54714 (NIXL, decode side): a decode request whose prompt is fully prefix-cached on D (an earlier
    request with the same prompt ran there; its blocks are back in the free queue, still hashed) gets its table
    from the local hit alone, so NIXL has 0 external tokens (a 65-token prompt: 4 full blocks hit, the partial last
    block is recomputed locally) - but the request is still put in WAITING_FOR_REMOTE_KVS, and no read is ever
    started for it (nothing to read, nothing to notify), so nothing ever completes it.

    Order: [chat-a: the same prompt, received, decoded, finished, freed] -> req_add(chat-b, remote_prefill) ->
    blocks_alloc(chat-b, the 4 cached blocks, hit=4, external=0) -> req_wait_kv(chat-b, blocks [], n=0) -> other
    requests arrive, receive, decode and finish over ~40 s -> the engine steps idly (waiting_kv=1) for ~50 s more;
    no kv_recv_rank / kv_recv_done / kv_recv_fail for chat-b, which holds its 4 blocks to the end."""
    b = builder()
    d = Sim(b, "decode-0", "decode", 2000, kv_role="kv_consumer", num_blocks=1024)
    a = d.add_req(Req("chat-a", "D", prompt=65, out=6, remote_req="chat-a-p"))
    drain(d)
    cached = _last_table(d, a.name)[:4]                      # chat-a's first 4 blocks: full, hashed, free
    b.advance(2 * S)
    d.add_req(Req("chat-b", "D", prompt=65, hit=cached, external=0, recv_after=None, remote_req="chat-b-p"))
    d.run(1)
    for wave in range(8):
        d.run(30, arrivals={0: decoders(f"w{wave}-", 2, out=20)}, gap_ns=int(0.1 * S))
        b.advance(2 * S)
    d.idle(50)
    return b.trace()


def _last_table(sim: Sim, req: str) -> list[int]:
    """The blocks `req` freed last (from the rows written so far)."""
    for row in reversed(sim.b.rows):
        if row["kind"] == "blocks_free" and row.get("req") == req and row["instance"] == sim.instance:
            return list(row["blocks"])
    return []


def failed_transfer_never_expires() -> Trace:
    """vllm#35943 (vLLM 0.16, MooncakeConnector P/D, open): the decode side's pull of one request's KV fails on the
    worker (`Mooncake transfer failed, ret: -1`, logged), but the failure is not reported (no failed_recving, no
    invalid_block_ids) and D has no pull timeout (its expiry defaults to infinity), so the request stays in
    WAITING_FOR_REMOTE_KVS holding its blocks; HBM leaks as such requests pile up. P's send expiry
    (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s) frees P's copy: its worker reports the expired request as sent.

    Two instances. Order: P: req_add(remote_decode) -> prefill -> req_finish(length, delay_free) ... 480 s of idle
    steps (a pending send keeps P stepping) -> kv_expire + kv_send_rank (tp0) -> kv_send_done -> blocks_free(sent).
    D: req_add(remote_prefill, remote_req = P's id) -> blocks_alloc + req_wait_kv -> (no row for the failed pull)
    ... other requests come and go ... D steps idly with waiting_kv=1 until the trace ends (~560 s)."""
    b = builder()
    p = Sim(b, "prefill-0", "prefill", 1000, connector="MooncakeConnector", kv_role="kv_producer", num_blocks=2048)
    d = Sim(b, "decode-0", "decode", 2000, connector="MooncakeConnector", kv_role="kv_consumer", num_blocks=2048)
    p.run(4, arrivals={0: prefills("req-b", 2, send_after=2)})
    d.run(6, arrivals={0: decoders("req-b", 2, out=12)})
    p.add_req(Req("req-35943-p", "P", prompt=256, send_after=None))
    p.step()                                                # prefill + finish with delay_free
    d.add_req(Req("req-35943-d", "D", prompt=256, recv_after=None, remote_req="req-35943-p"))
    d.step()                                                # waits; the pull later fails silently
    for wave in range(4):
        p.run(4, arrivals={0: prefills(f"req-w{wave}-", 2, send_after=2)})
        d.run(20, arrivals={0: decoders(f"req-w{wave}-", 2, out=16)}, gap_ns=int(0.05 * S))
        b.advance(5 * S)
    start = b.now
    # both engines keep stepping (a pending send on P, a KV wait on D); written one after the other by time
    t_expire = _finish_ts(b, "prefill-0", "req-35943-p") + 480 * S
    _idle_pair(p, d, until=t_expire)
    k = p.schedule()
    p.rank("kv_expire", "req-35943-p", k, detail={"timeout_s": 480})
    p.rank("kv_send_rank", "req-35943-p", k)
    p.update()
    p.ev("kv_send_done", step=k, req="req-35943-p", status="FINISHED_LENGTH_CAPPED")
    p.free_req(p.reqs["req-35943-p"], "sent", step=k)
    p.reqs["req-35943-p"].state = "done"
    d.idle(60)
    assert b.now - start > 400 * S
    return b.trace()


def _finish_ts(b, instance: str, req: str) -> int:
    return next(row["ts_ns"] for row in b.rows if row["kind"] == "req_finish" and row["req"] == req
                and row["instance"] == instance)


def _idle_pair(a: Sim, c: Sim, until: int, chunk_s: float = 5.0) -> None:
    """Two engines stepping idly side by side until `until` (chunks alternate so both writers' ts stay close)."""
    b = a.b
    while b.now < until:
        span = min(chunk_s, (until - b.now) / S)
        t0 = b.now
        a.idle(span)
        b.now = t0
        c.idle(span)
        b.now = max(b.now, t0 + int(span * S))


def notification_with_peer_request_id() -> Trace:
    """vllm PR #36958 (closed; same fix #40449, reverted by #40731, restored by #41975 for #41974): NIXL with an MLA
    model and prefill TP > decode TP (P TP=2, D TP=1). D reads the (replicated) MLA KV from P's rank 0 only and
    notifies P's other ranks that the read is done, but builds that notification from its own request id instead
    of P's (`meta.remote.request_id`); ids differ since vLLM 0.14 (random suffixes). P rank 1 gets a notification
    for an id it does not know and drops it ("Potentially invalid KV blocks for unrecognized request", no row), so
    the aggregated finished_sending needs a report rank 1 never makes: P's request, finished with delay_free, is not
    freed until rank 1's abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s in vLLM 0.18) expires its send.

    Order: P: req_add(remote_decode) -> prefill -> req_finish(length, delay_free); D: req_add(remote_req = P's id)
    -> req_wait_kv -> remote_read(P's blocks) -> kv_recv_rank -> kv_recv_done -> decode -> finish; P: kv_send_rank
    (tp0 only, P's id) ... idle steps ... 480 s after the finish: kv_expire + kv_send_rank (tp1) -> kv_send_done
    -> blocks_free(sent). Healthy P/D pairs before it complete on both P ranks. Recorded on vLLM 0.18.0."""
    b = builder()
    p = Sim(b, "prefill-0", "prefill", 1000, kv_role="kv_producer", tp=2, version="0.18.0", num_blocks=4096)
    d = Sim(b, "decode-0", "decode", 2000, kv_role="kv_consumer", version="0.18.0", num_blocks=4096)
    # healthy pairs: the notification reaches both P ranks (a request whose D id P knows: bidirectional lookups)
    p.run(4, arrivals={0: prefills("cmpl-ok", 2, send_after=2)})
    d.run(8, arrivals={0: [Req(f"cmpl-ok{i}-d", "D", prompt=96 + 16 * i, out=8, remote_req=f"cmpl-ok{i}")
                           for i in range(2)]})
    pr = p.add_req(Req("cmpl-36958-8f2a", "P", prompt=512, send_after=None))
    p.step()
    dr = d.add_req(Req("cmpl-36958-c41d", "D", prompt=512, out=12, recv_after=2, remote_req=pr.name))
    d.step()
    d.ev("remote_read", component="connector", pid=d.wpid(), pp_rank=0, tp_rank=0, req=dr.name,
         blocks=list(pr.blocks), detail={"remote_instance": "prefill-0"})
    k = p.schedule()
    p.rank("kv_send_rank", pr.name, k, tp_rank=0)            # rank 0: D's read notification names P's id
    p.update()
    drain(d)
    # vLLM 0.18 does not step for a pending send alone (the engine core sleeps between requests), so rank 1's
    # timeout is checked in the steps of later traffic: a few requests every ~20 s (their D is another instance)
    t_expire = _finish_ts(b, "prefill-0", pr.name) + 480 * S
    wave = 0
    while b.now < t_expire:
        p.run(4, arrivals={0: prefills(f"cmpl-w{wave}-", 2, send_after=2)})
        b.advance(20 * S)
        wave += 1
    p.add_req(Req("cmpl-next", "P", prompt=128, send_after=2))
    k = p.schedule()
    p.rank("kv_expire", pr.name, k, tp_rank=1, detail={"timeout_s": 480})
    p.rank("kv_send_rank", pr.name, k, tp_rank=1)
    p.update()
    p.ev("kv_send_done", step=k, req=pr.name, status="FINISHED_LENGTH_CAPPED", detail={"expected_ranks": 2})
    p.free_req(pr, "sent", step=k)
    pr.state = "done"
    drain(p)
    return b.trace()


def decode_counts_notifications_never_arriving() -> Trace:
    """vllm#48633 row C2, PR #50754 (open; NixlPushConnector): in push mode the prefill side writes KV straight
    into the decode side's blocks and D knows it has everything by counting the write notifications per rank. P's
    TP=2 workers: one could not post its writes (logged, nothing sent), so D's rank 1 never counts to its total
    while D's rank 0 does. The aggregated finished_recving needs both ranks: the request hangs in
    WAITING_FOR_REMOTE_KVS holding its blocks over a half-written cache (until a lease would expire, not within
    this trace).

    Order: D (TP=2): req_add(remote_prefill) -> blocks_alloc + req_wait_kv -> kv_recv_rank(tp0) -> nothing from
    tp1, no kv_recv_done -> healthy requests keep being received on both ranks, decode and finish for ~150 s ->
    the engine steps idly with waiting_kv=1 to the end (~210 s)."""
    b = builder()
    d = Sim(b, "decode-0", "decode", 2000, connector="NixlPushConnector", kv_role="kv_consumer", tp=2,
            num_blocks=2048)
    d.run(10, arrivals={0: decoders("push-", 3, out=10)})
    r = d.add_req(Req("push-48633", "D", prompt=300, recv_after=None, remote_req="push-48633-p"))
    d.step()
    k = d.schedule()
    d.rank("kv_recv_rank", r.name, k, tp_rank=0)              # rank 0 counted all its notifications
    d.update()
    for wave in range(10):
        d.run(25, arrivals={0: decoders(f"pw{wave}-", 2, out=16)}, gap_ns=int(0.1 * S))
        b.advance(10 * S)
    d.idle(60)
    return b.trace()


def engine_idle_with_pending_frees() -> Trace:
    """vllm PR #41180 (closed; the keep-alive landed as #43433 in 0.22): on a prefill engine of vLLM <= 0.21,
    `has_finished_requests` counts only `finished_req_ids`, so once the last request has finished (with
    delay_free, for D's read) and the one step that carries its finished id has run, the engine core sleeps on its
    input queue: no more schedule(), no execute_model, so the workers' get_finished is never polled again. Here P
    is TP=2: in that last step rank 0 already had D's read notification and reported finished_sending, rank 1's
    arrived just after its get_finished; the aggregated kv_send_done never comes and the blocks stay held (the
    PR's symptom: reset_prefix_cache fails; KV usage never returns to 0). NIXL's abort timeout is checked only
    inside get_finished, so it never fires either.

    Order: P (TP=2, vLLM 0.21.0): healthy requests send and free on both ranks -> last request: req_add ->
    prefill -> req_finish(length, delay_free) -> one empty step: kv_send_rank(tp0) only -> P writes nothing more.
    D: reads it promptly (kv_recv_done), decodes and finishes; D's other requests keep it busy for ~60 s."""
    b = builder()
    p = Sim(b, "prefill-0", "prefill", 1000, kv_role="kv_producer", tp=2, version="0.21.0", num_blocks=2048)
    d = Sim(b, "decode-0", "decode", 2000, kv_role="kv_consumer", version="0.21.0", num_blocks=2048)
    p.run(6, arrivals={0: prefills("req-", 3, send_after=2)})
    d.run(8, arrivals={0: [Req(f"req-{i}-d", "D", prompt=96 + 16 * i, out=10, remote_req=f"req-{i}")
                           for i in range(3)]})
    last = p.add_req(Req("req-last", "P", prompt=200, send_after=None))
    p.step()                                                 # prefill; finished with delay_free at its update
    k = p.schedule()                                         # the step that carries finished_req_ids
    p.rank("kv_send_rank", last.name, k, tp_rank=0)
    p.update()
    # P's engine core now sleeps on its input queue: no more P rows.
    d.add_req(Req("req-last-d", "D", prompt=200, out=30, recv_after=1, remote_req=last.name))
    d.run(2)
    for wave in range(6):
        d.run(25, arrivals={0: decoders(f"dw{wave}-", 2, out=16)}, gap_ns=int(0.1 * S))
        b.advance(6 * S)
    drain(d)
    return b.trace()


def engine_idle_with_deferred_frees() -> Trace:
    """Variant of `engine_idle_with_pending_frees` for vLLM 0.33's deferred frees (defer_block_free: a KV consumer
    with more than one batch in flight, here PP=2). Parked frees drain only in the update of a *non-empty* step
    (docs/trace-format.md, step_output). The last request, in step k, finishes at step k's update while step k+1
    is in flight (empty: with PP=2 a request is never in two micro-batches at once), so its free is parked with
    fence k+1; step k+1's update is empty and drains nothing; the engine then has no request and sleeps, so the
    blocks stay parked (not in the free queue) until some later request's non-empty step - the same symptom as
    PR #41180 (reset_prefix_cache fails, KV usage stays above 0). Derived from the documented drain rule, not a
    filed issue.

    Order: D (PP=2, defer_block_free): healthy requests finish with deferred frees that drain -> last request:
    ... req_sched(k) -> sched(k+1, 0 tokens) -> step_output(k) -> blocks_free(deferred, fence k+1) -> req_finish ->
    step_output(k+1) -> nothing more (no blocks_pool_free for those blocks)."""
    b = builder()
    d = Sim(b, "decode-0", "decode", 2000, kv_role="kv_consumer", pp=2, defer_block_free=True, num_blocks=1024)
    reqs = decoders("pp-", 3, out=6) + [Req("pp-last", "D", prompt=70, out=9, recv_after=4)]
    for r in reqs:
        d.add_req(r)
    for _ in range(200):                                      # two micro-batches in flight
        if not d.busy() and not d.in_flight:
            break
        if d.busy():
            d.schedule()
        if len(d.in_flight) >= 2 or not d.busy():
            d.update()
    while d.in_flight:
        d.update()
    b.advance(30 * S)                                         # the engine sleeps: nothing recorded
    return b.trace()


def offload_store_before_load_filled() -> Trace:
    """vllm PR #35092 (closed; issue #34526): MultiConnector(NixlConnector, OffloadingConnector) on the decode
    side. MultiConnector loads from one child only (NIXL, which has the remote KV) but stores through all of them,
    and the OffloadingConnector's store of the request's blocks is scheduled before NIXL has filled them, so it
    copies blocks the load has not written yet (garbage later reloaded from CPU by a prefix hit).

    vLLM's OffloadingConnector itself reports a request's stores (finished_sending) only once the request has
    finished, so a 0.33 recording shows no row for the early store; this trace renders the connector reporting the
    store's completion per request, as the brief of this file asked: the store completes on the worker
    (kv_send_rank) and at the scheduler (kv_send_done, status WAITING_FOR_REMOTE_KVS) while the NIXL load is open,
    before its kv_recv_done. vLLM 0.33 then calls _free_blocks on a request that is not finished and dies on
    `assert request.is_finished()` (scheduler.py:3065).

    Order: req_add(remote_prefill) -> blocks_alloc + req_wait_kv -> kv_send_rank -> step_output -> kv_send_done
    (WAITING_FOR_REMOTE_KVS) -> engine_error."""
    b = builder()
    d = Sim(b, "decode-0", "decode", 2000, connector="MultiConnector(NixlConnector,OffloadingConnector)",
            kv_role="kv_both", num_blocks=1024)
    d.run(5, arrivals={0: decoders("off-", 2, out=12)})
    r = d.add_req(Req("off-35092", "D", prompt=160, recv_after=None, remote_req="off-35092-p"))
    d.step()
    k = d.schedule()
    d.rank("kv_send_rank", r.name, k)
    d.update()
    d.ev("kv_send_done", step=k, req=r.name, status="WAITING_FOR_REMOTE_KVS")
    engine_error(d, k, "AssertionError: assert request.is_finished() (scheduler.py:_free_blocks)")
    return b.trace()


def admission_deadlock() -> Trace:
    """vllm#53130 (open; also #45387/#45388 with an offloading connector; fixes proposed in PR #54348, #57104):
    requests held aside in `skipped_waiting` (WAITING_FOR_REMOTE_KVS, shown as "deferred") count against
    max_num_seqs together with the running ones. Once running + deferred reaches max_num_seqs the admission loop
    stops before it reaches them, so even after their loads complete they are never promoted; the running requests
    finish, nothing else is admitted, and the engine stays up (health 200) with Running 0, Waiting N, KV cache
    mostly free, 0 tokens per step, until a restart.

    Order (max_num_seqs=8): 2 requests run; 6 decode requests arrive, wait for remote KV, and their loads complete
    (kv_recv_done) -> the 2 running finish -> 3 plain requests arrive -> from then on every schedule() has 0
    tokens (sched detail running=0, waiting=9, waiting_kv=6, free_blocks ~1000 of 1024) for ~60 s of idle
    stepping (coalesced runs, ~60k steps); none of the 9 is ever scheduled."""
    b = builder()
    d = Sim(b, "decode-0", "decode", 2000, kv_role="kv_consumer", num_blocks=1024, max_num_seqs=8)
    d.run(3, arrivals={0: decoders("run-", 2, out=40)})
    d.run(1, arrivals={0: [Req(f"dq-{i}", "D", prompt=128, out=16, recv_after=3) for i in range(6)]})
    # 2 running + 6 deferred = max_num_seqs: the admission loop stops before it reaches any waiting request, the
    # received ones included (their kv_recv_done comes, their promotion never does)
    d.admit = False
    while d.live("running"):
        d.step()
    for i in range(3):
        d.add_req(Req(f"q-{i}", "L", prompt=200, out=30))
    d.idle(60)
    return b.trace()


def double_allocation() -> Trace:
    """An undescribed class (a block-pool corruption: a block id in the free queue while a request still owns it).
    `a` owns blocks [5, 6, 7] and keeps decoding; `b` is admitted and the pool hands it a fresh block (not a prefix
    hit: blocks_alloc detail hit=0) that is block 7, which `a` never freed. Both write it, both finish.

    Order: blocks_alloc(a, [5, 6, 7]) ... blocks_alloc(b, [7, 12], hit=0) while a is RUNNING -> req_sched(a),
    req_sched(b) in the same steps -> a finishes: blocks_free(a, [5, 6, 7]) -> b finishes: blocks_free(b, [7, 12]).
    Healthy requests run beside them."""
    b = builder()
    e = Sim(b, "engine-0", "both", 3000, connector=None, num_blocks=64)
    e.pool = deque([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14] + list(range(15, 64)))
    e.add_req(Req("x", "L", prompt=64, out=20))                  # 1-4 (+ a decode block later)
    ra = e.add_req(Req("a", "L", prompt=40, out=30))             # 5, 6, 7
    e.run(4)
    # the corruption: block 7 is back at the head of the free queue although `a` holds it
    assert ra.blocks[:3] == [5, 6, 7], ra.blocks
    e.pool.appendleft(7)
    e.ref[7] = 0
    e.add_req(Req("b", "L", prompt=20, out=12))               # gets [7, <next free>], hit=0
    e.run(6, arrivals={2: [Req("y", "L", prompt=30, out=8)]})
    drain(e)
    return b.trace()


# == healthy controls: suspicious-looking, correct vLLM behaviour ==================================================
def healthy_legal_abort_during_transfer() -> Trace:
    """vLLM 0.16+ (finish_requests' delay_free_blocks; scheduler.py `_update_from_kv_xfer_finished`): the decode
    side aborts a request while NIXL is still reading its KV. vLLM keeps the blocks (the read may still write
    them) and frees them when the read completes. Order: req_wait_kv -> req_finish(abort, WAITING_FOR_REMOTE_KVS,
    delay_free, step null) -> (2 steps later) kv_recv_rank -> step_output -> kv_recv_done(FINISHED_ABORTED) ->
    blocks_free(received) + blocks_pool_free. Healthy requests before and after."""
    b = builder()
    d = Sim(b, "decode-0", "decode", 2000, kv_role="kv_consumer", num_blocks=1024)
    d.run(4, arrivals={0: decoders("ok-", 2, out=10)})
    r = d.add_req(Req("abort-me", "D", prompt=192, recv_after=None, remote_req="abort-me-p"))
    d.step()
    d.step()
    d._current = None
    d.ev("req_finish", req=r.name, reason="abort", status="WAITING_FOR_REMOTE_KVS", delay_free=True)
    r.state = "aborted"
    d.step()
    k = d.schedule()
    d.rank("kv_recv_rank", r.name, k)
    d.update()
    d.ev("kv_recv_done", step=k, req=r.name, status="FINISHED_ABORTED")
    d.free_req(r, "received", step=k)
    d.run(10, arrivals={2: decoders("after-", 2, out=8)})
    drain(d)
    return b.trace()


def healthy_long_prefix_hit() -> Trace:
    """A system prompt's 4 blocks, computed by the first request, are prefix-cache hits (blocks_alloc detail hit=4)
    for every later request over ~90 s; the requests overlap, so the blocks have 1 to 3 owners at a time and reach
    the pool (blocks_pool_free) only when the last owner frees, then are revived by the next hit. Local engine, no
    connector."""
    b = builder()
    e = Sim(b, "engine-0", "both", 3000, connector=None, num_blocks=512)
    first = e.add_req(Req("sys-0", "L", prompt=64 + 20, out=40))
    e.step()
    shared = list(first.blocks[:4])
    for i in range(1, 24):
        e.add_req(Req(f"sys-{i}", "L", prompt=64 + 8 * (i % 5) + 4, out=30 + (i % 4) * 10, hit=shared))
        e.run(12, gap_ns=int(0.3 * S))
    drain(e, gap_ns=int(0.3 * S))
    return b.trace()


def healthy_small_kv_preempt_queue() -> Trace:
    """A small KV pool (24 blocks): the running requests outgrow it, vLLM preempts the newest running request
    (req_preempt, blocks_free reason preempted, back to the waiting queue), resumes it when blocks are free again
    (recomputing its prompt), and every request finishes."""
    b = builder()
    e = Sim(b, "engine-0", "both", 3000, connector=None, num_blocks=24)
    for i in range(4):
        e.add_req(Req(f"s{i}", "L", prompt=64, out=60))
    for _ in range(600):
        if not e.busy():
            break
        running = e.live("running")
        growing = [r for r in running if r.computed >= r.prompt and (r.computed + 1) > len(r.blocks) * BLOCK]
        preempt: list[str] = []
        if growing and e.free_blocks() < len(growing):
            preempt = [running[-1].name]                    # newest running request (FCFS policy)
        waiting = e.live("waiting")
        hold = {r.name for r in waiting if math.ceil(r.prompt / BLOCK) + 1 > e.free_blocks()}
        if preempt:
            hold |= set(preempt)
        e.step(preempt=preempt, hold=hold)
    return b.trace()


def healthy_async_optimistic() -> Trace:
    """Async scheduling (vLLM 0.33, no connector): step k+1 is scheduled (and submitted: step_submit n=2) before
    step k's output comes back, so a request is scheduled optimistically for a token not yet sampled; when step
    k's output finishes a request, its free is immediate (same CUDA stream, no connector: nothing else writes the
    blocks) although step k+1, still in flight, holds it - vLLM drops that step's output for it."""
    b = builder()
    e = Sim(b, "engine-0", "both", 3000, connector=None, num_blocks=256, async_scheduling=True)
    for i in range(4):
        e.add_req(Req(f"as{i}", "L", prompt=48 + 16 * i, out=12 + 3 * i))
    e.schedule()
    for _ in range(200):
        if not e.busy():
            break
        for r in e.live("running"):
            r.in_step = None if r.in_step is not None and r.in_step < e.next_step - 1 else r.in_step
        _schedule_optimistic(e)
        e.update()
    while e.in_flight:
        e.update()
    return b.trace()


def _schedule_optimistic(e: Sim) -> None:
    """Async scheduling: a running request is scheduled again while its previous step is in flight."""
    for r in e.live("running"):
        r.in_step = None
    e.schedule()


def healthy_slow_but_completes() -> Trace:
    """A P/D transfer that takes 100 s (a congested link) but completes: P holds the request's blocks with
    delay_free for 100 s (D's heartbeats renew NIXL's lease while it waits), D waits in WAITING_FOR_REMOTE_KVS for
    100 s, then kv_recv_done, decode, finish; P's kv_send_done frees its blocks. Both engines step idly meanwhile
    (a pending send / a KV wait), other requests come and go."""
    b = builder()
    p = Sim(b, "prefill-0", "prefill", 1000, kv_role="kv_producer", num_blocks=2048)
    d = Sim(b, "decode-0", "decode", 2000, kv_role="kv_consumer", num_blocks=2048)
    p.run(4, arrivals={0: prefills("fast-", 2, send_after=2)})
    d.run(8, arrivals={0: [Req(f"fast-{i}-d", "D", prompt=96 + 16 * i, out=8, remote_req=f"fast-{i}")
                           for i in range(2)]})
    pr = p.add_req(Req("slow-p", "P", prompt=1024, send_after=None))
    p.step()
    dr = d.add_req(Req("slow-d", "D", prompt=1024, out=20, recv_after=None, remote_req="slow-p"))
    d.step()
    d.ev("remote_read", component="connector", pid=d.wpid(), pp_rank=0, tp_rank=0, req=dr.name,
         blocks=list(pr.blocks), detail={"remote_instance": "prefill-0"})
    for wave in range(4):
        p.run(4, arrivals={0: prefills(f"mid{wave}-", 1, send_after=2)})
        d.run(12, arrivals={0: [Req(f"mid{wave}-0-d", "D", prompt=96, out=8, remote_req=f"mid{wave}-0")]})
        b.advance(2 * S)
    _idle_pair(p, d, until=_finish_ts(b, "prefill-0", "slow-p") + 100 * S)
    k = d.schedule()
    d.rank("kv_recv_rank", dr.name, k)
    d.update()
    d.ev("kv_recv_done", step=k, req=dr.name, status="WAITING_FOR_REMOTE_KVS")
    dr.state = "ready"
    k = p.schedule()
    p.rank("kv_send_rank", pr.name, k)
    p.update()
    p.ev("kv_send_done", step=k, req=pr.name, status="FINISHED_LENGTH_CAPPED")
    p.free_req(pr, "sent", step=k)
    pr.state = "done"
    drain(d)
    drain(p)
    return b.trace()


INCIDENTS: dict[str, tuple[Callable[[], Trace], str, str, str]] = {
    "abort_both_completions_same_step": (
        abort_both_completions_same_step, "decode-0", "cmpl-46240-0",
        "vllm#46240/#43226: aborted request's recv and send completions in one step; the second asserts"),
    "abort_completion_after_free": (
        abort_completion_after_free, "decode-0", "cmpl-46240-0",
        "vllm#46240: the store's completion arrives one step after the receive freed the request; asserts"),
    "prefix_fully_cached_waits_forever": (
        prefix_fully_cached_waits_forever, "decode-0", "chat-b",
        "vllm PR #54714: full local prefix hit, 0 external tokens, waits for remote KV forever"),
    "failed_transfer_never_expires": (
        failed_transfer_never_expires, "decode-0", "req-35943-d",
        "vllm#35943 (Mooncake): failed pull never reported, D waits forever; P expires its send at 480 s"),
    "notification_with_peer_request_id": (
        notification_with_peer_request_id, "prefill-0", "cmpl-36958-8f2a",
        "vllm PR #36958 (MLA, P TP > D TP): rank 1 notified with D's id, P's blocks held until the 480 s timeout"),
    "decode_counts_notifications_never_arriving": (
        decode_counts_notifications_never_arriving, "decode-0", "push-48633",
        "vllm#48633 C2 / PR #50754 (NIXL push): one D rank never gets its notifications, no kv_recv_done"),
    "engine_idle_with_pending_frees": (
        engine_idle_with_pending_frees, "prefill-0", "req-last",
        "vllm PR #41180 (<= 0.21): P engine sleeps with a delayed free pending; tp1's send report never polled"),
    "engine_idle_with_deferred_frees": (
        engine_idle_with_deferred_frees, "decode-0", "pp-last",
        "deferred free fenced on an empty step never drains once the engine goes idle (derived, PP=2)"),
    "offload_store_before_load_filled": (
        offload_store_before_load_filled, "decode-0", "off-35092",
        "vllm PR #35092: offloading store of a request's blocks completes while NIXL's load is still open"),
    "admission_deadlock": (
        admission_deadlock, "decode-0", "dq-0",
        "vllm#53130: running + deferred == max_num_seqs; nothing admitted, 0 tokens per step, KV mostly free"),
    "double_allocation": (
        double_allocation, "engine-0", "b",
        "block 7 handed to b as a new block (hit=0) while a still owns it"),
}

CONTROLS: dict[str, Callable[[], Trace]] = {
    "healthy_legal_abort_during_transfer": healthy_legal_abort_during_transfer,
    "healthy_long_prefix_hit": healthy_long_prefix_hit,
    "healthy_small_kv_preempt_queue": healthy_small_kv_preempt_queue,
    "healthy_async_optimistic": healthy_async_optimistic,
    "healthy_slow_but_completes": healthy_slow_but_completes,
}


if __name__ == "__main__":
    from pdtrace.trace.validate import validate_table

    for name, fn in [(n, v[0]) for n, v in INCIDENTS.items()] + list(CONTROLS.items()):
        trace = fn()
        notes = validate_table(trace.table, where=name)
        span = (trace.table.column("ts_ns").to_numpy().max() - trace.table.column("ts_ns").to_numpy().min()) / 1e9
        print(f"{name:45s} {len(trace):7d} rows {span:8.1f} s  notes={notes}")
