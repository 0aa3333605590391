"""premature_free: blocks given up too early.

Algorithm (all over arrays of `blocks_free` rows and ownership intervals; positions are the global time order):

- `unfinished`: a free whose reason is not `preempted`, `skipped` or `load_failed` (the frees vLLM makes for running
  requests) while the request is not finished: no `req_finish` before it, and it is not the free of
  `_free_request` itself (the recorder writes that free just before `req_finish`: same step, no `req_sched` between).
- `send_open`: a free while the request's send is open: `req_finish` with delay_free (not for a pending receive) and
  no `kv_send_done` / `kv_expire` since (v10: an abort during the delayed free re-runs `_free_request`).
- `recv_open`: a free (other than `load_failed`) while the request waits for remote KV: after `req_wait_kv`, before
  the receive closed (`kv_recv_done`; a `kv_recv_fail` only where no `kv_recv_done` follows: requests.py) (v10 frees
  an aborted `WAITING_FOR_REMOTE_KVS` request at once; v33 waits). Not when the load was deferred and never started
  (`_load_never_started`: v33's `deferred_loads`, freed at once by `finish_requests` as vLLM intends).
- `quorum` (the per-rank check lives here): where the instance has `kv_send_rank` / `kv_recv_rank` rows, an
  aggregated `kv_send_done` / `kv_recv_done` reached the scheduler before every expected rank reported (expected =
  `rulekit.expected_ranks`, the one definition leaked_blocks uses too: detail `expected_ranks`, else the
  scheduler's completions' `expected_ranks`, else engine_config tp*pp, else the ranks that reported that direction
  for any request of the scheduler): the blocks are freed while some rank still transfers. A `recorder_gap` or
  `recorder_off` of the instance between the request's finish (else the completion) and the completion, or a
  gap of unknown size (a killed process's loss, which runs to its end) before the completion, may hold the silent
  rank's report (e.g. a worker SIGKILLed by vLLM's shutdown before its last hand-over): the finding is a warning
  then (extra `downgraded`), and says so.
- `async_load_reuse`: a freed block handed (a later `req_wait_kv` allocation) to a request whose KV arrives
  asynchronously before the step_output of the freeing request's last step: the remote write races that step.
  Freeing under a step in flight is otherwise normal (same-stream GPU order) and not reported. A sliding-window
  trim (reason `skipped`) races only when that step still reads the trimmed block (`_trims_still_read`, from the
  trim's detail; vllm#47282); a trim without that detail is reported as a warning (`downgraded` no_trim_window).
- `not_deferred`: an immediate free (deferred=false) on a scheduler whose engine_config says `defer_block_free`
  while the request's last scheduled step is still in flight (no step_output yet). Never a trim: vLLM does not
  fence them, by design.
One finding per free row and subrule (the first of unfinished, send_open, recv_open, not_deferred), blocks grouped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (NO, FindingsBuilder, Rule, columns, declared_ranks, defer_block_free,
                                      expected_ranks, fmt_blocks, gaps, groups, last_sched_before,
                                      next_at_or_after, ownership, request_state, step_index)

# `last_sched_before` lived here (other rules and the lifecycle model imported it from this module); it is now
# `pdtrace.analysis.requests.last_sched_before`, imported above, so the old import path still works.

RUNNING_FREE_REASONS = ("preempted", "skipped", "load_failed")


def _free_rows(ctx: Any) -> dict[str, np.ndarray]:
    cols = columns(ctx)
    st = request_state(ctx)
    rows = cols.req_rows("blocks_free")
    rk = cols.rk[rows]
    pos = cols.pos[rows]
    reason, names = cols.codes("reason")
    running_ok = np.isin(reason[rows], [names.index(r) for r in RUNNING_FREE_REASONS if r in names])
    load_failed = reason[rows] == cols.code_of("reason", "load_failed")
    unfinished = ~running_ok & ~st.finished_by(cols, rows)
    send_open = st.send_open_at(rk, pos)
    recv_open = st.recv_open_at(rk, pos) & ~load_failed
    cand = np.flatnonzero(recv_open)
    if len(cand):
        recv_open[cand[_load_never_started(ctx, rows[cand])]] = False
    return {"rows": rows, "rk": rk, "pos": pos, "unfinished": unfinished, "send_open": send_open,
            "recv_open": recv_open}


def _load_never_started(ctx: Any, free_rows: np.ndarray) -> np.ndarray:
    """For frees made while a receive was open: the receive's load was deferred and never started, so nothing
    writes the blocks (vLLM 0.33's deferred async loads, `Scheduler.deferred_loads`: on a scheduler that defers
    frees, a load allocated while a step is in flight starts only in the update of a later non-empty step, when
    `_drain_deferred_loads` runs; `finish_requests` frees an aborted request whose load is still deferred at once).
    True where the free is the request's final one at a finish with delay_free false (vLLM decided no receive
    was pending), its scheduler defers frees, a step was in flight at the `req_wait_kv` (scheduled before it, no
    `step_output` yet), and no non-empty step had its `step_output` between the `req_wait_kv` and the free."""
    cols = columns(ctx)
    st = request_state(ctx)
    rk = cols.rk[free_rows]
    sk = cols.sk[free_rows]
    pos = cols.pos[free_rows]
    wait = st.recv_window_at(rk, pos)[0]  # the req_wait_kv of the receive open at the free
    ok = st.finished_by(cols, free_rows) & ~st.delay_free[rk] & (st.finish_pos[rk] >= 0) & (wait >= 0)
    ok &= defer_block_free(ctx)[sk]
    if not ok.any():
        return ok
    si = step_index(ctx)
    outs = cols.rows_of("step_output")
    busy = outs[si.tokens_of(cols.sk[outs], cols.step[outs]) > 0]
    drain = next_at_or_after(sk, wait, cols.sk[busy], cols.pos[busy], strict=True)
    drain_pos = np.where(drain >= 0, cols.pos[busy[np.maximum(drain, 0)]] if len(busy) else NO, NO)
    ok &= (drain_pos < 0) | (drain_pos > pos)
    # a step in flight at the req_wait_kv: scheduled (its `sched` row) before it, its step_output after it or never
    # (sched rows, not step_submit: a scheduler driven without an engine loop, as vLLM's unit tests do, has none)
    sched = cols.rows_of("sched")
    for i in np.flatnonzero(ok).tolist():  # a few frees: those flagged recv_open that could be deferred loads
        earlier = sched[(cols.sk[sched] == sk[i]) & (cols.pos[sched] < wait[i])]
        out_pos = si.output_pos_of(cols.sk[earlier], cols.step[earlier])
        ok[i] = bool(((out_pos < 0) | (out_pos > wait[i])).any())
    return ok


def _not_deferred(ctx: Any, fr: dict[str, np.ndarray]) -> np.ndarray:
    cols = columns(ctx)
    out = np.zeros(len(fr["rows"]), bool)
    defer = defer_block_free(ctx)
    if not defer.any():
        return out
    rows = fr["rows"]
    sk = cols.sk[rows]
    value, valid = cols.bools_at("deferred", rows)
    # a sliding-window trim (reason `skipped`) is never fenced, by design (remove_skipped_blocks returns the blocks
    # at once): only a trim the step in flight still reads is premature, which `async_load_reuse` judges
    trim = cols.codes("reason")[0][rows] == cols.code_of("reason", "skipped")
    cand = np.flatnonzero(defer[sk] & valid & ~value & ~trim)
    if len(cand) == 0:
        return out
    si = step_index(ctx)
    sched_row = last_sched_before(ctx, fr["rk"][cand], fr["pos"][cand])
    has = sched_row >= 0
    step = np.where(has, cols.step[np.maximum(sched_row, 0)], NO)
    out_pos = si.output_pos_of(sk[cand], step)
    flying = has & ((out_pos > fr["pos"][cand]) | ((out_pos < 0) & si.has_outputs[sk[cand]]))
    out[cand[flying]] = True
    return out


# where the expected rank count was recorded for this completion (its detail, engine_config); the other sources of
# rulekit.expected_ranks are inferred, and the finding says which
_RECORDED_RANK_SOURCES = ("expected_ranks of its completion", "engine_config tp*pp")


def _quorum(ctx: Any, found: FindingsBuilder) -> None:
    cols = columns(ctx)
    rank_rows = cols.rows_of("kv_send_rank", "kv_recv_rank")
    if len(rank_rows) == 0:
        return
    inst, _ = cols.codes("instance")
    req, _ = cols.codes("req")
    kind, knames = cols.codes("kind")
    send_rank = knames.index("kv_send_rank") if "kv_send_rank" in knames else -9
    pp = cols.table.column("pp_rank").to_pandas().fillna(-1).to_numpy().astype(np.int64)
    tp = cols.table.column("tp_rank").to_pandas().fillna(-1).to_numpy().astype(np.int64)
    ranks = pd.DataFrame({"inst": inst[rank_rows], "req": req[rank_rows],
                          "send": kind[rank_rows] == send_rank, "rpos": cols.pos[rank_rows],
                          "rank": pp[rank_rows] * 10_000 + tp[rank_rows]})
    done_rows = cols.rows_of("kv_send_done", "kv_recv_done")
    done_rows = done_rows[np.isin(inst[done_rows], np.unique(ranks["inst"]))]
    if len(done_rows) == 0:
        return
    send_done = cols.code_of("kind", "kv_send_done")
    done = pd.DataFrame({"row": done_rows, "inst": inst[done_rows], "req": req[done_rows],
                         "send": kind[done_rows] == send_done, "pos": cols.pos[done_rows]})
    joined = done.merge(ranks, on=["inst", "req", "send"], how="left")
    joined = joined[joined["rpos"].isna() | (joined["rpos"] < joined["pos"])]
    got = joined.groupby("row")["rank"].nunique()
    details = cols.details(done_rows)
    ev = found.evidence
    gp = gaps(ctx)
    finish_pos = request_state(ctx).finish_pos
    rk_all = cols.rk
    for row, detail in zip(done_rows.tolist(), details):  # one per completion on an instance with rank rows
        direction = "send" if kind[row] == send_done else "recv"
        expected, source = expected_ranks(ctx, int(cols.sk[row]), direction, declared_ranks([detail]))
        if not expected:
            continue
        have = int(got.get(row, 0))
        if have >= int(expected):
            continue
        mine = ranks[(ranks["inst"] == inst[row]) & (ranks["req"] == req[row]) & (ranks["send"] == (direction == "send"))]
        rank_rows_before = rank_rows[np.isin(cols.pos[rank_rows], mine["rpos"][mine["rpos"] < cols.pos[row]])]
        evidence = [ev.ref(row, f"aggregated kv_{direction}_done after {have} of {expected} ranks")]
        evidence += [ev.ref(int(r), "rank reported") for r in rank_rows_before[:8].tolist()]
        reqname = ev.ref(row).get("req")
        rk_row, pos_row = int(rk_all[row]), int(cols.pos[row])
        since = int(finish_pos[rk_row]) if rk_row >= 0 and 0 <= finish_pos[rk_row] <= pos_row else pos_row
        gap = gp.covers(int(inst[row]), since, pos_row)
        found.add("quorum", "warning" if gap else "error",
                  f"kv_{direction}_done for {reqname} reached the scheduler after {have} of {expected} ranks "
                  f"reported: its blocks are freed while other ranks may still transfer them"
                  + ("" if source in _RECORDED_RANK_SOURCES else f" ({expected} expected from {source})")
                  + (f" ({gap} in the trace before it: a rank's report may be among the lost events)"
                     if gap else ""),
                  evidence, at=row, context=f"premature_free:quorum:{direction}",
                  extra={"ranks_reported": have, "ranks_expected": int(expected), "direction": direction,
                         **({} if source in _RECORDED_RANK_SOURCES else {"ranks_source": source}),
                         **({"downgraded": gap} if gap else {})})


SUBRULE_TEXT = {
    "unfinished": "freed while the request was still unfinished",
    "send_open": "freed while the request's KV send was still open (finished with delay_free, no kv_send_done yet)",
    "recv_open": "freed while the request was still waiting for remote KV (no kv_recv_done / kv_recv_fail yet)",
    "not_deferred": "freed immediately although this scheduler defers frees (defer_block_free) and the request's "
                    "last step was still in flight",
}


def run(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    st = request_state(ctx)
    own = ownership(ctx)
    fr = _free_rows(ctx)
    fr["not_deferred"] = _not_deferred(ctx, fr)
    found = FindingsBuilder(ctx, "premature_free")
    ev = found.evidence
    si = step_index(ctx)
    reason_codes, reason_names = cols.codes("reason")

    flagged = np.zeros(len(fr["rows"]), bool)
    subrule = np.full(len(fr["rows"]), "", dtype=object)
    for name in ("unfinished", "send_open", "recv_open", "not_deferred"):
        hit = fr[name] & ~flagged
        subrule[hit] = name
        flagged |= hit
    idx = np.flatnonzero(flagged)
    if len(idx):
        free_rows = fr["rows"][idx]
        # the intervals each flagged free closed: allocation rows as evidence
        closes = pd.DataFrame({"free_row": own.free_row, "alloc_row": own.alloc_row, "block": own.block})
        closes = closes[closes["free_row"].isin(free_rows)]
        first_alloc = closes.groupby("free_row")["alloc_row"].min()
        sched_rows = last_sched_before(ctx, fr["rk"][idx], fr["pos"][idx])
        ev.refs(np.concatenate([free_rows, first_alloc.to_numpy(), sched_rows]))
        for i, free_row, sched_row in zip(idx.tolist(), free_rows.tolist(), sched_rows.tolist()):
            rk = int(fr["rk"][i])
            pos = int(fr["pos"][i])
            sub = str(subrule[i])
            sk = int(cols.sk[free_row])
            free_ref = ev.ref(free_row, "blocks given up here")
            blocks = list(free_ref.get("blocks") or [])
            evidence = [free_ref]
            if free_row in first_alloc.index:
                evidence.append(ev.ref(int(first_alloc[free_row]), "allocated here"))
            if sub == "send_open":
                evidence.append(ev.ref(int(cols.order[st.finish_pos[rk]]), "finished with delay_free: send open"))
            elif sub == "recv_open":
                wait = int(st.recv_window_at(np.array([rk]), np.array([pos]))[0][0])
                evidence.append(ev.ref(int(cols.order[wait]), "waiting for remote KV since"))
            elif sub == "unfinished" and st.finish_pos[rk] > pos:
                evidence.append(ev.ref(int(cols.order[st.finish_pos[rk]]), "finished only later"))
            if sched_row >= 0:
                evidence.append(ev.ref(int(sched_row), "last scheduled before the free"))
            flying = si.in_flight_rows(sk, pos)
            for r in flying[:4]:
                evidence.append(ev.ref(int(r), "step in flight at the free"))
            rc = reason_codes[free_row]
            reason = reason_names[rc] if rc >= 0 else None
            req = free_ref.get("req")
            found.add(sub, "error", f"blocks {fmt_blocks(blocks)} of {req} {SUBRULE_TEXT[sub]} (free reason {reason})",
                      evidence, at=free_row, blocks=blocks, context=f"premature_free:{sub}:{reason}",
                      extra={"free_reason": reason, "steps_in_flight": len(flying)})

    _async_reuse(ctx, found)
    _quorum(ctx, found)
    return found.frame()


def _async_reuse(ctx: Any, found: FindingsBuilder) -> None:
    cols = columns(ctx)
    ev = found.evidence
    own = ownership(ctx)
    si = step_index(ctx)
    # only frees under a step still in flight can race: the freeing request's last step before the free has no
    # step_output yet; only for those is the block's next req_wait_kv allocation looked up
    freed = np.flatnonzero(own.free_row >= 0)
    if len(freed) == 0:
        return
    sched_row = last_sched_before(ctx, own.rk[freed], own.free_pos[freed])
    has = sched_row >= 0
    step = np.where(has, cols.step[np.maximum(sched_row, 0)], NO)
    out_pos = si.output_pos_of(own.sk[freed], step)
    flying = has & ((out_pos > own.free_pos[freed]) | ((out_pos < 0) & si.has_outputs[own.sk[freed]]))
    cand = freed[flying]
    wait_row = own.next_wait_kv_after(cand)
    wait_pos = np.where(wait_row >= 0, cols.pos[np.maximum(wait_row, 0)], NO)
    out_c = out_pos[flying]
    racing = (wait_row >= 0) & ((out_c > wait_pos) | (out_c < 0))
    hit = cand[racing]
    if len(hit) == 0:
        return
    sched_hit = sched_row[flying][racing]
    wait_hit = wait_row[racing]
    still_read, no_facts = _trims_still_read(ctx, hit)
    keep = still_read | no_facts
    hit, sched_hit, wait_hit, no_facts = hit[keep], sched_hit[keep], wait_hit[keep], no_facts[keep]
    if len(hit) == 0:
        return
    # one finding per (free row, wait_kv row)
    key = own.free_row[hit].astype(np.int64) * (cols.n + 1) + wait_hit
    for group in groups(key):
        members = hit[group]
        first = int(members[0])
        free_row = int(own.free_row[first])
        wait_row = int(wait_hit[group[0]])
        srow = int(sched_hit[group[0]])
        blocks = sorted(int(b) for b in own.block[members])
        sk = int(own.sk[first])
        ev.refs([free_row, wait_row, srow, int(own.alloc_row[first])])
        step_k = int(cols.step[srow])
        out_row = int(si.output_row_of(np.array([sk]), np.array([step_k]))[0])
        evidence = [ev.ref(free_row, "blocks given up here"), ev.ref(int(own.alloc_row[first]), "allocated here"),
                    ev.ref(srow, f"step {step_k} used them and was still in flight"),
                    ev.ref(wait_row, "handed to a request whose KV is written asynchronously")]
        if out_row >= 0:
            evidence.append(ev.ref(out_row, "the step's output came only here"))
        old = ev.ref(free_row).get("req")
        new = ev.ref(wait_row).get("req")
        trim = ev.ref(free_row).get("reason") == "skipped"
        severity, extra = "error", {"new_owner": new, "step_in_flight": step_k}
        message = (f"blocks {fmt_blocks(blocks)} freed by {old} went to {new} (remote KV load) before step "
                   f"{step_k}, which used them, had its output: the asynchronous write races that step")
        if trim:
            extra["trim"] = True
            message = (f"blocks {fmt_blocks(blocks)} trimmed out of {old}'s sliding window went to {new} (remote KV "
                       f"load) before step {step_k} had its output")
            if bool(no_facts[group[0]]):
                severity = "warning"
                extra["downgraded"] = "no_trim_window"
                message += (": the trim records no window or token counts, so whether that step still reads them "
                            "is unknown")
            else:
                message += (", and that step still reads them (the trim counted tokens still in flight): the "
                            "asynchronous write races the attention read")
        found.add("async_load_reuse", severity, message, evidence, at=free_row, sk=sk, blocks=blocks,
                  context="premature_free:async_load_reuse" + (":skipped" if trim else ""), extra=extra,
                  requests=[new] if new is not None and new != old else [])


TRIM_FACTS = ("window", "block_size", "upto", "computed")


def _trims_still_read(ctx: Any, intervals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ownership intervals closed by a free under a step in flight: (still_read, no_facts). Frees other than
    sliding-window trims (reason `skipped`) are still read by definition (the step used the request's blocks).

    A trim's detail (vLLM hooks since pdtrace 0.1) gives the window W, the group's block size B, `upto` (the
    trimmed blocks hold tokens below it, the last one ending there, the others before it in table order) and
    `computed` (the request's num_computed_tokens at the trim, tokens of its steps in flight included). The oldest
    step in flight computes from token s = computed - (the request's `req_sched` tokens scheduled before the trim
    whose step_output came after it), and its first query attends to tokens >= s - W + 1: a trimmed block ending
    after that is still read (vllm#47282, trimming on the optimistic count; vLLM since #47728 trims on s and never
    cuts in). A trim without those keys: no_facts (the rule reports it one level lower, saying why)."""
    cols = columns(ctx)
    own = ownership(ctx)
    si = step_index(ctx)
    free_rows = own.free_row[intervals]
    trim = cols.codes("reason")[0][free_rows] == cols.code_of("reason", "skipped")
    still = ~trim
    no_facts = np.zeros(len(intervals), bool)
    if not trim.any():
        return still, no_facts
    sched_rows = cols.req_rows("req_sched")
    uniq = np.unique(free_rows[trim])
    facts = dict(zip(uniq.tolist(), cols.details(uniq)))
    for i in np.flatnonzero(trim).tolist():  # the racing trims only (few)
        row = int(free_rows[i])
        d = facts.get(row) or {}
        if not all(isinstance(d.get(k), (int, float)) for k in TRIM_FACTS):
            no_facts[i] = True
            continue
        pos = int(cols.pos[row])
        mine = sched_rows[(cols.rk[sched_rows] == cols.rk[row]) & (cols.pos[sched_rows] < pos)]
        out_pos = si.output_pos_of(cols.sk[mine], cols.step[mine])
        flying = (out_pos > pos) | ((out_pos < 0) & si.has_outputs[cols.sk[mine]])
        in_flight = int(np.maximum(cols.ints_at("n", mine[flying], fill=0), 0).sum())
        settled = int(d["computed"]) - in_flight
        blocks = list(cols.table.column("blocks")[row].as_py() or [])
        block = int(own.block[intervals[i]])
        after = len(blocks) - 1 - blocks.index(block) if block in blocks else 0  # trimmed blocks after it
        end = int(d["upto"]) - after * int(d["block_size"])
        still[i] = end > settled - int(d["window"]) + 1
    return still, no_facts


RULE = Rule(
    id="premature_free",
    summary="blocks given up while their request is unfinished or its KV transfer is open, or handed to an "
            "asynchronously loaded request before the step that used them has its output",
    run=run,
    subrules=("unfinished", "send_open", "recv_open", "quorum", "async_load_reuse", "not_deferred"),
    needs=(request_state, ownership, step_index),
    cost=0.05,
    window_policy={
        # the request's req_finish may lie before the window, unless the window holds it after the free
        "unfinished": {"request": "drop_unless_finished_later"},
        # the ranks' reports may lie before the window: they follow the transfer's start (the finish for a send,
        # the req_wait_kv for a receive), so a request whose start the window holds keeps the finding (one lower)
        "quorum": {"step": "drop", "request": "drop_unless_started"},
    },
)
