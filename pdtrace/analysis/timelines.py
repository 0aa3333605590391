"""Timelines that plots and exports draw and no rule owns: request phases and KV blocks in use over time.

`request_phases(ctx)` turns each request's scheduler events into consecutive phase intervals; `block_usage(ctx)`
counts the blocks held over time per scheduler, split by the state of their owner. Both are vectorised over the
event columns (sorts, group-wise cumulative sums, shifts), with no Python loop per event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.analysis import available_rules
from pdtrace.analysis.blocks import ownership
from pdtrace.analysis.columns import _ramp, columns, order_by_key, positions, request_keys
from pdtrace.analysis.context import trace_span
from pdtrace.analysis.parallel import shared_table
from pdtrace.analysis.requests import request_state
from pdtrace.analysis.rulekit import engine_configs, step_index
from pdtrace.analysis.windows import judged

if TYPE_CHECKING:  # pragma: no cover
    from pdtrace.analysis.context import AnalysisContext

#: Request phases, in lifecycle order.
PHASES: tuple[str, ...] = ("waiting", "waiting_kv", "running", "finished_holding", "freed")
_WAITING, _WAITING_KV, _RUNNING, _FINISHED_HOLDING, _FREED = range(len(PHASES))

#: Owner states of a held block, in the priority a shared block takes (a block any running request holds is
#: "running", whatever its other owners do).
BLOCK_STATES: tuple[str, ...] = ("running", "finished_awaiting_transfer", "leaked")

PHASE_COLUMNS = ("instance", "dp_rank", "role", "req", "phase", "start_ns", "end_ns")
USAGE_COLUMNS = ("instance", "dp_rank", "ts_ns", *BLOCK_STATES, "in_use", "pool_blocks")

_STATE_KINDS = ("req_add", "req_wait_kv", "kv_recv_done", "kv_recv_fail", "req_sched", "req_preempt",
                "req_finish", "blocks_free")


def _empty_phases() -> pd.DataFrame:
    return pd.DataFrame({
        "instance": pd.Series(dtype="str"), "dp_rank": pd.Series(dtype="Int16"), "role": pd.Series(dtype="str"),
        "req": pd.Series(dtype="str"), "phase": pd.Categorical([], categories=PHASES, ordered=True),
        "start_ns": pd.Series(dtype="int64"), "end_ns": pd.Series(dtype="int64"),
    })


def request_phases(ctx: "AnalysisContext") -> pd.DataFrame:
    """One row per phase interval of a request: instance, dp_rank, role, req, phase, start_ns, end_ns.

    Algorithm: take the scheduler rows that carry a request and can change its state; sort them by request key
    (instance, dp_rank, req) and position in the global event order (columns.py: time, then each writer's seq).
    Each row maps to the phase it starts: `req_add` -> waiting, `req_wait_kv` -> waiting_kv,
    `kv_recv_done`/`kv_recv_fail` -> waiting (loaded or failed: back in the queue), `req_sched` -> running,
    `req_preempt` -> waiting, `req_finish` -> finished_holding when `delay_free` (the blocks stay owned for a
    transfer) else freed, `blocks_free` -> freed. A lifecycle runs from a request's first row or a `req_add` to the
    next one (a reused id starts a new one); it is "finished" from its `req_finish` on (a running maximum of
    2 * lifecycle + is_finish over the sorted rows). Once finished, only `blocks_free` (-> freed), `req_sched`
    (-> running: a scheduled finished request, which rules report) and a new `req_add` change the phase; before
    the finish `blocks_free` (preemption, trimming) does not. Rows that repeat the previous row's phase are
    dropped; a phase ends where the request's next phase starts, and the last one at the end of the trace.
    Zero-length phases are dropped.
    """
    return ctx.cached("timelines.request_phases", lambda: _request_phases(ctx))


def _request_phases(ctx: "AnalysisContext") -> pd.DataFrame:
    arrays = _phase_arrays(ctx)
    if arrays is None:
        return _empty_phases()
    rk, phase, start, end = arrays
    names = columns(ctx).rk_names
    return pd.DataFrame({
        "instance": names["instance"].to_numpy(dtype=object)[rk].astype(str),
        "dp_rank": pd.array(names["dp_rank"].to_numpy()[rk], dtype="Int16"),
        "role": names["role"].to_numpy(dtype=object)[rk].astype(str),
        "req": names["req"].to_numpy(dtype=object)[rk].astype(str),
        "phase": pd.Categorical.from_codes(phase, categories=PHASES, ordered=True),
        "start_ns": start,
        "end_ns": end,
    }).astype({"instance": "str", "role": "str", "req": "str"})


@shared_table(positions, request_keys, cost=0.2)
def _phase_arrays(ctx: "AnalysisContext") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """request_phases as arrays (request key, phase code, start_ns, end_ns), sorted by request key then time;
    None where request_phases is the empty frame. Cached: block_usage joins on the integer keys."""
    return ctx.cached("timelines.phase_arrays", lambda: _compute_phase_arrays(ctx))


def _compute_phase_arrays(ctx: "AnalysisContext") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    cols = columns(ctx)
    if cols.n == 0:
        return None
    comp_codes, comp_names = cols.codes("component")
    mask = (cols.rk >= 0) & cols.is_kind(*_STATE_KINDS)
    if "scheduler" in comp_names:
        mask &= comp_codes == comp_names.index("scheduler")
    else:
        mask[:] = False
    # per request, in the global event order: the rows taken in that order, then a stable sort by request key alone
    # (numpy's timsort: requests are scheduled in batches, so the keys come in runs)
    rows = cols.order[mask[cols.order]]
    if len(rows) == 0:
        return None
    rows = rows[np.argsort(cols.rk[rows], kind="stable")]
    rk = cols.rk[rows]
    kind_codes, kind_names = cols.codes("kind")
    # small dtypes throughout: these arrays have a row per request event (600k at 1M events), and in a fresh
    # process every new page is a page fault
    kind_lut = np.full(len(kind_names), -1, np.int8)
    for i, name in enumerate(_STATE_KINDS):  # per kind (eight)
        if name in kind_names:
            kind_lut[kind_names.index(name)] = i
    k = kind_lut[kind_codes[rows]]
    is_add, is_wait_kv, is_recv_done, is_recv_fail, is_sched, is_preempt, is_finish, is_free = (
        k == i for i in range(len(_STATE_KINDS)))

    new_group = np.ones(len(rows), dtype=bool)
    new_group[1:] = rk[1:] != rk[:-1]
    # A request key is one lifetime of a request (columns.py: a req_add after the id's finish starts a new one);
    # "finished" once it had a req_finish (a running maximum of 2*key index + finished along the sorted rows).
    lifecycle = np.cumsum(new_group, dtype=np.int32)
    finished = (np.maximum.accumulate(2 * lifecycle + is_finish) - 2 * lifecycle) == 1

    phase = np.full(len(rows), -1, dtype=np.int8)
    active = ~finished
    phase[is_add] = _WAITING
    phase[is_wait_kv & active] = _WAITING_KV
    phase[(is_recv_done | is_recv_fail | is_preempt) & active] = _WAITING
    phase[is_sched] = _RUNNING
    delay_free = request_state(ctx).delay_free[rk[is_finish]]  # the request table's, inferred where null
    phase[is_finish] = np.where(delay_free, _FINISHED_HOLDING, _FREED)
    phase[is_free & finished & ~is_finish] = _FREED

    keep = phase >= 0
    rows, rk, phase = rows[keep], rk[keep], phase[keep]
    changed = np.ones(len(rows), dtype=bool)
    changed[1:] = (phase[1:] != phase[:-1]) | (rk[1:] != rk[:-1])
    rows, rk, phase = rows[changed], rk[changed], phase[changed]

    _, trace_end = trace_span(ctx)
    start = cols.ts[rows]
    # a request's last phase lasts to the end of the trace, or to the start of the next lifetime of its id (the
    # next request key, when that is the same id's lifetime after it)
    life = cols.request_lifetime
    first_start = np.full(cols.n_requests, trace_end, dtype=np.int64)
    firsts = np.r_[True, rk[1:] != rk[:-1]]  # rows are sorted by request key, then time
    first_start[rk[firsts]] = start[firsts]
    until = np.full(cols.n_requests, trace_end, dtype=np.int64)
    followed = np.flatnonzero(life[1:] > 0)
    until[followed] = first_start[followed + 1]
    end = until[rk]
    same_next = rk[1:] == rk[:-1]
    end[:-1] = np.where(same_next, start[1:], end[:-1])
    keep = end > start
    return rk[keep], phase[keep], start[keep], end[keep]


request_phases = shared_table(_phase_arrays, cost=0.3)(request_phases)


def pool_sizes(ctx: "AnalysisContext") -> pd.DataFrame:
    """KV blocks in the pool per scheduler (instance, dp_rank): `n` of its engine_config as `rulekit.engine_configs`
    reads it (the first per scheduler), the one reading every analysis shares."""
    names = columns(ctx).sk_names
    found = [(sk, cfg["num_blocks"]) for sk, cfg in engine_configs(ctx).items() if "num_blocks" in cfg]
    return pd.DataFrame({
        "instance": np.array([str(names["instance"].iloc[sk]) for sk, _ in found], dtype=object),
        "dp_rank": np.array([-1 if pd.isna(names["dp_rank"].iloc[sk]) else int(names["dp_rank"].iloc[sk])
                             for sk, _ in found], np.int64),
        "pool_blocks": np.array([n for _, n in found], np.int64)})


def usage_held_at(usage: pd.DataFrame, ts_ns: int) -> np.ndarray:
    """A mask of `block_usage` rows: per scheduler (instance, dp_rank), its last row before ts_ns, whose counts
    are what it held at ts_ns (the rows are in time order per scheduler). A figure or an export of a window starts
    each scheduler's counts there."""
    if len(usage) == 0:
        return np.zeros(0, bool)
    key = usage["instance"].astype("str") + "/" + usage["dp_rank"].astype("Int64").astype("str")
    early = usage["ts_ns"].to_numpy(np.int64) < ts_ns
    return early & ~pd.Series(early).groupby(key.to_numpy()).shift(-1, fill_value=False).to_numpy(bool)


def _empty_usage() -> pd.DataFrame:
    data: dict[str, pd.Series] = {"instance": pd.Series(dtype="str"), "dp_rank": pd.Series(dtype="Int16"),
                                  "ts_ns": pd.Series(dtype="int64")}
    for name in (*BLOCK_STATES, "in_use"):
        data[name] = pd.Series(dtype="int64")
    data["pool_blocks"] = pd.Series(dtype="Int64")
    return pd.DataFrame(data)


@shared_table(request_state, ownership, step_index, cost=0.05)
def leaked_blocks_findings(ctx: "AnalysisContext") -> pd.DataFrame | None:
    """The registered `leaked_blocks` rule's own findings on this context (one code path with analyze); None when
    no such rule is registered."""
    rule = available_rules()[0].get("leaked_blocks")
    return ctx.cached("timelines.leaked_blocks", lambda: judged(ctx, rule.run(ctx))) if rule else None


def _leak_findings(ctx: "AnalysisContext", findings: pd.DataFrame | None) -> pd.DataFrame:
    """(instance, req, block, leak_ts) of the blocks the `leaked_blocks` rule reports (block -1: all of them)."""
    if findings is None:
        findings = leaked_blocks_findings(ctx)
    cols = ["instance", "req", "block", "leak_ts"]
    if findings is None or len(findings) == 0 or not (findings["rule"] == "leaked_blocks").any():
        return pd.DataFrame({c: pd.Series(dtype="int64" if c in ("block", "leak_ts") else "str") for c in cols})
    leaks = findings[findings["rule"] == "leaked_blocks"]
    # `possibly` leaked (an owner still alive, only quiet) and `still_held` (a transfer within its grace period) are
    # not counted as leaked; definitely / indirectly are.
    leak_class = [e.get("class") if isinstance(e, dict) else None for e in leaks["extra"]]  # per finding
    leaks = leaks[[c not in ("possibly", "still_held") for c in leak_class]]
    # One row per finding (few): their blocks lists become rows; an empty or missing list means all blocks.
    blocks = [list(b) if isinstance(b, (list, tuple, np.ndarray)) and len(b) else [-1] for b in leaks["blocks"]]
    lengths = [len(b) for b in blocks]
    return pd.DataFrame({
        "instance": np.repeat(leaks["instance"].astype("str").to_numpy(), lengths),
        "req": np.repeat(leaks["req"].astype("str").to_numpy(), lengths),
        "block": np.fromiter((x for b in blocks for x in b), dtype=np.int64, count=sum(lengths)),
        "leak_ts": np.repeat(pd.to_numeric(leaks["ts_ns"], errors="coerce").fillna(0).to_numpy(np.int64), lengths),
    })


@shared_table(ownership, _phase_arrays, leaked_blocks_findings, cost=0.3)
def block_usage(ctx: "AnalysisContext", findings: pd.DataFrame | None = None) -> pd.DataFrame:
    """Blocks in use over time per scheduler, split by owner state: one row per (instance, dp_rank, ts_ns) where a
    count changes, with the counts from then on in `running`, `finished_awaiting_transfer`, `leaked`, their sum
    `in_use`, and the pool size `pool_blocks` (from `engine_config`, NA without one).

    Algorithm: start from the block ownership intervals (`block_ownership`'s rows, as the cached ownership arrays:
    one holding interval per (req, block), open ones end at the end of the trace) and intersect each holding with
    its owner's `request_phases` (joined on the integer request key by a search in the phases sorted by key, then
    clipped): the part while the owner waits or runs is `running`, the part after its finish (finished_holding or
    freed) is `finished_awaiting_transfer`. Holdings never freed that the `leaked_blocks` rule reports (its findings:
    `findings` when given, else the rule's own run on `ctx`; one code path with `analyze`) are `leaked` from the
    owner's finish, or from the finding's ts_ns when the owner never finished. A block that never had two holders
    at once (`Ownership.shared_blocks`) is in its holder's state, so its segments' starts and ends are its state
    changes. A block with several owners counts once, in the first of BLOCK_STATES that any owner holds it in: per
    block, +1/-1 per segment and state are summed cumulatively (sorted by time, frees before allocations at the same
    instant) and the block's state is the first non-zero count. The state changes become +1/-1 per state per
    scheduler, cumulated over time, and the last row per instant is kept. Holdings still open at the end of the
    trace stay counted there.
    """
    if findings is not None:
        return _block_usage(ctx, findings)
    return ctx.cached("timelines.block_usage", lambda: _block_usage(ctx, None))


def _block_usage(ctx: "AnalysisContext", findings: pd.DataFrame | None) -> pd.DataFrame:
    # Integer keys throughout (request key, scheduler key, block), from the ownership arrays and the phase arrays:
    # the join and the sorts are numpy searches and lexsorts, not pandas merges and sorts of string columns.
    own = ownership(ctx)
    if len(own) == 0:
        return _empty_usage()
    cols = columns(ctx)
    _, trace_end = trace_span(ctx)
    sk_names = cols.sk_names
    sk_of_rk = cols.request_sk  # int32; the request keys' names are only built for leaks
    sk_instance = sk_names["instance"].to_numpy(dtype=object).astype(str)
    sk_dp = sk_names["dp_rank"].astype("Int64").fillna(-1).to_numpy(dtype=np.int64)
    # Schedulers ranked in (instance, dp_rank) order: the order the results are sorted in.
    _, instance_rank = np.unique(sk_instance, return_inverse=True)
    sk_rank = np.empty(len(sk_names), np.int64)
    sk_rank[np.lexsort((sk_dp, instance_rank))] = np.arange(len(sk_names))

    h_rk = own.rk.astype(np.int64)
    h_block = own.block.astype(np.int64)
    h_alloc = cols.ts[own.alloc_row]
    h_open = own.free_row < 0
    h_free = np.where(h_open, trace_end, cols.ts[np.where(h_open, 0, own.free_row)])

    # Each holding against every state run of its owner (sorted by request key), clipped to both.
    phases = _phase_arrays(ctx)
    if phases is None:
        p_rk = np.empty(0, np.int64)
        p_code = p_start_all = p_end_all = np.zeros(1, np.int64)
    else:
        p_rk, p_code, p_start_all, p_end_all = _state_runs(*phases)
    lo = np.searchsorted(p_rk, h_rk, side="left")
    n_match = np.searchsorted(p_rk, h_rk, side="right") - lo
    holding = np.repeat(np.arange(len(h_rk)), np.maximum(n_match, 1))
    has_phase = n_match[holding] > 0
    pidx = np.where(has_phase, lo[holding] + _ramp(np.maximum(n_match, 1)), 0)
    # An owner without phases (its events fell outside the trace) counts as running for the whole holding.
    p_start = np.where(has_phase, p_start_all[pidx], h_alloc[holding])
    p_end = np.where(has_phase, p_end_all[pidx], trace_end)
    s = np.maximum(h_alloc[holding], p_start)
    e = np.minimum(h_free[holding], p_end)
    state = np.where(has_phase & (p_code[pidx] >= _FINISHED_HOLDING), np.int8(1), np.int8(0))
    keep = e > s
    holding, s, e, state = holding[keep], s[keep], e[keep], state[keep]

    leaks = _leak_findings(ctx, findings)
    if len(leaks):
        seg_open = h_open[holding]
        open_ids = np.unique(holding[seg_open])
        open_rk = h_rk[open_ids]
        names = cols.rk_names
        open_h = pd.DataFrame({"holding": open_ids,
                               "instance": names["instance"].to_numpy(dtype=object)[open_rk].astype(str),
                               "req": names["req"].to_numpy(dtype=object)[open_rk].astype(str),
                               "block": h_block[open_ids]})
        exact = open_h.merge(leaks[leaks["block"] >= 0], on=["instance", "req", "block"])
        whole = open_h.merge(leaks[leaks["block"] < 0].drop(columns="block"), on=["instance", "req"])
        flagged = pd.concat([exact, whole])[["holding", "leak_ts"]].groupby("holding")["leak_ts"].min()
        never = np.iinfo(np.int64).max
        fin_start = np.full(len(h_rk), never, dtype=np.int64)
        np.minimum.at(fin_start, holding[state == 1], s[state == 1])
        flagged_ids = flagged.index.to_numpy(dtype=np.int64)
        leak_at = np.full(len(h_rk), never, dtype=np.int64)
        leak_at[flagged_ids] = np.minimum(flagged.to_numpy(np.int64), fin_start[flagged_ids])
        lf = leak_at[holding]
        has = lf != never
        split = has & (s < lf) & (e > lf)
        tail_holding, tail_s, tail_e = holding[split], lf[split], e[split]
        e = np.where(split, lf, e)
        state = np.where(has & (s >= lf), 2, state)
        holding = np.concatenate([holding, tail_holding])
        s = np.concatenate([s, tail_s])
        e = np.concatenate([e, tail_e])
        state = np.concatenate([state, np.full(len(tail_holding), 2, state.dtype)])

    # State changes (scheduler, time, new state, old state; -1: not held). A block with one holder at a time (no
    # prefix sharing) is in its holder's state: its segments' starts and ends are its changes. Blocks that ever
    # had several holders at once go through the count of holders per state below.
    ends_open = h_open[holding] & (e >= trace_end)
    seg_sk = sk_of_rk[h_rk[holding]]
    shared = own.shared_blocks()[holding]
    solo = np.flatnonzero(~shared)
    solo_end = solo[~ends_open[solo]]
    c_sk = np.concatenate([seg_sk[solo], seg_sk[solo_end]])
    c_ts = np.concatenate([s[solo], e[solo_end]])
    new = np.concatenate([state[solo], np.full(len(solo_end), -1, state.dtype)])
    old = np.concatenate([np.full(len(solo), -1, state.dtype), state[solo_end]])
    if shared.any():
        # Per shared block: +1 at each segment's start, -1 at its end (none for open holdings at the end of the
        # trace); the block's state is the first of BLOCK_STATES with a holder.
        many = np.flatnonzero(shared)
        closes = many[~ends_open[many]]
        d_sk = np.concatenate([seg_sk[many], seg_sk[closes]])
        d_block = np.concatenate([h_block[holding[many]], h_block[holding[closes]]])
        d_ts = np.concatenate([s[many], e[closes]])
        d_state = np.concatenate([state[many], state[closes]])
        d_delta = np.concatenate([np.ones(len(many), np.int64), -np.ones(len(closes), np.int64)])
        order = np.lexsort((d_delta, d_ts, d_block, sk_rank[d_sk]))
        d_sk, d_block, d_ts, d_state, d_delta = (a[order] for a in (d_sk, d_block, d_ts, d_state, d_delta))
        new_block = np.ones(len(d_sk), dtype=bool)
        new_block[1:] = (d_sk[1:] != d_sk[:-1]) | (d_block[1:] != d_block[:-1])
        counts = np.stack([np.where(d_state == i, d_delta, 0) for i in range(len(BLOCK_STATES))], axis=1)
        counts = _group_cumsum(counts, new_block)
        held = counts > 0
        block_state = np.where(held.any(axis=1), held.argmax(axis=1), -1)
        prev_state = np.full(len(d_sk), -1, dtype=np.int64)
        prev_state[1:] = np.where(new_block[1:], -1, block_state[:-1])
        change = block_state != prev_state
        c_sk = np.concatenate([c_sk, d_sk[change]])
        c_ts = np.concatenate([c_ts, d_ts[change]])
        new = np.concatenate([new, block_state[change].astype(np.int8)])
        old = np.concatenate([old, prev_state[change].astype(np.int8)])
    # Per scheduler, in time order: +1 / -1 per state at each change, cumulated; the last row per instant; rows
    # where no count changed (an owner changed phase) dropped. Within an instant the order of the changes does not
    # matter (only the counts after its last one are kept).
    order = order_by_key(sk_rank[c_sk], c_ts)
    c_sk, c_ts, new, old = c_sk[order], c_ts[order], new[order], old[order]
    del order
    states = np.arange(len(BLOCK_STATES), dtype=np.int8)
    per_state = (new[:, None] == states).astype(np.int32)  # counts of blocks: int32 is ample
    per_state -= old[:, None] == states
    del new, old
    bounds = np.flatnonzero(np.r_[True, c_sk[1:] != c_sk[:-1], True])
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):  # per scheduler (few), in place
        np.cumsum(per_state[a:b], axis=0, out=per_state[a:b])
    last = np.ones(len(c_sk), dtype=bool)
    last[:-1] = (c_sk[1:] != c_sk[:-1]) | (c_ts[1:] != c_ts[:-1])
    c_sk, c_ts, per_state = c_sk[last], c_ts[last], per_state[last]
    same = np.zeros(len(c_sk), dtype=bool)
    same[1:] = (c_sk[1:] == c_sk[:-1]) & (per_state[1:] == per_state[:-1]).all(axis=1)
    c_sk, c_ts, per_state = c_sk[~same], c_ts[~same], per_state[~same].astype(np.int64)

    t = pd.DataFrame({"instance": sk_instance.astype(object)[c_sk], "dp_rank": sk_dp[c_sk], "ts_ns": c_ts})
    for i, name in enumerate(BLOCK_STATES):
        t[name] = per_state[:, i]
    t["in_use"] = per_state.sum(axis=1)
    # Pool size per scheduler key (a lookup of the few engine_config rows), spread by the rows' scheduler keys.
    pools = pool_sizes(ctx)
    sk_of = {(str(i), int(dp)): k for k, (i, dp) in enumerate(zip(sk_instance.tolist(), sk_dp.tolist()))}
    pool_of_sk = np.zeros(len(sk_names), np.int64)
    has_pool = np.zeros(len(sk_names), bool)
    for inst, dp, blocks in zip(pools["instance"].tolist(), pools["dp_rank"].tolist(),
                                pools["pool_blocks"].tolist()):  # per scheduler (few)
        k = sk_of.get((str(inst), int(dp)))
        if k is not None:
            pool_of_sk[k], has_pool[k] = blocks, True
    t["pool_blocks"] = pd.arrays.IntegerArray(pool_of_sk[c_sk], ~has_pool[c_sk])
    t["dp_rank"] = pd.array(np.where(t["dp_rank"] < 0, None, t["dp_rank"]), dtype="Int16")
    return t[list(USAGE_COLUMNS)]


