"""Block ownership: one holding interval per (instance, dp_rank, req, block), from allocation to free.

Algorithm: the block lists of `blocks_alloc` and `blocks_free` rows (with a req) are flattened into (request key,
block, position, is_alloc) entries and sorted by (request key, block, position) in one sort of a combined int64
key. Within one (request, block):
- an allocation opens an interval unless the previous entry is an allocation already (a repeated id in the table
  extends the open interval);
- the first free after the opening closes it; a free whose previous entry is not an allocation is *unmatched*: the
  request gave up a block it did not own (double_free uses these).
Per pool (instance, dp_rank) and block, the interval starts and ends sorted by position give the number of other
owners at each free (a running sum of +1 at starts and -1 at ends). The first `blocks_pool_free` of the block after
a free (`pool_free_*`), the next interval start of another request (`next_alloc_*`) and the next `req_wait_kv`
allocation (`next_wait_kv_*`) are found with one searchsorted each (columns.next_at_or_after).

`ownership(ctx)` holds these as numpy arrays (rules use it); `block_ownership(ctx)` is the DataFrame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.columns import NO, Columns, columns, next_at_or_after

OWNERSHIP_COLUMNS = (
    "instance", "dp_rank", "req", "block", "alloc_ts", "alloc_seq", "alloc_step", "free_ts", "free_seq",
    "free_step", "free_reason", "deferred", "pool_free_ts",
)


@dataclass
class Ownership:
    """Holding intervals as parallel arrays (index = interval), plus the unmatched frees."""

    rk: np.ndarray
    sk: np.ndarray
    block: np.ndarray
    alloc_row: np.ndarray
    alloc_pos: np.ndarray
    free_row: np.ndarray        # NO if never freed
    free_pos: np.ndarray
    others_at_free: np.ndarray  # other owners of the block in the pool right after the free (0 if never freed)
    pool_free_row: np.ndarray   # first blocks_pool_free of the block after the free
    pool_free_pos: np.ndarray
    next_alloc_rk: np.ndarray   # next interval of the block in this pool after the free, by another holder
    next_alloc_row: np.ndarray
    next_alloc_pos: np.ndarray
    next_wait_kv_row: np.ndarray  # next req_wait_kv allocation of the block after the free
    next_wait_kv_pos: np.ndarray
    # frees of blocks the request did not hold
    unmatched_row: np.ndarray
    unmatched_block: np.ndarray
    unmatched_rk: np.ndarray

    def __len__(self) -> int:
        return len(self.rk)


def _sort_by(key: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Order by (key, pos); one argsort of a combined key when it fits in int64, else a lexsort."""
    if len(key) == 0:
        return np.empty(0, np.int64)
    span = int(pos.max()) + 1
    if int(key.max()) < (2**62) // max(span, 1):
        return np.argsort(key.astype(np.int64) * span + pos, kind="stable")
    return np.lexsort((pos, key))


def _pool_block_key(sk: np.ndarray, block: np.ndarray, width: int) -> np.ndarray:
    return sk.astype(np.int64) * width + block.astype(np.int64)


