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


def trace_span(ctx: "AnalysisContext") -> tuple[int, int]:
    """(first, last) `ts_ns` of the whole trace; (0, 0) for an empty trace."""
    ts = ctx.trace.table.column("ts_ns")
    if len(ts) == 0:
        return 0, 0
    bounds = pc.min_max(ts).as_py()
    return int(bounds["min"]), int(bounds["max"])


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
    from pdtrace.analysis.columns import bool_column, columns

    cols = columns(ctx)
    if cols.n == 0:
        return _empty_phases()
    comp_codes, comp_names = cols.codes("component")
    mask = (cols.rk >= 0) & cols.is_kind(*_STATE_KINDS)
    if "scheduler" in comp_names:
        mask &= comp_codes == comp_names.index("scheduler")
    else:
        mask[:] = False
    rows = np.flatnonzero(mask)
    if len(rows) == 0:
        return _empty_phases()
    rows = rows[np.lexsort((cols.pos[rows], cols.rk[rows]))]  # per request, in the global event order
    rk = cols.rk[rows]
    kind_codes, kind_names = cols.codes("kind")
    kind_lut = np.full(len(kind_names), -1, np.int64)
    for i, name in enumerate(_STATE_KINDS):  # per kind (eight)
        if name in kind_names:
            kind_lut[kind_names.index(name)] = i
    k = kind_lut[kind_codes[rows]]
    is_add, is_wait_kv, is_recv_done, is_recv_fail, is_sched, is_preempt, is_finish, is_free = (
        k == i for i in range(len(_STATE_KINDS)))
    delay_free = bool_column(cols.table, "delay_free")[0][rows]

    new_group = np.ones(len(rows), dtype=bool)
    new_group[1:] = rk[1:] != rk[:-1]
    # A lifecycle runs from a request's first row or a req_add to the next; "finished" once it had a req_finish
    # (a running maximum of 2*lifecycle + finished: lifecycles only grow along the sorted rows).
    lifecycle = np.cumsum(new_group | is_add)
    finished = (np.maximum.accumulate(2 * lifecycle + is_finish) - 2 * lifecycle) == 1

    phase = np.full(len(rows), -1, dtype=np.int64)
    active = ~finished
    phase[is_add] = _WAITING
    phase[is_wait_kv & active] = _WAITING_KV
    phase[(is_recv_done | is_recv_fail | is_preempt) & active] = _WAITING
    phase[is_sched] = _RUNNING
    phase[is_finish] = np.where(delay_free[is_finish], _FINISHED_HOLDING, _FREED)
    phase[is_free & finished & ~is_finish] = _FREED

    keep = phase >= 0
    rows, rk, phase = rows[keep], rk[keep], phase[keep]
    changed = np.ones(len(rows), dtype=bool)
    changed[1:] = (phase[1:] != phase[:-1]) | (rk[1:] != rk[:-1])
    rows, rk, phase = rows[changed], rk[changed], phase[changed]

    _, trace_end = trace_span(ctx)
    start = cols.ts[rows]
    end = np.full(len(rows), trace_end, dtype=np.int64)
    same_next = rk[1:] == rk[:-1]
    end[:-1] = np.where(same_next, start[1:], trace_end)
    names = cols.rk_names
    keep = end > start
    rk, phase, start, end = rk[keep], phase[keep], start[keep], end[keep]
    return pd.DataFrame({
        "instance": names["instance"].to_numpy(dtype=object)[rk].astype(str),
        "dp_rank": pd.array(names["dp_rank"].to_numpy()[rk], dtype="Int16"),
        "role": names["role"].to_numpy(dtype=object)[rk].astype(str),
        "req": names["req"].to_numpy(dtype=object)[rk].astype(str),
        "phase": pd.Categorical.from_codes(phase, categories=PHASES, ordered=True),
        "start_ns": start,
        "end_ns": end,
    }).astype({"instance": "str", "role": "str", "req": "str"})


