"""unscheduled_request: requests the scheduler left behind.

Positions are the global time order of `pdtrace.analysis.columns`; request keys (`rk`) name (instance, dp_rank,
req). Steps are counted as `schedule()` calls of the request's scheduler (`sched` rows, a coalesced row counting
its `empty_run`), with prefix sums over the scheduler's `sched` rows and searchsorted, never per event.

A step *had room* for a waiting request when the token budget was not exhausted (tokens < max_num_batched_tokens
and running < max_num_seqs, where engine_config gives them) and the pool had the blocks its prompt needs (sched
detail free_blocks >= ceil(prompt / block_size); 1 block without a block size). Other requests running is not
required: a FCFS queue stalled behind a head-of-line request that can never fit leaves the engine stepping with
nothing scheduled, the worst starvation there is (the dry run's `starve` sample); the message says how many of the
steps ran other requests. The room count of a window is a prefix sum of (budget and free_blocks >= 1); windows
reaching the threshold on that upper bound are then checked exactly against the request's own block need (one
numpy slice per candidate).

Subrules (thresholds from AnalysisConfig: starve_steps, zombie_steps, grace_s):
- `starved`: a waiting period (from req_add, req_preempt or the close of a KV receive, to the next req_sched,
  req_wait_kv or req_finish) with at least starve_steps steps that had room for it. Error when still waiting at the
  end of the trace, warning when it was served late. The message names the head-of-line blocker: the oldest request that
  was waiting unscheduled when the period began.
- `never_scheduled`: never scheduled, unfinished, not waiting for remote KV, and starve_steps steps went by after
  req_add without room for it (with room it is `starved`): warning (an overloaded pool, not a scheduler bug); info
  when no step kept it out for want of blocks (budget left, fewer free blocks than its prompt needs:
  `extra.steps_short_of_blocks` = 0), each either ran a full batch (token budget spent or max_num_seqs running, from
  engine_config; `extra.steps_batch_full`) or had room (fewer times than starve_steps): the queue of a loaded
  engine that a stop or a dump cuts.
- `preempted_not_resumed`: preempted, unfinished, no req_sched after the preemption while starve_steps steps went
  by: error when starve_steps of them had room, warning otherwise.
- `stuck_waiting_kv`: a receive (every req_wait_kv opens one: a request preempted after its KV arrived may wait
  again when re-admitted, vllm#53250) never closed (no kv_recv_done / kv_recv_fail after it), request unfinished;
  one finding per such receive, `extra.receive` = its number (2, 3, ...) when it is not the first. Error when it
  has waited longer than grace_s (past every connector timeout), or when its prefill side (req_add's
  remote_instance / remote_req, in the same trace) expired the transfer (kv_expire) or saw the send finish
  (kv_send_done) starve_steps steps before the end: the completion was lost, not late; warning when requests that
  began waiting later have already received their KV (overtaken: the transfer is lost, not slow) and starve_steps
  steps went by; info when the engine kept stepping (starve_steps steps) but nothing else says it is lost: the
  trace may just end mid-transfer. A receive that closed but only after grace_s is a warning. When the prefill
  side's engine failed (its first engine_error), the finding cites it (message, evidence, extra
  `peer_engine_failed`) with the same severity: the decode side must still give up on a dead peer.
- `dropped_from_batch` (vLLM's V1 runner only; the rows exist only there): batch_remove reason `unscheduled` on a
  worker lane, no batch_add on that lane after it, request unfinished. Error when the scheduler scheduled it again
  and the lane executed that step (the worker ran a step whose request it had dropped); warning when it was never
  scheduled again and zombie_steps steps went by.
- `zombie`: in the running set (scheduled, not preempted or finished since) and not scheduled for zombie_steps
  steps: the longest such gap per request. Error when the gap is open at the end of the trace, warning when the
  request was scheduled (or preempted, or finished) again later.
A `recorder_gap` or `recorder_off` on the instance over a finding's window lowers its severity one level (the
missing event may have been dropped). On a scheduler without engine_config, `starved` and `preempted_not_resumed`
(whose severity rests on the steps with room) are one level lower too, with `extra.downgraded = "no_engine_config"`
and a note in the message: room was judged without the scheduler's token, sequence and block-size limits.
Engine failures (the crash policy of `rulekit`, "engine failures"): a finding whose window is open at the end of
the trace, on a scheduler whose engine logged `engine_error`, is re-measured up to the failure point (the first
event of the failing step): when the steps strictly before it stay under the subrule's step threshold
(starve_steps for starved / never_scheduled / preempted_not_resumed / stuck_waiting_kv, zombie_steps for zombie /
dropped_from_batch; for starved that step count bounds the steps with room from above) and, for
stuck_waiting_kv, the wait up to the failure point is within grace_s, the schedule or transfer it misses would only
have come after the crash: the finding becomes info, says "engine failed at step K (engine_error ...) before ..."
and cites the engine_error. Windows that were already over their threshold before the failure keep their severity;
windows closed before the end are not affected.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (CRASH_NOTE, DOWNGRADE, NO, AnalysisContext, Columns, CrossInstance,
                                      EngineFailure, FindingsBuilder, RequestState, Rule, columns, detail_text,
                                      engine_configs, engine_failures, gaps, grace_s, inst_code_of_sk,
                                      next_at_or_after, request_state, rows_columns, sk_instance, step_frame,
                                      trace_span)

#: how a wait ended, by the kind of the row that ended it (the message's tail)
_END_WORDS = {"req_sched": "scheduled", "req_wait_kv": "parked waiting for remote KV",
              "req_finish": "finished without being scheduled"}
_MAX_EXACT = 20_000  # candidates checked exactly against their block need; beyond, the upper bound stands


class SchedCounter:
    """The `sched` rows of every scheduler sorted by (sk, pos), with prefix sums for window counts."""

    def __init__(self, ctx: AnalysisContext, cols: Columns) -> None:
        frame = step_frame(ctx)  # the sched details, parsed once for every analysis
        frame = frame[frame["row"] >= 0]
        rows = frame["row"].to_numpy()
        self.span = int(cols.n) + 2
        key = cols.sk[rows].astype(np.int64) * self.span + cols.pos[rows]
        order = np.argsort(key, kind="stable")
        rows = rows[order]
        self.key = key[order]
        self.rows = rows
        weight = frame["empty_run"].to_numpy()[order]
        free = frame["free_blocks"].to_numpy()[order]
        running = frame["running"].to_numpy()[order]
        tokens = frame["tokens"].to_numpy()[order]
        sk = cols.sk[rows]
        n_sk = len(cols.sk_names)
        max_tokens = np.full(n_sk, np.inf)
        max_seqs = np.full(n_sk, np.inf)
        self.block_size = np.full(n_sk, np.nan)
        self.has_config = np.zeros(n_sk, bool)  # room is judged on the scheduler's own limits only where it has one
        for s, cfg in engine_configs(ctx).items():
            self.has_config[s] = True
            for arr, name in ((max_tokens, "max_num_batched_tokens"), (max_seqs, "max_num_seqs"),
                              (self.block_size, "block_size")):
                try:
                    arr[s] = float(cfg[name])
                except (KeyError, TypeError, ValueError):
                    pass
        # free_blocks unknown: room is not judged on blocks (NaN compares false below, so fill with +inf)
        self.free = np.where(np.isnan(free), np.inf, free)
        budget = ~(tokens >= max_tokens[sk]) & ~(running >= max_seqs[sk])
        # a step that preempted admits no waiting request (every release's `schedule()`: `if not preempted_reqs`),
        # however many blocks the preemption freed: no room for a waiting one there
        pre = cols.rows_of("req_preempt")
        pre = pre[cols.step[pre] >= 0]
        if len(pre):
            step_key = sk.astype(np.int64) * (1 << 40) + cols.step[rows]
            budget &= ~np.isin(step_key, cols.sk[pre].astype(np.int64) * (1 << 40) + cols.step[pre])
        self.budget = budget
        self.cum_weight = np.r_[0.0, np.cumsum(weight)]
        self.cum_busy = np.r_[0, np.cumsum(tokens > 0)]
        # each scheduler's last step id (a coalesced run's last id included)
        self.last_step = np.full(n_sk, NO, np.int64)
        if len(rows):
            np.maximum.at(self.last_step, sk, cols.step[rows] + np.maximum(weight, 1).astype(np.int64) - 1)
        self.cum_room = np.r_[0, np.cumsum(budget & (self.free >= 1))]
        # vLLM puts a preempted request back at the head of its waiting queue: while one waits, a request that
        # arrived (or received its KV) is behind it, and FCFS admits nothing past a head that does not fit
        self.behind_preempted = _preempted_waiting(cols, sk, self.key % self.span)
        self.cum_room_queued = np.r_[0, np.cumsum(budget & (self.free >= 1) & ~self.behind_preempted)]

    def _range(self, sk: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Index range [lo, hi) of the sched rows of scheduler sk strictly between positions a and b (b = -1:
        to the end of the trace)."""
        base = sk.astype(np.int64) * self.span
        lo = np.searchsorted(self.key, base + a, "right")
        end = np.where(b < 0, base + self.span - 1, base + b)
        hi = np.searchsorted(self.key, end, "left")
        return lo, np.maximum(hi, lo)

    def steps_between(self, sk: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        lo, hi = self._range(sk, a, b)
        return self.cum_weight[hi] - self.cum_weight[lo]

    def busy_between(self, sk: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """sched rows that scheduled tokens (other requests ran), strictly between a and b."""
        lo, hi = self._range(sk, a, b)
        return self.cum_busy[hi] - self.cum_busy[lo]

    def fcfs_room(self, sk: int, a: int, b: int, need_r: int, rk: int, st: RequestState,
                  need: np.ndarray) -> int:
        """Steps strictly between a and b with room for request rk (`room_between`'s, behind no waiting preempted
        request) at which no request added before it was still waiting without room for itself: vLLM's waiting
        queue is FCFS, and a head that does not fit yet stops the admission of everything behind it (a request
        waiting for remote KV is skipped, not a head; a head never admitted in the trace is the starvation itself and
        excuses nothing). One candidate finding at a time."""
        lo, hi = self._range(np.array([sk]), np.array([a]), np.array([b]))
        s = slice(int(lo[0]), int(hi[0]))
        ok = self.budget[s] & (self.free[s] >= need_r) & ~self.behind_preempted[s]
        if not ok.any():
            return 0
        mine = np.flatnonzero((st.sk == sk) & (st.add_pos >= 0) & (st.add_pos < st.add_pos[rk]))
        if len(mine):
            big = np.iinfo(np.int64).max
            ends = np.stack([np.where(p > st.add_pos[mine], p, big) for p in
                             (st.first_sched_pos[mine], st.wait_kv_pos[mine], st.finish_pos[mine])]).min(axis=0)
            # a head that never fits (never scheduled) is the starvation, not the queue: it excuses nothing
            admitted = (st.first_sched_pos[mine] >= 0) & (ends == st.first_sched_pos[mine])
            mine, ends = mine[admitted], ends[admitted]
            pos = (self.key[s] % self.span)[ok]
            free = self.free[s][ok]
            ahead = ((st.add_pos[mine][:, None] < pos[None, :]) & (ends[:, None] > pos[None, :])
                     & (need[mine][:, None] > free[None, :]))
            blocked = ahead.any(axis=0)
            return int(np.count_nonzero(~blocked))
        return int(np.count_nonzero(ok))

    def short_of_blocks(self, sk: int, a: int, b: int, need: int) -> tuple[int, int]:
        """(steps whose batch was full: token budget spent or max_num_seqs running, steps with budget left but
        fewer than `need` free blocks) strictly between a and b, exactly (one slice: for a candidate finding)."""
        lo, hi = self._range(np.array([sk]), np.array([a]), np.array([b]))
        s = slice(int(lo[0]), int(hi[0]))
        budget = self.budget[s]
        return int(np.count_nonzero(~budget)), int(np.count_nonzero(budget & (self.free[s] < need)))

    def room_between(self, sk: np.ndarray, a: np.ndarray, b: np.ndarray, need: np.ndarray,
                     threshold: int, queued: np.ndarray | None = None) -> np.ndarray:
        """Steps with room for a request needing `need` blocks, strictly between a and b; exact where the upper
        bound reaches `threshold`. Where `queued` holds, a step in which a preempted request waited (ahead of
        this one in vLLM's queue) is not room for it."""
        lo, hi = self._range(sk, a, b)
        queued = np.zeros(len(lo), bool) if queued is None else queued
        room = np.where(queued, self.cum_room_queued[hi] - self.cum_room_queued[lo],
                        self.cum_room[hi] - self.cum_room[lo]).astype(np.int64)
        exact = np.flatnonzero((room >= threshold) & (need > 1))[:_MAX_EXACT]
        for i in exact.tolist():  # one slice per candidate finding
            s = slice(lo[i], hi[i])
            ok = self.budget[s] & (self.free[s] >= need[i])
            if queued[i]:
                ok &= ~self.behind_preempted[s]
            room[i] = int(np.count_nonzero(ok))
        return room


def _preempted_waiting(cols: Columns, sched_sk: np.ndarray, sched_pos: np.ndarray) -> np.ndarray:
    """For each sched row (its scheduler and position): whether a preempted request of that scheduler was waiting
    to resume then (from its `req_preempt` to its next `req_sched` or `req_finish`, or the end). A running count of
    +1 at preemptions and -1 at their ends per scheduler, read at the sched rows."""
    pre = cols.req_rows("req_preempt")
    if not len(pre) or not len(sched_pos):
        return np.zeros(len(sched_pos), bool)
    ends = cols.req_rows("req_sched", "req_finish")
    if len(ends):
        nxt = next_at_or_after(cols.rk[pre], cols.pos[pre], cols.rk[ends], cols.pos[ends], strict=True)
        end_pos = np.where(nxt >= 0, cols.pos[ends[np.maximum(nxt, 0)]].astype(np.int64), int(cols.n) + 1)
    else:  # no request was ever scheduled or finished: every preemption waits to the end
        end_pos = np.full(len(pre), int(cols.n) + 1, np.int64)
    span = int(cols.n) + 2
    ev_key = np.concatenate([cols.sk[pre].astype(np.int64) * span + cols.pos[pre], cols.sk[pre].astype(np.int64)
                             * span + end_pos])
    ev_delta = np.concatenate([np.ones(len(pre), np.int64), -np.ones(len(pre), np.int64)])
    order = np.argsort(ev_key, kind="stable")
    ev_key, running = ev_key[order], np.cumsum(ev_delta[order])
    at = np.searchsorted(ev_key, sched_sk.astype(np.int64) * span + sched_pos, side="right") - 1
    same = (at >= 0) & (ev_key[np.maximum(at, 0)] // span == sched_sk)
    return same & (running[np.maximum(at, 0)] > 0)


def _sorted_events(cols: Columns, kinds: tuple[str, ...], requests: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """(rows, composite key rk*span+pos, rk, pos, kind code) of the events of these kinds, sorted by key; only of
    the requests where the boolean `requests[rk]` holds, when given (the few that need an exact search)."""
    mask = cols.is_kind(*kinds) & (cols.rk >= 0)
    if requests is not None:
        mask &= requests[np.maximum(cols.rk, 0)]
    rows = np.flatnonzero(mask)
    span = int(cols.n) + 2
    rk = cols.rk[rows]
    pos = cols.pos[rows]
    key = rk.astype(np.int64) * span + pos
    order = np.argsort(key, kind="stable")
    kind, _ = cols.codes("kind")
    rows = rows[order]
    return rows, key[order], rk[order], pos[order], kind[rows]


def _next_in(sorted_key: np.ndarray, rk: np.ndarray, pos: np.ndarray, span: int) -> np.ndarray:
    """Index into the sorted events of the first one of the same rk strictly after pos; -1 if none."""
    if len(sorted_key) == 0:
        return np.full(len(rk), NO, np.int64)
    q = rk.astype(np.int64) * span + pos
    idx = np.searchsorted(sorted_key, q, "right")
    ok = idx < len(sorted_key)
    idx_c = np.minimum(idx, len(sorted_key) - 1)
    same = ok & (sorted_key[idx_c] // span == rk)
    return np.where(same, idx_c, NO)


class _Out:
    """Collects finding records (a FindingsBuilder: evidence rows fetched in one take at the end), judging each
    against recorder gaps, missing engine_configs and the crash policy first."""

    #: step threshold (an AnalysisConfig field) per subrule, for the crash policy
    # subrules whose severity rests on steps "with room", which the scheduler's engine_config limits decide
    ROOM_SUBRULES = ("starved", "preempted_not_resumed")
    STEP_THRESHOLD = {"starved": "starve_steps", "never_scheduled": "starve_steps",
                      "preempted_not_resumed": "starve_steps", "stuck_waiting_kv": "starve_steps",
                      "zombie": "zombie_steps", "dropped_from_batch": "zombie_steps"}
    #: what the crash cut off, per subrule (message text)
    CUT_OFF = {"stuck_waiting_kv": "its KV arrived", "dropped_from_batch": "it came back to the batch"}

    def __init__(self, ctx: AnalysisContext, cols: Columns, sc: SchedCounter | None = None) -> None:
        self.ctx = ctx
        self.cols = cols
        self.found = FindingsBuilder(ctx, "unscheduled_request")
        self.gaps = gaps(ctx)
        self.sc = sc
        self.failures = engine_failures(ctx)

    def _crash_cut(self, subrule: str, sk: int, start_row: int) -> Any:
        """The engine failure that explains a window open at the end, or None (see the module docstring)."""
        failure = self.failures.get(sk)
        if failure is None or self.sc is None:
            return None
        start = int(self.cols.pos[start_row])
        if start >= failure.point_pos:
            return failure
        steps = float(self.sc.steps_between(np.array([sk]), np.array([start]), np.array([failure.point_pos]))[0])
        if steps >= int(getattr(self.ctx.config, self.STEP_THRESHOLD.get(subrule, "starve_steps"))):
            return None
        if subrule == "stuck_waiting_kv" and \
                failure.point_ts - int(self.cols.ts[start_row]) > grace_s(self.ctx) * 1e9:
            return None
        return failure

    def add(self, subrule: str, severity: str, rk: int, start_row: int, end_pos: int, message: str,
            evidence: list[tuple[int, str | None]], extra: dict[str, Any]) -> None:
        cols = self.cols
        names = cols.rk_names
        sk = int(names["sk"].iloc[rk])
        instance = sk_instance(cols, sk)[0]
        covered = self.gaps.covers(inst_code_of_sk(cols, sk), int(cols.pos[start_row]),
                                   int(end_pos if end_pos >= 0 else cols.n))
        if covered:
            severity = DOWNGRADE[severity]
            message += f" ({covered} on {instance} over this window: the missing event may have been dropped)"
            extra = dict(extra, downgraded=covered)
        elif subrule in self.ROOM_SUBRULES and self.sc is not None and not self.sc.has_config[sk]:
            severity = DOWNGRADE[severity]
            message += (f" (no engine_config for {instance}: room judged without its token, sequence and "
                        "block-size limits)")
            extra = dict(extra, downgraded="no_engine_config")
        step = int(cols.step[start_row])
        record = self.found.add(subrule, severity, message,
                                [(r, note) for r, note in evidence if r is not None and r >= 0], sk=sk,
                                req=str(names["req"].iloc[rk]), step=step if step >= 0 else None,
                                ts_ns=int(cols.ts[start_row]), extra=extra)
        crash = self._crash_cut(subrule, sk, start_row) if end_pos < 0 else None
        if crash is not None:
            crash.mark(record, f"{names['req'].iloc[rk]} {self.CUT_OFF.get(subrule, 'was scheduled')}")
            record["evidence"].append((crash.row, CRASH_NOTE))

    def frame(self) -> pd.DataFrame:
        return self.found.frame()


def _row(cols: Columns, pos: np.ndarray | int) -> Any:
    return np.where(np.asarray(pos) >= 0, cols.order[np.maximum(pos, 0)], NO)


def _blockers(cols: Columns, st: RequestState, sk: int, rk: int, a: int, b: int) -> int | None:
    """The oldest other request of the scheduler, added before this one, that waited unscheduled through the whole
    window (a, b) (b = -1: to the end of the trace): the head of the line."""
    mine = np.flatnonzero(st.sk == sk)
    end = b if b >= 0 else cols.n
    add = st.add_pos[mine]
    first = st.first_sched_pos[mine]
    fin = st.finish_pos[mine]
    kv = st.wait_kv_pos[mine]
    waiting = ((add >= 0) & (add < st.add_pos[rk]) & ((first < 0) | (first > end)) & ((fin < 0) | (fin > end))
               & (mine != rk) & ((kv < 0) | (kv > end)))
    cand = mine[waiting]
    if len(cand) == 0:
        return None
    return int(cand[np.argmin(st.add_pos[cand])])


def _remote_side(ctx: AnalysisContext, cols: Columns, st: RequestState, rk: int) -> dict[str, Any]:
    """For a decode-side request: its prefill side (req_add detail remote_instance / remote_req) and the rows
    where that side expired the transfer (kv_expire) or saw the send finish (kv_send_done); {} if unknown. One
    finding at a time (few): a mask over the request names, no per-event work."""
    add = int(st.add_pos[rk])
    if add < 0:
        return {}
    row = int(cols.order[add])
    instance = detail_text(ctx, np.array([row]), "remote_instance")[0]
    if instance is None:
        return {}
    remote_req = detail_text(ctx, np.array([row]), "remote_req")[0] or str(cols.rk_names["req"].iloc[rk])
    names = cols.rk_names
    match = np.flatnonzero(((names["instance"] == instance) & (names["req"] == remote_req)).to_numpy())
    out: dict[str, Any] = {"instance": instance, "req": remote_req}
    if len(match):
        p = int(match[0])
        if st.expire_pos[p] >= 0:
            out["expire_row"] = int(cols.order[st.expire_pos[p]])
        if st.send_done_pos[p] >= 0:
            out["send_row"] = int(cols.order[st.send_done_pos[p]])
    return out


def _peer_failure(cols: Columns, failures: dict[int, EngineFailure], instance: str | None) -> EngineFailure | None:
    """The first engine failure of any scheduler of `instance` (the side a request waits on), or None."""
    if not instance or not failures:
        return None
    schedulers = np.flatnonzero((cols.sk_names["instance"] == instance).to_numpy()).tolist()
    found = [failures[sk] for sk in schedulers if sk in failures]
    return min(found, key=lambda failure: failure.pos) if found else None


def _prompt_need(ctx: AnalysisContext, cols: Columns, st: RequestState, sc: SchedCounter) -> np.ndarray:
    """Blocks each request's prompt needs (>= 1): ceil(req_add n / block_size) where both are known."""
    need = np.ones(st.n, np.int64)
    add = st.add_pos
    has = add >= 0
    rows = _row(cols, add[has])
    prompt = cols.ints_at("n", rows).astype(np.float64)
    bs = sc.block_size[st.sk[has]]
    blocks = np.where((prompt > 0) & (bs > 0), np.ceil(prompt / np.where(bs > 0, bs, 1)), 1)
    need[has] = np.maximum(blocks, 1).astype(np.int64)
    return need


def _fmt_ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def run(ctx: AnalysisContext) -> pd.DataFrame:
    cols = columns(ctx)
    if cols.n == 0 or cols.n_requests == 0:
        return FindingsBuilder(ctx, "unscheduled_request").frame()
    st = request_state(ctx)
    cfg = ctx.config
    sc = SchedCounter(ctx, cols)
    out = _Out(ctx, cols, sc)
    need = _prompt_need(ctx, cols, st, sc)
    span = int(cols.n) + 2
    unfinished = st.finish_pos < 0
    kind_codes, kind_names = cols.codes("kind")
    code = {k: (kind_names.index(k) if k in kind_names else -9) for k in
            ("req_add", "req_sched", "req_preempt", "req_wait_kv", "req_finish", "kv_recv_done", "kv_recv_fail")}

    # --- waiting periods: starved / never_scheduled / preempted_not_resumed ------------------------------------
    # A period starts at req_add, at the close of a KV receive, or at a preemption, and ends at the request's next
    # req_sched / req_wait_kv / req_finish. For adds and receives that end is read off the per-request first
    # positions; requests that were preempted (or scheduled before their receive) get an exact search in a sorted
    # table of their own events only, so no pass sorts every req_sched of the trace.
    big = np.iinfo(np.int64).max

    def first_after(after: np.ndarray, *positions: np.ndarray) -> np.ndarray:
        cands = np.stack([np.where(p > after, p, big) for p in positions])
        best = cands.min(axis=0)
        return np.where(best == big, NO, best)

    adders = np.flatnonzero(st.add_pos >= 0)
    add_end = first_after(st.add_pos[adders], st.first_sched_pos[adders], st.wait_kv_pos[adders],
                          st.finish_pos[adders])
    receivers = np.flatnonzero(st.recv_close_pos >= 0)
    recv_pos = st.recv_close_pos[receivers]
    recv_end = first_after(recv_pos, st.first_sched_pos[receivers], st.finish_pos[receivers])
    exact = np.zeros(st.n, bool)
    exact[st.n_preempt > 0] = True
    exact[receivers[(st.first_sched_pos[receivers] >= 0) & (st.first_sched_pos[receivers] < recv_pos)]] = True
    if exact.any():
        _, small_key, _, small_pos, _ = _sorted_events(cols, ("req_sched", "req_wait_kv", "req_finish"), exact)
    else:
        small_key = small_pos = np.empty(0, np.int64)
    preempt_rows = cols.rows_of("req_preempt")
    preempt_rows = preempt_rows[cols.rk[preempt_rows] >= 0]
    rk = np.concatenate([adders, receivers, cols.rk[preempt_rows].astype(np.int64)])
    pos = np.concatenate([st.add_pos[adders], recv_pos, cols.pos[preempt_rows]])
    end_pos = np.concatenate([add_end, recv_end, np.full(len(preempt_rows), NO)])
    start_rows = _row(cols, pos).astype(np.int64)
    search = np.flatnonzero(exact[rk])
    if len(search):
        nxt = _next_in(small_key, rk[search], pos[search], span)
        end_pos[search] = np.where(nxt >= 0, small_pos[np.maximum(nxt, 0)] if len(small_pos) else NO, NO)
    is_open = end_pos < 0
    sk = cols.sk[start_rows]
    steps = sc.steps_between(sk, pos, end_pos)
    # requests that wait for remote KV right from the add are not waiting to be scheduled until the KV arrives
    start_kind = cols.codes("kind")[0][start_rows]
    threshold = int(cfg.starve_steps)
    cand = np.flatnonzero(steps >= threshold)
    room = np.zeros(len(start_rows), np.int64)
    if len(cand):
        room[cand] = sc.room_between(sk[cand], pos[cand], end_pos[cand], need[rk[cand]], threshold,
                                     queued=start_kind[cand] != code["req_preempt"])
    ts_end = trace_span(ctx)[1]  # the whole trace's end, also on one partition of it
    reported = np.zeros(st.n, bool)
    # candidate findings, chosen vectorised: room enough (starved), or still open at the end after a preemption
    # or after an add never followed by a schedule (preempted_not_resumed / never_scheduled)
    open_unfinished = is_open & unfinished[rk]
    maybe = (steps >= threshold) & ((room >= threshold) | (open_unfinished & (
        (start_kind == code["req_preempt"])
        | ((start_kind == code["req_add"]) & (st.first_sched_pos[rk] < 0) & (st.wait_kv_pos[rk] < 0)))))
    for i in np.flatnonzero(maybe).tolist():  # candidate findings only
        r = int(rk[i])
        srow = int(start_rows[i])
        kind = int(start_kind[i])
        open_ = bool(is_open[i])
        end_row = int(_row(cols, end_pos[i])) if not open_ else NO
        waited_ns = (ts_end if open_ else cols.ts[end_row]) - cols.ts[srow]
        n_steps = int(steps[i])
        n_room = int(room[i])
        if open_ and not unfinished[r]:
            continue
        evidence: list[tuple[int, str | None]] = [(srow, "waiting from here")]
        if end_row >= 0:
            evidence.append((end_row, "first scheduled after" if kind_codes[end_row] == code["req_sched"]
                             else "waiting ended here"))
        extra = {"steps_waited": n_steps, "steps_with_room": n_room, "blocks_needed": int(need[r]),
                 "waited_ns": int(waited_ns), "open_at_end": open_}
        if kind == code["req_preempt"] and open_:
            sev = "error" if n_room >= threshold else "warning"
            msg = (f"request {cols.rk_names['req'].iloc[r]} was preempted and never resumed: {n_steps} steps "
                   f"({_fmt_ms(waited_ns)}) to the end of the trace, {n_room} of them with room for it")
            out.add("preempted_not_resumed", sev, r, srow, NO, msg, evidence, extra)
            reported[r] = True
            continue
        if n_room >= threshold and kind != code["req_preempt"]:
            n_room = room[i] = sc.fcfs_room(int(sk[i]), int(pos[i]), int(end_pos[i]), int(need[r]), r, st, need)
            extra["steps_with_room"] = n_room
        if n_room >= threshold:
            blocker = (_blockers(cols, st, int(sk[i]), r, int(pos[i]), int(end_pos[i]))
                       if len(out.found.records) < 200 else None)
            sev = "error" if open_ else "warning"
            tail = ("still waiting at the end of the trace" if open_
                    else f"then {_END_WORDS.get(kind_names[kind_codes[end_row]], 'scheduled')} ({_fmt_ms(waited_ns)})")
            n_busy = int(sc.busy_between(sk[i:i + 1], pos[i:i + 1], end_pos[i:i + 1])[0])
            extra["steps_others_ran"] = n_busy
            msg = (f"request {cols.rk_names['req'].iloc[r]} waited {n_steps} steps, {n_room} of them with room for "
                   f"it (token budget left, >= {int(need[r])} free blocks), other requests running in {n_busy}; "
                   f"{tail}")
            if blocker is not None:
                blocker_name = str(cols.rk_names["req"].iloc[blocker])
                msg += f"; head of line: {blocker_name}, waiting since before it"
                extra["head_of_line"] = blocker_name
                evidence.append((int(_row(cols, st.add_pos[blocker])), "head of line: waiting since"))
            out.add("starved", sev, r, srow, end_pos[i], msg, evidence, extra)
            reported[r] = True
            continue
        if open_ and kind == code["req_add"] and st.first_sched_pos[r] < 0 and not reported[r] \
                and (st.wait_kv_pos[r] < 0):
            msg = (f"request {cols.rk_names['req'].iloc[r]} was never scheduled: {n_steps} steps "
                   f"({_fmt_ms(waited_ns)}) since it was added, none with room for it "
                   f"(>= {int(need[r])} free blocks and token budget)")
            n_full, n_short = sc.short_of_blocks(int(sk[i]), int(pos[i]), int(end_pos[i]), int(need[r]))
            extra["steps_batch_full"] = n_full
            extra["steps_short_of_blocks"] = n_short
            sev = "warning"
            if n_short == 0 and n_full:
                # no step kept it out for want of blocks, each ran a full batch (or had room, too few times to be
                # starved): the queue of a loaded engine when the trace ends (a stop, a dump)
                sev = "info"
                msg += (f"; {n_full} of them ran a full batch (max_num_seqs or the token budget), none kept it out "
                        "for want of blocks: a queue, not a fault")
            out.add("never_scheduled", sev, r, srow, NO, msg, evidence, extra)
            reported[r] = True

    # --- stuck_waiting_kv -----------------------------------------------------------------------------------
    grace = grace_s(ctx)  # the recorded release's connector timeout unless configured
    grace_ns = int(grace * 1e9)
    # every req_wait_kv opens a receive (a request preempted after its KV arrived may wait again on re-admission,
    # vllm#53250): each receive window is judged, not only the request's first
    waiters = st.window_rk.astype(np.int64)
    if len(waiters):
        wait_pos = st.window_start
        wrow = _row(cols, wait_pos).astype(np.int64)
        wts = cols.ts[wrow]
        close = st.window_close
        crow = _row(cols, close).astype(np.int64)
        closed = close >= 0
        cts = np.where(closed, cols.ts[np.maximum(crow, 0)], ts_end)
        wsk = st.sk[waiters]
        # overtaken: requests of the same scheduler that began waiting later and already closed
        overtaken = np.zeros(len(waiters), np.int64)
        for s in np.unique(wsk).tolist():  # per scheduler
            m = wsk == s
            done_waits = np.sort(wts[m & closed])
            overtaken[m] = len(done_waits) - np.searchsorted(done_waits, wts[m], "right")
        wsteps = sc.steps_between(wsk, wait_pos, np.full(len(waiters), NO))
        age = cts - wts
        for i in np.flatnonzero((closed & (age > grace_ns)) | (~closed & unfinished[waiters]
                                                               & ((age > grace_ns) | (wsteps >= threshold)))).tolist():
            r = int(waiters[i])
            again = int(st.window_start[i] != st.wait_kv_pos[r])  # a later receive of the request
            evidence = [(int(_row(cols, st.add_pos[r])), None)]
            if again:
                evidence.append((int(_row(cols, st.wait_kv_pos[r])), "its first receive"))
            evidence.append((int(wrow[i]), "waiting for remote KV" + (" again" if again else "")))
            extra = {"waited_ns": int(age[i]), "steps_since": int(wsteps[i]), "overtaken_by": int(overtaken[i]),
                     "grace_s": grace, "open_at_end": not bool(closed[i])}
            if again:
                extra["receive"] = int(np.count_nonzero((st.window_rk == r) & (st.window_start <= wait_pos[i])))
            name = cols.rk_names["req"].iloc[r]
            if closed[i]:
                evidence.append((int(crow[i]), "receive closed"))
                msg = f"request {name} waited {_fmt_ms(age[i])} for remote KV, longer than grace {grace:g} s"
                out.add("stuck_waiting_kv", "warning", r, int(wrow[i]), int(close[i]), msg, evidence, extra)
                continue
            remote = _remote_side(ctx, cols, st, r)
            for key in ("expire_row", "send_row"):  # only signals the engine had starve_steps steps to act on
                if key in remote:
                    after = sc.steps_between(np.array([st.sk[r]]), np.array([cols.pos[remote[key]]]),
                                             np.array([NO]))[0]
                    if after < threshold:
                        del remote[key]
            expired_row = remote.get("expire_row")
            if expired_row is not None:
                evidence.append((expired_row, "the sender's expiry: it gave up on this transfer"))
                extra["remote_expired"] = True
            if remote.get("send_row") is not None:
                evidence.append((remote["send_row"], "the sender reported the send finished"))
                extra["remote_sent"] = True
            if age[i] > grace_ns:
                sev = "error"
                why = f"longer than the grace period ({grace:g} s, past every connector timeout)"
            elif expired_row is not None or remote.get("send_row") is not None:
                sev = "error"
                why = (f"although {remote['instance']} already "
                       + ("expired its side" if expired_row is not None else "reported the send finished"))
            elif overtaken[i] and wsteps[i] >= threshold:
                sev = "warning"
                why = f"while {int(overtaken[i])} requests that began waiting later already received theirs"
            else:
                sev = "info"
                why = "while the engine kept stepping (the trace may end mid-transfer)"
            peer = _peer_failure(cols, out.failures, remote.get("instance"))
            if peer is not None:
                # the root cause, cited; the severity stays: a decode side must still give up on a dead peer
                # (its connector's timeout), so a wait past the grace period is its own bug
                evidence.append((peer.row, f"{remote['instance']} failed here"))
                extra["peer_engine_failed"] = {"instance": remote["instance"], "step": peer.step if peer.step >= 0
                                               else None, "ts_ns": peer.ts_ns, "error": peer.error}
                why += f"; its KV source {remote['instance']} {peer.describe()}"
            which = f" (its receive #{extra['receive']}: it waits again after its KV arrived)" if again else ""
            msg = (f"request {name} still waits for remote KV{which} at the end of the trace: {_fmt_ms(age[i])}, "
                   f"{int(wsteps[i])} steps, {why}")
            out.add("stuck_waiting_kv", sev, r, int(wrow[i]), NO, msg, evidence, extra)

    # --- dropped_from_batch (V1 runner) -------------------------------------------------------------------
    brows = np.flatnonzero(cols.is_kind("batch_add", "batch_remove") & (cols.rk >= 0))
    if len(brows):
        reason, rnames = cols.codes("reason")
        kinds = cols.codes("kind")[0]
        fields = rows_columns(ctx, brows, ["pp_rank", "tp_rank", "pid"])
        lane = pd.DataFrame({"row": brows, "rk": cols.rk[brows], "pid": fields["pid"],
                             "pp": fields["pp_rank"], "tp": fields["tp_rank"],
                             "pos": cols.pos[brows], "is_add": kinds[brows] == code_of(cols, "batch_add"),
                             "unsched": reason[brows] == (rnames.index("unscheduled") if "unscheduled" in rnames
                                                          else -9)})
        last = lane.sort_values("pos").groupby(["rk", "pid", "pp", "tp"], sort=False).tail(1)
        dropped = last[~last["is_add"] & last["unsched"] & unfinished[last["rk"].to_numpy()]]
        if len(dropped):
            exec_rows = cols.rows_of("exec_end", "exec_begin")
            exec_pid = rows_columns(ctx, exec_rows, ["pid"])["pid"]
            lane_last_step = pd.Series(cols.step[exec_rows]).groupby(exec_pid).max()
            mine = np.zeros(st.n, bool)
            mine[dropped["rk"].to_numpy()] = True
            sched_rows_, sched_keys, _, _, _ = _sorted_events(cols, ("req_sched",), mine)
            for d in dropped.itertuples(index=False):  # candidate findings only
                r = int(d.rk)
                drow = int(d.row)
                dpos = int(d.pos)
                nxt_i = _next_in(sched_keys, np.array([r]), np.array([dpos]), span)[0]
                name = cols.rk_names["req"].iloc[r]
                if nxt_i >= 0:
                    srow = int(sched_rows_[nxt_i])
                    ran = lane_last_step.get(int(d.pid), -1) >= cols.step[srow] >= 0
                    if not ran:
                        continue
                    msg = (f"request {name} was removed from the persistent batch of pp{int(d.pp)}/tp{int(d.tp)} as "
                           f"unscheduled, scheduled again at step {int(cols.step[srow])}, and never re-added on that "
                           "worker although it executed that step")
                    out.add("dropped_from_batch", "error", r, drow, int(sched_keys[nxt_i] % span),
                            msg, [(drow, "batch_remove unscheduled"), (srow, "scheduled again")],
                            {"pp_rank": int(d.pp), "tp_rank": int(d.tp)})
                else:
                    n_after = float(sc.steps_between(np.array([st.sk[r]]), np.array([dpos]), np.array([NO]))[0])
                    if n_after < int(cfg.zombie_steps):
                        continue
                    msg = (f"request {name} was removed from the persistent batch of pp{int(d.pp)}/tp{int(d.tp)} as "
                           f"unscheduled and never came back: unfinished, {int(n_after)} steps to the end of the trace")
                    out.add("dropped_from_batch", "warning", r, drow, NO, msg, [(drow, "batch_remove unscheduled")],
                            {"pp_rank": int(d.pp), "tp_rank": int(d.tp), "steps_since": int(n_after)})

    # --- zombie --------------------------------------------------------------------------------------------
    # Internal gaps: consecutive req_sched rows of a request, in load order (one writer's rows are in seq order,
    # files in path order), differenced after a stable sort on the request key alone. Step ids count schedule()
    # calls (a coalesced empty run advances them by its length), so the calls strictly between two schedules are a
    # difference of steps. Tail gaps (after the last req_sched: to a finish, or open to the end of the trace) come
    # from the per-request positions. Requests whose steps do not increase in load order (several writers), with a
    # preemption inside a long gap, or with events lacking a step are re-checked with an exact sorted search over
    # their own events only.
    threshold_z = int(cfg.zombie_steps)
    sched_rows = cols.req_rows("req_sched")  # request_state's row list and keys: no pass of its own
    z_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (row, rk, gap, next_pos)
    if len(sched_rows):
        # a stable sort on the request key keeps each request's rows in load order. The sorted keys are each key
        # repeated n_sched times (request_state counted these rows), the steps are read in row order and then
        # permuted, and the rows themselves only where a long gap is: few large temporaries, each freed early
        # (fresh memory is what costs at 10M events)
        by_request = np.argsort(cols.req_keys("req_sched"), kind="stable")
        s_rk = np.repeat(np.arange(st.n, dtype=np.int32), st.n_sched)
        s_step = cols.step[sched_rows][by_request]
        same = s_rk[1:] == s_rk[:-1]
        d = s_step[1:] - s_step[:-1]
        d -= 1
        disorder = np.zeros(st.n, bool)
        disorder[s_rk[1:][same & (d < 0)]] = True
        disorder[s_rk[s_step < 0]] = True
        long_in = np.flatnonzero(same & (d >= threshold_z)) + 1  # the later req_sched of each long gap
        del same, d
        long_in = long_in[~disorder[s_rk[long_in]]]
        # a preemption inside the gap means the request was waiting, not running
        before_rows = sched_rows[by_request[long_in - 1]]
        lp = st.last_preempt_pos[s_rk[long_in]]
        ok = ~((st.n_preempt[s_rk[long_in]] > 0) & (lp > cols.pos[before_rows]))
        disorder[s_rk[long_in[~ok]]] = True
        long_in = long_in[ok]
        gap_long = (s_step[long_in] - s_step[long_in - 1] - 1).astype(np.float64)
        z_parts.append((before_rows[ok], s_rk[long_in].astype(np.int64), gap_long,
                        cols.pos[sched_rows[by_request[long_in]]]))
        del by_request, s_rk, s_step
        # tails: after the request's last req_sched
        has = np.flatnonzero((st.last_sched_pos >= 0) & ~disorder)
        last_row = _row(cols, st.last_sched_pos[has]).astype(np.int64)
        after_preempt = st.last_preempt_pos[has] > st.last_sched_pos[has]
        fin = st.finish_pos[has]
        finished_after = fin > st.last_sched_pos[has]
        tail_open = (fin < 0) & ~after_preempt
        tail_fin = finished_after & ~after_preempt
        fin_row = _row(cols, np.maximum(fin, 0)).astype(np.int64)
        step_last = cols.step[last_row]
        gap_t = np.full(len(has), -1.0)
        gap_t[tail_open] = sc.last_step[st.sk[has[tail_open]]] - step_last[tail_open]
        fin_step = cols.step[fin_row]
        known = tail_fin & (fin_step >= 0) & (step_last >= 0)
        gap_t[known] = fin_step[known] - step_last[known] - 1
        unknown = np.flatnonzero((tail_fin & ~known) | (tail_open & (step_last < 0)))
        if len(unknown):
            gap_t[unknown] = sc.steps_between(st.sk[has[unknown]], st.last_sched_pos[has[unknown]],
                                              np.where(tail_fin[unknown], fin[unknown], NO))
        keep = gap_t >= threshold_z
        z_parts.append((last_row[keep], has[keep].astype(np.int64), gap_t[keep],
                        np.where(tail_fin[keep], fin[keep], NO)))
        # exact search for the requests set aside
        if disorder.any():
            rows_x, _, rk_x, pos_x, kind_x = _sorted_events(cols, ("req_sched", "req_wait_kv", "req_finish",
                                                                   "req_preempt"), disorder)
            is_s = kind_x == code["req_sched"]
            last_of = np.r_[rk_x[1:] != rk_x[:-1], True] if len(rk_x) else np.empty(0, bool)
            idx = np.flatnonzero(is_s & (~last_of | unfinished[rk_x]))
            has_next = ~last_of[idx]
            nxt = np.minimum(idx + 1, max(len(pos_x) - 1, 0))
            nxt_pos = np.where(has_next, pos_x[nxt], NO)
            step_here = cols.step[rows_x[idx]]
            step_next = np.where(has_next, cols.step[rows_x[nxt]], NO)
            by_steps = (step_here >= 0) & np.where(has_next, step_next >= 0, True)
            gap_x = np.where(has_next, step_next - step_here - 1,
                             sc.last_step[st.sk[rk_x[idx]]] - step_here).astype(np.float64)
            slow = np.flatnonzero(~by_steps)
            if len(slow):
                gap_x[slow] = sc.steps_between(st.sk[rk_x[idx[slow]]], pos_x[idx[slow]], nxt_pos[slow])
            keep = gap_x >= threshold_z
            z_parts.append((rows_x[idx[keep]], rk_x[idx[keep]].astype(np.int64), gap_x[keep], nxt_pos[keep]))
    if z_parts:
        z_row = np.concatenate([z[0] for z in z_parts])
        z_rk = np.concatenate([z[1] for z in z_parts])
        gap = np.concatenate([z[2] for z in z_parts])
        nxt_pos = np.concatenate([z[3] for z in z_parts])
        has_next = nxt_pos >= 0
        big = gap >= threshold_z
        if big.any():
            frame = pd.DataFrame({"row": z_row[big], "rk": z_rk[big], "gap": gap[big], "open": ~has_next[big],
                                  "nxt": nxt_pos[big]})
            frame = frame.sort_values(["rk", "gap"]).groupby("rk").tail(1)
            for z in frame.itertuples(index=False):  # one per request
                srow = int(z.row)
                r = int(z.rk)
                name = cols.rk_names["req"].iloc[r]
                if z.open:
                    msg = (f"request {name} is in the running set but was not scheduled in its last {int(z.gap)} "
                           f"steps, and is not finished at the end of the trace")
                    evidence = [(srow, "last scheduled")]
                    out.add("zombie", "error", r, srow, NO, msg, evidence, {"steps": int(z.gap), "open_at_end": True})
                else:
                    nrow = int(_row(cols, int(z.nxt)))
                    msg = (f"request {name} stayed in the running set {int(z.gap)} steps without being scheduled "
                           f"or finished, then {kind_names[cols.codes('kind')[0][nrow]]}")
                    evidence = [(srow, "scheduled"), (nrow, "next")]
                    out.add("zombie", "warning", r, srow, int(z.nxt), msg, evidence,
                            {"steps": int(z.gap), "open_at_end": False})
    return out.frame()


def code_of(cols: Columns, kind: str) -> int:
    return cols.code_of("kind", kind)


def _cross_summary(ctx: Any, findings: pd.DataFrame, instances: frozenset[str]) -> tuple[str, ...]:
    """`stuck_waiting_kv` across instances, phase 1 (`CrossInstance.summarize`): the instances outside the
    partition that its waits open at the end of the trace name as where their KV comes from (the req_add's
    `remote_instance`): the prefill side decides the finding's severity and evidence. Open waits are few."""
    if not columns(ctx).n or not len(findings):
        return ()
    open_waits = findings[(findings["subrule"] == "stuck_waiting_kv")
                          & findings["extra"].map(lambda e: bool((e or {}).get("open_at_end")))]
    if not len(open_waits):
        return ()
    return tuple(sorted(_waited_on(ctx, open_waits) - instances))


def _waited_on(ctx: Any, waits: pd.DataFrame) -> set[str]:
    """The `remote_instance` of the req_add of each waiting request (the instances its KV comes from)."""
    cols = columns(ctx)
    st = request_state(ctx)
    names = cols.rk_names.reset_index().rename(columns={"index": "rk"})
    names = names.astype({"instance": object, "req": object})
    keys = waits[["instance", "req"]].astype(object).merge(names[["rk", "instance", "req"]], how="inner")
    add = st.add_pos[keys["rk"].to_numpy(np.int64)]
    rows = cols.order[add[add >= 0]].astype(np.int64)
    return {str(v) for v in detail_text(ctx, rows, "remote_instance") if v is not None}


def _cross_merge(parts: Any) -> tuple[str, ...]:
    """One partition's named instances from its windows': united."""
    return tuple(sorted({name for part in parts for name in part}))


def _cross_links(parts: Any) -> set[tuple[int, int]]:
    """Phase 2: a partition's open wait naming an instance of another partition links the two."""
    owner_of = {inst: i for i, (instances, _) in enumerate(parts) for inst in instances}
    return {(i, owner_of[name]) for i, (_, part) in enumerate(parts) for name in (part or ()) if name in owner_of}


RULE = Rule(
    id="unscheduled_request",
    summary="requests never scheduled, starved, stuck waiting for KV, preempted and not resumed, dropped, zombies",
    run=run,
    subrules=("never_scheduled", "starved", "stuck_waiting_kv", "preempted_not_resumed", "dropped_from_batch",
              "zombie"),
    needs=(request_state, step_frame),
    cost=0.14,
    # a wait open at the end of the trace is judged by its prefill side (req_add `remote_instance`)
    cross_instance=CrossInstance("stuck_waiting_kv", _cross_summary, _cross_merge, _cross_links),
)