def _build(cols: Columns) -> Ownership:
    rk_all = cols.rk
    a_rows, a_blocks = cols.flat_blocks(cols.mask_of_rows(cols.req_rows("blocks_alloc")))
    f_rows, f_blocks = cols.flat_blocks(cols.mask_of_rows(cols.req_rows("blocks_free")))
    # int32 rows and blocks: at 10M events these arrays are the largest of the analysis
    rows = np.concatenate([a_rows, f_rows]).astype(np.int32)
    block = np.concatenate([a_blocks, f_blocks]).astype(np.int32)
    is_alloc = np.concatenate([np.ones(len(a_rows), bool), np.zeros(len(f_rows), bool)])
    del a_rows, f_rows, a_blocks, f_blocks
    rk = rk_all[rows]
    pos = cols.pos[rows]
    width = int(cols.block_rows[1].max()) + 1 if len(cols.block_rows[1]) else 1
    key = rk.astype(np.int64) * width + block
    order = _sort_by(key, pos)
    rows, block, is_alloc, rk, pos, key = (a[order] for a in (rows, block, is_alloc, rk, pos, key))
    del order

    same_prev = np.zeros(len(key), bool)
    same_prev[1:] = key[1:] == key[:-1]
    prev_alloc = np.zeros(len(key), bool)
    prev_alloc[1:] = is_alloc[:-1]
    starts = np.flatnonzero(is_alloc & ~(same_prev & prev_alloc))
    unmatched = np.flatnonzero(~is_alloc & ~(same_prev & prev_alloc))
    # the first free at or after each index
    big = len(key)
    free_idx = np.where(~is_alloc, np.arange(len(key)), big)
    next_free = np.minimum.accumulate(free_idx[::-1])[::-1] if len(key) else free_idx
    closer = next_free[starts] if len(starts) else np.empty(0, np.int64)
    closed = closer < big
    closed[closed] = key[closer[closed]] == key[starts[closed]]
    closer = np.where(closed, closer, 0)

    i_rk = rk[starts]
    i_block = block[starts]
    sk_of_rk = cols.rk_names["sk"].to_numpy().astype(np.int64) if cols.n_requests else np.empty(0, np.int64)
    i_sk = sk_of_rk[i_rk] if len(i_rk) else np.empty(0, np.int64)
    alloc_row = rows[starts]
    alloc_pos = pos[starts]
    free_row = np.where(closed, rows[closer] if len(rows) else 0, NO)
    free_pos = np.where(closed, pos[closer] if len(pos) else 0, NO)

    # other owners in the pool at each free: +1 at starts, -1 at frees, running sum per (pool, block)
    pkey = _pool_block_key(i_sk, i_block, width)
    n_int = len(starts)
    ev_key = np.concatenate([pkey, pkey[closed]])
    ev_pos = np.concatenate([alloc_pos, free_pos[closed]])
    ev_delta = np.concatenate([np.ones(n_int, np.int64), -np.ones(int(closed.sum()), np.int64)])
    ev_id = np.concatenate([np.arange(n_int), np.flatnonzero(closed)])
    ev_order = _sort_by(ev_key, ev_pos)
    ev_key, ev_delta, ev_id = ev_key[ev_order], ev_delta[ev_order], ev_id[ev_order]
    running = np.cumsum(ev_delta)
    group_start = np.ones(len(ev_key), bool)
    group_start[1:] = ev_key[1:] != ev_key[:-1]
    base = np.maximum.accumulate(np.where(group_start, np.arange(len(ev_key)), 0)) if len(ev_key) else ev_key
    before_group = np.where(base > 0, running[np.maximum(base - 1, 0)], 0) if len(ev_key) else running
    count_after = running - before_group
    others = np.zeros(n_int, np.int64)
    is_end = ev_delta < 0
    others[ev_id[is_end]] = count_after[is_end]

    # pool frees, next holder, next req_wait_kv allocation of the block
    p_rows, p_blocks = cols.flat_blocks(cols.mask_of_rows(cols.rows_of("blocks_pool_free")))
    p_key = _pool_block_key(cols.sk[p_rows], p_blocks, width)
    fkey = pkey[closed]
    fpos = free_pos[closed]
    pool_row = np.full(n_int, NO, np.int64)
    pool_pos = np.full(n_int, NO, np.int64)
    hit = next_at_or_after(fkey, fpos, p_key, cols.pos[p_rows], strict=True)
    idx = np.flatnonzero(closed)
    pool_row[idx[hit >= 0]] = p_rows[hit[hit >= 0]]
    pool_pos[idx[hit >= 0]] = cols.pos[pool_row[idx[hit >= 0]]]

    next_rk = np.full(n_int, NO, np.int64)
    next_row = np.full(n_int, NO, np.int64)
    next_pos = np.full(n_int, NO, np.int64)
    hit = next_at_or_after(fkey, fpos, pkey, alloc_pos, strict=True)
    ok = hit >= 0
    next_rk[idx[ok]] = i_rk[hit[ok]]
    next_row[idx[ok]] = alloc_row[hit[ok]]
    next_pos[idx[ok]] = alloc_pos[hit[ok]]

    w_rows, w_blocks = cols.flat_blocks(cols.mask_of_rows(cols.req_rows("req_wait_kv")))
    w_key = _pool_block_key(cols.sk[w_rows], w_blocks, width)
    wait_row = np.full(n_int, NO, np.int64)
    wait_pos = np.full(n_int, NO, np.int64)
    hit = next_at_or_after(fkey, fpos, w_key, cols.pos[w_rows], strict=True)
    ok = hit >= 0
    wait_row[idx[ok]] = w_rows[hit[ok]]
    wait_pos[idx[ok]] = cols.pos[w_rows[hit[ok]]]

    return Ownership(
        rk=i_rk, sk=i_sk, block=i_block, alloc_row=alloc_row, alloc_pos=alloc_pos, free_row=free_row,
        free_pos=free_pos, others_at_free=others, pool_free_row=pool_row, pool_free_pos=pool_pos,
        next_alloc_rk=next_rk, next_alloc_row=next_row, next_alloc_pos=next_pos, next_wait_kv_row=wait_row,
        next_wait_kv_pos=wait_pos, unmatched_row=rows[unmatched], unmatched_block=block[unmatched],
        unmatched_rk=rk[unmatched],
    )


def ownership(ctx: Any) -> Ownership:
    """Holding intervals as arrays, cached on the context."""
    return ctx.cached("ownership", lambda: _build(columns(ctx)))


