"""Block ownership: one holding interval per (instance, dp_rank, req, block), from allocation to free.

Algorithm: the block lists of `blocks_alloc` and `blocks_free` rows (with a req) are flattened into (request key,
block, position, is_alloc) entries and sorted by (request key, block, position) in one sort of a combined int64
key. Within one (request, block):
- an allocation opens an interval unless the previous entry is an allocation already (a repeated id in the table
  extends the open interval);
- the first free after the opening closes it; a free whose previous entry is not an allocation is *unmatched*: the
  request gave up a block it did not own (double_free uses these).
Lookups per freed interval, on demand for the intervals a rule asks about (the searched rows are sorted once, by
(pool, block, position), on first use): the number of other owners in the pool right after the free (a running
sum of +1 at interval starts and -1 at frees per pool and block), the first `blocks_pool_free` of the block after
the free, the block's next holder and its next `req_wait_kv` allocation (one searchsorted each).

`ownership(ctx)` holds these as numpy arrays (rules use it); `block_ownership(ctx)` is the DataFrame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.columns import (NO, Columns, block_lists, columns, last_before, order_by_key, positions,
                                      request_keys)
from pdtrace.analysis.parallel import shared_table

OWNERSHIP_COLUMNS = (
    "instance", "dp_rank", "req", "block", "alloc_ts", "alloc_seq", "alloc_step", "free_ts", "free_seq",
    "free_step", "free_reason", "deferred", "pool_free_ts",
)


@dataclass
class Ownership:
    """Holding intervals as parallel arrays (index = interval), plus the unmatched frees. Lookups that only a few
    intervals need (the pool free, the next holder, the next req_wait_kv allocation of a freed block, the other
    owners at a free) are methods taking interval indexes: the rows they search are sorted once, on first use."""

    rk: np.ndarray
    sk: np.ndarray
    block: np.ndarray
    alloc_row: np.ndarray
    alloc_pos: np.ndarray
    free_row: np.ndarray        # NO if never freed
    free_pos: np.ndarray
    # frees of blocks the request did not hold
    unmatched_row: np.ndarray
    unmatched_block: np.ndarray
    unmatched_rk: np.ndarray
    cols: Columns | None = None
    width: int = 1
    _sorted: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    _others: np.ndarray | None = field(default=None, repr=False)
    _shared: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.rk)

    @property
    def pool_key(self) -> np.ndarray:
        return pool_block_key(self.sk, self.block, self.width)

    def _table(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sorted composite keys, their rows (or interval ids), span) of the rows a lookup searches."""
        if name not in self._sorted:
            cols = self.cols
            assert cols is not None
            if name == "alloc":
                key, pos, ids = self.pool_key, self.alloc_pos, np.arange(len(self), dtype=np.int64)
            else:
                kinds = ("blocks_pool_free",) if name == "pool" else ("req_wait_kv",)
                rows = cols.rows_of(*kinds) if name == "pool" else cols.req_rows(*kinds)
                b_rows, b_blocks = cols.flat_blocks(cols.mask_of_rows(rows))
                key = pool_block_key(cols.sk[b_rows], b_blocks, self.width)
                pos, ids = cols.pos[b_rows], b_rows
            span = int(cols.n) + 2
            composite = key.astype(np.int64) * span + pos
            order = np.argsort(composite)
            self._sorted[name] = (composite[order], ids[order], np.array([span]))
        return self._sorted[name]

    def _next_after(self, name: str, idx: np.ndarray) -> np.ndarray:
        """For intervals idx (freed ones): the id of the first entry of table `name` with the same pool block
        strictly after the free, else NO."""
        out = np.full(len(idx), NO, np.int64)
        if len(idx) == 0:
            return out
        composite, ids, span = self._table(name)
        if len(composite) == 0:
            return out
        span_v = int(span[0])
        query = self.pool_key[idx].astype(np.int64) * span_v + self.free_pos[idx] + 1
        at = np.searchsorted(composite, query)
        ok = at < len(composite)
        ok[ok] = (composite[at[ok]] // span_v) == (query[ok] // span_v)
        out[ok] = ids[at[ok]]
        return out

    def pool_free_after(self, idx: np.ndarray) -> np.ndarray:
        """Row of the first blocks_pool_free of the block after each interval's free (NO if none)."""
        return self._next_after("pool", idx)

    def next_alloc_after(self, idx: np.ndarray) -> np.ndarray:
        """Interval id of the block's next holder after each interval's free (NO if none)."""
        return self._next_after("alloc", idx)

    def next_wait_kv_after(self, idx: np.ndarray) -> np.ndarray:
        """Row of the block's next req_wait_kv allocation after each interval's free (NO if none)."""
        return self._next_after("wait_kv", idx)

    def others_at_free(self, idx: np.ndarray) -> np.ndarray:
        """Other holders of the block in its pool right after each interval's free: a running count of +1 at
        starts and -1 at frees per (pool, block), computed once for all intervals on first use."""
        if len(idx) == 0:
            return np.zeros(0, np.int64)
        if self._others is None:
            closed = self.free_row >= 0
            pkey = self.pool_key
            n_int = len(self)
            ev_key = np.concatenate([pkey, pkey[closed]])
            ev_pos = np.concatenate([self.alloc_pos, self.free_pos[closed]])
            ev_delta = np.concatenate([np.ones(n_int, np.int64), -np.ones(int(closed.sum()), np.int64)])
            ev_id = np.concatenate([np.arange(n_int), np.flatnonzero(closed)])
            order = order_by_key(ev_key, ev_pos)
            ev_key, ev_delta, ev_id = ev_key[order], ev_delta[order], ev_id[order]
            count_after = _running_count(ev_key, ev_delta)
            others = np.zeros(n_int, np.int64)
            is_end = ev_delta < 0
            others[ev_id[is_end]] = count_after[is_end]
            self._others = others
        return self._others[idx]


    def shared_blocks(self) -> np.ndarray:
        """For each interval: whether its block (in its pool) ever had two holders at once, in any of its
        intervals (prefix sharing). Computed once: the intervals in (pool block, allocation position) order (the
        `next_alloc_after` table); an interval that starts before the furthest free seen so far in its block
        overlaps an earlier one, and marks every interval of that block."""
        if self._shared is None:
            ids = self._table("alloc")[1]
            key = self.pool_key[ids]
            start = self.alloc_pos[ids].astype(np.int64)
            end = np.where(self.free_row[ids] >= 0, self.free_pos[ids], np.iinfo(np.int32).max).astype(np.int64)
            new_block = np.ones(len(ids), bool)
            new_block[1:] = key[1:] != key[:-1]
            block_index = np.cumsum(new_block) - 1
            # the furthest end so far within each block: one running maximum over (block index, end) packed in an
            # int64 (positions < 2**31), block indexes ascending
            reach = np.maximum.accumulate((block_index << 32) | end) & 0xFFFFFFFF if len(ids) else end
            overlaps = np.zeros(len(ids), bool)
            overlaps[1:] = ~new_block[1:] & (start[1:] < reach[:-1])
            block_shared = np.zeros(int(block_index[-1]) + 1 if len(ids) else 0, bool)
            block_shared[block_index[overlaps]] = True
            shared = np.zeros(len(self), bool)
            shared[ids] = block_shared[block_index]
            self._shared = shared
        return self._shared


def pool_block_key(sk: np.ndarray, block: np.ndarray, width: int) -> np.ndarray:
    """One int64 per (scheduler key, block id): a block of one scheduler's pool (width: above every block id)."""
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
    order = order_by_key(key, pos)
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
    sk_of_rk = cols.request_sk.astype(np.int64) if cols.n_requests else np.empty(0, np.int64)
    i_sk = sk_of_rk[i_rk] if len(i_rk) else np.empty(0, np.int64)
    alloc_row = rows[starts]
    alloc_pos = pos[starts]
    free_row = np.where(closed, rows[closer] if len(rows) else 0, NO)
    free_pos = np.where(closed, pos[closer] if len(pos) else 0, NO)

    return Ownership(
        rk=i_rk, sk=i_sk, block=i_block, alloc_row=alloc_row, alloc_pos=alloc_pos, free_row=free_row,
        free_pos=free_pos, unmatched_row=rows[unmatched], unmatched_block=block[unmatched],
        unmatched_rk=rk[unmatched], cols=cols, width=width,
    )


@shared_table(positions, request_keys, block_lists, cost=0.09)
def ownership(ctx: Any) -> Ownership:
    """Holding intervals as arrays, cached on the context."""
    return ctx.cached("ownership", lambda: _build(columns(ctx)))


def _build_frame(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    own = ownership(ctx)
    names = cols.rk_names
    seq = cols.table.column("seq").to_numpy() if cols.n else np.empty(0, np.int64)
    reason_codes, reason_names = cols.codes("reason")
    freed = own.free_row >= 0
    frow = np.where(freed, own.free_row, 0)
    deferred_value, deferred_valid = cols.bools_at("deferred", frow)

    def nullable(values: np.ndarray, valid: np.ndarray, dtype: str) -> Any:
        arr = pd.array(values, dtype=dtype)
        arr[~valid] = pd.NA
        return arr

    lookup = np.asarray(list(reason_names) + [None], dtype=object)
    rc = reason_codes[frow] if len(frow) else np.empty(0, np.int32)
    fstep = cols.step[frow] if len(frow) else np.empty(0, np.int64)
    astep = cols.step[own.alloc_row] if len(own.alloc_row) else np.empty(0, np.int64)
    pool_row = np.full(len(own), NO, np.int64)
    pool_row[freed] = own.pool_free_after(np.flatnonzero(freed))
    has_pool = pool_row >= 0
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
        "deferred": nullable(deferred_value, freed & deferred_valid, "boolean"),
        "pool_free_ts": nullable(cols.ts[np.where(has_pool, pool_row, 0)] if len(own) else frow,
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
        idx = last_before(rk, pos, self.rk, self.start_pos, strict=True)
        ok = idx >= 0
        end = np.where(ok, self.end_pos[np.maximum(idx, 0)] if len(self.end_pos) else NO, NO)
        inside = ok & ((end < 0) | (pos < end))
        return np.where(inside, idx, NO)


def _running_count(key: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Running sum of delta within runs of equal (sorted) key: the global running sum less its value just before
    each run, repeated over the run."""
    running = np.cumsum(delta)
    if len(key) == 0:
        return running
    starts = np.flatnonzero(key[1:] != key[:-1]) + 1
    before = np.empty(len(starts) + 1, running.dtype)
    before[0] = 0
    before[1:] = running[starts - 1]
    running -= np.repeat(before, np.diff(starts, prepend=0, append=len(key)))
    return running


def _build_gaps(ctx: Any) -> ReleaseGaps:
    own = ownership(ctx)
    closed = own.free_row >= 0
    key = np.concatenate([own.rk, own.rk[closed]]).astype(np.int64)
    pos = np.concatenate([own.alloc_pos, own.free_pos[closed]])
    delta = np.concatenate([np.ones(len(own), np.int64), -np.ones(int(closed.sum()), np.int64)])
    row = np.concatenate([own.alloc_row, own.free_row[closed]])
    order = order_by_key(key, pos)
    key, pos, delta, row = key[order], pos[order], delta[order], row[order]
    count = _running_count(key, delta)
    zero = np.flatnonzero((delta < 0) & (count == 0))
    nxt = zero + 1
    has_next = nxt < len(key)
    has_next[has_next] = key[nxt[has_next]] == key[zero[has_next]]
    end = np.where(has_next, pos[np.minimum(nxt, len(key) - 1)] if len(key) else NO, NO)
    return ReleaseGaps(rk=key[zero], start_pos=pos[zero], end_pos=end, free_row=row[zero])


@shared_table(ownership, cost=0.045)
def release_gaps(ctx: Any) -> ReleaseGaps:
    """The request-level "holds nothing" gaps, cached on the context."""
    return ctx.cached("release_gaps", lambda: _build_gaps(ctx))
