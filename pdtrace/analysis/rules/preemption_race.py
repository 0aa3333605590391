"""preemption_race: a preempted request's blocks handed to another request while work that references them is open.

vLLM gives a preempted request's blocks up inside `schedule()` (`_preempt_request`: at once, or parked behind a step
fence where v0.33 defers frees) and the same call, or the next, may hand them to another request. Work started while
the victim owned them can still be reading or writing them: the KV store / offload job a connector runs in the
background (MooncakeStoreConnector, LMCache, OffloadingConnector), one tensor-parallel rank's part of it, a step in
flight whose connector saves what it computes. The rule of ownership this checks: **a block may change owner only
once every piece of work that references it under its old owner is done.** A write by the new owner while such work
is open stores the new owner's KV under the victim's keys (a later prefix hit loads it: silent corruption), or lets
a load for the victim overwrite the new owner's KV.

Algorithm (positions are the global time order of `pdtrace.analysis.columns`):
1. Hand-overs (`preempt_handovers`, a shared table): the ownership intervals (`blocks.ownership`) closed by a
   `blocks_free` with reason `preempted` whose block went back to the pool (no other holder right after the free)
   and whose next holder is another request Q, not as a prefix-cache hit (the block's index in Q's `blocks_alloc`
   list is at or past the row's detail `hit`: a hit reads the victim's KV, it does not write). For each: Q's
   allocation, Q's first write (its first `req_sched` or `req_wait_kv` at or after the allocation; the allocation
   itself where neither was recorded, allocate_slots runs for a request being scheduled, or where the allocation is
   an asynchronous load's destination that no `req_wait_kv` shows, see `step_in_flight`), the victim's
   resume (its next `blocks_alloc` after the free) and its last `req_sched` before the free (the step that used the
   blocks). One searchsorted join per lookup, over all hand-overs at once.
2. Work of the victim still open at Q's first write, in this order (one subrule per hand-over):
   - `late_rank_report` (error): a per-rank report (`kv_send_rank` / `kv_recv_rank`) of the victim after Q's first
     write and before its resume, while another rank of the same direction had already reported since the victim
     got the block: the transfer looked done, one rank still read or wrote the blocks.
   - `async_store` (error): a send / store completion (`kv_send_rank` or `kv_send_done`) of the victim after Q's
     first write, before its resume and before any finish of the victim: an asynchronous store or offload job was
     still reading blocks Q was writing. Reported in a step after Q's first write step: the job outlived a whole
     step of the new owner; reported in that very step (the connector may have flushed the job before the forward
     pass, `handle_preemptions`): warning.
   - `async_load` (error): the same for a receive (`kv_recv_done`, or `kv_recv_rank` with no earlier rank): a load
     for the victim wrote blocks Q owned.
   - `step_in_flight`: none of the above, the victim's last step before the free had no `step_output` yet when Q
     began writing, Q's write is not a `req_wait_kv` (premature_free's `async_load_reuse` reports those), and
     either Q's allocation is still an asynchronous load's destination (`blocks_alloc` detail `external` > 0, or
     Q's first allocation with `req_add` detail `remote_prefill`: a trace without the `req_wait_kv` row): error,
     the load is not ordered after the step's writes (vllm #45357); or the scheduler's connector saves running
     requests' KV in the background (engine_config `connector` names a store or offload connector,
     `STORE_CONNECTOR_WORDS`, or the trace has a `kv_send_rank` / `kv_send_done` of this scheduler for a request
     not finished at the time): warning, the step's save job may read the blocks after Q's write unless the
     connector flushes it on preemption (the trace cannot show the flush). Otherwise silent: plain compute on one
     stream is ordered.
   - `finished_while_preempted` (error; before `step_in_flight`): the victim's KV is for a peer to read (`req_add`
     detail `remote_decode`) and its `req_finish` (reason `stop`, `length` or `repetition`) came after the free and
     before any resume, at or after the output of its last step before the free, which was still in flight at the
     free (no `req_sched` of the victim in between): under async scheduling that older step's output finished the
     preempted request (vLLM 0.33's `update_from_output` appends a preempted request's in-flight tokens and checks
     the stop), holding no block, so the connector has nothing to send (`delay_free` false; NIXL's
     `request_finished` delays only a request with blocks) and the decode side reads nothing, its KV now the new
     owner's. Issue 22 item 7, on a prefill instance. `extra.finish_step`, `delay_free`.
One finding per (free row, new owner, subrule), the blocks grouped; evidence: the preemption, the free, the step
that used the blocks, the hand-over allocation, Q's first write, and the late completion (plus the earlier rank
reports for `late_rank_report`).

Not seen by the vLLM 0.33 hooks: connectors report a store job's completion (`finished_sending`) only for finished
requests, so a store of a running request that a preemption interrupts leaves no row; those traces show
`step_in_flight` at most. A `computed_tokens` check (a resumed request's `num_computed_tokens` against its block
table) needs the computed-token count, which no kind records: `blocks_alloc` has `external` only for asynchronous
loads, so a prefix a connector loads synchronously on the resume looks the same as a count that went wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (NO, Columns, FindingsBuilder, Rule, columns, detail_int, detail_numbers,
                                      engine_configs, first_per_key, fmt_blocks, groups, int_column_at, last_before,
                                      last_sched_before, next_at_or_after, ownership, remote_flags, request_state,
                                      shared_table, step_index)

#: Words of an engine_config `connector` name that mark a connector saving running requests' KV in the background.
STORE_CONNECTOR_WORDS = ("offload", "lmcache", "store", "flexkv", "3fs")

SUBRULES = ("late_rank_report", "async_store", "async_load", "step_in_flight", "finished_while_preempted")


@dataclass
class Handovers:
    """Preempted blocks that went to another request, one entry per (interval, block); NO where absent."""

    interval: np.ndarray     # the victim's interval (blocks.ownership index)
    next_interval: np.ndarray
    victim: np.ndarray       # request keys
    owner: np.ndarray
    sk: np.ndarray
    block: np.ndarray
    free_row: np.ndarray
    free_pos: np.ndarray
    alloc_row: np.ndarray    # the new owner's allocation
    write_row: np.ndarray    # the new owner's first req_sched / req_wait_kv at or after its allocation
    write_pos: np.ndarray
    write_is_load: np.ndarray   # the first write is a req_wait_kv (an asynchronous load the trace shows)
    load_unseen: np.ndarray     # the allocation is an asynchronous load's destination with no req_wait_kv row
    resume_pos: np.ndarray   # the victim's next blocks_alloc after the free (NO: never)
    sched_row: np.ndarray    # the victim's last req_sched before the free

    def __len__(self) -> int:
        return len(self.interval)


def _index_in_row(cols: Columns, rows: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Index of each block in its row's `blocks` list (NO if absent), for the few rows asked about."""
    flat_rows, flat_ids = cols.block_rows
    out = np.full(len(rows), NO, np.int64)
    if len(rows) == 0 or len(flat_rows) == 0:
        return out
    wanted = np.unique(rows)
    # a row's entries are contiguous and in list order (flat_rows ascends): one range per wanted row
    lo = np.searchsorted(flat_rows, wanted, "left")
    length = np.searchsorted(flat_rows, wanted, "right") - lo
    index = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    mine = np.repeat(lo, length) + index
    entry_rows = flat_rows[mine].astype(np.int64)
    width = int(max(int(flat_ids.max()), int(blocks.max()))) + 1
    key = entry_rows * width + flat_ids[mine]
    order = np.argsort(key, kind="stable")
    key, index = key[order], index[order]
    query = rows.astype(np.int64) * width + blocks
    at = np.minimum(np.searchsorted(key, query), len(key) - 1)
    found = key[at] == query
    out[found] = index[at[found]]
    return out