def _state_runs(rk: np.ndarray, code: np.ndarray, start: np.ndarray,
                end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The phases (of `_phase_arrays`) merged into runs of one owner state per request key: before the finish
    (code _RUNNING) or after it (_FINISHED_HOLDING), which is all block_usage tells apart. A request's phases are
    contiguous (each ends where the next starts), so a run spans its first phase's start to its last phase's end.
    Why: a holding is joined with every run of its owner, and a decode request has 5-16 phases but one or two runs
    (10M segments -> 3M at 10M events)."""
    finished = code >= _FINISHED_HOLDING
    new_run = np.ones(len(rk), dtype=bool)
    new_run[1:] = (rk[1:] != rk[:-1]) | (finished[1:] != finished[:-1])
    first = np.flatnonzero(new_run)
    last = np.append(first[1:] - 1, len(rk) - 1)
    run_code = np.where(finished[first], np.int8(_FINISHED_HOLDING), np.int8(_RUNNING))
    return rk[first], run_code, start[first], end[last]


def _group_cumsum(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Cumulative sums of the rows of `values` (2-D) restarting at each row where `starts` is True."""
    if len(values) == 0:
        return values
    total = np.cumsum(values, axis=0)
    first = np.flatnonzero(starts)
    before = np.zeros_like(values[: len(first)])
    before[1:] = total[first[1:] - 1]
    return total - np.repeat(before, np.diff(np.append(first, len(values))), axis=0)
