"""The KV lifecycle model: vLLM's shadow state of every request, block, transfer and step, checked on every event.

memcheck does not know bug classes: it keeps a shadow state of every byte and reports any access the state forbids.
This module is that core for pdtrace. It replays the lifecycle events of each scheduler (instance, dp_rank) in the
global order and applies each to a model of what vLLM holds; an event the state forbids, or a state that never
resolves, is a `Violation` whether or not any rule knows its class. docs/lifecycle.md is the model as a table (each
transition and invariant with the vLLM file and function it comes from); `pdtrace.analysis.rules.lifecycle` turns
the violations into findings, reported only where no other rule explains them (`Rule.fallback`).

State (per scheduler):
- request (one lifetime, `columns.rk`): vLLM's RequestStatus as the events imply it (WAITING after `req_add`,
  WAITING_FOR_REMOTE_KVS from `req_wait_kv` until its receive completes, RUNNING once `schedule()` allocates for it
  or schedules it, PREEMPTED, FINISHED), its open receive and the blocks it fills, its pending send (finished with
  delay_free), the ranks that reported its transfer (`kv_<dir>_rank`), whether vLLM has forgotten it (its final
  free), and a short history (the rows that made its state) for the evidence;
- block: its holders, `blocks.ownership`'s intervals (request, block, from its allocation to its free; a prefix-cache
  hit shares a block, so the reference count is the number of open intervals);
- scheduler: whether its engine failed, its runs of empty steps with requests waiting (an admission stall).

Algorithm, in three parts:
1. requests: one pass over the request events in the global order (`columns.pos`), gathered once as Python lists;
   the high-volume rows that change no request state are left out (`req_sched`, `exec_*`, `batch_*`, and the
   allocations after a request's first one while it runs: `_loop_rows`); a preemption is judged against the
   request's last `req_sched` (`last_sched_before`); `detail` is parsed only for `engine_error` rows;
2. blocks: vectorised over the ownership intervals sorted by (pool block, allocation), with a running maximum of
   the intervals' ends (`_block_violations`); `detail` is parsed only where two requests hold one block;
3. what never resolved, at the end: admission stalls over the `sched` rows (only empty steps' details parsed), and
   transfers every rank reported that the scheduler never processed, or whose ranks disagree (`_unresolved`).

A trace that starts mid-run (`history.trace_window`): a request first seen without `req_add`, or a block first
seen without an allocation, is adopted with the state its first event implies, and nothing is reported about
what only history before the window could explain; `history.window_findings` downgrades the rest as for every
rule.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.analysis.blocks import pool_block_key, ownership
from pdtrace.analysis.columns import columns, last_before, last_per_key, next_at_or_after, order_by_key
from pdtrace.analysis.history import trace_window
from pdtrace.analysis.parallel import shared_table
from pdtrace.analysis.requests import last_sched_before, request_state
from pdtrace.analysis.rulekit import engine_configs, expected_ranks, gaps

#: kinds the model replays (the others change no KV state)
MODEL_KINDS = ("req_add", "req_wait_kv", "req_preempt", "req_finish", "blocks_alloc", "blocks_free",
               "blocks_pool_free", "kv_send_done", "kv_recv_done", "kv_recv_fail", "kv_expire", "kv_send_rank",
               "kv_recv_rank", "engine_error", "kv_recv_dest")

WAITING, WAITING_KV, RUNNING, PREEMPTED, FINISHED = ("WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED",
                                                    "FINISHED")

#: Each invariant: (severity, what vLLM does about it). `error` where vLLM itself asserts it (the engine dies, or
#: would die with the check compiled in); `warning` where it is a contract no assert guards. The vLLM places are
#: those of 0.33.0's `vllm/v1/...` (docs/lifecycle.md has the table per release range).
INVARIANTS: dict[str, tuple[str, str]] = {
    "add_while_live": ("warning", "a request id added again while its earlier request is still live "
                                  "(vLLM keys requests by id: `Scheduler.requests[request_id]`)"),
    "event_before_add": ("warning", "a scheduler event for a request the scheduler was never given "
                                    "(`Scheduler.add_request` comes first)"),
    "alloc_owned_block": ("error", "a block handed out as a new block while another request still owns it "
                                   "(`BlockPool.get_new_blocks` asserts `block.ref_cnt == 0`)"),
    "alloc_after_finish": ("warning", "blocks allocated to a finished request (`allocate_slots` runs only for "
                                      "requests being scheduled)"),
    "block_listed_twice": ("error", "one allocation or free lists the same block twice (`get_new_blocks` hands "
                                    "out distinct blocks; `BlockPool.free_blocks` would drop two references and "
                                    "queue the block twice, so two requests get it)"),
    "free_not_returned": ("error", "a block its last owner gave up never reached the free queue, or was handed out "
                                   "again before it did (`BlockPool.free_blocks` queues every block whose ref_cnt "
                                   "reaches 0): the pool lost it"),
    "preempt_kept_blocks": ("error", "a preempted request kept blocks it held (`_preempt_request` frees them with "
                                     "`kv_cache_manager.free`): they stay out of the pool while it waits, and its "
                                     "resumption allocates over them"),
    "decode_on_failed_load": ("error", "a request whose KV load failed (`kv_recv_fail`: its blocks invalid) is "
                                       "scheduled as if the KV were there: its next step computes fewer tokens than "
                                       "the blocks the load failed to fill (vLLM recomputes from the first invalid "
                                       "block, or fails the request: `_handle_invalid_blocks`)"),
    "hit_misplaced": ("error", "a prefix-cache hit handed a block at another place of the table than the one it "
                               "held when its KV was written (a block's hash chains its whole prefix, so a hit sits "
                               "where it was computed): the request reads another prefix's KV"),
    "tokens_over_capacity": ("warning", "a request scheduled past the slots its block table holds: its computed "
                                      "tokens (scheduled, loaded from a peer, prefix hits) exceed its blocks x "
                                      "block_size (`allocate_slots` allocates every slot a step computes)"),
    "read_unwritten_kv": ("warning", "a step reads KV nothing wrote: the request's table opens (its admission, or "
                                     "its resumption after a preemption, which freed its blocks) with more computed "
                                     "tokens (`num_computed_tokens`, where its scheduled tokens start) than its "
                                     "prefix-cache hits and a connector's load put in its blocks (vLLM's "
                                     "`_preempt_request` resets the count to 0, an admission sets it to local hit "
                                     "+ external tokens; no assert checks it: the step attends to garbage)"),
    "recv_into_shared": ("warning", "a KV load writes blocks its request does not hold as its own fresh blocks: "
                                    "its destination (the connector's, e.g. NIXL's `_reqs_need_recv`) lies outside "
                                    "the blocks the request waits with (`req_wait_kv`: allocated past its prefix-"
                                    "cache hits), so the read overwrites hashed, shared prefix blocks other "
                                    "requests read, or blocks it does not own (NIXL's `update_state_after_alloc` "
                                    "takes `get_unhashed_block_ids`; no assert checks it)"),
    "pool_free_while_owned": ("warning", "a block back in the free queue while a request still owns it "
                                         "(`BlockPool.free_blocks` queues a block only at ref_cnt 0)"),
    "free_not_owned": ("error", "a request gives up a block it does not own (`BlockPool.free_blocks` takes one "
                                "reference per owner)"),
    "preempt_not_running": ("error", "a request preempted while not running (`Scheduler._preempt_request` "
                                     "asserts `request.status == RequestStatus.RUNNING`)"),
    "finish_twice": ("warning", "a request finished twice (`finish_requests` skips finished requests; "
                                "`_free_request` runs once)"),
    "wait_twice": ("warning", "a request starts waiting for remote KV while its receive is already open"),
    "wait_without_transfer": ("warning", "a request waits for remote KV with no external token to load, so no "
                                         "transfer will ever complete its wait (`load_kv_async` with "
                                         "`num_external_computed_tokens == 0`)"),
    "completion_unknown": ("error", "a transfer completion for an id the scheduler never had "
                                    "(`_update_from_kv_xfer_finished` asserts `req_id in self.requests`)"),
    "completion_after_free": ("error", "a transfer completion after the request's final free "
                                       "(`_update_from_kv_xfer_finished` asserts `req_id in self.requests`)"),
    "completion_unfinished": ("error", "a send completion for an unfinished request, or a receive completion "
                                       "for a request neither waiting for it nor finished (`_free_blocks` "
                                       "asserts `request.is_finished()`)"),
    "recv_fail_without_receive": ("warning", "a failed load reported for a request with no receive open"),
    "read_before_filled": ("warning", "a send or store of a request's blocks completed while its receive "
                                      "(the load that fills those blocks) was still open"),
    "completion_not_processed": ("warning", "every rank reported a transfer done, and the scheduler never "
                                            "processed it (`finished_sending` / `finished_recving` never reached "
                                            "`_update_from_kv_xfer_finished`): its blocks stay held"),
    "ranks_disagree": ("warning", "some ranks reported a transfer done long ago and the others never did: the "
                                  "aggregated completion cannot come, the blocks stay held"),
    "engine_assert": ("error", "the engine died on one of vLLM's own consistency checks (an AssertionError or "
                               "KeyError escaped `EngineCore.step` or the handling of client input)"),
    "send_expired": ("warning", "a finished request's send ended by its timeout with no rank ever reporting it: "
                                "the peer never read the blocks, which stayed held for the whole timeout"),
    "admission_stall": ("warning", "nothing running, most of the KV cache free, requests waiting, and the "
                                   "scheduler schedules nothing for many steps"),
}

#: exception types of an `engine_error` that are vLLM's own consistency checks failing (not a dead worker or a
#: client's bad input): the engine died on an invariant of its state
INTERNAL_ERRORS = ("AssertionError", "KeyError")
#: scheduler kinds whose request the scheduler acted on (the subject of an engine error that names none)
_SCHEDULER_KINDS = frozenset({"req_add", "req_wait_kv", "req_preempt", "req_finish", "blocks_alloc", "blocks_free",
                              "kv_send_done", "kv_recv_done", "kv_recv_fail"})

#: free reasons that end a request's life in vLLM (its final free: `_free_blocks` deletes it from `requests`)
FINAL_FREE_REASONS = frozenset({"finished", "aborted", "sent", "received"})
#: an admission stall: at least this many consecutive empty steps over at least this long, with requests waiting,
#: nothing running and at least this share of the pool free
STALL_STEPS = 50
STALL_NS = 5_000_000_000
STALL_FREE_SHARE = 0.5
#: ranks that disagree: the first report at least this long before the end of the trace, the others still silent
DISAGREE_NS = 10_000_000_000
#: a transfer every rank reported is processed by the scheduler's next update: within this time of an idle end
PROCESS_NS = 1_000_000_000
#: the blocks a request fills before its first receive (shared: never changed, only replaced)
_NO_BLOCKS: list[int] = []
#: history rows kept per request for the evidence
HISTORY_ROWS = 12


@dataclass
class Violation:
    """One event the model forbids, or a state that never resolved (row: the row at the end of the trace where it
    is an unresolved state: the last row of the request's history)."""

    invariant: str
    row: int
    sk: int
    rk: int
    blocks: list[int]
    state: str          # the request's (or block's) state before the event, in words
    history: list[int]  # rows that made that state (the request's, then the blocks')
    extra: dict[str, Any] = field(default_factory=dict)


class RequestModel:
    __slots__ = ("status", "recv_open", "send_pending", "forgotten", "finished", "adopted", "history",
                 "send_ranks", "recv_ranks", "first_rank_ts", "last_rank_row", "first_alloc_row",
                 "finish_row", "filling", "skew_reported",
                 "status_pos")

    def __init__(self, status: str, adopted: bool = False) -> None:
        self.status = status
        self.recv_open = False
        self.send_pending = False
        self.forgotten = False
        self.finished = False
        self.adopted = adopted
        self.history: list[int] = []
        # made at a request's first rank report: most requests of a trace never get one, and every container made
        # per request is one more object for the garbage collector to walk
        self.send_ranks: set[tuple[int, int]] | None = None
        self.recv_ranks: set[tuple[int, int]] | None = None
        self.first_rank_ts = -1
        self.last_rank_row = -1
        self.first_alloc_row = -1
        self.finish_row = -1
        self.filling: list[int] = _NO_BLOCKS
        self.skew_reported = False
        self.status_pos = -1

    def note(self, row: int) -> None:
        if len(self.history) < HISTORY_ROWS:
            self.history.append(row)
        else:
            self.history[-1] = row  # keep the first rows (how it began) and the latest

    def describe(self) -> str:
        parts = [self.status if not self.forgotten else "freed (forgotten by the scheduler)"]
        if self.recv_open:
            parts.append("receive open")
        if self.send_pending:
            parts.append("send pending")
        return ", ".join(parts)


@dataclass
class LifecycleModel:
    """The replay's result: the violations in event order, and each request's state at the end of the trace."""

    violations: list[Violation]
    final: dict[int, RequestModel]


@shared_table(ownership, request_state, cost=1.0)
def lifecycle_model(ctx: Any) -> LifecycleModel:
    """The model replayed over the context's trace (built once per analysis)."""
    return ctx.cached("lifecycle.model", lambda: _replay(ctx))


def _replay(ctx: Any) -> LifecycleModel:
    cols = columns(ctx)
    windowed = trace_window(ctx) is not None
    rows = _loop_rows(cols)
    kind_codes, kind_names = cols.codes("kind")
    kinds = [kind_names[c] for c in kind_codes[rows].tolist()]
    sks = cols.sk[rows].tolist()
    rks = cols.rk[rows].tolist()
    ts = cols.ts[rows].tolist()
    pos = cols.pos[rows].tolist()
    n = cols.ints_at("n", rows).tolist()
    reason_codes, reason_names = cols.codes("reason")
    reasons = [reason_names[c] if c >= 0 else None for c in reason_codes[rows].tolist()]
    # delay_free where the recorder left it null: as the connector decides it (requests.request_state)
    delay, delay_valid = cols.bools_at("delay_free", rows)
    implied = request_state(ctx).delay_free[np.maximum(cols.rk[rows], 0)] if cols.n_requests else \
        np.zeros(len(rows), bool)
    delay = np.where(np.asarray(delay_valid, bool), np.asarray(delay, bool), implied).tolist()
    status_codes, status_names = cols.codes("status")
    unknown_status = cols.code_of("status", "unknown")
    # a completion's recorded status other than `unknown` is the scheduler's word that it knows the id
    known_id = ((status_codes[rows] >= 0) & (status_codes[rows] != unknown_status)).tolist()
    pp = cols.ints_at("pp_rank", rows, fill=0).tolist()
    tp = cols.ints_at("tp_rank", rows, fill=0).tolist()
    row_list = rows.tolist()
    # a request is RUNNING from its first schedule after it became WAITING / PREEMPTED: a received request runs on
    # the blocks it waited with (no new allocation), so a preemption is judged against its last req_sched
    preempts = rows[kind_codes[rows] == cols.code_of("kind", "req_preempt")]
    preempts = preempts[cols.rk[preempts] >= 0]
    sched_rows = last_sched_before(ctx, cols.rk[preempts], cols.pos[preempts])
    sched_before = dict(zip(preempts.tolist(), np.where(sched_rows >= 0, cols.pos[np.maximum(sched_rows, 0)],
                                                        -1).tolist()))
    # each row's blocks as a slice of one flat list (block_rows is in row order)
    block_rows, block_ids = cols.block_rows
    b_start = np.searchsorted(block_rows, rows).tolist()
    b_end = np.searchsorted(block_rows, rows, side="right").tolist()
    ids = block_ids.tolist()
    pools = {sk: int(cfg["num_blocks"]) for sk, cfg in engine_configs(ctx).items() if cfg.get("num_blocks")}

    requests: dict[int, RequestModel] = {}
    last_touched: dict[int, int] = {}       # sk -> the request key of its latest scheduler row
    failed: dict[int, int] = {}             # sk -> row of its first engine_error
    out: list[Violation] = []

    def violation(inv: str, i: int, sk: int, rk: int, req: RequestModel | None, blocks: list[int] | None = None,
                  state: str | None = None, **extra: Any) -> None:
        history = list(req.history) if req is not None else []
        out.append(Violation(inv, row_list[i], sk, rk, list(blocks or []),
                             state if state is not None else (req.describe() if req else "unknown to the scheduler"),
                             history, extra))

    def request(i: int, sk: int, rk: int, implied: str) -> RequestModel:
        """The request's model; a request first seen without req_add is adopted in a window, else reported."""
        req = requests.get(rk)
        if req is None:
            req = requests[rk] = RequestModel(implied, adopted=True)
            if not windowed:
                violation("event_before_add", i, sk, rk, None, state="never added")
        return req

    for i, kind in enumerate(kinds):
        sk, rk, row = sks[i], rks[i], row_list[i]
        if kind == "engine_error":
            failed.setdefault(sk, row)
            error = str(cols.details(np.array([row]))[0].get("error") or "")
            if error.startswith(INTERNAL_ERRORS):
                named = _request_named_in(cols, error)
                subject = named if named >= 0 else last_touched.get(sk, -1)
                why = ("the request the error names" if named >= 0 else
                       "the last request the scheduler acted on before the error" if subject >= 0 else None)
                violation("engine_assert", i, sk, subject, requests.get(subject),
                          state=f"the engine raised {error[:200]}", error=error[:500], subject=why)
            continue
        if rk < 0:
            continue
        if kind in _SCHEDULER_KINDS:
            last_touched[sk] = rk
        if kind == "blocks_alloc":
            req = request(i, sk, rk, RUNNING)
            if req.finished and not req.adopted:
                violation("alloc_after_finish", i, sk, rk, req, ids[b_start[i]:b_end[i]])
            if req.status == WAITING or req.status == PREEMPTED:
                req.status = RUNNING
                if req.first_alloc_row < 0:
                    req.first_alloc_row = row
            req.note(row)
            continue
        if kind == "req_add":
            req = requests.get(rk)
            if req is not None and not req.finished and not req.adopted:
                violation("add_while_live", i, sk, rk, req)
            req = requests[rk] = RequestModel(WAITING)
            req.status_pos = pos[i]
            req.history.append(row)
            continue
        if kind == "req_wait_kv":
            req = request(i, sk, rk, WAITING)
            if req.finished and not req.adopted:
                violation("alloc_after_finish", i, sk, rk, req, ids[b_start[i]:b_end[i]])
            elif req.recv_open:
                violation("wait_twice", i, sk, rk, req)
            elif n[i] == 0:
                violation("wait_without_transfer", i, sk, rk, req, external_tokens=0)
            req.status = WAITING_KV
            req.recv_open = True
            req.filling = ids[b_start[i]:b_end[i]]
            req.recv_ranks = None
            req.first_rank_ts = -1
            req.note(row)
            continue
        if kind == "blocks_free":
            req = request(i, sk, rk, RUNNING)
            if reasons[i] in FINAL_FREE_REASONS and req.finished and not req.recv_open and not req.send_pending:
                req.forgotten = True
            req.note(row)
            continue
        if kind == "req_preempt":
            req = request(i, sk, rk, RUNNING)
            scheduled_since = sched_before.get(row, -1) > req.status_pos
            if req.status != RUNNING and not req.adopted and not (
                    scheduled_since and req.status in (WAITING, PREEMPTED)):
                violation("preempt_not_running", i, sk, rk, req)
            req.status = PREEMPTED
            req.status_pos = pos[i]
            req.adopted = False
            req.note(row)
            continue
        if kind == "req_finish":
            req = request(i, sk, rk, RUNNING)
            if req.finished and not req.adopted:
                violation("finish_twice", i, sk, rk, req)
            req.finished = True
            req.finish_row = row
            req.status = FINISHED
            if req.recv_open:
                pass  # aborted while receiving: the free waits for the receive (0.16+; premature_free before)
            elif delay[i]:
                req.send_pending = True
                req.send_ranks = None
                req.first_rank_ts = -1
            else:
                req.forgotten = True
            req.note(row)
            continue
        if kind == "kv_send_done" or kind == "kv_recv_done":
            req = requests.get(rk)
            send = kind == "kv_send_done"
            if req is None:
                if not windowed and not known_id[i]:
                    violation("completion_unknown", i, sk, rk, None, state="never added")
                req = requests[rk] = RequestModel(FINISHED if send else WAITING_KV, adopted=True)
                req.note(row)
                continue
            if req.forgotten and not req.adopted:
                violation("completion_after_free", i, sk, rk, req)
            elif send and not req.finished and not req.adopted:
                violation("completion_unfinished", i, sk, rk, req)
            elif not send and not req.recv_open and not req.finished and not req.adopted:
                violation("completion_unfinished", i, sk, rk, req)
            elif send and req.recv_open and not req.adopted:
                violation("read_before_filled", i, sk, rk, req, req.filling)
            if send:
                req.send_pending = False
                req.forgotten = req.finished
            else:
                req.recv_open = False
                if req.finished:
                    req.forgotten = True
                elif req.status == WAITING_KV:
                    req.status = WAITING
                    req.status_pos = pos[i]
            req.note(row)
            continue
        if kind == "kv_recv_fail":
            req = requests.get(rk)
            if req is not None and not req.recv_open and not req.adopted and not req.forgotten:
                violation("recv_fail_without_receive", i, sk, rk, req)
            if req is not None:
                req.note(row)
            continue
        if kind == "kv_expire":
            req = requests.get(rk)
            if req is not None:
                if req.send_pending and not req.adopted and not req.send_ranks:
                    violation("send_expired", i, sk, rk, req,
                              held_s=round((ts[i] - int(cols.ts[req.finish_row])) / 1e9, 3) if req.finish_row >= 0
                              else None)
                req.send_pending = False
                req.note(row)
            continue
        if kind == "kv_recv_dest":
            req = requests.get(rk)
            if req is not None and req.recv_open and not req.adopted:
                waited = set(req.filling)
                dest = ids[b_start[i]:b_end[i]]
                stray = [b for b in dest if b not in waited]
                if stray:
                    violation("recv_into_shared", i, sk, rk, req, stray, destination=dest,
                              waiting_blocks=list(req.filling))
            if req is not None:
                req.note(row)
            continue
        if kind == "kv_send_rank" or kind == "kv_recv_rank":
            req = requests.get(rk)
            if req is None:
                continue
            rank = (pp[i], tp[i])
            if kind == "kv_send_rank":
                if req.recv_open and not req.adopted:
                    violation("read_before_filled", i, sk, rk, req, req.filling)
                if req.send_ranks is None:
                    req.send_ranks = set()
                req.send_ranks.add(rank)
            else:
                if req.recv_ranks is None:
                    req.recv_ranks = set()
                req.recv_ranks.add(rank)
            if req.first_rank_ts < 0:
                req.first_rank_ts = ts[i]
            elif ts[i] - req.first_rank_ts >= DISAGREE_NS and not req.skew_reported and not req.adopted:
                req.skew_reported = True
                violation("ranks_disagree", i, sk, rk, req, req.filling if kind == "kv_recv_rank" else [],
                          late_s=round((ts[i] - req.first_rank_ts) / 1e9, 3))
            req.last_rank_row = row
            continue

    _block_violations(ctx, cols, requests, windowed, out)
    _blocks_listed_twice(cols, requests, out)
    _tokens_over_capacity(ctx, cols, requests, windowed, out)
    _reads_of_unwritten_kv(ctx, cols, requests, out)
    if not windowed:  # a window's first owners may lie before it: who is last, and what was held, is unknown
        _frees_not_returned(ctx, cols, requests, out)
        _preemptions_that_kept_blocks(ctx, cols, requests, out)
    _decodes_on_failed_loads(ctx, cols, requests, out)
    _misplaced_hits(cols, requests, windowed, out)
    _admission_stalls(cols, requests, failed, pools, out)
    end_ts = int(cols.ts.max()) if cols.n else 0
    _unresolved(ctx, cols, requests, failed, _last_outputs(cols), end_ts, out)
    out.sort(key=lambda v: int(cols.pos[v.row]))
    return LifecycleModel(out, requests)


def _request_named_in(cols: Any, error: str) -> int:
    """The key of a request of the trace whose id the error text quotes (`KeyError: 'r7-d'`), else -1."""
    quoted = re.findall(r"""['"]([^'"]{1,200})['"]""", error)
    if not quoted or not cols.n_requests:
        return -1
    names = np.asarray(cols.rk_names["req"], dtype=object)
    for text in quoted:
        at = np.flatnonzero(names == text)
        if len(at):
            return int(at[-1])  # a reused id: its latest request
    return -1


def _loop_rows(cols: Any) -> np.ndarray:
    """The rows the request pass replays, in the global order: every MODEL_KINDS row but the pool's own frees
    (`_block_violations` judges blocks) and the allocations that change no request state: of a request's run of
    consecutive `blocks_alloc` rows (a decode allocates a block every block_size tokens) only the first, which
    makes it RUNNING, is kept."""
    kinds = tuple(k for k in MODEL_KINDS if k != "blocks_pool_free")
    rows = cols.rows_of(*kinds)
    alloc = cols.codes("kind")[0][rows] == cols.code_of("kind", "blocks_alloc")
    rk = cols.rk[rows]
    order = np.lexsort((cols.pos[rows], rk))
    prev_alloc = np.zeros(len(rows), bool)
    same = rk[order][1:] == rk[order][:-1]
    prev_alloc[order[1:]] = same & alloc[order][:-1]
    rows = rows[~(alloc & prev_alloc & (rk >= 0))]
    return rows[np.argsort(cols.pos[rows], kind="stable")]


def _block_violations(ctx: Any, cols: Any, requests: dict[int, RequestModel], windowed: bool,
                      out: list[Violation]) -> None:
    """The block invariants, vectorised over `blocks.ownership`'s holding intervals (request, block, from its
    allocation to its free) sorted by (pool block, allocation):
    - `alloc_owned_block`: an interval that starts while an earlier interval of another request on the same pool
      block is still open (a running maximum of the earlier intervals' ends), where the allocating row's block is
      past its leading prefix hits (`blocks_alloc` detail `hit`; without it nothing is judged: a hit shares);
    - `pool_free_while_owned`: a `blocks_pool_free` of a block that an interval holds at that moment (not a
      copy-on-write release, detail `cow`), one finding per holder (its first);
    - `free_not_owned`: the frees of blocks the request did not hold (`Ownership.unmatched_*`), one per row; not
      judged in a window (the allocation may lie before it: double_free/not_owned's window policy)."""
    own = ownership(ctx)
    n_pos = int(cols.n) + 2
    if len(own):
        key = own.pool_key.astype(np.int64)
        order = order_by_key(key, own.alloc_pos.astype(np.int64))
        k = key[order]
        start = own.alloc_pos[order].astype(np.int64)
        end = np.where(own.free_row[order] >= 0, own.free_pos[order], n_pos - 1).astype(np.int64)
        group = np.cumsum(np.r_[True, k[1:] != k[:-1]]) if len(k) else k
        combined = np.maximum.accumulate(group * n_pos + end)
        before = np.r_[-1, combined[:-1]]
        open_earlier = (before // n_pos == group) & (before % n_pos > start)
        other = np.flatnonzero(open_earlier)
        _double_allocations(cols, own, order, k, start, end, other, requests, out)
        _pool_frees_while_owned(cols, own, order, k, start, end, group, combined, n_pos, requests, out)
    if not windowed and len(own.unmatched_row):
        rows, first = np.unique(own.unmatched_row, return_index=True)
        for row, j in zip(rows.tolist(), first.tolist()):
            rk = int(own.unmatched_rk[j])
            stray = own.unmatched_block[own.unmatched_row == row].tolist()
            req = requests.get(rk)
            out.append(Violation("free_not_owned", row, int(cols.sk[row]), rk, stray,
                                 "the request did not hold these blocks" if req else "unknown to the scheduler",
                                 _history_before(cols, req, row, row), {}))


#: kinds whose `blocks` are this scheduler's own pool blocks, each listed once
_POOL_LIST_KINDS = ("blocks_alloc", "blocks_free", "blocks_pool_free", "req_wait_kv")


def _blocks_listed_twice(cols: Any, requests: dict[int, RequestModel], out: list[Violation]) -> None:
    """`block_listed_twice`: a row of `_POOL_LIST_KINDS` whose block list repeats an id (the flat (row, block)
    pairs sorted by one int64 key; equal neighbours), one violation per row naming the repeated blocks."""
    block_rows, block_ids = cols.block_rows
    if not len(block_rows):
        return
    keep = np.isin(cols.codes("kind")[0][block_rows], [cols.code_of("kind", k) for k in _POOL_LIST_KINDS])
    rows, ids = block_rows[keep].astype(np.int64), block_ids[keep].astype(np.int64)
    if not len(rows):
        return
    key = np.sort(rows * (int(ids.max()) + 1) + ids)
    dup = key[1:][key[1:] == key[:-1]]
    if not len(dup):
        return
    width = int(ids.max()) + 1
    dup_rows, dup_ids = dup // width, dup % width
    for row in np.unique(dup_rows).tolist():
        _violation_at(out, "block_listed_twice", cols, row, int(cols.rk[row]),
                      sorted(set(dup_ids[dup_rows == row].tolist())), requests, {})


def _misplaced_hits(cols: Any, requests: dict[int, RequestModel], windowed: bool, out: list[Violation]) -> None:
    """`hit_misplaced`: every `blocks_alloc` entry gets its index in its request's table (a running count per
    request, restarted at each `req_preempt`, which frees the table); the leading `hit` entries of a request's first
    allocation of a table must have the index the same pool block had in its previous holder's table (the holder's
    last entry of that block before). Vectorised but for the hit rows' detail; not judged in a window (a holder's
    table may begin before it)."""
    if windowed:
        return
    alloc = cols.req_rows("blocks_alloc")
    if not len(alloc):
        return
    hit_rows = [r for r, d in zip(alloc.tolist(), cols.details(alloc)) if isinstance(d, dict) and d.get("hit")]
    if not hit_rows:
        return
    b_rows, b_ids = cols.flat_blocks(cols.mask_of_rows(alloc))
    pre = cols.req_rows("req_preempt")
    rk = np.concatenate([cols.rk[b_rows], cols.rk[pre]]).astype(np.int64)
    pos = np.concatenate([cols.pos[b_rows], cols.pos[pre]]).astype(np.int64)
    is_pre = np.concatenate([np.zeros(len(b_rows), bool), np.ones(len(pre), bool)])
    seq = np.concatenate([np.arange(len(b_rows)), np.zeros(len(pre), np.int64)])  # entries keep their list order
    order = np.lexsort((seq, is_pre.astype(np.int8) * -1, pos, rk))
    rk, pos, is_pre = rk[order], pos[order], is_pre[order]
    start = np.r_[True, rk[1:] != rk[:-1]] | is_pre
    counter = np.cumsum(~is_pre)
    base = np.maximum.accumulate(np.where(start, counter - (~is_pre).astype(np.int64), 0))
    index_sorted = counter - base - 1
    entry = order[~is_pre]  # positions in the flat entries, in sorted order
    index = np.empty(len(b_rows), np.int64)
    index[entry] = index_sorted[~is_pre]
    # each entry's offset within its row, and whether its row opened a table (its request's first allocation in it)
    row_start = np.r_[True, b_rows[1:] != b_rows[:-1]]
    offset = np.arange(len(b_rows)) - np.maximum.accumulate(np.where(row_start, np.arange(len(b_rows)), 0))
    hits = dict.fromkeys(hit_rows, 0)
    for r, d in zip(hit_rows, cols.details(np.array(hit_rows))):
        hits[r] = int(d.get("hit") or 0)
    hit_n = np.zeros(len(b_rows), np.int64)
    hit_row = np.array(sorted(hits), np.int64)
    at = np.searchsorted(hit_row, b_rows)
    found = (at < len(hit_row)) & (hit_row[np.minimum(at, len(hit_row) - 1)] == b_rows)
    hit_n[found] = np.array([hits[r] for r in hit_row.tolist()], np.int64)[at[found]]
    judged = np.flatnonzero((offset < hit_n) & (index == offset))
    if not len(judged):
        return
    key = pool_block_key(cols.sk[b_rows], b_ids, int(b_ids.max()) + 1)
    prev = last_before(key[judged], cols.pos[b_rows[judged]], key, cols.pos[b_rows], strict=True)
    prev_of = np.full(len(b_rows), -1, np.int64)
    prev_of[judged] = prev
    has = prev >= 0
    bad = judged[has][index[prev[has]] != index[judged[has]]]
    for row in np.unique(b_rows[bad]).tolist():
        mine = bad[b_rows[bad] == row]
        _violation_at(out, "hit_misplaced", cols, row, int(cols.rk[row]), sorted(b_ids[mine].tolist()), requests,
                      {"indices": index[mine].tolist(), "written_at": index[prev_of[mine]].tolist()})


#: failed loads judged per trace (each a pass over the holding intervals)
FAILED_LOADS_JUDGED = 1000


def _failed_load_holders(ctx: Any, cols: Any) -> list[tuple[int, int, int, list[int]]]:
    """Each `kv_recv_fail` with the requests holding its blocks then (its request where recorded, else by the
    ownership intervals): (failed load row, request key, invalid blocks held, those blocks). Cached per context."""
    def build() -> list[tuple[int, int, int, list[int]]]:
        fails = cols.rows_of("kv_recv_fail")[:FAILED_LOADS_JUDGED]
        found: list[tuple[int, int, int, list[int]]] = []
        if not len(fails):
            return found
        own = ownership(ctx)
        if not len(own):
            return found
        block_rows, block_ids = cols.block_rows
        big = np.iinfo(np.int64).max
        free_pos = np.where(own.free_row >= 0, own.free_pos.astype(np.int64), big)
        for row in fails.tolist():
            lo, hi = np.searchsorted(block_rows, row), np.searchsorted(block_rows, row, side="right")
            blocks = block_ids[lo:hi].astype(np.int64)
            if not len(blocks):
                continue
            at = int(cols.pos[row])
            keys = pool_block_key(np.full(len(blocks), cols.sk[row]), blocks, own.width)
            held = np.flatnonzero(np.isin(own.pool_key, keys) & (own.alloc_pos < at) & (free_pos > at))
            if cols.rk[row] >= 0:
                held = held[own.rk[held] == cols.rk[row]]
            for rk in np.unique(own.rk[held]).tolist():
                mine = held[own.rk[held] == rk]
                found.append((row, int(rk), len(mine), sorted(own.block[mine].tolist())))
        return found
    return ctx.cached("lifecycle_failed_load_holders", build)


def _decodes_on_failed_loads(ctx: Any, cols: Any, requests: dict[int, RequestModel], out: list[Violation]) -> None:
    """`decode_on_failed_load`: for each `kv_recv_fail` (its blocks; its request where recorded, else each request
    holding those blocks then, by the ownership intervals), the request's next `req_sched`, `req_wait_kv`,
    `req_preempt` or `req_finish`: a `req_sched` of fewer tokens than the invalid blocks it holds is a violation
    (a recompute covers at least one token per invalid block; a new wait reloads; a finish fails it)."""
    found = _failed_load_holders(ctx, cols)
    nxt_rows = cols.req_rows("req_sched", "req_wait_kv", "req_preempt", "req_finish")
    sched_code = cols.code_of("kind", "req_sched")
    kind_codes = cols.codes("kind")[0]
    if not found:
        return
    # each holder's next scheduler event after its failed load: one search for all of them
    nxt = next_at_or_after(np.array([f[1] for f in found]), cols.pos[[f[0] for f in found]], cols.rk[nxt_rows],
                           cols.pos[nxt_rows], strict=True)
    for (row, rk, invalid, blocks), i in zip(found, nxt.tolist()):
        if i < 0:
            continue
        nrow = int(nxt_rows[i])
        n = int(cols.ints_at("n", np.array([nrow]), fill=0)[0])
        if kind_codes[nrow] == sched_code and n < invalid:
            _violation_at(out, "decode_on_failed_load", cols, nrow, rk, blocks, requests,
                          {"failed_load_row": row, "tokens": n, "invalid_blocks": invalid})


def _tokens_over_capacity(ctx: Any, cols: Any, requests: dict[int, RequestModel], windowed: bool,
                          out: list[Violation]) -> None:
    """`tokens_over_capacity`: per request, from its add and again from each preemption (vLLM frees the table and
    recomputes), in event order: tokens computed so far (each `req_sched` n, a `req_wait_kv`'s external n, the
    first allocation's prefix hits x block_size) against its table's slots (the blocks of its `blocks_alloc` rows x
    block_size; sliding-window trims keep their slots as null blocks, so frees do not shrink it). A load counts at
    most the prompt less one token (vLLM computes the last prompt token again), and nothing for a request whose load
    failed (vLLM recomputes from the first invalid block). Judged on the steps of the first prefill
    (those that begin before the computed tokens reach the prompt length, before any preemption: a decode step's
    slot rests on a boundary-exact reading hand-made traces often miss by one, and a resumption's recompute skips
    what its blocks still hold, which its allocation does not say); the first such `req_sched` past the slots, per
    request, is the violation. A warning: vLLM asserts nothing here (the step writes KV past the table).
    Cumulative sums with a reset per (request, segment), vectorised, over the rows `_prefill_candidate_rows` keeps
    (decode rows left out before the sort: 3M events, 0.29 -> see bench/analyze.py); schedulers without a block
    size (no engine_config) and requests that began before a window are not judged."""
    sizes = {sk: int(cfg["block_size"]) for sk, cfg in engine_configs(ctx).items() if cfg.get("block_size")}
    if not sizes:
        return
    n_sk = int(cols.sk.max()) + 1
    bs = np.zeros(n_sk, np.int64)
    for sk, size in sizes.items():
        if sk < n_sk:
            bs[sk] = size
    rows = _prefill_candidate_rows(cols, bs)
    if windowed:  # a request first seen mid-window holds a table the window does not show
        add_rows = cols.req_rows("req_add")
        has_add = np.zeros(cols.n_requests, bool)
        has_add[cols.rk[add_rows]] = True
        rows = rows[has_add[cols.rk[rows]]]
    if not len(rows):
        return
    rk = cols.rk[rows].astype(np.int64)
    order = np.lexsort((cols.pos[rows], rk))
    rows, rk = rows[order], rk[order]
    code = cols.codes("kind")[0][rows]
    is_sched = code == cols.code_of("kind", "req_sched")
    is_alloc = code == cols.code_of("kind", "blocks_alloc")
    is_wait = code == cols.code_of("kind", "req_wait_kv")
    is_preempt = code == cols.code_of("kind", "req_preempt")
    block = bs[cols.sk[rows]]
    n = np.maximum(cols.ints_at("n", rows, fill=0), 0).astype(np.int64)
    block_rows, _ = cols.block_rows
    counts = np.zeros(len(rows), np.int64)
    alloc_rows = rows[is_alloc]
    counts[is_alloc] = np.searchsorted(block_rows, alloc_rows, side="right") - np.searchsorted(block_rows, alloc_rows)
    hits = np.zeros(len(rows), np.int64)
    alloc_at = np.flatnonzero(is_alloc)
    if len(alloc_at):
        first_alloc = alloc_at[np.r_[True, rk[alloc_at][1:] != rk[alloc_at][:-1]]]
        for i, detail in zip(first_alloc.tolist(), cols.details(rows[first_alloc])):
            hits[i] = int(detail.get("hit") or 0) if isinstance(detail, dict) else 0
    # a load fills at most prompt - 1 tokens: the last prompt token is computed again, to sample from it
    add_rows = cols.req_rows("req_add")
    prompt = np.full(cols.n_requests, np.iinfo(np.int64).max // 4, np.int64)
    prompt[cols.rk[add_rows]] = np.maximum(cols.ints_at("n", add_rows, fill=0), 1)
    loaded = np.minimum(n, prompt[rk] - 1)
    failed = np.zeros(cols.n_requests, bool)  # a failed load: vLLM recomputes from its first invalid block
    failed[[f[1] for f in _failed_load_holders(ctx, cols)]] = True
    loaded[failed[rk]] = 0
    computed = np.where(is_sched, n, 0) + np.where(is_wait, loaded, 0) + hits * block
    slots = np.where(is_alloc, counts * block, 0)
    # segments: a new one at each request's first row and at each preemption (which frees the whole table)
    start = np.r_[True, rk[1:] != rk[:-1]] | is_preempt

    def seg_cumsum(values: np.ndarray) -> np.ndarray:
        total = np.cumsum(values)
        base = np.r_[0, total][np.flatnonzero(start)]
        return total - np.repeat(base, np.diff(np.r_[np.flatnonzero(start), len(values)]))
    comp_cum, slot_cum = seg_cumsum(computed), seg_cumsum(slots)
    # the first prefill's steps only (a first prefill, a resumption's recompute): a decode step's slot comes from a
    # boundary-exact reading (which position the sampled token is written at) that hand-made traces often miss
    # by one, where an allocation short of the prompt is wrong however the steps are counted
    in_prompt = comp_cum - computed < prompt[rk]
    # before the first preemption: a resumption's recompute skips what its own blocks still hold, and the trace
    # does not say how much (its allocation carries no hit count)
    first_segment = _segment_starts_before(rk, is_preempt) == 0
    over = is_sched & in_prompt & first_segment & (comp_cum > slot_cum)
    if not over.any():
        return
    bad = np.flatnonzero(over)
    first = bad[np.r_[True, rk[bad][1:] != rk[bad][:-1]]]
    for i in first.tolist():
        _violation_at(out, "tokens_over_capacity", cols, int(rows[i]), int(rk[i]), [], requests,
                      {"tokens": int(comp_cum[i]), "slots": int(slot_cum[i]), "block_size": int(block[i])})


def _reads_of_unwritten_kv(ctx: Any, cols: Any, requests: dict[int, RequestModel], out: list[Violation]) -> None:
    """`read_unwritten_kv`: each `blocks_alloc` that opens a request's table carries (where the recorder writes it)
    `computed`, the request's num_computed_tokens when the step starts, beside `hit` (leading prefix-cache hits)
    and `loaded` (external tokens a connector loads into it). The KV of the computed tokens must be in the table:
    computed <= hit x block_size + loaded. Only the rows whose detail holds `computed` are parsed (found with one
    substring match over the detail strings); schedulers without a block size (no engine_config) are not judged.
    The row holds every fact judged, so a window changes nothing."""
    sizes = {sk: int(cfg["block_size"]) for sk, cfg in engine_configs(ctx).items() if cfg.get("block_size")}
    if not sizes:
        return
    alloc = cols.req_rows("blocks_alloc")
    if not len(alloc):
        return
    details = cols.table.column("detail").take(pa.array(alloc))
    marked = np.asarray(pc.fill_null(pc.match_substring(details, '"computed"'), False), bool)
    rows = alloc[marked]
    for row, detail in zip(rows.tolist(), cols.details(rows)):
        size = sizes.get(int(cols.sk[row]))
        computed = _int_value(detail.get("computed"))
        if size is None or computed is None:
            continue
        hit = _int_value(detail.get("hit")) or 0
        loaded = _int_value(detail.get("loaded")) or 0
        written = hit * size + loaded
        if computed > written:
            rk = int(cols.rk[row])
            req = requests.get(rk)
            pre = cols.req_rows("req_preempt")
            resumed = bool(np.any((cols.rk[pre] == rk) & (cols.pos[pre] < cols.pos[row])))
            _violation_at(out, "read_unwritten_kv", cols, row, rk, [], requests,
                          {"computed": computed, "written": written, "hit": hit, "loaded": loaded,
                           "block_size": size, "resumed": resumed})


def _prefill_candidate_rows(cols: Any, bs: np.ndarray) -> np.ndarray:
    """The rows `tokens_over_capacity` reads, of schedulers with a block size: every allocation, wait and preemption,
    and the `req_sched` rows that may belong to a first prefill: those of more than one token, and each request's
    first one-token row (the recompute of a loaded prompt's last token). The other one-token rows are decodes, the
    bulk of a trace; a one-token chunk inside a chunked prefill left out only lowers the count (never a false
    finding)."""
    others = cols.req_rows("blocks_alloc", "req_wait_kv", "req_preempt")
    sched = cols.req_rows("req_sched")
    others = others[bs[cols.sk[others]] > 0]
    sched = sched[bs[cols.sk[sched]] > 0]
    if not len(sched):
        return others
    many = cols.ints_at("n", sched, fill=0) > 1
    ones = sched[~many]
    rk_ones, pos_ones = cols.rk[ones], cols.pos[ones].astype(np.int64)
    first = np.full(cols.n_requests, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first, rk_ones, pos_ones)
    return np.concatenate([others, sched[many], ones[pos_ones == first[rk_ones]]])


def _segment_starts_before(rk: np.ndarray, is_preempt: np.ndarray) -> np.ndarray:
    """Per row (rows sorted by request, then order): how many of the request's preemptions came at or before it."""
    total = np.cumsum(is_preempt)
    first = np.r_[True, rk[1:] != rk[:-1]]
    base = np.repeat((total - is_preempt)[first], np.diff(np.r_[np.flatnonzero(first), len(rk)]))
    return total - base


#: steps a scheduler must go on draining after a free before a block missing from its pool frees is judged (a
#: deferred free drains at a later step's fence)
RETURN_STEPS = 4


def _frees_not_returned(ctx: Any, cols: Any, requests: dict[int, RequestModel], out: list[Violation]) -> None:
    """`free_not_returned`, over the ownership intervals closed by a free with no other holder left
    (`Ownership.others_at_free` == 0; block 0, vLLM's null block, excepted): the block's next `blocks_pool_free`
    after the free must come before its next allocation; a block never pool-freed again is judged only where its
    scheduler records pool frees at least RETURN_STEPS steps after the free. One violation per free row."""
    pool_rows = cols.rows_of("blocks_pool_free")
    own = ownership(ctx)
    if not len(pool_rows) or not len(own):
        return
    closed = np.flatnonzero(own.free_row >= 0)
    last = closed[(own.others_at_free(closed) == 0) & (own.block[closed] != 0)]
    if not len(last):
        return
    big = np.iinfo(np.int64).max
    pf = own.pool_free_after(last)
    nxt = own.next_alloc_after(last)
    pf_pos = np.where(pf >= 0, cols.pos[np.maximum(pf, 0)].astype(np.int64), big)
    nxt_pos = np.where(nxt >= 0, own.alloc_pos[np.maximum(nxt, 0)].astype(np.int64), big)
    free_rows = own.free_row[last].astype(np.int64)
    n_sk = int(cols.sk.max()) + 1 if cols.n else 0
    last_pool_step = last_per_key(cols.sk[pool_rows], cols.step[pool_rows], n_sk, fill=-1)
    free_step = cols.step[free_rows]
    judged = (pf >= 0) | ((free_step >= 0) & (last_pool_step[cols.sk[free_rows]] >= free_step + RETURN_STEPS))
    bad = judged & ((pf < 0) | (pf_pos > nxt_pos))
    if not bad.any():
        return
    for row in np.unique(free_rows[bad]).tolist():
        _violation_at(out, "free_not_returned", cols, row, int(cols.rk[row]),
                      sorted(own.block[last[bad & (free_rows == row)]].tolist()), requests, {})


def _preemptions_that_kept_blocks(ctx: Any, cols: Any, requests: dict[int, RequestModel], out: list[Violation]) -> None:
    """`preempt_kept_blocks`: for each `req_preempt`, the request's holding intervals open at it (allocated before,
    not freed by then) that are still open at its next `req_sched` (its resumption), or at the end of the trace."""
    pre = cols.req_rows("req_preempt")
    if not len(pre):
        return
    own = ownership(ctx)
    if not len(own):
        return
    big = np.iinfo(np.int64).max
    sched = cols.req_rows("req_sched")
    nxt = next_at_or_after(cols.rk[pre], cols.pos[pre], cols.rk[sched], cols.pos[sched], strict=True)
    end = int(cols.n) + 1  # never resumed: judged at the end of the trace (a block never freed is open past it)
    horizon = np.where(nxt >= 0, cols.pos[sched[np.maximum(nxt, 0)]].astype(np.int64), end)
    order = np.argsort(own.rk, kind="stable")
    rk_sorted = own.rk[order]
    for i, row in enumerate(pre.tolist()):
        rk = int(cols.rk[row])
        lo, hi = np.searchsorted(rk_sorted, rk), np.searchsorted(rk_sorted, rk, side="right")
        mine = order[lo:hi]
        if not len(mine):
            continue
        at = cols.pos[row]
        free_pos = np.where(own.free_row[mine] >= 0, own.free_pos[mine].astype(np.int64), big)
        kept = mine[(own.alloc_pos[mine] < at) & (free_pos > at) & (free_pos > horizon[i])]
        if len(kept):
            _violation_at(out, "preempt_kept_blocks", cols, row, rk, sorted(own.block[kept].tolist()), requests,
                          {"resumed": bool(nxt[i] >= 0)})


def _holder(own: Any, order: np.ndarray, k: np.ndarray, start: np.ndarray, end: np.ndarray, at: int,
            pos: int, not_rk: int) -> int | None:
    """The interval (index into own) of another request holding pool block k[at] at position pos."""
    lo = int(np.searchsorted(k, k[at]))
    for j in range(lo, len(k)):
        if k[j] != k[at] or start[j] >= pos:
            break
        if end[j] > pos and int(own.rk[order[j]]) != not_rk:
            return int(order[j])
    return None


def _double_allocations(cols: Any, own: Any, order: np.ndarray, k: np.ndarray, start: np.ndarray, end: np.ndarray,
                        other: np.ndarray, requests: dict[int, RequestModel], out: list[Violation]) -> None:
    """`alloc_owned_block` for the intervals `other` (indexes into the sorted arrays) that start while another is
    open on their pool block: reported where the block lies past its row's leading prefix hits."""
    if len(other) == 0:
        return
    rows = own.alloc_row[order[other]]
    unique = np.unique(rows)
    hits = dict(zip(unique.tolist(), (_int_value(d.get("hit")) for d in cols.details(unique))))
    block_rows, block_ids = cols.block_rows
    reported: set[tuple[int, int]] = set()
    for at, row in zip(other.tolist(), rows.tolist()):
        hit = hits[row]
        if hit is None:
            continue
        interval = int(order[at])
        block = int(own.block[interval])
        lo, hi = np.searchsorted(block_rows, [row, row + 1])
        position = np.flatnonzero(block_ids[lo:hi] == block)
        if not len(position) or int(position[0]) < hit:
            continue
        rk = int(own.rk[interval])
        held = _holder(own, order, k, start, end, at, int(start[at]), rk)
        if held is None or (row, rk) in reported:
            continue
        reported.add((row, rk))
        owner = int(own.rk[held])
        req = requests.get(owner)
        out.append(Violation("alloc_owned_block", row, int(own.sk[interval]), rk, [block],
                             f"block {block} still owned by another request, which allocated it earlier and had not "
                             f"given it up", _history_before(cols, req, int(own.alloc_row[held]), row),
                             {"owner_rk": owner, "position": int(position[0]), "hit": hit}))


def _pool_frees_while_owned(cols: Any, own: Any, order: np.ndarray, k: np.ndarray, start: np.ndarray,
                            end: np.ndarray, group: np.ndarray, combined: np.ndarray, n_pos: int,
                            requests: dict[int, RequestModel], out: list[Violation]) -> None:
    rows = cols.rows_of("blocks_pool_free")
    if len(rows) == 0:
        return
    p_rows, p_blocks = cols.flat_blocks(cols.mask_of_rows(rows))
    p_key = pool_block_key(cols.sk[p_rows], p_blocks, own.width).astype(np.int64)
    p_pos = cols.pos[p_rows].astype(np.int64)
    # the last interval of the same pool block allocated before the pool free: the running maximum of ends there
    composite = k * n_pos + start
    at = np.searchsorted(composite, p_key * n_pos + p_pos) - 1
    ok = at >= 0
    ok[ok] = k[at[ok]] == p_key[ok]
    held = np.zeros(len(p_rows), bool)
    held[ok] = combined[at[ok]] % n_pos > p_pos[ok]
    held[ok] &= combined[at[ok]] // n_pos == group[at[ok]]
    seen: set[int] = set()
    for j in np.flatnonzero(held).tolist():
        row = int(p_rows[j])
        interval = _holder(own, order, k, start, end, int(at[j]), int(p_pos[j]), -1)
        if interval is None:
            continue
        holder = int(own.rk[interval])
        if holder in seen or _cow(cols, row):
            continue
        seen.add(holder)
        req = requests.get(holder)
        lost = own.block[(own.rk == holder) & (own.alloc_pos < p_pos[j]) &
                         ((own.free_row < 0) | (own.free_pos > p_pos[j]))]
        out.append(Violation("pool_free_while_owned", row, int(cols.sk[row]), holder, sorted(set(lost.tolist()))[:64],
                             "the block still owned by this request, which allocated it and had not given it up",
                             _history_before(cols, req, int(own.alloc_row[interval]), row), {}))


def _violation_at(out: list[Violation], invariant: str, cols: Any, row: int, rk: int, blocks: list[int],
                  requests: dict[int, RequestModel], extra: dict[str, Any]) -> None:
    """A violation of a check judged after the replay: the request's state in words and its history up to `row`."""
    req = requests.get(rk)
    out.append(Violation(invariant, row, int(cols.sk[row]), rk, blocks,
                         req.describe() if req is not None else "unknown to the scheduler",
                         _history_before(cols, req, row, row), extra))


def _history_before(cols: Any, req: RequestModel | None, alloc_row: int, row: int) -> list[int]:
    """The request's history rows up to the event at `row` (a block violation is judged after the replay: what the
    request did later is not its state then), and the allocation of the block, once each."""
    limit = int(cols.pos[row])
    rows = [r for r in (req.history if req else []) if int(cols.pos[r]) <= limit]
    return list(dict.fromkeys(rows + [alloc_row]))


def _last_outputs(cols: Any) -> np.ndarray:
    """The position of each scheduler's latest step_output (NO where none), by scheduler key."""
    rows = cols.rows_of("step_output")
    return last_per_key(cols.sk[rows], cols.pos[rows], len(cols.sk_names))


def _cow(cols: Any, row: int) -> bool:
    """A pool free made by a copy-on-write retention (detail `cow`), not by a request's free."""
    return bool(cols.details(np.array([row]))[0].get("cow"))


def _int_value(value: Any) -> int | None:
    """A detail value as an int (None where absent or not a number)."""
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _admission_stalls(cols: Any, requests: dict[int, RequestModel], failed: dict[int, int],
                      pools: dict[int, int], out: list[Violation]) -> None:
    """Runs of consecutive `sched` rows of one scheduler that schedule nothing while nothing runs, requests wait
    (not for remote KV) and at least STALL_FREE_SHARE of the pool is free; a run of at least STALL_STEPS steps
    (an `empty_run` row counts its k) over at least STALL_NS is a violation, its request the oldest one added
    before the run and neither scheduled nor finished by its end. Only the empty rows' details are parsed."""
    rows = cols.rows_of("sched")
    if len(rows) == 0 or not pools:
        return
    rows = rows[np.argsort(cols.pos[rows], kind="stable")]
    tokens = cols.ints_at("n", rows)
    empty = np.flatnonzero(tokens == 0)
    if len(empty) == 0:
        return
    stalled = np.zeros(len(rows), bool)
    weight = np.ones(len(rows), np.int64)
    sk_of = cols.sk[rows]
    for j, detail in zip(empty.tolist(), cols.details(rows[empty])):
        running, waiting = detail.get("running"), detail.get("waiting")
        free, pool = detail.get("free_blocks"), pools.get(int(sk_of[j]))
        if (isinstance(running, int) and running == 0 and isinstance(waiting, int)
                and waiting - int(detail.get("waiting_kv") or 0) > 0 and isinstance(free, int)
                and pool is not None and free >= STALL_FREE_SHARE * pool):
            stalled[j] = True
            weight[j] = int(detail.get("empty_run") or 1)
    ts = cols.ts[rows]
    for sk in np.unique(sk_of[stalled]).tolist():
        mine = np.flatnonzero(sk_of == sk)
        if sk in failed:
            mine = mine[cols.pos[rows[mine]] < cols.pos[failed[sk]]]
        flags = stalled[mine]
        edges = np.flatnonzero(np.diff(np.r_[0, flags.astype(np.int8), 0]))
        for lo, hi in zip(edges[::2].tolist(), edges[1::2].tolist()):
            run = mine[lo:hi]
            steps = int(weight[run].sum())
            seconds = (int(ts[run[-1]]) - int(ts[run[0]])) / 1e9
            if steps < STALL_STEPS or seconds * 1e9 < STALL_NS:
                continue
            first, last = int(rows[run[0]]), int(rows[run[-1]])
            waiting = _waiting_through(cols, requests, sk, int(cols.pos[first]), int(cols.pos[last]))
            out.append(Violation("admission_stall", first, sk, waiting[0] if waiting else -1, [],
                                 f"{steps} empty steps over {seconds:.1f} s with nothing running and requests "
                                 f"waiting", [first, last],
                                 {"steps": steps, "seconds": round(seconds, 3), "waiting_requests": len(waiting),
                                  "pool_blocks": pools.get(sk), "last_row": last}))


def _waiting_through(cols: Any, requests: dict[int, RequestModel], sk: int, first_pos: int,
                     last_pos: int) -> list[int]:
    """Request keys of scheduler sk added before first_pos and neither allocated blocks nor finished by
    last_pos, oldest first."""
    pos = cols.pos
    out = []
    for rk, req in requests.items():
        if req.adopted or not req.history or int(cols.request_sk[rk]) != sk:
            continue
        added = int(pos[req.history[0]])
        if added >= first_pos:
            continue
        if req.first_alloc_row >= 0 and int(pos[req.first_alloc_row]) <= last_pos:
            continue
        if req.finish_row >= 0 and int(pos[req.finish_row]) <= last_pos:
            continue
        out.append((added, rk))
    return [rk for _, rk in sorted(out)]


def _unresolved(ctx: Any, cols: Any, requests: dict[int, RequestModel], failed: dict[int, int],
                last_output: np.ndarray, end_ts: int, out: list[Violation]) -> None:
    """States open at the end of the trace that no later event can resolve: a transfer every expected rank
    reported that the scheduler never processed (after a later `step_output` of its scheduler, or PROCESS_NS
    before the end of the trace: a trace cut between a rank's report and the update that aggregates it is not
    one), and ranks that disagree for longer than DISAGREE_NS. A recorder gap or off after the last report leaves
    the state unjudged (the completion may be among the lost events)."""
    request_sk = cols.request_sk
    recorder = gaps(ctx)
    inst_codes = cols.codes("instance")[0]
    last_pos = int(cols.n) + 1
    for rk, req in requests.items():
        if req.last_rank_row < 0:
            continue
        report_pos = int(cols.pos[req.last_rank_row])
        if recorder.covers(int(inst_codes[req.last_rank_row]), report_pos, last_pos):
            continue
        for direction, pending, ranks in (("send", req.send_pending, req.send_ranks),
                                          ("recv", req.recv_open, req.recv_ranks)):
            if not pending or not ranks:
                continue
            sk = int(request_sk[rk])
            if sk in failed and int(cols.pos[failed[sk]]) <= int(cols.pos[req.last_rank_row]) + 1:
                continue  # the engine died before it could process the report (rulekit's crash policy)
            expected, source = expected_ranks(ctx, sk, direction, [])
            reported = len(ranks)
            held = list(req.filling) if direction == "recv" else []
            history = list(req.history) + [req.last_rank_row]
            extra = {"direction": direction, "ranks_reported": reported, "ranks_expected": expected,
                     "ranks_source": source, "sk_failed": sk in failed}
            later_output = int(last_output[sk]) > report_pos
            settled = later_output or end_ts - int(cols.ts[req.last_rank_row]) >= PROCESS_NS
            if (expected is None or reported >= expected) and settled:
                out.append(Violation("completion_not_processed", req.last_rank_row, sk, rk, held,
                                     req.describe(), history, extra))
            elif expected is not None and reported < expected and end_ts - req.first_rank_ts >= DISAGREE_NS \
                    and not req.skew_reported:
                extra["silent_s"] = round((end_ts - req.first_rank_ts) / 1e9, 3)
                out.append(Violation("ranks_disagree", req.last_rank_row, sk, rk, held,
                                     req.describe(), history, extra))
