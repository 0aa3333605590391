"""no_progress: a busy scheduler that produces nothing (livelock).

A scheduler preempts to make room for the request it is scheduling. When the room never appears (the victims'
frees are deferred behind a step fence, so the pool does not grow in this step; or the pool is too small for the
requests it keeps re-admitting) every step preempts, re-admits and recomputes, and no token comes out while the
queue waits. The rule of progress this checks: **a stretch of steps that preempts requests must also make
progress**: produce a token, or compute work that is kept (a request that is never preempted keeps all of its).
Preemptions that throw away at least half of what the stretch schedules, with no progress, are a livelock, not
load.

Algorithm (positions are the global time order of `pdtrace.analysis.columns`; everything vectorised over the
rows of the kinds involved, one sort each):
1. Progress (`produced_tokens`, a shared table), on the schedulers with at least two preemptions only. A request
   never preempted keeps all its work: each of its `req_sched` rows is progress, placed at its step's
   `step_output` (once that came). For the preempted requests, their `req_add`, `req_preempt`, `req_sched` and
   `req_finish` rows sorted by (request, position): a request's *work* restarts at its `req_add` and at each
   `req_preempt` (vLLM resets `num_computed_tokens`); a segmented cumulative sum of the `req_sched` counts gives the
   tokens computed since the restart. A `req_sched` produces a token when that sum reaches the prompt (`req_add` n;
   every schedule counts when the prompt is unknown) and the step's output is processed (its `step_output`, where
   the token is placed) and not thrown away: the request's next event is not a `req_preempt` before that output.
   Without step_output rows for the scheduler the token is placed at the `req_sched`, thrown away by a preemption
   fewer steps later than the steps that can be in flight (engine_config `batch_queue_size` / `async_scheduling`,
   else 1). A `req_finish` with reason stop, length or repetition is a token too. Thrown away (`_discarded`):
   every `req_sched` of a segment (from the admission or a preemption to the next restart) that ends in a
   `req_preempt`, after the segment's last token: vLLM resets `num_computed_tokens`, so a preemption loses every
   chunk computed since (vllm#52520), not only the schedule right before it.
2. Windows: per scheduler, the `sched` rows between two progress events (a searchsorted of each row's position
   among the production positions, keyed by scheduler). Per window (one pandas groupby): steps (a coalesced
   `sched` row counts its `empty_run`), tokens scheduled, the distinct requests scheduled, the largest `waiting`
   of the `sched` detail and the lowest `free_blocks`; and, searchsorted the same way, its `req_preempt` rows and
   how many of the preemptions' `blocks_free` rows were deferred (a fence). A scheduler with no `sched` row at all
   (a trace written without the kind) counts the distinct steps of its `req_sched` / `req_preempt` rows instead.
3. `livelock` (warning): a window of at least `livelock_steps` steps (AnalysisConfig, default 4) with at least two
   preemptions, no progress, at least half of its `req_sched` rows thrown away (step 1), and
   requests waiting (`waiting` > 0 on some step, or, where the detail lacks it, the preempted victims).
   `extra`: steps, preemptions, deferred_frees, tokens_produced (0), tokens_scheduled, requests, queue (the
   largest `waiting`, or the distinct victims), min_free_blocks, open_at_end. The finding names its victims:
   `req` the most preempted (the first preempted among equals), the finding's `requests` the others. A
   `recorder_gap` / `recorder_off` over the window lowers it to info (the production may have been dropped).
A busy scheduler that produces slowly has short windows; preemption with recompute produces once the victim is
back; a long prefill that preempts decoders to fit keeps its work; an idle scheduler or one waiting for remote KV
has no preemptions: all are silent. Cost: nothing on a scheduler with fewer than two preemptions; else one pass
over its `req_sched` rows and one sort of the preempted requests' rows only (bench/analyze.py's 2M-event trace
with every scheduler taken: 0.23 s, where sorting every request's rows took 0.5 s; shared machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (DOWNGRADE, NO, Cited, FindingsBuilder, Rule, columns, detail_numbers,
                                      engine_configs, gaps, inst_code_of_sk, order_by_key, request_state,
                                      shared_table, sk_instance, step_frame, step_index)

PRODUCING_FINISH = ("stop", "length", "repetition")


@dataclass
class Produced:
    """Production events (rows of `req_sched` that produced a token and producing `req_finish` rows), and the
    `req_sched` rows whose work was thrown away (the request's next event is a preemption)."""

    rows: np.ndarray
    sk: np.ndarray
    pos: np.ndarray
    wasted_rows: np.ndarray
    busy: np.ndarray         # per scheduler key: at least two preemptions (the only schedulers looked at)


def _steps_in_flight(ctx: Any) -> np.ndarray:
    """Per scheduler key: how many steps can be in flight (engine_config; 1 without it)."""
    cols = columns(ctx)
    depth = np.ones(len(cols.sk_names), np.int64)
    for sk, cfg in engine_configs(ctx).items():
        try:
            queue = int(cfg.get("batch_queue_size") or 1)
        except (TypeError, ValueError):
            queue = 1
        depth[sk] = max(queue, 2 if cfg.get("async_scheduling") else 1)
    return depth


def _output_pos_by_step(cols: Any, si: Any, sk: np.ndarray, step: np.ndarray) -> np.ndarray:
    """`StepIndex.output_pos_of` through a dense (scheduler, step) table: step ids count schedule() calls from 0,
    so one array of all steps is small, and a gather replaces the searchsorted per row (0.3 s of 1.0 s for 1.5M
    req_sched rows before, 0.02 s after, bench/analyze.py --events 2000000 with every scheduler taken)."""
    n_sk = len(cols.sk_names)
    top = np.full(n_sk, NO, np.int64)
    for keys in (si.sched_key, si.output_key):
        if len(keys):
            np.maximum.at(top, keys // si.span, keys % si.span)
    offset = np.r_[0, np.cumsum(top + 1)]
    dense = np.full(int(offset[-1]) + 1, NO, np.int64)
    if len(si.output_key):
        dense[offset[si.output_key // si.span] + si.output_key % si.span] = si.output_pos
    inside = (step >= 0) & (step <= top[sk])
    return np.where(inside, dense[np.where(inside, offset[sk] + step, offset[-1])], NO)


def _build(ctx: Any) -> Produced:
    cols = columns(ctx)
    st = request_state(ctx)
    si = step_index(ctx)
    empty = np.empty(0, np.int64)
    # only schedulers that preempt twice can livelock: the others are not looked at (a healthy trace costs nothing)
    preempts = np.bincount(cols.sk[cols.req_rows("req_preempt")], minlength=len(cols.sk_names))
    busy = preempts >= 2
    if not busy.any():
        return Produced(empty, empty, empty, empty, busy)
    has_outputs = si.has_outputs if len(si.has_outputs) else np.zeros(len(cols.sk_names), bool)
    # requests never preempted keep all their work: each of their schedules is progress once its step's output came
    kept = cols.req_rows("req_sched")
    kept = kept[(st.n_preempt[cols.req_keys("req_sched")] == 0) & busy[cols.sk[kept]]]
    kept_sk = cols.sk[kept]
    kept_out = _output_pos_by_step(cols, si, kept_sk, cols.step[kept].astype(np.int64))
    done = ~has_outputs[kept_sk] | (kept_out >= 0)
    kept, kept_sk = kept[done], kept_sk[done]
    kept_pos = np.where(has_outputs[kept_sk], kept_out[done], cols.pos[kept])
    # preempted requests: their events in (request, time) order, work restarting at each preemption
    kinds = ("req_add", "req_preempt", "req_sched", "req_finish")
    rows = cols.req_rows(*kinds)
    rows = rows[(st.n_preempt[cols.rk[rows]] > 0) & busy[cols.sk[rows]]]
    rk = cols.rk[rows]
    rows = rows[order_by_key(rk, cols.pos[rows])]
    rk = cols.rk[rows]
    pos = cols.pos[rows]
    kind = cols.codes("kind")[0][rows]
    is_sched = kind == cols.code_of("kind", "req_sched")
    restart = np.isin(kind, [cols.code_of("kind", "req_add"), cols.code_of("kind", "req_preempt")])
    restart[np.r_[True, rk[1:] != rk[:-1]] if len(rk) else empty.astype(bool)] = True
    n = np.where(is_sched, np.maximum(cols.ints_at("n", rows, fill=0), 0), 0)
    total = np.cumsum(n)
    start = np.flatnonzero(restart)
    segment = np.cumsum(restart) - 1
    computed = total - (total[start] - n[start])[segment]  # tokens since the restart, this row included
    add_row = np.where(st.add_pos >= 0, cols.order[np.maximum(st.add_pos, 0)], NO)
    prompt = np.where(add_row >= 0, cols.ints_at("n", np.maximum(add_row, 0), fill=NO), NO)[rk]
    prompt_done = (prompt < 0) | (computed >= prompt)
    # thrown away: the request's next event is a preemption before the step's output
    nxt = np.r_[np.arange(1, len(rows)), max(len(rows) - 1, 0)] if len(rows) else empty
    next_preempt = np.r_[rk[1:] == rk[:-1], False] & (kind[nxt] == cols.code_of("kind", "req_preempt")) \
        if len(rows) else empty.astype(bool)
    sk = cols.sk[rows]
    step = cols.step[rows].astype(np.int64)
    out_pos = _output_pos_by_step(cols, si, sk, step)
    has_out = has_outputs[sk]
    depth = _steps_in_flight(ctx)[sk]
    early = np.where(has_out, pos[nxt] < out_pos, cols.step[rows[nxt]] - step < depth)
    produced = is_sched & prompt_done & ~(next_preempt & early) & (~has_out | (out_pos >= 0))
    reason, rnames = cols.codes("reason")
    finish = (kind == cols.code_of("kind", "req_finish")) & np.isin(
        reason[rows], [rnames.index(r) for r in PRODUCING_FINISH if r in rnames])
    keep = np.flatnonzero(produced | finish)
    # the token exists once the step's output is processed
    placed = np.where(produced[keep] & has_out[keep], out_pos[keep], pos[keep])
    return Produced(np.concatenate([kept, rows[keep]]), np.concatenate([kept_sk, sk[keep]]).astype(np.int64),
                    np.concatenate([kept_pos, placed]).astype(np.int64),
                    rows[_discarded(rk, kind, is_sched, produced | finish, restart, cols)], busy)


def _discarded(rk: np.ndarray, kind: np.ndarray, is_sched: np.ndarray, progress: np.ndarray, restart: np.ndarray,
               cols: Any) -> np.ndarray:
    """Over one request's rows in (request, time) order, segmented at each restart (`req_add`, `req_preempt`):
    the `req_sched` rows whose work a preemption threw away, every schedule since the request's last token in the
    segment (or the segment's start) when the segment ends with a `req_preempt` of the same request. vLLM resets
    `num_computed_tokens` at a preemption, so all the chunks a prefill computed since its admission are lost, not
    only the last (vllm#52520: four chunks per cycle, forever)."""
    n = len(rk)
    if n == 0:
        return np.zeros(0, bool)
    segment = np.cumsum(restart) - 1
    start = np.flatnonzero(restart)
    nxt = np.r_[start[1:], n]  # the row after each segment: the restart that ends it
    ends_in_preempt = np.zeros(len(start), bool)
    inside = nxt < n
    ends_in_preempt[inside] = (kind[nxt[inside]] == cols.code_of("kind", "req_preempt")) & \
        (rk[nxt[inside]] == rk[start[inside]])
    # the index of the segment's last progress row (its last token), -1 where none
    idx = np.where(progress, np.arange(n), -1)
    last_progress = np.maximum.reduceat(idx, start)
    return is_sched & ~progress & ends_in_preempt[segment] & (np.arange(n) > last_progress[segment])


@shared_table(request_state, step_index, cost=0.1)
def produced_tokens(ctx: Any) -> Produced:
    """Production events per scheduler (see the module docstring, step 1), cached on the context."""
    return ctx.cached("no_progress.produced", lambda: _build(ctx))


def _steps_without_sched(ctx: Any, busy: np.ndarray, window: Any) -> pd.DataFrame:
    """The steps of busy schedulers that recorded no `sched` row at all (a trace written without the kind): one
    per distinct step id of their `req_sched` / `req_preempt` rows, at its first row, tokens from the `req_sched`
    counts, queue and free pool unknown."""
    cols = columns(ctx)
    has_sched = np.bincount(cols.sk[cols.rows_of("sched")], minlength=len(cols.sk_names)) > 0
    lacking = busy & ~has_sched
    if not lacking.any():
        return pd.DataFrame()
    rows = cols.req_rows("req_sched", "req_preempt")
    rows = rows[lacking[cols.sk[rows]] & (cols.step[rows] >= 0)]
    tokens = np.where(cols.codes("kind")[0][rows] == cols.code_of("kind", "req_sched"),
                      np.maximum(cols.ints_at("n", rows, fill=0), 0), 0)
    per = pd.DataFrame({"sk": cols.sk[rows].astype(np.int64), "step": cols.step[rows].astype(np.int64),
                        "pos": cols.pos[rows], "row": rows, "tokens": tokens})
    per = per.sort_values("pos").groupby(["sk", "step"], sort=False).agg(
        row=("row", "first"), pos=("pos", "first"), tokens=("tokens", "sum")).reset_index()
    first = per["row"].to_numpy()
    return pd.DataFrame({"win": window(first), "sk": per["sk"].to_numpy(), "row": first, "pos": per["pos"].to_numpy(),
                         "weight": 1.0, "tokens": per["tokens"].to_numpy().astype(float), "waiting": np.nan,
                         "free": np.nan})


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def run(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    prod = produced_tokens(ctx)
    if not prod.busy.any():
        return FindingsBuilder(ctx, "no_progress").frame()
    frame = step_frame(ctx)
    frame = frame[frame["row"].to_numpy() >= 0]
    frame = frame[prod.busy[cols.sk[frame["row"].to_numpy()]]]
    sched_rows = frame["row"].to_numpy()
    preempt_rows = cols.req_rows("req_preempt")
    span = int(cols.n) + 2
    prod_key = np.sort(prod.sk * span + prod.pos)

    def window(rows: np.ndarray) -> np.ndarray:
        """Window id of each row: the production events before it (globally sorted by scheduler, then time, so
        the id names the scheduler's window too)."""
        return np.searchsorted(prod_key, cols.sk[rows].astype(np.int64) * span + cols.pos[rows], "left")

    waiting = detail_numbers(ctx, sched_rows, ["waiting"], optional=["waiting"])["waiting"]
    steps = pd.DataFrame({"win": window(sched_rows), "sk": cols.sk[sched_rows].astype(np.int64),
                          "row": sched_rows, "pos": cols.pos[sched_rows], "weight": frame["empty_run"].to_numpy(),
                          "tokens": frame["tokens"].fillna(0).to_numpy(), "waiting": waiting,
                          "free": frame["free_blocks"].to_numpy()})
    steps = pd.concat([steps, _steps_without_sched(ctx, prod.busy, window)], ignore_index=True)
    if steps.empty:
        return FindingsBuilder(ctx, "no_progress").frame()
    per = steps.groupby("win").agg(sk=("sk", "first"), steps=("weight", "sum"), tokens=("tokens", "sum"),
                                   queue=("waiting", "max"), min_free=("free", "min"), first_pos=("pos", "min"),
                                   last_pos=("pos", "max"))
    p_win = window(preempt_rows)
    per["preemptions"] = pd.Series(p_win).value_counts().reindex(per.index, fill_value=0)
    victims = pd.DataFrame({"win": p_win, "rk": cols.rk[preempt_rows]}).groupby("win")["rk"].nunique()
    per["victims"] = victims.reindex(per.index, fill_value=0)
    s_rows = cols.req_rows("req_sched")
    scheduled = pd.DataFrame({"win": window(s_rows), "rk": cols.rk[s_rows]}).groupby("win")["rk"]
    per["requests"] = scheduled.nunique().reindex(per.index, fill_value=0)
    per["scheduled"] = scheduled.size().reindex(per.index, fill_value=0)
    per["wasted"] = pd.Series(window(prod.wasted_rows)).value_counts().reindex(per.index, fill_value=0)
    cfg = ctx.config
    cand = per[(per["steps"] >= int(cfg.livelock_steps)) & (per["preemptions"] >= 2)
               & (2 * per["wasted"] >= per["scheduled"])
               & ((per["queue"] > 0) | (per["queue"].isna() & (per["victims"] > 0)))]
    if cand.empty:
        return FindingsBuilder(ctx, "no_progress").frame()
    reason, _ = cols.codes("reason")
    free_rows = cols.req_rows("blocks_free")
    free_rows = free_rows[reason[free_rows] == cols.code_of("reason", "preempted")]
    value, valid = cols.bools_at("deferred", free_rows)
    deferred_rows = free_rows[value & valid]
    d_win = window(deferred_rows)
    gap = gaps(ctx)
    found = FindingsBuilder(ctx, "no_progress")
    for win, w in cand.iterrows():  # one per finding
        sk = int(w["sk"])
        instance = sk_instance(cols, sk)[0]
        mine = steps[steps["win"] == win]
        first_row, last_row = int(mine["row"].iloc[0]), int(mine["row"].iloc[-1])
        my_preempts = preempt_rows[p_win == win]
        my_deferred = deferred_rows[d_win == win]
        open_at_end = int(win) >= len(prod_key) or int(prod_key[int(win)] // span) != sk
        end_pos = int(cols.n) if open_at_end else int(prod_key[int(win)] % span)
        queue = int(w["queue"]) if not np.isnan(w["queue"]) else int(w["victims"])
        first_step, last_step = int(cols.step[first_row]), int(cols.step[last_row])
        severity = "warning"
        message = (f"scheduler {instance} ran {int(w['steps'])} steps ({first_step}..{last_step}) with "
                   f"{int(w['preemptions'])} preemptions of {_count(int(w['victims']), 'request')}"
                   + (f" ({len(my_deferred)} of their frees deferred behind a step fence)" if len(my_deferred) else "")
                   + f" and produced no token while {queue} requests waited: a livelock ({int(w['wasted'])} of its "
                   f"{int(w['scheduled'])} schedules were thrown away by a later preemption)"
                   + (", still going at the end of the trace" if open_at_end else ""))
        extra = {"steps": int(w["steps"]), "preemptions": int(w["preemptions"]), "deferred_frees": len(my_deferred),
                 "tokens_produced": 0, "tokens_scheduled": int(w["tokens"]), "requests": int(w["requests"]),
                 "schedules_thrown_away": int(w["wasted"]), "schedules": int(w["scheduled"]),
                 "queue": queue, "min_free_blocks": None if np.isnan(w["min_free"]) else int(w["min_free"]),
                 "first_step": first_step, "last_step": last_step, "open_at_end": bool(open_at_end)}
        covered = gap.covers(inst_code_of_sk(cols, sk), int(w["first_pos"]), end_pos)
        if covered:
            severity = DOWNGRADE[severity]
            message += f" ({covered} on {instance} over this window: the tokens produced may have been dropped)"
            extra["downgraded"] = covered
        # the requests it names: the victims, most preempted first (then by first preemption); `req` is the first
        victims = pd.Series(cols.rk[my_preempts]).value_counts(sort=False)
        first_at = pd.Series(np.arange(len(my_preempts)), index=cols.rk[my_preempts]).groupby(level=0).min()
        named = sorted(victims.index.tolist(), key=lambda r: (-int(victims[r]), int(first_at[r])))
        names = [str(cols.rk_names["req"].iloc[int(r)]) for r in named]
        victims_text = f"of {_count(int(w['victims']), 'request')}"
        message = message.replace(victims_text, f"{victims_text} ({_listed(names)})", 1)
        cite: list[Cited] = [(first_row, "first step without progress")] + [(int(r), "preempted") for r in my_preempts[:6]]
        cite += [(int(r), "free deferred: the pool did not grow") for r in my_deferred[:2]]
        cite.append((last_row, "last step without progress"))
        found.add("livelock", severity, message, cite, sk=sk, req=names[0] if names else None, step=first_step,
                  extra=extra, requests=names[1:])
    return found.frame()


RULE = Rule(
    id="no_progress",
    summary="a scheduler that keeps preempting and produces no token while requests wait (livelock)",
    run=run,
    subrules=("livelock",),
    needs=(produced_tokens, step_frame),
    cost=0.05,
)
