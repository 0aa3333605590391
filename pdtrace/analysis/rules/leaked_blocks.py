"""leaked_blocks: blocks that never go back, memcheck-style classes.

Algorithm, over the ownership intervals never closed by a free (one finding per request):
- `definitely` (error): the owner finished (`req_finish`) and has no open transfer at the end of the trace: nothing
  will ever free the blocks.
- `indirectly` (error): the owner is stuck waiting on a peer for longer than the grace period (`grace_s`: the
  recorded release's longest connector timeout, 120 s up to 0.11.0, else 480 s, unless configured) before the end
  of the trace: finished with delay_free and no `kv_send_done` / `kv_expire`, or waiting for remote KV with no
  `kv_recv_done` / `kv_recv_fail`. Shorter waits are transfers still in flight, not leaks. A NIXL prefill side's
  send from 0.22 (`send_lease`) is judged by the side's own timeout instead: a 30 s lease that the decode side's
  heartbeats renew while its request waits for the read, so it is overdue a lease after the later of the finish
  and the end of the decode side's wait. While the decode side still waits at the end of the trace, or where it is
  not in the trace (its heartbeats cannot be seen), the longest timeout stays.
- `possibly` (warning): the owner is alive (not finished) and had no scheduler event for longer than the grace
  period before the end of the trace.
- A deferred free (`deferred=true`) whose blocks were held by nobody else and never reached `blocks_pool_free`,
  although the step that was the last one submitted before the free has its `step_output` and a later non-empty
  step has had its update (deferred frees drain there), is `definitely` (context `deferred_never_drained`) unless
  the block was allocated again (the pool got it back unrecorded).
- On a window (a trace that starts mid-run, pdtrace.analysis.history): a request begun before it (no `req_add`)
  with no holding in it that finishes inside it with delay_free, and whose send never completes, holds blocks the
  window never saw allocated: `indirectly` past the grace period with its blocks unnamed (the window pass makes it
  one severity lower and says why), `still_held` within it.
Per-rank reports: where the owner's open transfer (`indirectly`) has `kv_send_rank` / `kv_recv_rank` rows of its
direction and some expected rank never reported (`rulekit.rank_report`, with the expected count of
`rulekit.expected_ranks`, the one definition premature_free's `quorum` uses too), the message names the
silent ranks, the rank rows are evidence, the context ends in `:missing_rank` and `extra` gets `missing_ranks`,
`ranks_reported` and `ranks_expected`: the aggregator waits for a rank that will never report. It stays a leak
(same class and severity): the blocks are what is lost, the silent rank is why.
A `recorder_gap` or `recorder_off` of the instance between the moment in question and the end of the trace
downgrades the finding one severity (extra `downgraded`).
Engine failures (the crash policy of `rulekit`, "engine failures"): on a scheduler whose engine logged
`engine_error`, a leak is a consequence of the crash, and becomes info with the engine_error as evidence, when
- `definitely`: the free was due (the later of the finish and the close of its send / receive) at or after the
  failure point (the first event of the failing step), e.g. a `kv_send_done` recorded in the update vLLM's assert
  interrupted;
- `deferred_never_drained`: the update that should have drained the free comes at or after the failure point;
- `indirectly` / `possibly`: the wait (or idleness), measured up to the failure point instead of the end of the
  trace, was not yet longer than the grace period.
Leaks already overdue before the failure keep their severity. `extra` carries `class`, `n_blocks`, `held_s` and
`pool_blocks` (engine_config n), which the leak summary adds up per instance (crash consequences left out).
- `still_held` (info; valgrind's "still reachable" at exit): blocks still held at the end of the trace by a request
  that finished (or was aborted) and waits, within the grace period, for its transfer's completion (`kv_send_done`
  for a send, `kv_recv_done` for a receive). Not a leak yet: the message and `extra` say how long they were held
  (`held_s`, from the finish for a send, from `req_wait_kv` for a receive) and which completion has not come
  (`awaiting`); `extra.class` is `still_held`, which the leak summary lists apart from the lost blocks. For a send
  whose decode side (in the trace) already received it (`kv_recv_done`), that row is evidence and
  `extra.peer_read` is true: the completion waits for the prefill engine's next step, which a release whose
  engine does not step with only sends pending (before 0.22) takes only with its next request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (CRASH_NOTE, DOWNGRADE, NO, CrossInstance, EngineFailure, Evidence,
                                      FindingsBuilder, Rule, columns, engine_configs, engine_failures, fmt_blocks,
                                      gaps, grace_s, groups, history, inst_code_of_sk, last_before, next_at_or_after,
                                      nixl_send_lease_s, ownership, rank_report, remote_flags, request_state,
                                      sk_instance, step_index, trace_behaviour, trace_span)

CLASS_SEVERITY = {"definitely": "error", "indirectly": "error", "possibly": "warning"}


def run(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    findings = FindingsBuilder(ctx, "leaked_blocks")
    if cols.n == 0:
        return findings.frame()
    st = request_state(ctx)
    own = ownership(ctx)
    grace = grace_s(ctx)  # the recorded release's connector timeout unless configured
    grace_ns = int(grace * 1e9)
    end_pos = cols.n
    end_ts = trace_span(ctx)[1]  # the whole trace's end, also on one partition of it
    gp = gaps(ctx)
    ev = findings.evidence
    cfgs = engine_configs(ctx)
    failures = engine_failures(ctx)

    def ts_at(pos: int) -> int:
        return int(cols.ts[cols.order[pos]])

    def emit(cls: str, sk: int, req_row: int, blocks: list[int], since_pos: int, why: str,
             evidence: list[dict[str, Any]], context: str, step: Any, crash: EngineFailure | None = None,
             extra_more: dict[str, Any] | None = None) -> None:
        severity = CLASS_SEVERITY[cls]
        gap = gp.covers(inst_code_of_sk(cols, sk), since_pos, end_pos)
        extra: dict[str, Any] = {"class": cls, "n_blocks": len(blocks), "held_s": (end_ts - ts_at(since_pos)) / 1e9,
                                 "pool_blocks": cfgs.get(sk, {}).get("num_blocks"), **(extra_more or {})}
        if gap:
            severity = DOWNGRADE[severity]
            extra["downgraded"] = gap
            why += f" ({gap} in the trace: events may be missing)"
        req = ev.ref(req_row).get("req")
        what = f"{len(blocks)} blocks {fmt_blocks(blocks)}" if blocks else \
            "its blocks (allocated before the window: ids and count unknown)"
        record = findings.add(cls, severity, f"{what} {cls} lost: {req} {why}", evidence, sk=sk, req=req,
                              step=step, ts_ns=ts_at(since_pos), blocks=blocks, context=context, extra=extra)
        if crash is not None:
            crash.mark(record, f"{req} gave them up")
            record["evidence"] = record["evidence"] + [(crash.row, CRASH_NOTE)]

    open_iv = np.flatnonzero(own.free_row < 0)
    if len(open_iv):
        held = groups(own.rk[open_iv])
        # the holders' transfer state at the end, for all of them at once (per request, three lookups cost ~0.2 ms)
        holders = np.array([int(own.rk[open_iv[g[0]]]) for g in held], np.int64)
        at_end = np.full(len(holders), end_pos, np.int64)
        sends_open = st.send_open_at(holders, at_end).tolist()
        recvs_open = st.recv_open_at(holders, at_end).tolist()
        waits = [w.tolist() for w in st.recv_window_at(holders, at_end)]
        for i, group in enumerate(held):
            members = open_iv[group]
            rk = int(own.rk[members[0]])
            sk = int(own.sk[members[0]])
            blocks = sorted({int(b) for b in own.block[members]})
            alloc_row = int(own.alloc_row[members].min())
            fin = int(st.finish_pos[rk])
            send_open, recv_open = bool(sends_open[i]), bool(recvs_open[i])
            ev.refs([alloc_row] + ([int(cols.order[fin])] if fin >= 0 else []))
            evidence = [ev.ref(alloc_row, "allocated here")]
            failure = failures.get(sk)
            crash: EngineFailure | None = None
            extra_more: dict[str, Any] = {}
            wait_start, wait_close = int(waits[0][i]), int(waits[1][i])
            if send_open or recv_open:
                since = fin if send_open else wait_start
                wait_grace, wait_grace_ns, lease_from = grace, grace_ns, None
                lease = send_lease(ctx, rk, sk, fin) if send_open else None
                if lease is not None:
                    lease_from, wait_grace = max(since, lease[0]), lease[1]
                    wait_grace_ns = int(wait_grace * 1e9)
                if end_ts - ts_at(since if lease_from is None else lease_from) <= wait_grace_ns:
                    if fin >= 0:  # finished (or aborted) and still waiting: still held, within the grace period
                        _still_held(ctx, findings, rk, sk, alloc_row, blocks, fin, since, send_open, wait_grace)
                    continue
                if lease_from is not None:
                    since = lease_from
                if failure is not None and failure.point_ts - ts_at(since) <= wait_grace_ns:
                    crash = failure
                cls = "indirectly"
                evidence.append(ev.ref(int(cols.order[fin if send_open else since]),
                                       "finished with delay_free: waiting for the peer's read" if send_open
                                       else "waiting for remote KV since"))
                if lease_from is not None and lease_from != fin:
                    ev.refs([int(cols.order[lease_from])])
                    evidence.append(ev.ref(int(cols.order[lease_from]), "the decode side stopped waiting here: "
                                           "its heartbeats no longer renew the send's lease"))
                    why = (f"holds them for the decode side's read {(end_ts - ts_at(since)) / 1e9:.1f} s after "
                           f"that side stopped waiting for it, past NIXL's lease ({wait_grace:g} s, "
                           f"kv_lease_duration), and never frees them")
                else:
                    why = (f"waits {'to send its KV' if send_open else 'for remote KV'} for "
                           f"{(end_ts - ts_at(since)) / 1e9:.1f} s (grace {grace:g} s) and never completes")
                context = f"leaked_blocks:indirectly:{'send' if send_open else 'recv'}"
                ranks = rank_report(ctx, rk, "send" if send_open else "recv")
                if ranks is not None:
                    why += f"; {ranks.describe()}"
                    ev.refs(ranks.rows[:16])
                    silent = ", ".join(ranks.missing) or "the rest"
                    evidence += [ev.ref(r, f"this rank reported; {silent} never did") for r in ranks.rows[:16]]
                    context += ":missing_rank"
                    extra_more = {"missing_ranks": ranks.missing, "ranks_reported": ranks.reported,
                                  "ranks_expected": ranks.expected}
            elif fin >= 0:
                since = fin
                cls = "definitely"
                evidence.append(ev.ref(int(cols.order[fin]), "request finished"))
                why = "finished and has no open transfer, but never gave them up"
                context = "leaked_blocks:definitely:finished"
                due = max(fin, int(st.send_close_pos[rk]), wait_close)
                if failure is not None and failure.cut_off(due):
                    crash = failure
            else:
                last = int(st.last_pos[rk])
                if last < 0 or end_ts - ts_at(last) <= grace_ns:
                    continue
                if failure is not None and failure.point_ts - ts_at(last) <= grace_ns:
                    crash = failure
                since = last
                cls = "possibly"
                evidence.append(ev.ref(int(cols.order[last]), "last event of the request"))
                why = f"is still alive but idle for {(end_ts - ts_at(last)) / 1e9:.1f} s"
                context = "leaked_blocks:possibly:idle"
            emit(cls, sk, alloc_row, blocks, since, why, evidence, context, ev.ref(alloc_row).get("step"), crash,
                 extra_more)

    _deferred_never_drained(ctx, ev, emit)
    if history(ctx) is not None:
        _held_since_before_the_window(ctx, findings, emit, grace, grace_ns)
    return findings.frame()


def _held_since_before_the_window(ctx: Any, findings: FindingsBuilder, emit: Any, grace: float,
                                  grace_ns: int) -> None:
    """On a window (pdtrace.analysis.history): a request begun before it (no req_add), with no holding in it, that
    finishes inside it with delay_free and whose send never completes holds blocks the window never saw allocated:
    `indirectly` past the grace period (its blocks unnamed; the window pass makes it one lower and says why),
    `still_held` within it."""
    cols = columns(ctx)
    st = request_state(ctx)
    own = ownership(ctx)
    ev = findings.evidence
    end_ts = trace_span(ctx)[1]
    held = np.zeros(st.n, bool)
    held[own.rk] = True
    cand = np.flatnonzero((st.add_pos < 0) & ~held & (st.finish_pos >= 0) & (st.last_free_pos < st.finish_pos))
    if len(cand) == 0:
        return
    cand = cand[st.send_open_at(cand, np.full(len(cand), cols.n))]
    for rk in cand.tolist():  # per request begun before the window that still waits to send: few
        fin = int(st.finish_pos[rk])
        fin_row = int(cols.order[fin])
        sk = int(st.sk[rk])
        if end_ts - int(cols.ts[fin_row]) <= grace_ns:
            _still_held(ctx, findings, rk, sk, fin_row, [], fin, fin, True, grace)
            continue
        evidence = [ev.ref(fin_row, "finished with delay_free: waiting for the peer's read")]
        why = (f"waits to send its KV for {(end_ts - int(cols.ts[fin_row])) / 1e9:.1f} s (grace {grace:g} s) and "
               "never completes")
        emit("indirectly", sk, fin_row, [], fin, why, evidence, "leaked_blocks:indirectly:send",
             ev.ref(fin_row).get("step"))


def send_lease(ctx: Any, rk: int, sk: int, fin: int) -> tuple[int, float] | None:
    """The NIXL lease a prefill side's open send is judged by (releases.nixl_send_lease_s: 0.22+), as (the position
    it runs from, its length in s), or None where the release's longest timeout applies, from the finish: another
    connector or release, a configured grace, a request that is no prefill side of P/D (a decode side's own send,
    bidirectional: `decoder_kv_blocks_ttl`), a decode side not in the trace (its heartbeats, unseen, may renew the
    lease as long as it waits), or one that still waits at the end of the trace (its heartbeats renew the lease:
    P's blocks are held for that wait, lost with it once it outlasts the grace period).

    The decode side heartbeats for its request from its arrival until its read closes or it finishes (nixl
    scheduler `on_new_request` / `_stop_heartbeat`), each heartbeat pushing P's expiry to 2/3 of the lease ahead;
    so once it stopped, the send is overdue a lease after the later of P's finish and the end of that wait. The
    decode side is the request naming this one as its `remote_instance` / `remote_req`."""
    cols = columns(ctx)
    lease = nixl_send_lease_s(ctx, engine_configs(ctx).get(sk, {}).get("connector"))
    if lease is None or fin < 0:
        return None
    st = request_state(ctx)
    prefill, decode, _, _ = cols.once("requests.remote_flags", lambda: remote_flags(cols, st.n))
    if not decode[rk]:
        return None
    decode_side = _decode_side_of(ctx, sk, rk)
    if decode_side is None:
        return None
    ends = [int(p) for p in (st.recv_close_pos[decode_side], st.finish_pos[decode_side]) if p >= 0]
    return (min(ends), lease) if ends else None


def _decode_side_of(ctx: Any, sk: int, rk: int) -> int | None:
    """The request key of the decode side of request `rk` on scheduler `sk` (`_decode_sides`), or None."""
    cols = columns(ctx)
    return _decode_sides(ctx).get((sk_instance(cols, sk)[0], str(cols.rk_names["req"].iloc[rk])))


def _decode_sides(ctx: Any) -> dict[tuple[str, str], int]:
    """(prefill instance, prefill request) -> the request key of its decode side, for the requests of the trace
    that name their prefill side."""
    def build() -> dict[tuple[str, str], int]:
        cols = columns(ctx)
        n = request_state(ctx).n
        prefill, _, instance, remote_req = cols.once("requests.remote_flags", lambda: remote_flags(cols, n))
        keys = np.flatnonzero(prefill & pd.notna(instance) & pd.notna(remote_req))
        return {(str(instance[k]), str(remote_req[k])): int(k) for k in keys.tolist()}
    return ctx.cached("leaked_blocks.decode_sides", build)


def _still_held(ctx: Any, findings: FindingsBuilder, rk: int, sk: int, alloc_row: int, blocks: list[int], fin: int,
                since: int, send_open: bool, grace_s: float) -> None:
    """An info finding (subrule `still_held`) for blocks a finished or aborted request still holds at the end of the
    trace while it waits, within the grace period, for the completion of its transfer: memcheck's "still
    reachable" at exit, not a leak (yet)."""
    cols = columns(ctx)
    ev = findings.evidence
    end_ts = int(cols.ts.max())
    fin_row = int(cols.order[fin])
    since_ts = int(cols.ts[cols.order[since]])
    held_s = (end_ts - since_ts) / 1e9
    awaiting = "kv_send_done" if send_open else "kv_recv_done"
    what = "the peer's read of its KV" if send_open else "its remote KV"
    reason_codes, reason_names = cols.codes("reason")
    how = "aborted" if reason_codes[fin_row] == cols.code_of("reason", "abort") else "finished"
    ev.refs([alloc_row, fin_row])
    evidence = [ev.ref(alloc_row, "allocated here"), ev.ref(fin_row, f"request {how} here")]
    if not send_open:
        evidence.append(ev.ref(int(cols.order[since]), "waiting for remote KV since"))
    req = ev.ref(alloc_row).get("req")
    peer_read = _peer_read_row(ctx, sk, rk) if send_open else None
    note = ""
    if peer_read is not None:
        ev.refs([peer_read])
        evidence.append(ev.ref(peer_read, "the decode side read it here"))
        note = (f"; the decode side already read it ({(int(cols.ts[peer_read]) - since_ts) / 1e9:.1f} s after the "
                f"finish): its completion reaches this engine at its next step")
        if not trace_behaviour(ctx).steps_for_pending_sends:
            note += (" (this release's engine does not step with only sends pending, vLLM before 0.22: the blocks "
                     "go back with its next request, or at the timeout)")
    findings.add(
        "still_held", "info",
        f"{f'{len(blocks)} blocks {fmt_blocks(blocks)}' if blocks else 'its blocks (allocated before the window)'}"
        f" still held at the end of the trace: {req} {how} and "
        f"has waited {held_s:.1f} s for {what} ({awaiting} has not come), within the grace period "
        f"({grace_s:g} s){note}",
        evidence, sk=sk, req=req, step=ev.ref(alloc_row).get("step"), ts_ns=since_ts, blocks=blocks,
        context=f"leaked_blocks:still_held:{'send' if send_open else 'recv'}",
        extra={"class": "still_held", "n_blocks": len(blocks), "held_s": held_s, "awaiting": awaiting,
               "request_state": how, "pool_blocks": engine_configs(ctx).get(sk, {}).get("num_blocks"),
               "peer_read": peer_read is not None})


def _peer_read_row(ctx: Any, sk: int, rk: int) -> int | None:
    """The row of the `kv_recv_done` with which the decode side of prefill request `rk` (the request naming it
    as its remote side, in the same trace) received its KV, or None."""
    cols = columns(ctx)
    decode_side = _decode_side_of(ctx, sk, rk)
    if decode_side is None:
        return None
    pos = int(request_state(ctx).recv_close_pos[decode_side])
    if pos < 0:
        return None
    row = int(cols.order[pos])
    return row if cols.codes("kind")[0][row] == cols.code_of("kind", "kv_recv_done") else None


def _deferred_never_drained(ctx: Any, ev: Evidence, emit: Any) -> None:
    cols = columns(ctx)
    own = ownership(ctx)
    free_row = np.where(own.free_row >= 0, own.free_row, 0)
    value, valid = cols.bools_at("deferred", free_row)
    cand = np.flatnonzero((own.free_row >= 0) & valid & value)
    cand = cand[own.pool_free_after(cand) < 0]
    cand = cand[(own.others_at_free(cand) == 0) & (own.next_alloc_after(cand) < 0)]
    if len(cand) == 0:
        return
    si = step_index(ctx)
    sub = cols.rows_of("step_submit")
    last_sub = last_before(own.sk[cand], own.free_pos[cand], cols.sk[sub], cols.pos[sub], strict=True)
    has = last_sub >= 0
    step = np.where(has, cols.step[sub[np.maximum(last_sub, 0)]], NO)
    fence_out = si.output_pos_of(own.sk[cand], step)
    outs = cols.rows_of("step_output")
    tokens = si.tokens_of(cols.sk[outs], cols.step[outs])
    busy = outs[tokens > 0]
    later = next_at_or_after(own.sk[cand], fence_out, cols.sk[busy], cols.pos[busy], strict=True)
    keep = has & (fence_out >= 0) & (later >= 0)
    leaked = cand[keep]
    drain_pos = cols.pos[busy[np.maximum(later, 0)]][keep] if len(busy) else np.zeros(0, np.int64)
    failures = engine_failures(ctx)
    for group in groups(own.free_row[leaked]):
        members = leaked[group]
        row = int(own.free_row[members[0]])
        blocks = sorted(int(b) for b in own.block[members])
        ev.refs([row, int(own.alloc_row[members[0]])])
        evidence = [ev.ref(row, "deferred free"), ev.ref(int(own.alloc_row[members[0]]), "allocated here")]
        sk = int(own.sk[members[0]])
        failure = failures.get(sk)
        crash = failure if failure is not None and failure.cut_off(int(drain_pos[group].min())) else None
        emit("definitely", sk, row, blocks, int(cols.pos[row]),
             "freed them with a deferred free that never reached the pool although its fence passed", evidence,
             "leaked_blocks:definitely:deferred_never_drained", ev.ref(row).get("step"), crash)


def _cross_summary(ctx: Any, findings: pd.DataFrame, instances: frozenset[str]) -> tuple[bool, tuple[str, ...]]:
    """A NIXL prefill side's send across instances, phase 1 (`CrossInstance.summarize`): (whether the partition
    reported a leak, the instances outside it that its requests name as their prefill side). A prefill side's open
    send (0.22+) is judged by a lease counted from the end of its decode side's wait (`send_lease`)."""
    cols = columns(ctx)
    if not cols.n:
        return False, ()
    prefill, _, named, _ = cols.once("requests.remote_flags", lambda: remote_flags(cols, request_state(ctx).n))
    peers = {str(name) for name in named[prefill] if name is not None} - instances
    return bool(len(findings)), tuple(sorted(peers))


def _cross_merge(parts: Any) -> tuple[bool, tuple[str, ...]]:
    """One partition's summary from its windows': a leak in any, the peers united."""
    return any(leaks for leaks, _ in parts), tuple(sorted({p for _, peers in parts for p in peers}))


def _cross_links(parts: Any) -> set[tuple[int, int]]:
    """Phase 2: a partition whose requests name a prefill side in another partition that reported a leak links
    the two (the leak may be judged by this partition's waits)."""
    owner_of = {inst: i for i, (instances, _) in enumerate(parts) for inst in instances}
    return {(i, owner_of[name]) for i, (_, part) in enumerate(parts) for name in (part[1] if part else ())
            if name in owner_of and parts[owner_of[name]][1] is not None and parts[owner_of[name]][1][0]}


RULE = Rule(
    id="leaked_blocks",
    summary="blocks still owned at the end of the trace, or past the grace period, by a finished request or one "
            "stuck on a transfer; deferred frees that never reach the pool",
    run=run,
    subrules=("definitely", "indirectly", "possibly", "still_held"),
    needs=(request_state, ownership, step_index),
    cost=0.02,
    # a NIXL prefill side's send (0.22+) is judged by a lease counted from the end of its decode side's wait
    # (send_lease): the same link as a waiting request's
    cross_instance=CrossInstance("send", _cross_summary, _cross_merge, _cross_links),
)