def pool_sizes(ctx: "AnalysisContext") -> pd.DataFrame:
    """KV blocks in the pool per scheduler (instance, dp_rank), from the last `engine_config` row's `n`."""
    # Filtered in Arrow: a few rows, not the whole trace, become pandas.
    table = ctx.trace.table
    mask = pc.fill_null(pc.and_(pc.equal(table.column("kind"), "engine_config"), pc.is_valid(table.column("n"))),
                        False)
    rows = table.select(["instance", "dp_rank", "n"]).filter(mask)
    instance = rows.column("instance")
    if pa.types.is_dictionary(instance.type):
        instance = instance.cast(instance.type.value_type)
    out = pd.DataFrame({"instance": instance.to_numpy(zero_copy_only=False).astype(object),
                        "dp_rank": pc.fill_null(rows.column("dp_rank"), -1).to_numpy().astype(np.int64),
                        "pool_blocks": rows.column("n").to_numpy().astype(np.int64)})
    return out.drop_duplicates(["instance", "dp_rank"], keep="last").reset_index(drop=True)


def _empty_usage() -> pd.DataFrame:
    data: dict[str, pd.Series] = {"instance": pd.Series(dtype="str"), "dp_rank": pd.Series(dtype="Int16"),
                                  "ts_ns": pd.Series(dtype="int64")}
    for name in (*BLOCK_STATES, "in_use"):
        data[name] = pd.Series(dtype="int64")
    data["pool_blocks"] = pd.Series(dtype="Int64")
    return pd.DataFrame(data)


def _leak_findings(ctx: "AnalysisContext", findings: pd.DataFrame | None) -> pd.DataFrame:
    """(instance, req, block, leak_ts) of the blocks the `leaked_blocks` rule reports (block -1: all of them)."""
    if findings is None:
        from pdtrace.analysis import available_rules

        rule = available_rules()[0].get("leaked_blocks")
        findings = ctx.cached("timelines.leaked_blocks", lambda: rule.run(ctx)) if rule else None
    cols = ["instance", "req", "block", "leak_ts"]
    if findings is None or len(findings) == 0 or not (findings["rule"] == "leaked_blocks").any():
        return pd.DataFrame({c: pd.Series(dtype="int64" if c in ("block", "leak_ts") else "str") for c in cols})
    leaks = findings[findings["rule"] == "leaked_blocks"]
    # `possibly` leaked (an owner still alive, only quiet) is not counted as leaked; definitely / indirectly are.
    leak_class = [e.get("class") if isinstance(e, dict) else None for e in leaks["extra"]]  # per finding
    leaks = leaks[[c != "possibly" for c in leak_class]]
    # One row per finding (few): their blocks lists become rows; an empty or missing list means all blocks.
    blocks = [list(b) if isinstance(b, (list, tuple, np.ndarray)) and len(b) else [-1] for b in leaks["blocks"]]
    lengths = [len(b) for b in blocks]
    return pd.DataFrame({
        "instance": np.repeat(leaks["instance"].astype("str").to_numpy(), lengths),
        "req": np.repeat(leaks["req"].astype("str").to_numpy(), lengths),
        "block": np.fromiter((x for b in blocks for x in b), dtype=np.int64, count=sum(lengths)),
        "leak_ts": np.repeat(pd.to_numeric(leaks["ts_ns"], errors="coerce").fillna(0).to_numpy(np.int64), lengths),
    })


def block_usage(ctx: "AnalysisContext", findings: pd.DataFrame | None = None) -> pd.DataFrame:
    """Blocks in use over time per scheduler, split by owner state: one row per (instance, dp_rank, ts_ns) where a
    count changes, with the counts from then on in `running`, `finished_awaiting_transfer`, `leaked`, their sum
    `in_use`, and the pool size `pool_blocks` (from `engine_config`, NA without one).

    Algorithm: start from `block_ownership` (one holding interval per (req, block), open ones end at the end of the
    trace) and intersect each holding with its owner's `request_phases` (a merge on (instance, dp_rank, req), then
    clip): the part while the owner waits or runs is `running`, the part after its finish (finished_holding or
    freed) is `finished_awaiting_transfer`. Holdings never freed that the `leaked_blocks` rule reports (its findings:
    `findings` when given, else the rule's own run on `ctx`; one code path with `analyze`) are `leaked` from the
    owner's finish, or from the finding's ts_ns when the owner never finished. A block with several owners counts
    once, in the first of BLOCK_STATES that any owner holds it in: per block, +1/-1 per segment and state are
    summed cumulatively (sorted by time, frees before allocations at the same instant) and the block's state is the
    first non-zero count; its state changes become +1/-1 per state per scheduler, cumulated over time, and the last
    row per instant is kept. Holdings still open at the end of the trace stay counted there.
    """
    if findings is not None:
        return _block_usage(ctx, findings)
    return ctx.cached("timelines.block_usage", lambda: _block_usage(ctx, None))


