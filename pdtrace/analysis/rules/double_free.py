"""double_free: blocks or completions released twice.

Algorithm:
- `not_owned`: flattened `blocks_free` entries that close no holding interval of their (request, block): the
  request gave up a block it did not hold (blocks.ownership's unmatched frees; one finding per free row). Evidence:
  the earlier free that released the block (last interval of the same request and block freed before), and its
  allocation. Downgraded to a warning when the request has no allocation and no `req_add` in the trace at all (it
  may predate the recording).
- `completion_after_free`: a completion inside a request's release gap (blocks.release_gaps) whose emptying free was
  the request's *final* one: it came with or after its `req_finish` (`RequestState.finished_by`), or was caused by
  a completion (reason `sent` / `received`). Whatever the reason of that free (`aborted`, `finished`, `received`,
  `sent`), vLLM forgot the request there (`_free_blocks` deletes it from `self.requests`), so the completion hits
  `self.requests[req_id]`: 0.33 asserts `req_id in self.requests` (`scheduler.py:3571` / `:3581`), 0.10 raises
  KeyError (C09: an aborted request with a receive and a send pending). The trace's own history decides, so a
  status `unknown` on the completion (what the recorder writes then) only corroborates it, and a trace without
  `status` gives the same finding.
- `unknown_id`: a `kv_send_done` / `kv_recv_done` with status `unknown` (the scheduler no longer knows the id; the
  message says what the recorded release does with it: pdtrace.analysis.releases) that
  no final free in the trace explains, or with no status and no earlier event of the request in the trace (a
  warning then, `extra.downgraded = "no_status"`: it may predate the recording, and only a status would say
  whether the scheduler knows it).
Rule of thumb (shared with use_after_free): a completion after the final free is a double free; a completion after
a free that left a still-alive request (preempted, waiting) without blocks is a use after free.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (COMPLETION_FREE_REASONS, NO, Cited, FindingsBuilder, Rule, columns, fmt_blocks,
                                      groups, last_before, ownership, release_gaps, request_state, step_index,
                                      trace_behaviour)


def _completion_evidence(ctx: Any, row: int) -> list[Cited]:
    """Other completions of the same update (same scheduler and step), up to four."""
    cols = columns(ctx)
    step = cols.step[row]
    if step < 0:
        return []
    rows = cols.rows_of("kv_send_done", "kv_recv_done")
    same = rows[(cols.sk[rows] == cols.sk[row]) & (cols.step[rows] == step) & (rows != row)]
    return [(int(r), "in the same update") for r in same[:4].tolist()]


def run(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    st = request_state(ctx)
    own = ownership(ctx)
    found = FindingsBuilder(ctx, "double_free")
    kind_codes, kind_names = cols.codes("kind")

    # frees of blocks the request did not hold
    if len(own.unmatched_row):
        width = int(max(own.block.max() if len(own) else 0, own.unmatched_block.max())) + 1
        key_u = own.unmatched_rk.astype(np.int64) * width + own.unmatched_block
        closed = own.free_row >= 0
        key_i = own.rk[closed].astype(np.int64) * width + own.block[closed]
        prev = last_before(key_u, cols.pos[own.unmatched_row], key_i, own.free_pos[closed], strict=True)
        closed_idx = np.flatnonzero(closed)
        has_interval = np.zeros(cols.n_requests, bool)
        has_interval[own.rk] = True
        for group in groups(own.unmatched_row):
            row = int(own.unmatched_row[group[0]])
            blocks = sorted(int(b) for b in own.unmatched_block[group])
            rk = int(own.unmatched_rk[group[0]])
            prev_i = [int(closed_idx[p]) for p in prev[group] if p >= 0]
            cite: list[Cited] = [(row, "blocks given up again here")]
            if prev_i:
                cite += [(int(own.free_row[prev_i[0]]), "already given up here"),
                         (int(own.alloc_row[prev_i[0]]), "allocated here")]
            never_known = st.add_pos[rk] < 0 and not prev_i and not has_interval[rk]
            req = found.ref(row).get("req")
            listed = cols.table.column("blocks")[row].as_py() or []  # one row's list, for the message only
            twice = any(listed.count(b) > 1 for b in blocks)
            found.add("not_owned", "warning" if never_known else "error",
                      f"{req} gave up blocks {fmt_blocks(blocks)} it did not hold"
                      + (" (listed twice in this free: it held one reference)" if twice
                         else " (freed before)" if prev_i else " (no allocation of them in the trace)"),
                      cite, blocks=blocks, extra={"previously_freed": bool(prev_i), "listed_twice": twice})

    # completions for unknown ids, and completions after a completion already freed the blocks
    comp = cols.rows_of("kv_send_done", "kv_recv_done")
    comp = comp[cols.rk[comp] >= 0]
    status_codes, _ = cols.codes("status")
    unknown = cols.code_of("status", "unknown")
    rk = cols.rk[comp]
    pos = cols.pos[comp]
    is_unknown = status_codes[comp] == unknown
    first = st.first_known_pos[rk]
    never_seen = (status_codes[comp] < 0) & ((first < 0) | (first > pos)) & (st.last_free_pos[rk] < 0)
    gaps = release_gaps(ctx)
    g = gaps.find(rk, pos) if len(gaps) else np.full(len(comp), NO)
    reason_codes, reason_names = cols.codes("reason")
    completion_reasons = [reason_names.index(r) for r in COMPLETION_FREE_REASONS if r in reason_names]
    gap_free_row = np.where(g >= 0, gaps.free_row[np.maximum(g, 0)] if len(gaps) else NO, NO)
    by_completion = np.isin(np.where(gap_free_row >= 0, reason_codes[np.maximum(gap_free_row, 0)], -9),
                            completion_reasons)
    final = st.finished_by(cols, np.maximum(gap_free_row, 0)) if len(comp) else np.zeros(0, bool)
    after = (g >= 0) & (by_completion | final)
    is_unknown &= ~after
    never_seen &= ~after
    si = step_index(ctx)
    for i in np.flatnonzero(is_unknown | never_seen | after).tolist():
        row = int(comp[i])
        kind = kind_names[kind_codes[row]]
        req = found.ref(row).get("req")
        r = int(rk[i])
        evidence: list[Cited] = [(row, "completion")]
        release = trace_behaviour(ctx)  # what the recorded vLLM does with a completion for an id it forgot
        effect = release.unknown_send if kind == "kv_send_done" else release.unknown_recv
        if after[i]:
            sub, sev = "completion_after_free", "error"
            free_row = int(gap_free_row[i])
            reason = reason_names[reason_codes[free_row]] if reason_codes[free_row] >= 0 else None
            evidence.append((free_row, f"final free (reason {reason}): the scheduler forgot {req} here"))
            if st.finish_pos[r] >= 0:
                evidence.append((int(cols.order[st.finish_pos[r]]), "request finished here"))
            msg = f"{kind} for {req} after its final free (reason {reason}) released it: {effect}"
        else:
            sub = "unknown_id"
            sev = "error" if is_unknown[i] else "warning"
            if st.last_free_pos[r] >= 0 and st.last_free_pos[r] < pos[i]:
                evidence.append((int(cols.order[st.last_free_pos[r]]), "blocks last freed here"))
            if st.finish_pos[r] >= 0 and st.finish_pos[r] < pos[i]:
                evidence.append((int(cols.order[st.finish_pos[r]]), "request finished here"))
            msg = (f"{kind} for {req}, which the scheduler no longer knows (status unknown): {effect}"
                   if is_unknown[i] else
                   f"{kind} for {req}, which has no earlier event in the trace (no status says whether the "
                   "scheduler knows it: it may predate the recording)")
        evidence += _completion_evidence(ctx, row)
        flying = si.in_flight_rows(int(cols.sk[row]), int(pos[i]))
        found.add(sub, sev, msg, evidence, context=f"double_free:{sub}:{kind}",
                  extra={"steps_in_flight": len(flying),
                         **({"downgraded": "no_status"} if sub == "unknown_id" and not is_unknown[i] else {})})
    return found.frame()


RULE = Rule(
    id="double_free",
    summary="blocks given up by a request that no longer owns them; a second completion after the blocks were "
            "freed; completions for unknown ids",
    run=run,
    subrules=("not_owned", "unknown_id", "completion_after_free"),
    needs=(request_state, ownership, release_gaps, step_index),
    cost=0.02,
    window_policy={
        # the freed blocks' allocation (or the request's) may lie before the window
        "not_owned": {"request": "drop", "blocks": "drop"},
        # a completion for an id the window never saw (without a status saying the scheduler does not know it)
        "unknown_id": {"request": "drop"},
    },
    # the completion's recorded status `unknown` is the scheduler's own word that it does not know the id
    status_proves=frozenset({"unknown_id"}),
)