def _build_frame(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    own = ownership(ctx)
    names = cols.rk_names
    seq = cols.table.column("seq").to_numpy() if cols.n else np.empty(0, np.int64)
    reason_codes, reason_names = cols.codes("reason")
    deferred_value, deferred_valid = cols.bool_col("deferred")
    freed = own.free_row >= 0
    frow = np.where(freed, own.free_row, 0)

    def nullable(values: np.ndarray, valid: np.ndarray, dtype: str) -> Any:
        arr = pd.array(values, dtype=dtype)
        arr[~valid] = pd.NA
        return arr

    lookup = np.asarray(list(reason_names) + [None], dtype=object)
    rc = reason_codes[frow] if len(frow) else np.empty(0, np.int32)
    fstep = cols.step[frow] if len(frow) else np.empty(0, np.int64)
    astep = cols.step[own.alloc_row] if len(own.alloc_row) else np.empty(0, np.int64)
    has_pool = own.pool_free_row >= 0
    return pd.DataFrame({
        "instance": names["instance"].to_numpy()[own.rk] if len(own) else np.empty(0, object),
        "dp_rank": names["dp_rank"].array[own.rk] if len(own) else pd.array([], "Int16"),
        "req": names["req"].to_numpy()[own.rk] if len(own) else np.empty(0, object),
        "block": own.block.astype(np.int64),
        "alloc_ts": cols.ts[own.alloc_row],
        "alloc_seq": seq[own.alloc_row],
        "alloc_step": nullable(astep, astep >= 0, "Int64"),
        "free_ts": nullable(cols.ts[frow] if len(frow) else frow, freed, "Int64"),
        "free_seq": nullable(seq[frow] if len(frow) else frow, freed, "Int64"),
        "free_step": nullable(fstep, freed & (fstep >= 0), "Int64"),
        "free_reason": pd.array(lookup[np.where(freed & (rc >= 0), rc, len(reason_names))], dtype="string"),
        "deferred": nullable(deferred_value[frow] if len(frow) else frow.astype(bool),
                             freed & (deferred_valid[frow] if len(frow) else freed), "boolean"),
        "pool_free_ts": nullable(cols.ts[np.where(has_pool, own.pool_free_row, 0)] if len(own) else frow,
                                 has_pool, "Int64"),
    }, columns=list(OWNERSHIP_COLUMNS))


def block_ownership(ctx: Any) -> pd.DataFrame:
    """One row per holding interval of a block by a request: the columns of OWNERSHIP_COLUMNS."""
    return ctx.cached("block_ownership", lambda: _build_frame(ctx))


@dataclass
class ReleaseGaps:
    """Times a request held no block after having held some: from the free that emptied its table (`free_row`,
    `start_pos`) to its next allocation (`end_pos`, NO if none)."""

    rk: np.ndarray
    start_pos: np.ndarray
    end_pos: np.ndarray
    free_row: np.ndarray

    def __len__(self) -> int:
        return len(self.rk)

    def find(self, rk: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """For each (rk, pos): the index of the gap that contains pos, else NO."""
        from pdtrace.analysis.columns import last_before

        idx = last_before(rk, pos, self.rk, self.start_pos, strict=True)
        ok = idx >= 0
        end = np.where(ok, self.end_pos[np.maximum(idx, 0)] if len(self.end_pos) else NO, NO)
        inside = ok & ((end < 0) | (pos < end))
        return np.where(inside, idx, NO)


def _running_count(key: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Running sum of delta within runs of equal (sorted) key."""
    running = np.cumsum(delta)
    if len(key) == 0:
        return running
    group_start = np.ones(len(key), bool)
    group_start[1:] = key[1:] != key[:-1]
    base = np.maximum.accumulate(np.where(group_start, np.arange(len(key)), 0))
    return running - np.where(base > 0, running[np.maximum(base - 1, 0)], 0)


def _build_gaps(ctx: Any) -> ReleaseGaps:
    own = ownership(ctx)
    closed = own.free_row >= 0
    key = np.concatenate([own.rk, own.rk[closed]]).astype(np.int64)
    pos = np.concatenate([own.alloc_pos, own.free_pos[closed]])
    delta = np.concatenate([np.ones(len(own), np.int64), -np.ones(int(closed.sum()), np.int64)])
    row = np.concatenate([own.alloc_row, own.free_row[closed]])
    order = _sort_by(key, pos)
    key, pos, delta, row = key[order], pos[order], delta[order], row[order]
    count = _running_count(key, delta)
    zero = np.flatnonzero((delta < 0) & (count == 0))
    nxt = zero + 1
    has_next = nxt < len(key)
    has_next[has_next] = key[nxt[has_next]] == key[zero[has_next]]
    end = np.where(has_next, pos[np.minimum(nxt, len(key) - 1)] if len(key) else NO, NO)
    return ReleaseGaps(rk=key[zero], start_pos=pos[zero], end_pos=end, free_row=row[zero])


def release_gaps(ctx: Any) -> ReleaseGaps:
    """The request-level "holds nothing" gaps, cached on the context."""
    return ctx.cached("release_gaps", lambda: _build_gaps(ctx))