def _loads_without_wait_kv(ctx: Any, alloc_row: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Per hand-over: the new owner's allocation is an asynchronous load's destination although no `req_wait_kv`
    row shows it: its `blocks_alloc` detail has `external` > 0, or, on a scheduler with no `req_wait_kv` row at all
    (a trace written without the kind), it is the first allocation of a request whose `req_add` says
    `remote_prefill` (where the kind is recorded, such a request with no wait had its prefix locally)."""
    cols = columns(ctx)
    st = request_state(ctx)
    if len(alloc_row) == 0:
        return np.zeros(0, bool)
    rows, which = np.unique(alloc_row, return_inverse=True)
    external = detail_int(ctx, rows, "external", fill=0)[which] > 0
    add_pos = st.add_pos[owner]
    added = add_pos >= 0  # an owner without a req_add row (a trace cut at its start) is not remote_prefill
    add_rows, at = np.unique(cols.order[add_pos[added]], return_inverse=True)
    remote = np.zeros(len(owner), bool)
    remote[added] = (detail_numbers(ctx, add_rows, ["remote_prefill"], optional=["remote_prefill"])["remote_prefill"]
                     == 1)[at]
    a_rows = cols.req_rows("blocks_alloc")
    first = first_per_key(cols.rk[a_rows], cols.pos[a_rows], cols.n_requests)[owner]
    waits = np.bincount(cols.sk[cols.req_rows("req_wait_kv")], minlength=len(cols.sk_names)) > 0
    unrecorded = ~waits[cols.request_sk[owner]]
    return external | (remote & unrecorded & (first == cols.pos[alloc_row]))


def _first_at_or_after(cols: Columns, kind: str, rk: np.ndarray, pos: np.ndarray, strict: bool = False) -> np.ndarray:
    """Row of each request's first `kind` row at (or strictly after) pos, NO if none; only the rows of the requests
    asked about are searched (the searched side is sorted per call)."""
    rows, keys = cols.req_rows(kind), cols.req_keys(kind)
    wanted = np.zeros(cols.n_requests, bool)
    wanted[rk] = True
    mine = wanted[keys]
    rows, keys = rows[mine], keys[mine]
    idx = next_at_or_after(rk, pos, keys, cols.pos[rows], strict=strict)
    return np.where(idx >= 0, rows[np.maximum(idx, 0)] if len(rows) else NO, NO).astype(np.int64)


def _build(ctx: Any) -> Handovers:
    cols = columns(ctx)
    own = ownership(ctx)
    reason, _ = cols.codes("reason")
    preempted = cols.code_of("reason", "preempted")
    free_rows = cols.req_rows("blocks_free")
    if not (reason[free_rows] == preempted).any():  # no preemption free: nothing to hand over
        empty = np.empty(0, np.int64)
        return Handovers(*([empty] * 11), np.empty(0, bool), np.empty(0, bool), empty, empty)
    freed = np.flatnonzero(own.free_row >= 0)
    freed = freed[reason[own.free_row[freed]] == preempted]
    nxt = own.next_alloc_after(freed)
    keep = nxt >= 0
    freed, nxt = freed[keep], nxt[keep]
    keep = (own.rk[nxt] != own.rk[freed]) & (own.others_at_free(freed) == 0)
    freed, nxt = freed[keep], nxt[keep]
    alloc_row = own.alloc_row[nxt].astype(np.int64)
    if len(freed):  # a prefix-cache hit reads the victim's KV, it does not write it
        rows, which = np.unique(alloc_row, return_inverse=True)
        hits = detail_int(ctx, rows, "hit", fill=0)[which]
        index = _index_in_row(cols, alloc_row, own.block[nxt].astype(np.int64))
        keep = (index < 0) | (index >= hits)
        freed, nxt, alloc_row = freed[keep], nxt[keep], alloc_row[keep]
    victim = own.rk[freed].astype(np.int64)
    owner = own.rk[nxt].astype(np.int64)
    free_pos = own.free_pos[freed].astype(np.int64)
    # the new owner's first write
    got = own.alloc_pos[nxt].astype(np.int64)
    sched = _first_at_or_after(cols, "req_sched", owner, got)
    wait = _first_at_or_after(cols, "req_wait_kv", owner, got)
    sched_pos = np.where(sched >= 0, cols.pos[np.maximum(sched, 0)], np.iinfo(np.int64).max)
    wait_pos = np.where(wait >= 0, cols.pos[np.maximum(wait, 0)], np.iinfo(np.int64).max)
    write_row = np.where(wait_pos < sched_pos, wait, sched)
    # no req_sched / req_wait_kv recorded after it (a hand-made trace): allocate_slots runs for a request being
    # scheduled, so the allocation stands for the write
    write_row = np.where(write_row >= 0, write_row, alloc_row)
    write_is_load = (write_row >= 0) & (cols.codes("kind")[0][np.maximum(write_row, 0)]
                                        == cols.code_of("kind", "req_wait_kv"))
    # a load the trace shows only by its destination starts writing at the allocation
    load_unseen = _loads_without_wait_kv(ctx, alloc_row, owner) & ~write_is_load
    write_row = np.where(load_unseen, alloc_row, write_row)
    write_pos = np.where(write_row >= 0, cols.pos[np.maximum(write_row, 0)], NO).astype(np.int64)
    resume = _first_at_or_after(cols, "blocks_alloc", victim, free_pos, strict=True)
    resume_pos = np.where(resume >= 0, cols.pos[np.maximum(resume, 0)], NO)
    sched_row = last_sched_before(ctx, victim, free_pos).astype(np.int64)
    return Handovers(freed, nxt, victim, owner, own.sk[freed].astype(np.int64), own.block[freed].astype(np.int64),
                     own.free_row[freed].astype(np.int64), free_pos, alloc_row, write_row, write_pos,
                     write_is_load, load_unseen, resume_pos.astype(np.int64), sched_row)


@shared_table(ownership, request_state, cost=0.02)
def preempt_handovers(ctx: Any) -> Handovers:
    """Preempted blocks handed to another request (see the module docstring, step 1), cached on the context."""
    return ctx.cached("preemption_race.handovers", lambda: _build(ctx))


def _storing_schedulers(ctx: Any) -> np.ndarray:
    """Per scheduler key: its connector saves running requests' KV in the background (engine_config's connector
    name, or a send completion in the trace for a request not finished at the time)."""
    cols = columns(ctx)
    st = request_state(ctx)
    out = np.zeros(len(cols.sk_names), bool)
    for sk, cfg in engine_configs(ctx).items():
        name = str(cfg.get("connector") or "").lower()
        out[sk] = any(word in name for word in STORE_CONNECTOR_WORDS)
    rows = cols.req_rows("kv_send_rank", "kv_send_done")
    fin = st.finish_pos[cols.rk[rows]]
    running = (fin < 0) | (fin > cols.pos[rows])
    out[np.unique(cols.sk[rows[running]])] = True
    return out


_TEXT = {
    "late_rank_report": "a rank reported its part of {victim}'s {what} only after {owner} began writing them, "
                        "while other ranks had reported before: that rank was still {verb} them",
    "async_store": "{victim}'s asynchronous {what} completed only after {owner} began writing them: the job read "
                   "{owner}'s KV and stores it under {victim}'s keys",
    "async_load": "{victim}'s asynchronous {what} completed only after {owner} began writing them: the load wrote "
                  "into blocks {owner} owned",
    "step_in_flight": "step {step}, which used them for {victim}, was still in flight when {owner} began writing "
                      "them, and this instance's connector saves KV in the background: unless it flushed that "
                      "step's save on the preemption, the save read {owner}'s KV",
    "finished_while_preempted": "step {step}, in flight when {victim} was preempted, then finished {victim} "
                                "normally without a block: nothing is left to send, and the decode side that "
                                "reads {victim}'s KV gets none ({owner} holds those blocks now)",
    "step_in_flight_load": "step {step}, which used them for {victim}, was still in flight when {owner}'s "
                           "asynchronous load (remote or offloaded KV) began writing them: the load is not ordered "
                           "after the step's writes",
}


def _finished_by_older_step(ctx: Any, h: Handovers, step: np.ndarray, out_pos: np.ndarray) -> np.ndarray:
    """Per hand-over: `finished_while_preempted` (see the module docstring). Numpy over the hand-overs."""
    cols = columns(ctx)
    st = request_state(ctx)
    fin = st.finish_pos[h.victim].astype(np.int64)
    _, decode, _, _ = cols.once("requests.remote_flags", lambda: remote_flags(cols, cols.n_requests))
    fin_row = np.where(fin >= 0, cols.order[np.maximum(fin, 0)], NO)
    reason = cols.codes("reason")[0][np.maximum(fin_row, 0)]
    normal = np.isin(reason, [cols.code_of("reason", r) for r in ("stop", "length", "repetition")])
    before_resume = (h.resume_pos < 0) | (fin < h.resume_pos)
    # the step that finished it: the victim's last step before the free, still in flight there, no schedule since
    stale = (h.sched_row >= 0) & (out_pos > h.free_pos) & (fin >= out_pos)
    last = last_sched_before(ctx, h.victim, np.maximum(fin, 0))
    stale &= last == h.sched_row
    return decode[h.victim] & (fin > h.free_pos) & normal & before_resume & stale & (step >= 0)


def run(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    st = request_state(ctx)
    si = step_index(ctx)
    h = preempt_handovers(ctx)
    if len(h) == 0:
        return FindingsBuilder(ctx, "preemption_race").frame()
    kind, knames = cols.codes("kind")
    ok = h.write_row >= 0
    resume = np.where(h.resume_pos >= 0, h.resume_pos, np.iinfo(np.int64).max)

    # the victim's first completion after the new owner's first write
    comp_rows = cols.req_rows("kv_send_rank", "kv_send_done", "kv_recv_rank", "kv_recv_done")
    c_idx = next_at_or_after(h.victim, h.write_pos, cols.rk[comp_rows], cols.pos[comp_rows], strict=True)
    comp_row = np.where(ok & (c_idx >= 0), comp_rows[np.maximum(c_idx, 0)] if len(comp_rows) else NO, NO)
    comp_pos = np.where(comp_row >= 0, cols.pos[np.maximum(comp_row, 0)], NO).astype(np.int64)
    fin = st.finish_pos[h.victim]
    late = (comp_row >= 0) & (comp_pos < resume) & ((fin < 0) | (fin > comp_pos))
    comp_kind = np.where(comp_row >= 0, kind[np.maximum(comp_row, 0)], NO)
    codes = {k: cols.code_of("kind", k) for k in ("kv_send_rank", "kv_send_done", "kv_recv_rank", "kv_recv_done")}
    is_send = np.isin(comp_kind, [codes["kv_send_rank"], codes["kv_send_done"]])
    is_rank = np.isin(comp_kind, [codes["kv_send_rank"], codes["kv_recv_rank"]])
    # an earlier rank report of the same direction since the victim got the block
    earlier = np.full(len(h), NO, np.int64)
    own = ownership(ctx)
    got_pos = own.alloc_pos[h.interval].astype(np.int64)
    for direction in ("send", "recv"):
        rows = cols.req_rows(f"kv_{direction}_rank")
        sel = np.flatnonzero(late & is_rank & (is_send == (direction == "send")))
        if len(sel) == 0 or len(rows) == 0:
            continue
        idx = last_before(h.victim[sel], h.write_pos[sel], cols.rk[rows], cols.pos[rows], strict=True)
        found = idx >= 0
        prev = rows[np.maximum(idx, 0)]
        other_rank = ((int_column_at(cols, "pp_rank", prev) != int_column_at(cols, "pp_rank", comp_row[sel]))
                      | (int_column_at(cols, "tp_rank", prev) != int_column_at(cols, "tp_rank", comp_row[sel])))
        after_got = found & (cols.pos[prev] > got_pos[sel]) & other_rank
        earlier[sel[after_got]] = prev[after_got]

    subrule = np.full(len(h), "", dtype=object)
    subrule[late & is_rank & (earlier >= 0)] = "late_rank_report"
    subrule[late & (subrule == "") & is_send] = "async_store"
    subrule[late & (subrule == "") & ~is_send] = "async_load"
    # step_in_flight: the victim's last step before the free still in flight at the new owner's first write
    step = np.where(h.sched_row >= 0, cols.step[np.maximum(h.sched_row, 0)], NO).astype(np.int64)
    out_pos = si.output_pos_of(h.sk, step)
    flying = (h.sched_row >= 0) & ((out_pos > h.write_pos) | ((out_pos < 0) & si.has_outputs[h.sk]))
    finished_stale = _finished_by_older_step(ctx, h, step, out_pos)
    subrule[(subrule == "") & finished_stale] = "finished_while_preempted"
    storing = _storing_schedulers(ctx)
    async_write = h.load_unseen
    subrule[ok & (subrule == "") & flying & ~h.write_is_load & (storing[h.sk] | async_write)] = "step_in_flight"

    hit = np.flatnonzero(subrule != "")
    if len(hit) == 0:
        return FindingsBuilder(ctx, "preemption_race").frame()
    sub_code = np.array([SUBRULES.index(s) for s in subrule[hit]], np.int64)
    key = (h.free_row[hit] * (cols.n_requests + 1) + h.owner[hit]) * len(SUBRULES) + sub_code
    found = FindingsBuilder(ctx, "preemption_race")
    ev = found.evidence
    preempt_rows = cols.req_rows("req_preempt")
    p_idx = last_before(h.victim[hit], h.free_pos[hit] + 1, cols.rk[preempt_rows], cols.pos[preempt_rows])
    preempt_row = np.where(p_idx >= 0, preempt_rows[np.maximum(p_idx, 0)] if len(preempt_rows) else NO, NO)
    members = groups(key)
    firsts = hit[[int(g[0]) for g in members]]
    ev.refs(np.concatenate([h.free_row[firsts], h.alloc_row[firsts], h.write_row[firsts], h.sched_row[firsts],
                            comp_row[firsts], earlier[firsts], preempt_row[[int(g[0]) for g in members]]]))
    for g in members:  # one per finding
        i = int(hit[g[0]])
        sub = str(subrule[i])
        blocks = sorted(int(b) for b in h.block[hit[g]])
        free_ref = ev.ref(int(h.free_row[i]), "preempted: blocks given up here")
        victim = free_ref.get("req")
        owner = ev.ref(int(h.alloc_row[i])).get("req")
        evidence = []
        if preempt_row[g[0]] >= 0:
            evidence.append(ev.ref(int(preempt_row[g[0]]), "preempted"))
        evidence.append(free_ref)
        if h.sched_row[i] >= 0:
            evidence.append(ev.ref(int(h.sched_row[i]), f"step {int(step[i])} used the blocks"))
        if h.write_row[i] != h.alloc_row[i]:
            evidence.append(ev.ref(int(h.alloc_row[i]), f"handed to {owner}"))
            evidence.append(ev.ref(int(h.write_row[i]), f"{owner} writes them from here"))
        else:
            evidence.append(ev.ref(int(h.alloc_row[i]), f"handed to {owner}, which writes them from here"))
        severity = "error"
        extra: dict[str, Any] = {"new_owner": owner, "victim_step": int(step[i]) if step[i] >= 0 else None}
        what = verb = ""
        if sub in ("late_rank_report", "async_store", "async_load"):
            what = "store / send" if is_send[i] else "load / receive"
            verb = "reading" if is_send[i] else "writing"
            if earlier[i] >= 0:
                evidence.append(ev.ref(int(earlier[i]), "another rank had reported before"))
            c_ref = ev.ref(int(comp_row[i]), f"{victim}'s {what} completed only here")
            evidence.append(c_ref)
            c_step = int(cols.step[comp_row[i]])
            w_step = int(cols.step[h.write_row[i]])
            extra["completion"] = c_ref.get("kind")
            if sub == "async_store" and c_step >= 0 and c_step == w_step:
                severity = "warning"
                extra["same_step"] = True
        elif sub == "step_in_flight":
            severity = "error" if async_write[i] else "warning"
            extra["async_load"] = bool(async_write[i])
            out_row = si.output_row_of(np.array([h.sk[i]]), np.array([step[i]]))[0]
            if out_row >= 0:
                evidence.append(ev.ref(int(out_row), f"step {int(step[i])}'s output came only here"))
        elif sub == "finished_while_preempted":
            fin_row = int(cols.order[st.finish_pos[h.victim[i]]])
            out_row = si.output_row_of(np.array([h.sk[i]]), np.array([step[i]]))[0]
            if out_row >= 0:
                evidence.append(ev.ref(int(out_row), f"step {int(step[i])}'s output, after the preemption"))
            fin_ref = ev.ref(fin_row, f"{victim} finished by that output, holding no block")
            evidence.append(fin_ref)
            delay = cols.table.column("delay_free")[fin_row].as_py()
            extra.update(finish_step=fin_ref.get("step"), delay_free=delay)
        text = _TEXT["step_in_flight_load" if sub == "step_in_flight" and async_write[i] else sub]
        message = (f"blocks {fmt_blocks(blocks)} of preempted {victim} went to {owner}, and "
                   + text.format(victim=victim, owner=owner, what=what, verb=verb, step=int(step[i])))
        if severity == "warning" and sub == "async_store":
            message += (" (reported in the step of that write: the connector may have flushed the job before the "
                        "forward pass)")
        found.add(sub, severity, message, evidence, at=int(h.free_row[i]), sk=int(h.sk[i]), blocks=blocks,
                  extra=extra)
    return found.frame()


RULE = Rule(
    id="preemption_race",
    summary="a preempted request's blocks handed to another request while its store, load, per-rank transfer or "
            "in-flight step still referenced them",
    run=run,
    subrules=SUBRULES,
    needs=(preempt_handovers, request_state, step_index),
    cost=0.02,
)