def _block_usage(ctx: "AnalysisContext", findings: pd.DataFrame | None) -> pd.DataFrame:
    from pdtrace.analysis.blocks import block_ownership

    own = block_ownership(ctx)
    if len(own) == 0:
        return _empty_usage()
    _, trace_end = trace_span(ctx)
    h = pd.DataFrame({
        "instance": own["instance"].astype("str").to_numpy(),
        "dp_rank": own["dp_rank"].astype("Int64").fillna(-1).to_numpy(dtype=np.int64),
        "req": own["req"].astype("str").to_numpy(),
        "block": own["block"].to_numpy(dtype=np.int64),
        "alloc_ts": own["alloc_ts"].to_numpy(dtype=np.int64),
        "free_ts": own["free_ts"].astype("Int64").fillna(-1).to_numpy(dtype=np.int64),
    })
    h["holding"] = np.arange(len(h))
    h["open"] = h["free_ts"] < 0
    h.loc[h["open"], "free_ts"] = trace_end

    ph = request_phases(ctx)
    ph = pd.DataFrame({"instance": ph["instance"].to_numpy(), "req": ph["req"].to_numpy(),
                       "dp_rank": ph["dp_rank"].astype("Int64").fillna(-1).to_numpy(dtype=np.int64),
                       "finished": (ph["phase"].cat.codes.to_numpy() >= _FINISHED_HOLDING),
                       "start_ns": ph["start_ns"].to_numpy(), "end_ns": ph["end_ns"].to_numpy()})
    seg = h.merge(ph, on=["instance", "dp_rank", "req"], how="left")
    # An owner without phases (its events fell outside the trace) counts as running for the whole holding.
    no_phase = seg["start_ns"].isna().to_numpy()
    p_start = seg["start_ns"].fillna(0).to_numpy(dtype=np.int64, copy=True)
    p_end = seg["end_ns"].fillna(trace_end).to_numpy(dtype=np.int64)
    p_start[no_phase] = seg["alloc_ts"].to_numpy()[no_phase]
    seg["s"] = np.maximum(seg["alloc_ts"].to_numpy(), p_start)
    seg["e"] = np.minimum(seg["free_ts"].to_numpy(), p_end)
    seg["state"] = np.where(seg["finished"].fillna(False).to_numpy(dtype=bool), 1, 0)
    seg = seg[seg["e"] > seg["s"]]
    seg = seg[["instance", "dp_rank", "req", "block", "holding", "open", "alloc_ts", "s", "e", "state"]]

    leaks = _leak_findings(ctx, findings)
    if len(leaks):
        open_h = seg.loc[seg["open"], ["holding", "instance", "req", "block"]].drop_duplicates("holding")
        exact = open_h.merge(leaks[leaks["block"] >= 0], on=["instance", "req", "block"])
        whole = open_h.merge(leaks[leaks["block"] < 0].drop(columns="block"), on=["instance", "req"])
        flagged = pd.concat([exact, whole])[["holding", "leak_ts"]].groupby("holding")["leak_ts"].min()
        fin_start = seg[seg["state"] == 1].groupby("holding")["s"].min()
        never = np.iinfo(np.int64).max
        leak_at = np.full(len(h), never, dtype=np.int64)
        leak_at[flagged.index.to_numpy()] = np.minimum(
            flagged.to_numpy(np.int64), fin_start.reindex(flagged.index, fill_value=never).to_numpy(np.int64))
        lf = leak_at[seg["holding"].to_numpy()]
        has = lf != never
        s, e_ = seg["s"].to_numpy(), seg["e"].to_numpy()
        split = has & (s < lf) & (e_ > lf)
        tail = seg[split].copy()
        tail["s"] = lf[split]
        tail["state"] = 2
        seg.loc[split, "e"] = lf[split]
        seg.loc[has & (s >= lf), "state"] = 2
        seg = pd.concat([seg, tail], ignore_index=True)

    # Per block: +1 at each segment's start, -1 at its end (none for open holdings at the end of the trace).
    n = len(seg)
    ends_open = seg["open"].to_numpy() & (seg["e"].to_numpy() >= trace_end)
    d = pd.DataFrame({
        "instance": np.concatenate([seg["instance"].to_numpy(), seg["instance"].to_numpy()[~ends_open]]),
        "dp_rank": np.concatenate([seg["dp_rank"].to_numpy(), seg["dp_rank"].to_numpy()[~ends_open]]),
        "block": np.concatenate([seg["block"].to_numpy(), seg["block"].to_numpy()[~ends_open]]),
        "ts_ns": np.concatenate([seg["s"].to_numpy(), seg["e"].to_numpy()[~ends_open]]),
        "state": np.concatenate([seg["state"].to_numpy(), seg["state"].to_numpy()[~ends_open]]),
        "delta": np.concatenate([np.ones(n, np.int64), -np.ones(int((~ends_open).sum()), np.int64)]),
    })
    d = d.sort_values(["instance", "dp_rank", "block", "ts_ns", "delta"], kind="stable", ignore_index=True)
    bkey = d[["instance", "dp_rank", "block"]]
    bgroup = (bkey != bkey.shift()).any(axis=1).cumsum().to_numpy()
    state, delta = d["state"].to_numpy(), d["delta"].to_numpy()
    counts = np.stack([np.where(state == i, delta, 0) for i in range(len(BLOCK_STATES))], axis=1)
    counts = pd.DataFrame(counts).groupby(bgroup).cumsum().to_numpy()
    held = counts > 0
    block_state = np.where(held.any(axis=1), held.argmax(axis=1), -1)
    prev_state = np.full(len(d), -1, dtype=np.int64)
    prev_state[1:] = np.where(bgroup[1:] == bgroup[:-1], block_state[:-1], -1)
    change = block_state != prev_state
    chg = d[change]
    new, old = block_state[change], prev_state[change]
    per_state = np.zeros((len(chg), len(BLOCK_STATES)), dtype=np.int64)
    rows = np.arange(len(chg))
    per_state[rows[new >= 0], new[new >= 0]] += 1
    per_state[rows[old >= 0], old[old >= 0]] -= 1

    t = pd.DataFrame({"instance": chg["instance"].to_numpy(), "dp_rank": chg["dp_rank"].to_numpy(),
                      "ts_ns": chg["ts_ns"].to_numpy()})
    for i, name in enumerate(BLOCK_STATES):
        t[name] = per_state[:, i]
    t = t.sort_values(["instance", "dp_rank", "ts_ns"], kind="stable", ignore_index=True)
    sgroup = (t[["instance", "dp_rank"]] != t[["instance", "dp_rank"]].shift()).any(axis=1).cumsum().to_numpy()
    t[list(BLOCK_STATES)] = t[list(BLOCK_STATES)].groupby(sgroup).cumsum()
    t = t.drop_duplicates(["instance", "dp_rank", "ts_ns"], keep="last").reset_index(drop=True)
    # Drop instants where an owner changed phase but no count did.
    same = (t[["instance", "dp_rank", *BLOCK_STATES]] == t[["instance", "dp_rank", *BLOCK_STATES]].shift()).all(axis=1)
    t = t[~same.to_numpy()].reset_index(drop=True)
    t["in_use"] = t[list(BLOCK_STATES)].sum(axis=1)
    t = t.merge(pool_sizes(ctx), on=["instance", "dp_rank"], how="left")
    t["pool_blocks"] = t["pool_blocks"].astype("Int64")
    t["dp_rank"] = pd.array(np.where(t["dp_rank"] < 0, None, t["dp_rank"]), dtype="Int16")
    return t[list(USAGE_COLUMNS)]
