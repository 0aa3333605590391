"""use_after_free: blocks used after their owner gave them up.

Algorithm:
- From the ownership intervals, each request's *release gaps*: from the free that left it holding no block to its
  next allocation (blocks.release_gaps: a running count of open intervals per request, sorted by position).
- `sched_after_free`: a `req_sched` of the request inside a gap (scheduled with a freed block table).
- `remote_read`: a `remote_read` naming the request (the reader's detail `remote_instance` names the owner's
  instance) inside a gap: a peer read blocks that were already freed.
- `completion_after_free`: a `kv_send_done` / `kv_recv_done` inside a gap of a request still alive at the emptying
  free (not finished: preempted, waiting; `RequestState.finished_by` is false and the free was not caused by a
  completion): the transfer touched blocks the request no longer holds. A completion after the request's final
  free (whatever its reason) is double_free's `completion_after_free`: vLLM forgot the request there. Status
  `unknown` is double_free's too. Rule of thumb: after the final free, a double free; after a free that left a
  live request without blocks, a use after free.
- `reused_during_transfer`: a block freed while the request's transfer was open (send: delay_free and no
  kv_send_done / kv_expire yet; receive: waiting for remote KV, no kv_recv_done / kv_recv_fail yet) and then
  allocated to another request before that transfer closed: the still-running transfer reads or writes another
  request's KV. (A still-running *step* writing reused blocks is safe on one CUDA stream, except for asynchronous
  loads, which premature_free reports as `async_load_reuse`.)
- `transfer_after_reuse`: a rank's report of a transfer (`kv_recv_rank` / `kv_send_rank`) of a request inside one
  of its release gaps, after a block that gap's free gave up went to another request (the block's next holder was
  allocated before the report): that rank's transfer was still writing (a load) or reading (a store) the block,
  now the new owner's KV. vllm#53049: MultiConnector broadcasts `start_load_kv`, two loads start for one request,
  one completes, the request runs, finishes and is freed, its blocks go to the next request, and the late NIXL
  load lands in them (its `kv_recv_done` after the final free stays double_free's `completion_after_free`).
  Left to the rules that own them: a free with reason `preempted` (preemption_race), a free made while the same
  direction's transfer was open (`reused_during_transfer` above). One finding per (free, direction); `extra`:
  `new_owner`, `direction`, `ranks` (the late reports' tp ranks), `reports`.
Lookups are searchsorted joins on (request key, position); one finding per offending event or per free.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (COMPLETION_FREE_REASONS, NO, CrossInstance, FindingsBuilder, Rule, columns,
                                      fmt_blocks, groups, ownership, release_gaps, request_state)


def remote_read_targets(ctx: Any) -> pd.DataFrame:
    """The remote_read rows and the request each names as the owner of the blocks it read: row, instance, req.
    The owner is what the read's detail says (`remote_instance`, `remote_req`); where it names no request, the
    link vLLM itself keeps: the reader's own request's `req_add` (its kv_transfer_params' `remote_request_id` and
    `remote_engine_id`, detail `remote_req` / `remote_instance`), so a read recorded under the reader's id (a
    decode side whose ids differ from the prefill side's) still reaches the prefill request; else the row's own req
    (the two sides' ids alike). Rows naming no instance either way are left out. Also read by this rule's
    cross-instance part (`_cross_summary`: a read of another partition's blocks)."""
    cols = columns(ctx)
    rows = cols.rows_of("remote_read")
    details = cols.details(rows) if len(rows) else []
    req_codes, req_names = cols.codes("req")
    linked: dict[int, dict[str, Any]] = {}
    if len(rows):
        adds = cols.req_rows("req_add")
        for rk, add in zip(cols.req_keys("req_add").tolist(), cols.details(adds) if len(adds) else []):
            if add.get("remote_req") is not None or add.get("remote_instance") is not None:
                linked.setdefault(rk, add)
    instances, owners = [], []
    for d, c, rk in zip(details, req_codes[rows].tolist(), cols.rk[rows].tolist()):
        own = linked.get(rk, {}) if rk >= 0 else {}
        instance = d.get("remote_instance", own.get("remote_instance"))
        req = d.get("remote_req", own.get("remote_req"))
        instances.append(None if instance is None else str(instance))
        owners.append(str(req) if req is not None else (req_names[c] if c >= 0 else None))
    return pd.DataFrame({"row": rows, "instance": instances, "req": owners},
                        columns=["row", "instance", "req"]).dropna()


def _remote_read_rk(ctx: Any) -> tuple[np.ndarray, np.ndarray]:
    """(rows, owner's request key) of remote_read rows whose detail names a known owner instance."""
    cols = columns(ctx)
    reads = remote_read_targets(ctx)
    if len(reads) == 0:
        return reads["row"].to_numpy(np.int64), np.empty(0, np.int64)
    names = cols.rk_names.reset_index().rename(columns={"index": "rk"})[["rk", "instance", "req"]]
    names = names.astype({"instance": object, "req": object})
    joined = reads.merge(names, on=["instance", "req"], how="inner")
    # a reused id has one key per lifetime: the read belongs to the latest one begun before it (else the first)
    st = request_state(ctx)
    start = st.first_known_pos[joined["rk"].to_numpy(np.int64)]
    begun = (start >= 0) & (start < cols.pos[joined["row"].to_numpy(np.int64)])
    key = joined["rk"].to_numpy(np.int64)
    joined = joined.assign(_score=np.where(begun, key, -key - 1)).sort_values(["row", "_score"], kind="stable")
    joined = joined.drop_duplicates("row", keep="last")
    return joined["row"].to_numpy(np.int64), joined["rk"].to_numpy(np.int64)


def run(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    st = request_state(ctx)
    own = ownership(ctx)
    gaps = release_gaps(ctx)
    found = FindingsBuilder(ctx, "use_after_free")
    ev = found.evidence
    reason_codes, reason_names = cols.codes("reason")
    completion_reasons = [reason_names.index(r) for r in COMPLETION_FREE_REASONS if r in reason_names]
    status_codes, _ = cols.codes("status")
    unknown = cols.code_of("status", "unknown")

    if len(gaps):
        # req_sched rows are the bulk of a trace: only those of requests that may be scheduled inside a gap are
        # looked at (a gap that never ends holds a req_sched only if the request's last one comes after it)
        suspect = np.zeros(cols.n_requests, bool)
        endless = gaps.end_pos < 0
        suspect[gaps.rk[~endless]] = True
        late = gaps.rk[endless][st.last_sched_pos[gaps.rk[endless]] > gaps.start_pos[endless]]
        suspect[late] = True
        sched_rows = cols.req_rows("req_sched")
        sched_rows = sched_rows[suspect[cols.req_keys("req_sched")]] if suspect.any() else sched_rows[:0]
        q_rows = np.concatenate([sched_rows, cols.req_rows("kv_send_done", "kv_recv_done")])
        q_rk = cols.rk[q_rows]
        r_rows, r_rk = _remote_read_rk(ctx)
        q_rows = np.concatenate([q_rows, r_rows])
        q_rk = np.concatenate([q_rk, r_rk])
        g = gaps.find(q_rk, cols.pos[q_rows]) if len(q_rows) else np.empty(0, np.int64)
        hit = np.flatnonzero(g >= 0)
        final = st.finished_by(cols, gaps.free_row[g[hit]]) if len(hit) else np.zeros(0, bool)
        final_of = dict(zip(hit.tolist(), final.tolist()))
        kind_codes, kind_names = cols.codes("kind")
        for i in hit.tolist():
            row = int(q_rows[i])
            gap = int(g[i])
            free_row = int(gaps.free_row[gap])
            kind = kind_names[kind_codes[row]]
            if kind in ("kv_send_done", "kv_recv_done"):
                if reason_codes[free_row] in completion_reasons or status_codes[row] == unknown or final_of[i]:
                    continue  # double_free's: after the final free, or the scheduler no longer knows the id
                sub = "completion_after_free"
            elif kind == "remote_read":
                sub = "remote_read"
            else:
                sub = "sched_after_free"
            ev.refs([row, free_row])
            free_ref = ev.ref(free_row, "blocks given up here")
            blocks = list(free_ref.get("blocks") or [])
            req = free_ref.get("req")
            rk = int(q_rk[i])
            evidence = [ev.ref(row, f"{kind} after the free"), free_ref]
            if st.finish_pos[rk] >= 0:
                evidence.append(ev.ref(int(cols.order[st.finish_pos[rk]]), "request finished"))
            what = {"sched_after_free": "was scheduled again", "remote_read": "was read by a peer",
                    "completion_after_free": f"got a {kind}"}[sub]
            # when: the use (a remote read's row may be another instance's); who: the request that freed them
            found.add(sub, "error", f"{req} {what} after it gave up all its blocks {fmt_blocks(blocks)} and before "
                      f"any new allocation", evidence, at=row, about=free_row, blocks=blocks,
                      context=f"use_after_free:{sub}:{kind}",
                      extra={"free_reason": reason_names[reason_codes[free_row]] if reason_codes[free_row] >= 0
                             else None})

    # blocks handed to another request while the old owner's transfer is still open
    freed = np.flatnonzero(own.free_row >= 0)
    rk = own.rk[freed]
    fpos = own.free_pos[freed]
    send = st.send_open_at(rk, fpos)
    recv = st.recv_open_at(rk, fpos)
    opened = send | recv
    cand = freed[opened]  # freed while a transfer was open: only these look up the block's next holder
    if len(cand):
        send, recv, rk = send[opened], recv[opened], rk[opened]
        recv_close = st.recv_window_at(rk, fpos[opened])[1]  # the close of the receive open at the free
        close = np.where(send, st.send_close_pos[rk], np.where(recv, recv_close, NO))
        nxt = own.next_alloc_after(cand)
        npos = np.where(nxt >= 0, own.alloc_pos[np.maximum(nxt, 0)], NO)
        bad = (nxt >= 0) & ((close < 0) | (npos < close))
        hit = cand[bad]
        direction = np.where(send[bad], "send", "recv")
        close_hit = close[bad]
        new_rows = own.alloc_row[nxt[bad]]
        for group in groups(own.free_row[hit].astype(np.int64) * (cols.n + 1) + new_rows):
            members = hit[group]
            first = int(members[0])
            free_row = int(own.free_row[first])
            new_row = int(new_rows[group[0]])
            d = str(direction[group[0]])
            c = int(close_hit[group[0]])
            ev.refs([free_row, new_row, int(own.alloc_row[first])] + ([int(cols.order[c])] if c >= 0 else []))
            blocks = sorted(int(b) for b in own.block[members])
            old = ev.ref(free_row).get("req")
            new = ev.ref(new_row).get("req")
            evidence = [ev.ref(free_row, f"freed while the {d} was open"),
                        ev.ref(int(own.alloc_row[first]), "allocated here"),
                        ev.ref(new_row, f"reallocated to {new}")]
            if c >= 0:
                evidence.append(ev.ref(int(cols.order[c]), f"the {d} completed only here"))
            found.add("reused_during_transfer", "error",
                      f"blocks {fmt_blocks(blocks)} of {old} went to {new} while {old}'s KV {d} was still "
                      f"open: the transfer {'reads' if d == 'send' else 'writes'} another request's KV",
                      evidence, at=new_row, about=free_row, sk=int(own.sk[first]), blocks=blocks,
                      context=f"use_after_free:reused_during_transfer:{d}", extra={"new_owner": new, "direction": d})
    _transfer_after_reuse(ctx, found)
    return found.frame()


def _transfer_after_reuse(ctx: Any, found: FindingsBuilder) -> None:
    """`transfer_after_reuse` (see the module docstring): rank reports inside a release gap, after a block of the
    gap's free went to its next holder. Numpy up to the few hits (one searchsorted per lookup); a loop per finding."""
    cols = columns(ctx)
    gaps = release_gaps(ctx)
    rows = cols.req_rows("kv_recv_rank", "kv_send_rank")
    if len(gaps) == 0 or len(rows) == 0:
        return
    rk = cols.rk[rows]
    g = gaps.find(rk, cols.pos[rows])
    inside = np.flatnonzero(g >= 0)
    if len(inside) == 0:
        return
    st = request_state(ctx)
    own = ownership(ctx)
    rows, rk, g = rows[inside], rk[inside], g[inside]
    free_row = gaps.free_row[g].astype(np.int64)
    kind_codes, _ = cols.codes("kind")
    is_recv = kind_codes[rows] == cols.code_of("kind", "kv_recv_rank")
    reason_codes, reason_names = cols.codes("reason")
    preempted = cols.code_of("reason", "preempted")
    fpos = cols.pos[free_row]
    open_then = np.where(is_recv, st.recv_open_at(rk, fpos), st.send_open_at(rk, fpos))
    keep = (reason_codes[free_row] != preempted) & ~open_then
    rows, rk, free_row, is_recv = rows[keep], rk[keep], free_row[keep], is_recv[keep]
    if len(rows) == 0:
        return
    # the intervals each free closed, and their blocks' next holders
    by_free = np.argsort(own.free_row, kind="stable")
    sorted_free = own.free_row[by_free]
    lo = np.searchsorted(sorted_free, free_row, "left")
    hi = np.searchsorted(sorted_free, free_row, "right")
    hits: list[tuple[int, int, int, int]] = []  # (report row, free row, recv, next holder's interval)
    reused_of: dict[int, set[int]] = {}  # free row -> its blocks in another request's hands at a late report
    for i in range(len(rows)):  # reports inside a gap after a non-preemption free: a handful
        intervals = by_free[lo[i]:hi[i]]
        nxt = own.next_alloc_after(intervals) if len(intervals) else intervals
        taken = (nxt >= 0) & (own.alloc_pos[np.maximum(nxt, 0)] < cols.pos[rows[i]])
        if taken.any():
            first = nxt[taken][np.argmin(own.alloc_pos[nxt[taken]])]
            hits.append((int(rows[i]), int(free_row[i]), int(is_recv[i]), int(first)))
            reused_of.setdefault(int(free_row[i]), set()).update(own.block[intervals[taken]].tolist())
    if not hits:
        return
    ev = found.evidence
    h = np.array(hits, dtype=np.int64)
    for group in groups(h[:, 1] * 2 + h[:, 2]):
        reports = h[group, 0]
        free = int(h[group[0], 1])
        first_new = int(h[group, 3][np.argmin(own.alloc_pos[h[group, 3]])])
        new_row = int(own.alloc_row[first_new])
        d = "recv" if h[group[0], 2] else "send"
        ev.refs([*reports.tolist(), free, new_row])
        new = ev.ref(new_row).get("req")
        old = ev.ref(free).get("req")
        reused = sorted(int(b) for b in reused_of[free])
        ranks = sorted({int(r) for r in cols.ints_at("tp_rank", reports).tolist() if r >= 0})
        evidence = [ev.ref(int(reports[0]), f"a rank's {d} of {old} reported after its blocks went to {new}"),
                    ev.ref(free, "blocks given up here"), ev.ref(new_row, f"reallocated to {new}")]
        evidence += [ev.ref(int(r), "reported after the reuse too") for r in reports[1:4].tolist()]
        verb = "wrote into" if d == "recv" else "read"
        found.add("transfer_after_reuse", "error",
                  f"a KV {d} of {old} was still running on {len(reports)} rank report(s) after its blocks "
                  f"{fmt_blocks(reused)} went to {new}: it {verb} {new}'s KV",
                  evidence, at=int(reports[0]), about=free, blocks=reused,
                  context=f"use_after_free:transfer_after_reuse:{d}",
                  extra={"new_owner": new, "direction": d, "ranks": ranks, "reports": len(reports),
                         "free_reason": reason_names[reason_codes[free]] if reason_codes[free] >= 0 else None})


_OPEN_END = np.iinfo(np.int64).max


def _no_reads_or_gaps() -> tuple[pd.DataFrame, pd.DataFrame]:
    reads = pd.DataFrame({"owner": pd.Series(dtype=object), "req": pd.Series(dtype=object),
                          "ts_ns": pd.Series(dtype=np.int64)})
    gaps = pd.DataFrame({"instance": pd.Series(dtype=object), "req": pd.Series(dtype=object),
                         "start_ts": pd.Series(dtype=np.int64), "end_ts": pd.Series(dtype=np.int64)})
    return reads, gaps


def _cross_summary(ctx: Any, findings: pd.DataFrame, instances: frozenset[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`remote_read` across instances, phase 1 (`CrossInstance.summarize`): (reads, gaps). reads: the partition's
    remote_read rows naming an owner instance outside it (owner, req, ts_ns); gaps: the release gaps of its
    requests (instance, req, start_ts, end_ts; int64 max while open). Vectorised over both."""
    reads, gaps = _no_reads_or_gaps()
    cols = columns(ctx)
    if not cols.n:
        return reads, gaps
    targets = remote_read_targets(ctx)
    targets = targets[~targets["instance"].isin(instances)]
    if len(targets):
        reads = pd.DataFrame({"owner": targets["instance"].to_numpy(object),
                              "req": targets["req"].to_numpy(object),
                              "ts_ns": cols.ts[targets["row"].to_numpy(np.int64)].astype(np.int64)})
    g = release_gaps(ctx)
    if len(g):
        names = cols.rk_names
        end = np.where(g.end_pos >= 0, cols.ts[cols.order[np.maximum(g.end_pos, 0)]], _OPEN_END)
        gaps = pd.DataFrame({"instance": names["instance"].to_numpy(object)[g.rk],
                             "req": names["req"].to_numpy(object)[g.rk],
                             "start_ts": cols.ts[cols.order[g.start_pos]].astype(np.int64),
                             "end_ts": end.astype(np.int64)})
    return reads, gaps


def _cross_merge(parts: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One partition's (reads, gaps) from its windows': together (a request's gap seen in two windows is kept
    twice, open in one: a superset, as the links are)."""
    reads = [r for r, _ in parts if len(r)]
    gaps = [g for _, g in parts if len(g)]
    first = parts[0]
    return (pd.concat(reads, ignore_index=True) if reads else first[0],
            pd.concat(gaps, ignore_index=True).drop_duplicates() if gaps else first[1])


def _cross_links(parts: Any) -> set[tuple[int, int]]:
    """Phase 2: a partition's read whose (owner, req, ts) falls inside a release gap of another partition links
    the two (compared on ts, inclusive: a superset of the rule's exact test on global positions)."""
    links: set[tuple[int, int]] = set()
    present = [(i, part[1]) for i, (_, part) in enumerate(parts) if part is not None and len(part[1])]
    if not present:
        return links
    gaps = pd.concat([g.assign(part=i) for i, g in present], ignore_index=True)
    for i, (_, part) in enumerate(parts):
        if part is None or not len(part[0]):
            continue
        hit = part[0].merge(gaps, left_on=["owner", "req"], right_on=["instance", "req"], how="inner")
        hit = hit[(hit["start_ts"] <= hit["ts_ns"]) & (hit["ts_ns"] <= hit["end_ts"])]
        for other in set(hit["part"].tolist()):
            links.add((i, int(other)))
    return links


RULE = Rule(
    id="use_after_free",
    summary="a block used again by its old owner after the free, or reused while the old owner's transfer still "
            "runs",
    run=run,
    subrules=("sched_after_free", "remote_read", "completion_after_free", "reused_during_transfer",
              "transfer_after_reuse"),
    needs=(request_state, ownership, release_gaps),
    cost=0.02,
    window_policy={
        # the allocation that makes the use legal may lie before the window
        "sched_after_free": {"blocks": "drop"},
        "reused_during_transfer": {"blocks": "drop"},
    },
    # the reader's remote_read and the owner's release gaps may be two instances' rows
    cross_instance=CrossInstance("remote_read", _cross_summary, _cross_merge, _cross_links),
)
