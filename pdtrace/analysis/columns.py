"""The trace's columns as numpy arrays, computed once per analysis run and shared by every rule.

Rules compare events by their position in one global order: a stable sort of `ts_ns` over the rows in load order
(files in path order, each file in `seq` order), so one writer's events keep their exact `seq` order whenever its
clock does not step back. `pos[row]` is a row's rank in that order (int32 below 2**31 rows) and `order[pos]` the
row at a rank.

Keys:
- `sk` (scheduler key): one dense id per (instance, dp_rank); a null dp_rank is its own value.
- `rk` (request key): one dense id per request (instance, dp_rank, req, lifetime) on rows that carry a req, -1
  elsewhere. The lifetime is 0 unless the id is reused: a `req_add` after the id's request finished starts a new
  request (`_split_lifetimes`); `request_lifetime` gives each key's ordinal.
Dictionary columns become small integer codes (`code_of(column, value)` gives the code of one value, -1 if absent),
so no rule compares strings per event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.analysis.once import OnceCache, once_property
from pdtrace.analysis.parallel import shared_table
from pdtrace.trace.model import Trace, parse_details, rows_by_chunk
from pdtrace.trace.reader import REQ_DICTIONARY_ATTR, REQ_DICTIONARY_TYPE

NO = -1  # the "absent" value of every code, key, step and position array
ABSENT = -2  # code_of() for a value the column does not hold


def _bits(buffer: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """An Arrow bitmap (validity or bool values) as n numpy bools, starting at the array's offset."""
    packed = np.frombuffer(buffer, dtype=np.uint8)
    return np.unpackbits(packed, count=offset + n, bitorder="little")[offset:].view(bool)


def _values(arr: pa.Array, dtype: Any, fill: int) -> np.ndarray:
    """A primitive Arrow array's values as numpy, nulls replaced by `fill`, read straight from its buffers: no
    Arrow compute, so no memory held by Arrow's pool (which keeps what it frees) at 10M rows."""
    n = len(arr)
    arrow_dtype = np.dtype(arr.type.to_pandas_dtype())
    values = np.frombuffer(arr.buffers()[1], dtype=arrow_dtype, count=arr.offset + n)[arr.offset:]
    if arr.null_count:
        return np.where(_bits(arr.buffers()[0], arr.offset, n), values, fill).astype(dtype, copy=False)
    return values.astype(dtype, copy=False)  # no nulls, same type: a read-only view of the Arrow buffer


def _concat_values(arrays: list[pa.Array], dtype: Any, fill: int) -> np.ndarray:
    """`np.concatenate([_values(a, dtype, fill) for a in arrays])` written straight into one output array: each
    chunk's values copied (and converted) once, nulls overwritten where a chunk has any; no per-chunk temporaries
    beyond its validity bits."""
    if len(arrays) == 1:
        return _values(arrays[0], dtype, fill)
    out = np.empty(sum(len(a) for a in arrays), dtype)
    start = 0
    for arr in arrays:
        n = len(arr)
        if n == 0:
            continue
        arrow_dtype = np.dtype(arr.type.to_pandas_dtype())
        piece = out[start:start + n]
        piece[...] = np.frombuffer(arr.buffers()[1], dtype=arrow_dtype, count=arr.offset + n)[arr.offset:]
        if arr.null_count:
            valid = _bits(arr.buffers()[0], arr.offset, n)
            np.logical_not(valid, out=valid)
            piece[valid] = fill
        start += n
    return out


def dictionary_codes(column: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """(integer codes with -1 for null, category names) of a string or dictionary column, one dictionary for all
    chunks (int16 codes when there are fewer than 32,000 names)."""
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    if column.num_chunks == 0:
        return np.empty(0, np.int16), []
    first = column.chunk(0).dictionary
    if any(not chunk.dictionary.equals(first) for chunk in column.chunks[1:]):
        column = pa.table({"c": column}).unify_dictionaries().column("c")
        first = column.chunk(0).dictionary
    names = [str(n) for n in first.to_pylist()]
    dtype = np.int16 if len(names) < 32_000 else np.int32
    codes = _concat_values([chunk.indices for chunk in column.chunks], dtype, -1)
    return codes, names


def _unified_indices(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """(one dictionary, int32 indices into it with -1 for null) of a chunked dictionary column. The chunks' distinct
    dictionaries (one per Parquet row group, shared by its batches) are encoded together once, and each chunk's
    indices go through its dictionary's small lookup table straight into the output (Arrow's unify_dictionaries
    would rewrite every chunk's index buffer first)."""
    distinct: list[pa.Array] = []
    which: list[int] = []
    for chunk in column.chunks:
        d = chunk.dictionary
        last = distinct[-1] if distinct else None
        if last is not None and (last is d or last.equals(d)):
            which.append(len(distinct) - 1)
            continue
        for i, seen in enumerate(distinct):
            if seen.equals(d):
                which.append(i)
                break
        else:
            distinct.append(d)
            which.append(len(distinct) - 1)
    if len(distinct) == 1:
        return distinct[0], _concat_values([chunk.indices for chunk in column.chunks], np.int32, -1)
    encoded = pc.dictionary_encode(pa.concat_arrays(distinct))
    ids = _values(encoded.indices, np.int32, -1)
    bounds = np.cumsum([0] + [len(d) for d in distinct])
    luts = [np.append(ids[bounds[i]:bounds[i + 1]], np.int32(NO)) for i in range(len(distinct))]
    out = np.empty(len(column), np.int32)
    start = 0
    for chunk, i in zip(column.chunks, which):
        m = len(chunk)
        if m == 0:
            continue
        idx = chunk.indices
        arrow_dtype = np.dtype(idx.type.to_pandas_dtype())
        values = np.frombuffer(idx.buffers()[1], dtype=arrow_dtype, count=idx.offset + m)[idx.offset:]
        piece = out[start:start + m]
        np.take(luts[i], values, out=piece, mode="clip")  # a null slot's index may be anything: fixed below
        if idx.null_count:
            valid = _bits(idx.buffers()[0], idx.offset, m)
            np.logical_not(valid, out=valid)
            piece[valid] = NO
        start += m
    return encoded.dictionary, out


_CHECK_BLOCK = 256  # rows per block of _numbered_by_first_seen
_KEY_BLOCK = 1024  # rows per block of Columns._sched_keys
_IN_PLACE_SLICE = 1 << 20  # rows per slice of a lookup written back in place


def _numbered_by_first_seen(raw: np.ndarray, size: int) -> bool:
    """Whether codes (-1 for null) in [0, size) are numbered by first appearance in row order with every code used:
    each row at most one above the largest code before it (the first row at most 0), and size - 1 reached.

    Checked by blocks of _CHECK_BLOCK rows instead of a running maximum over every row: a row no greater than the
    largest code of the earlier blocks passes, so only the rows above it (each code's first rows, a few per block)
    are compared with the running maximum, which over them is the larger of the earlier blocks' maximum and a
    cumulative maximum of the rows above before it. Two reductions per row (block maxima, comparison) and
    work on the few rows above."""
    n = len(raw)
    full = n // _CHECK_BLOCK * _CHECK_BLOCK
    block_max = raw[:full].reshape(-1, _CHECK_BLOCK).max(axis=1)
    if full < n:
        block_max = np.append(block_max, raw[full:].max())
    running = np.maximum.accumulate(block_max)
    if int(running[-1]) != size - 1:
        return False
    before = np.empty(len(block_max), raw.dtype)  # the largest code of the earlier blocks; -1 before the first
    before[0] = NO
    before[1:] = running[:-1]
    above = np.empty(n, bool)
    np.greater(raw[:full].reshape(-1, _CHECK_BLOCK), before[:full // _CHECK_BLOCK, None],
               out=above[:full].reshape(-1, _CHECK_BLOCK))
    np.greater(raw[full:], before[-1], out=above[full:])
    rows = np.flatnonzero(above)
    del above
    values = raw[rows]
    earlier = np.empty(len(values), np.int64)  # the largest code of the rows above before each one
    if len(values):
        earlier[0] = NO
        np.maximum.accumulate(values[:-1], out=earlier[1:])
    bound = np.maximum(before[rows // _CHECK_BLOCK], earlier)
    return bool((values <= bound + 1).all())


def _first_seen_by_runs(column: pa.ChunkedArray, n: int) -> tuple[np.ndarray, list[str]] | None:
    """`_first_seen_codes` run by run of chunks sharing one dictionary (a Parquet row group's batches), or None
    when the result fails its check. A whole row group's dictionary holds its values in first-seen order, every one
    used; only a row group cut at a window's edge (a slice or a filter) does not, and only such a run is renumbered
    (one scatter over its rows). Then encoding the runs' dictionaries end to end numbers the names by first
    appearance in the rows, so the codes need no pass over every row beyond one lookup. A 5M-row window (46
    chunks): CPU 32-37 ms against 55 ms for the renumbering of every row that a cut row group forced before
    (bench/long_trace.py, one core)."""
    chunks = [c for c in column.chunks if len(c)]
    runs: list[tuple[pa.Array, np.ndarray]] = []
    i = 0
    while i < len(chunks):
        d = chunks[i].dictionary
        j = i + 1
        while j < len(chunks) and (chunks[j].dictionary is d or chunks[j].dictionary.equals(d)):
            j += 1
        raw = _concat_values([c.indices for c in chunks[i:j]], np.int32, NO)
        if not _numbered_by_first_seen(raw, len(d)):
            first = np.full(len(d) + 1, len(raw), np.int64)
            first[raw[::-1]] = np.arange(len(raw) - 1, -1, -1)  # each code's first row (the last write wins)
            used = np.flatnonzero(first[:len(d)] < len(raw))
            ranked = used[np.argsort(first[used], kind="stable")]
            lut = np.full(len(d) + 1, NO, np.int32)
            lut[ranked] = np.arange(len(ranked), dtype=np.int32)
            raw = lut[raw]  # a new array (raw may be a view of the Arrow buffer); a null (-1) reads lut[-1]: NO
            d = d.take(pa.array(ranked, pa.int64()))
        runs.append((d, raw))
        i = j
    if not runs:
        return None
    encoded = pc.dictionary_encode(pa.concat_arrays([d for d, _ in runs]))
    ids = _values(encoded.indices, np.int32, NO)
    size = len(encoded.dictionary)
    dtype = np.int16 if size < 32_000 else np.int32
    out = np.empty(n, dtype)
    start = bound = 0
    for d, raw in runs:
        lut = np.append(ids[bound:bound + len(d)], NO).astype(dtype)
        np.take(lut, raw, out=out[start:start + len(raw)])
        start += len(raw)
        bound += len(d)
    if start != n or not _numbered_by_first_seen(out, size):
        return None
    return out, [str(v) for v in encoded.dictionary.to_pylist()]


def _first_seen_codes(column: pa.ChunkedArray, n: int) -> tuple[np.ndarray, list[str]]:
    """What `dictionary_codes` gives for the strings of a dictionary<int32, string> column whose dictionary may be
    in any order and hold unused values: codes renumbered by first appearance in row order, unused names dropped.
    Reads the indices only (no string is hashed): a blockwise check that they are numbered so already (what a
    Parquet writer's dictionary gives), else one scatter for each code's first row and a sort of the distinct
    codes."""
    if column.num_chunks == 0 or n == 0:
        return np.empty(0, np.int16), []
    by_runs = _first_seen_by_runs(column, n)
    if by_runs is not None:
        return by_runs
    dictionary, raw = _unified_indices(column)
    size = len(dictionary)
    dtype = np.int16 if size < 32_000 else np.int32
    if _numbered_by_first_seen(raw, size):
        return raw.astype(dtype, copy=False), [str(v) for v in dictionary.to_pylist()]
    # each code's first row: a scatter of every row number in reverse, the last write wins; a null (-1) lands in
    # the extra slot (no list of the non-null rows first: 0.021 s against 0.030 s at 5M rows)
    dtype_rows = np.int32 if n < 2**31 - 1 else np.int64
    first = np.full(size + 1, n, dtype_rows)
    first[raw[::-1]] = np.arange(n - 1, -1, -1, dtype=dtype_rows)
    first = first[:size]
    used = np.flatnonzero(first < n)
    ranked = used[np.argsort(first[used], kind="stable")]
    dtype = np.int16 if len(ranked) < 32_000 else np.int32
    lut = np.full(size + 1, NO, dtype)  # lut[-1] (null) stays NO
    lut[ranked] = np.arange(len(ranked), dtype=dtype)
    names = [str(v) for v in dictionary.take(pa.array(ranked, pa.int64())).to_pylist()]
    return lut[raw], names


def _ramp(lengths: np.ndarray) -> np.ndarray:
    """0..len-1 for each length, concatenated."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts


def order_by_key(key: np.ndarray, value: np.ndarray) -> np.ndarray:
    """np.lexsort((value, key)), the stable order by key then value of two integer arrays, as one stable argsort
    of the int64 `key * span + (value - min value)` where the keys are non-negative and that fits, else the
    lexsort. Numpy's stable sort (timsort) merges the runs real traces have (a request's or a writer's rows in
    time order); at 10M events it took 0.06 s where a quicksort of the same key took 0.2 s."""
    if len(key) == 0:
        return np.empty(0, np.intp)
    low = int(value.min())
    span = int(value.max()) - low + 1
    if int(key.min()) >= 0 and int(key.max()) < (2**62) // span:
        return np.argsort(key.astype(np.int64) * span + (value.astype(np.int64) - low), kind="stable")
    return np.lexsort((value, key))


def order_by_pair(primary: np.ndarray, secondary: np.ndarray) -> np.ndarray | None:
    """`order_by_key(primary, secondary)`, or None when the rows are in that order already: one O(n) comparison
    first. Exec spans and busy intervals usually are (each writer's part file holds its rows in seq order, and
    the spans are built in lane order), and the sort plus the gathers it implies cost several ms per 100k rows in
    a fresh process."""
    if len(primary) < 2:
        return None
    ahead = primary[1:] > primary[:-1]
    tied = primary[1:] == primary[:-1]
    if bool((ahead | (tied & (secondary[1:] >= secondary[:-1]))).all()):
        return None
    return order_by_key(primary, secondary)


def int_column(table: pa.Table, name: str, dtype: Any = np.int64) -> np.ndarray:
    """A numeric column as numpy with nulls as -1."""
    col = table.column(name)
    if col.num_chunks == 0:
        return np.empty(0, dtype)
    return _concat_values(col.chunks, dtype, -1)


def _bits_at(buffer: pa.Buffer, offset: int, positions: np.ndarray) -> np.ndarray:
    """Bits of an Arrow bitmap at the given positions of an array starting at `offset`, as bools."""
    packed = np.frombuffer(buffer, dtype=np.uint8)
    at = positions + offset
    return ((packed[at >> 3] >> (at & 7).astype(np.uint8)) & 1).astype(bool)


def gather(column: pa.ChunkedArray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, is_valid) of a primitive or bool column at `rows` (any order), read straight from each chunk's
    buffers: no 10M-row copy of the column for the few rows a rule looks at, and no Arrow allocation. Values under
    a null are whatever the buffer holds; use is_valid."""
    rows = np.asarray(rows)
    is_bool = pa.types.is_boolean(column.type)
    out = np.empty(len(rows), bool if is_bool else np.dtype(column.type.to_pandas_dtype()))
    valid = np.ones(len(rows), bool)
    for i, where, local in rows_by_chunk(column, rows):
        chunk = column.chunk(i)
        if is_bool:
            out[where] = _bits_at(chunk.buffers()[1], chunk.offset, local)
        else:
            values = np.frombuffer(chunk.buffers()[1], dtype=out.dtype, count=chunk.offset + len(chunk))
            out[where] = values[chunk.offset:][local]
        if chunk.null_count:
            valid[where] = _bits_at(chunk.buffers()[0], chunk.offset, local)
    return out, valid


def _kind_mask(codes: np.ndarray, wanted: list[int], n_names: int) -> np.ndarray:
    """Whether each kind code is one of `wanted` (codes of a column with n_names names)."""
    if not wanted:
        return np.zeros(len(codes), bool)
    if len(wanted) == 1:
        return codes == wanted[0]
    lut = np.zeros(n_names, bool)
    lut[wanted] = True
    return lut[codes]


@dataclass
class Columns:
    """Per-row arrays of one trace (see the module docstring)."""

    trace: Trace
    #: every derived array, built once even when rules on several threads ask together (see pdtrace.analysis.once)
    _once: OnceCache = field(default_factory=OnceCache, repr=False)

    @property
    def table(self) -> pa.Table:
        return self.trace.table

    @once_property
    def n(self) -> int:
        return self.trace.table.num_rows

    def codes(self, name: str) -> tuple[np.ndarray, list[str]]:
        return self._once.get(("codes", name), lambda: self._build_codes(name))

    def _build_codes(self, name: str) -> tuple[np.ndarray, list[str]]:
        # the reader keeps `req` as read from Parquet (dictionary indices) next to the table's strings
        kept = getattr(self.trace, REQ_DICTIONARY_ATTR, None) if name == "req" else None
        if kept is not None and kept[0] is self.table:
            codes = _first_seen_codes(kept[1], self.n)
            delattr(self.trace, REQ_DICTIONARY_ATTR)  # its indices are not needed again: free them
            return codes
        column = self.table.column(name)
        if name == "req" and column.type == REQ_DICTIONARY_TYPE:  # read as codes: `open_trace(req_dictionary=True)`
            return _first_seen_codes(column, self.n)
        return dictionary_codes(column)

    def once(self, key: Any, build: Any) -> Any:
        """A value derived from these columns, built once (by the first caller, on any thread) and kept."""
        return self._once.get(("derived", key), build)

    def code_of(self, name: str, value: str) -> int:
        """The code of one value; ABSENT (never equal to any code, nor to NO for null) if the column lacks it."""
        names = self.codes(name)[1]
        return names.index(value) if value in names else ABSENT

    def _row_index(self, rows: np.ndarray) -> np.ndarray:
        # cached row lists stay for the whole run (req_sched rows are most of a trace): int32 like pos
        return rows.astype(np.int32) if self.n < 2**31 - 2 else rows

    @once_property
    def _kind_split(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(code of the most common kind, its rows, every other row, their kind codes): rows of the other kinds are
        picked from that short list (a fifth of a trace where req_sched is most of it) instead of a pass over every
        row's kind per query."""
        codes, _ = self.codes("kind")
        sample = codes[::97]  # the most common kind of a strided sample: only the speed depends on this choice
        sample = sample[sample >= 0]
        major = int(np.bincount(sample).argmax()) if len(sample) else ABSENT
        minor_rows = np.flatnonzero(codes != major)
        # the major rows are the runs between minor rows, written as a running sum of steps in the rows' own dtype
        # (no int64 list of most rows of the trace): +1 within a run, and at the start of run r (r minor rows
        # before it) the jump over the minor rows since the previous run
        runs = np.diff(minor_rows, prepend=-1, append=self.n) - 1
        dtype = np.int32 if self.n < 2**31 - 2 else np.int64
        major_rows = np.ones(self.n - len(minor_rows), dtype)
        if len(major_rows):
            filled = np.flatnonzero(runs)  # the runs that hold rows, by index r
            major_rows[np.cumsum(runs[filled]) - runs[filled]] = np.diff(filled, prepend=filled[0]) + 1
            major_rows[0] = filled[0]
            np.cumsum(major_rows, out=major_rows)
        minor_rows = self._row_index(minor_rows)
        minor_codes = codes[minor_rows]
        for shared in (major_rows, minor_rows, minor_codes):  # handed out by rows_of and req_rows: never written
            shared.flags.writeable = False
        return major, major_rows, minor_rows, minor_codes

    def rows_of(self, *kinds: str) -> np.ndarray:
        """Rows of the given kinds, in row order (cached: rules ask for the same kinds again). The most common kind's
        rows come from one split of the kind codes (`_kind_split`), other kinds from the rows outside it."""
        return self._once.get(("rows",) + kinds, lambda: self._select_rows(kinds))

    def _select_rows(self, kinds: tuple[str, ...]) -> np.ndarray:
        _, names = self.codes("kind")
        wanted = [names.index(k) for k in kinds if k in names]
        major, major_rows, minor_rows, minor_codes = self._kind_split
        if major not in wanted:
            return minor_rows[_kind_mask(minor_codes, wanted, len(names))]
        if all(w == major for w in wanted):
            return major_rows
        return self._row_index(np.flatnonzero(self.is_kind(*kinds)))

    def req_rows(self, *kinds: str) -> np.ndarray:
        """Rows of the given kinds that name a request (cached): `rows_of` where rk >= 0."""
        return self._req_rows_and_keys(kinds)[0]

    def req_keys(self, *kinds: str) -> np.ndarray:
        """`rk` at `req_rows(*kinds)` (cached with them: read once to select the rows)."""
        return self._req_rows_and_keys(kinds)[1]

    def _req_rows_and_keys(self, kinds: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        def build() -> tuple[np.ndarray, np.ndarray]:
            rows = self.rows_of(*kinds)
            keys = self.rk[rows]
            has = keys >= 0
            if not has.all():
                rows, keys = rows[has], keys[has]
            keys.flags.writeable = False
            return rows, keys

        return self._once.get(("req_rows",) + kinds, build)

    def mask_of_rows(self, rows: np.ndarray) -> np.ndarray:
        mask = np.zeros(self.n, bool)
        mask[rows] = True
        return mask

    def is_kind(self, *kinds: str) -> np.ndarray:
        codes, names = self.codes("kind")
        return _kind_mask(codes, [names.index(k) for k in kinds if k in names], len(names))

    @once_property
    def ts(self) -> np.ndarray:
        return int_column(self.table, "ts_ns")

    @once_property
    def step(self) -> np.ndarray:
        # int32 when every step fits (vLLM counts schedule() calls: 2**31 is years of steps): the array stays in
        # memory for the whole run. Composite keys cast it to int64 first, like pos.
        col = self.table.column("step")
        top = pc.max(col).as_py() if self.n else None
        return int_column(self.table, "step", np.int32 if top is None or top < 2**31 - 2 else np.int64)

    def ints_at(self, name: str, rows: np.ndarray, fill: int = NO) -> np.ndarray:
        """A numeric column's values at rows as int64, `fill` where null (see `gather`)."""
        values, valid = gather(self.table.column(name), rows)
        values = values.astype(np.int64, copy=False)
        if not valid.all():
            values = np.where(valid, values, fill)
        return values

    def numbers_at(self, name: str, rows: np.ndarray) -> np.ndarray:
        """A numeric column's values at rows as float64, NaN where null."""
        values, valid = gather(self.table.column(name), rows)
        values = values.astype(np.float64)
        values[~valid] = np.nan
        return values

    def bools_at(self, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(value, is_valid) of a bool column at rows."""
        return gather(self.table.column(name), rows)

    @once_property
    def _order_and_pos(self) -> tuple[np.ndarray, np.ndarray]:
        # Both from one stable argsort: the scatter pos[order] = rank indexes with argsort's own int64 result (numpy
        # casts an int32 index array chunk by chunk: twice the time); order is narrowed only afterwards.
        # int32 below 2**31 rows: order is only ever an index, and pos (with pos + 2, the span of composite keys
        # `key * span + pos`, which are int64) fits; both stay in memory for the whole run.
        order = np.argsort(self.ts, kind="stable")
        dtype = np.int32 if self.n < 2**31 - 2 else np.int64
        pos = np.empty(self.n, dtype)
        pos[order] = np.arange(self.n, dtype=dtype)
        return order.astype(dtype, copy=False), pos

    @property
    def order(self) -> np.ndarray:
        """The row at each rank of the global order (a stable argsort of ts_ns)."""
        return self._order_and_pos[0]

    @property
    def pos(self) -> np.ndarray:
        """Each row's rank in the global order: the inverse permutation of `order`."""
        return self._order_and_pos[1]

    @once_property
    def dp(self) -> np.ndarray:
        return int_column(self.table, "dp_rank", np.int16)

    @once_property
    def _sched_keys(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inst, _ = self.codes("instance")
        if self.n == 0:
            return np.empty(0, np.int16), np.empty(0, np.int64), np.empty(0, np.int64)
        width = int(self.dp.max()) + 2
        # (instance, dp) as one small int (int16 when every pair fits), its distinct values and a lookup table (no
        # 10M-row hashing). A writer's rows are contiguous and its (instance, dp) constant, so most blocks of
        # _KEY_BLOCK rows hold one value: the values present are the blocks' minima and maxima plus the rows of
        # the mixed blocks, and a constant block's keys are one fill
        dtype = np.int16 if (len(self.codes("instance")[1]) + 1) * width < 32_000 else np.int32
        combined = np.multiply(inst, dtype(width), dtype=dtype)
        combined += self.dp
        combined += 1
        full = self.n // _KEY_BLOCK * _KEY_BLOCK
        blocks = combined[:full].reshape(-1, _KEY_BLOCK)
        low, high = blocks.min(axis=1), blocks.max(axis=1)
        mixed = np.flatnonzero(low != high)
        tail = combined[full:]
        if min(int(low.min()) if len(low) else 0, int(tail.min()) if len(tail) else 0) < 0:  # a null instance
            present = np.flatnonzero(np.bincount(combined))  # refuses negative values, as always
        else:
            top = max(int(high.max()) if len(high) else 0, int(tail.max()) if len(tail) else 0)
            seen = np.zeros(top + 1, bool)
            seen[low] = True
            seen[high] = True
            seen[blocks[mixed]] = True
            seen[tail] = True
            present = np.flatnonzero(seen)
        sk_dtype = np.int16 if len(present) < 32_000 else np.int32
        lut = np.full(int(present[-1]) + 1, NO, sk_dtype)
        lut[present] = np.arange(len(present))
        sk = np.empty(self.n, sk_dtype)
        sk_blocks = sk[:full].reshape(-1, _KEY_BLOCK)
        sk_blocks[...] = lut[low][:, None]
        sk_blocks[mixed] = lut[blocks[mixed]]
        sk[full:] = lut[tail]
        return sk, present // width, present % width - 1

    @property
    def sk(self) -> np.ndarray:
        return self._sched_keys[0]

    @once_property
    def sk_names(self) -> pd.DataFrame:
        """One row per scheduler key: instance, dp_rank (NA when null)."""
        _, inst_of, dp_of = self._sched_keys
        names = self.codes("instance")[1]
        return pd.DataFrame({
            "instance": [names[i] for i in inst_of],
            "dp_rank": pd.array([None if d < 0 else int(d) for d in dp_of], dtype="Int16"),
        })

    @once_property
    def _request_keys(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rk per row, scheduler key per request key, req code per request key, lifetime per request key)."""
        rk, key_sk, key_req = self._id_keys()
        return (rk, key_sk, key_req, np.zeros(len(key_sk), np.int64)) if self.n == 0 else \
            _split_lifetimes(rk, key_sk, key_req, self)

    def _id_keys(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(key per row, scheduler key per key, req code per key) of the (instance, dp_rank, req) ids."""
        req, _ = self.codes("req")
        if self.n == 0:
            return np.empty(0, np.int32), np.empty(0, np.int64), np.empty(0, np.int64)
        width = int(req.max()) + 1
        if len(self._sched_keys[1]) == 1 and width < 2**31 - 1:
            # one scheduler (an instance's partition or window): a request key is its req code where every code
            # is used, as the reader's codes are (numbered by first appearance): one cast, no combined key and
            # lookup table (`_request_keys` of a 5M-row window: 0.03 s against 0.045 s)
            seen = np.zeros(width + 1, bool)
            seen[req] = True  # a null (-1) marks the extra slot
            if seen[:width].all():
                return req.astype(np.int32), np.zeros(width, np.int64), np.arange(width, dtype=np.int64)
        has = req >= 0
        space = (int(self.sk.max()) + 1) * width
        if space < 2**31 - 1:
            # dense key space: int32 arithmetic, one scatter of the keys seen and a lookup table instead of hashing
            # every row; rows without a req map to the extra slot `space`, which the table maps to NO
            combined = np.multiply(self.sk, np.int32(width), dtype=np.int32)
            combined += req
            combined[~has] = space
            seen = np.zeros(space + 1, bool)
            seen[combined] = True
            present = np.flatnonzero(seen[:space])
            lut = np.full(space + 1, NO, np.int32)
            lut[present] = np.arange(len(present), dtype=np.int32)
            # the keys replace the combined values in place, a slice at a time: no second 10M-row array
            for start in range(0, self.n, _IN_PLACE_SLICE):
                piece = combined[start:start + _IN_PLACE_SLICE]
                piece[...] = lut[piece]
            rk = combined
            del lut
        else:
            combined = self.sk.astype(np.int64) * width + req
            rk = np.full(self.n, NO, np.int32)
            codes, present = pd.factorize(combined[has], sort=False)
            rk[has] = codes
            present = np.asarray(present, np.int64)
        return rk, present // width, present % width

    @property
    def rk(self) -> np.ndarray:
        return self._request_keys[0]

    @once_property
    def request_sk(self) -> np.ndarray:
        """The scheduler key of each request key, int32 (`rk_names["sk"]` without building the names)."""
        return self._request_keys[1].astype(np.int32)

    @property
    def request_req(self) -> np.ndarray:
        """The `req` code (of `codes("req")`) of each request key."""
        return self._request_keys[2]

    @property
    def request_lifetime(self) -> np.ndarray:
        """The lifetime ordinal of each request key: 0 for an id's first lifetime, 1 for the request that reused the
        id after it, ..."""
        return self._request_keys[3]

    @property
    def n_requests(self) -> int:
        return len(self._request_keys[1])

    @once_property
    def sk_role(self) -> list[str]:
        """The role of each scheduler key (from the first row of that scheduler)."""
        role_codes, role_names = self.codes("role")
        sk = self.sk
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]]) if self.n else np.empty(0, np.int64)
        first = np.full(len(self.sk_names), NO, np.int64)
        first[sk[starts][::-1]] = starts[::-1]
        return [role_names[role_codes[r]] if r >= 0 and role_codes[r] >= 0 else "none" for r in first.tolist()]

    @once_property
    def rk_names(self) -> pd.DataFrame:
        """One row per request key: instance, dp_rank, req, role (its scheduler's), sk, lifetime."""
        _, key_sk, key_req, key_life = self._request_keys
        _, req_names = self.codes("req")
        out = self.sk_names.iloc[key_sk].reset_index(drop=True)
        names = np.asarray(req_names, dtype=object)
        out["req"] = names[key_req] if len(key_req) else np.empty(0, object)
        roles = np.asarray(self.sk_role, dtype=object)
        out["role"] = roles[key_sk] if len(key_sk) else np.empty(0, object)
        out["sk"] = self.request_sk
        out["lifetime"] = key_life
        return out

    @once_property
    def block_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The `blocks` column flattened: (row of each block, block id), read from the list offsets with numpy."""
        col = self.table.column("blocks")
        rows_parts, id_parts = [], []
        base = 0
        for arr in col.chunks:
            n, off = len(arr), arr.offset
            offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=off + n + 1)[off:]
            lengths = np.diff(offsets)
            if arr.null_count:  # a null list may still span values in theory; count none for it
                valid = _bits(arr.buffers()[0], off, n)
                lengths = np.where(valid, lengths, 0)
            else:
                valid = None
            child = arr.values
            vals = np.frombuffer(child.buffers()[1], dtype=np.int32, count=child.offset + len(child))[child.offset:]
            start = offsets[:-1]
            if valid is None or int(lengths.sum()) == int(offsets[-1] - offsets[0]):
                # no null list spans values (what writers give): the values are the rows' blocks, in order
                ids = vals[offsets[0]:offsets[-1]]
            else:
                take = np.repeat(start - offsets[0], lengths) + _ramp(lengths)
                ids = vals[offsets[0]:offsets[-1]][take]
            filled = np.flatnonzero(lengths)  # only rows that hold blocks: no arange over every row
            rows_parts.append(np.repeat(filled + base, lengths[filled]))
            id_parts.append(np.array(ids, dtype=np.int32))
            base += n
        if not rows_parts:
            return np.empty(0, np.int64), np.empty(0, np.int32)
        return np.concatenate(rows_parts), np.concatenate(id_parts)

    def flat_blocks(self, rows_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, block) pairs of the rows selected by a boolean mask, in row order."""
        rows, ids = self.block_rows
        keep = rows_mask[rows]
        return rows[keep], ids[keep]

    def details(self, rows: np.ndarray) -> list[dict[str, Any]]:
        """`Trace.details`: the parsed `detail` JSON of these rows ({} where null or not an object)."""
        return parse_details(self.table.column("detail"), rows)


def _split_lifetimes(rk: np.ndarray, key_sk: np.ndarray, key_req: np.ndarray,
                     cols: Columns) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Request keys per lifetime: a request's lifetime ends with it (its final free follows its `req_finish`), and a
    later `req_add` of the same id on the same scheduler starts a new request (clients reuse ids; vLLM's own tests
    call `create_requests` twice). Rule: an id's `req_add` starts a new lifetime when a `req_finish` of that id came
    after its previous `req_add` (or, for its first `req_add`, anywhere before it). Each row goes to the lifetime
    that had begun at its position, so a late event of the old request after the new `req_add` counts for the new
    one (the trace cannot tell them apart).

    Only ids with two or more `req_add` rows, or one after a `req_finish` of the id (a window that starts while the
    id's earlier request was alive), are looked at (none in most traces: then the keys are returned as they are, and
    nothing else is computed): their rows are sorted by (key, position) and the finishes counted with one
    cumulative sum; the new keys number each id's lifetimes in order (key_sk and key_req repeated per lifetime)."""
    n_ids = len(key_sk)
    # one comparison of the kind codes (not `rows_of`: its kind split would then sit on the path of every table
    # that waits for the request keys)
    adds = np.flatnonzero(cols.codes("kind")[0] == cols.code_of("kind", "req_add"))
    adds = adds[rk[adds] >= 0]
    per_id = np.bincount(rk[adds], minlength=n_ids) if len(adds) else np.zeros(n_ids, np.int64)
    reused = per_id > 1
    if len(adds):
        # an id finished before its only req_add: a window of the run (pdtrace.analysis.history) that starts while
        # the id's earlier request was still alive
        finish = np.flatnonzero(cols.codes("kind")[0] == cols.code_of("kind", "req_finish"))
        finish = finish[rk[finish] >= 0]
        if len(finish):
            first_add = np.full(n_ids, np.iinfo(np.int64).max, np.int64)
            np.minimum.at(first_add, rk[adds], cols.pos[adds])
            first_finish = np.full(n_ids, np.iinfo(np.int64).max, np.int64)
            np.minimum.at(first_finish, rk[finish], cols.pos[finish])
            reused |= (per_id == 1) & (first_finish < first_add)
    if not reused.any():
        return rk, key_sk, key_req, np.zeros(n_ids, np.int64)
    # the rows of the ids added more than once, in (id, position) order
    rows = np.flatnonzero(reused[np.maximum(rk, 0)] & (rk >= 0))
    pos = cols.pos[rows]
    order = order_by_key(rk[rows], pos)
    rows = rows[order]
    ids = rk[rows].astype(np.int64)
    kind_codes, _ = cols.codes("kind")
    is_add = kind_codes[rows] == cols.code_of("kind", "req_add")
    finishes = np.cumsum(kind_codes[rows] == cols.code_of("kind", "req_finish"))  # inclusive, over all ids
    first_of_id = np.r_[True, ids[1:] != ids[:-1]]
    # finishes before each id's first row (the cumulative count is global: subtract it per id)
    before_id = np.maximum.accumulate(np.where(first_of_id, np.arange(len(rows)), 0))
    base = finishes[before_id] - (kind_codes[rows[before_id]] == cols.code_of("kind", "req_finish"))
    add_idx = np.flatnonzero(is_add)
    seen = finishes[add_idx] - base[add_idx]  # finishes of the id before this add (an add is no finish)
    prev = np.r_[0, seen[:-1]]
    prev[np.r_[True, ids[add_idx][1:] != ids[add_idx][:-1]]] = 0  # an id's first add compares with its start
    starts = np.zeros(len(rows), np.int64)
    starts[add_idx[seen > prev]] = 1
    running = np.cumsum(starts)
    life = running - (running[before_id] - starts[before_id])  # lifetime ordinal of each row within its id
    n_life = np.ones(n_ids, np.int64)
    np.maximum.at(n_life, ids, life + 1)
    first_key = np.r_[0, np.cumsum(n_life)[:-1]]
    new_rk = np.where(rk >= 0, first_key[np.maximum(rk, 0)], NO).astype(np.int32)
    new_rk[rows] += life.astype(np.int32)
    lifetime = np.arange(int(n_life.sum()), dtype=np.int64) - np.repeat(first_key, n_life)
    return new_rk, np.repeat(key_sk, n_life), np.repeat(key_req, n_life), lifetime


def columns(ctx: Any) -> Columns:
    """The shared Columns of an AnalysisContext."""
    return ctx.cached("columns", lambda: Columns(ctx.trace))


@shared_table(cost=0.08)
def positions(ctx: Any) -> np.ndarray:
    """`Columns.pos`: every row's rank in the global order (one stable sort of ts_ns)."""
    return columns(ctx).pos


@shared_table(cost=0.14)
def request_keys(ctx: Any) -> np.ndarray:
    """`Columns.rk`: the request key of every row (-1 where none)."""
    return columns(ctx).rk


@shared_table(cost=0.03)
def block_lists(ctx: Any) -> tuple[np.ndarray, np.ndarray]:
    """`Columns.block_rows`: the `blocks` column flattened to (row, block id) pairs."""
    return columns(ctx).block_rows


def _reduce_per_key(reduce: np.ufunc, keys: np.ndarray, values: np.ndarray, n_keys: int, fill: int) -> np.ndarray:
    values = np.asarray(values)
    # ufunc.at has a fast path only when the values already have the output's type: int32 values (positions,
    # steps) are reduced in int32 unless one of them is the sentinel, int64 otherwise; the result is int64
    dtype = np.dtype(np.int32) if values.dtype == np.int32 else np.dtype(np.int64)
    info = np.iinfo(dtype)
    empty = info.max if reduce is np.minimum else info.min
    if dtype == np.int32 and len(values) and (values == empty).any():
        dtype, empty = np.dtype(np.int64), (np.iinfo(np.int64).max if reduce is np.minimum else np.iinfo(np.int64).min)
    out = np.full(n_keys, empty, dtype)
    if len(keys):
        reduce.at(out, keys, values.astype(dtype, copy=False))
    missing = out == empty
    out = out.astype(np.int64, copy=False)
    out[missing] = fill
    return out


def first_per_key(keys: np.ndarray, values: np.ndarray, n_keys: int, fill: int = NO) -> np.ndarray:
    """Minimum of `values` per key (keys in [0, n_keys)), int64; `fill` where a key has none. One `np.minimum.at`
    (in int32 for int32 values)."""
    return _reduce_per_key(np.minimum, keys, values, n_keys, fill)


def last_per_key(keys: np.ndarray, values: np.ndarray, n_keys: int, fill: int = NO) -> np.ndarray:
    """Maximum of `values` per key, int64; `fill` where a key has none. One `np.maximum.at`."""
    return _reduce_per_key(np.maximum, keys, values, n_keys, fill)


def _search_by_key(key_a: np.ndarray, pos_a: np.ndarray, key_b: np.ndarray, pos_b: np.ndarray, shift_a: int,
                   side: str, step: int) -> np.ndarray:
    """For each a: the index into b found by searching (key_a, pos_a + shift_a) among the sorted (key_b, pos_b)
    with `side`, moved by `step`, kept only where that b has a's key; else -1. Keys and positions are combined
    into one int64 (key * span + pos): one stable argsort of b and one searchsorted of a."""
    if len(key_b) == 0 or len(key_a) == 0:
        return np.full(len(key_a), NO, np.int64)
    span = int(max(pos_a.max(), pos_b.max())) + 2
    cb = key_b.astype(np.int64) * span + pos_b
    sort_b = np.argsort(cb, kind="stable")
    ca = key_a.astype(np.int64) * span + pos_a + shift_a
    idx = np.searchsorted(cb[sort_b], ca, side=side) + step
    found = np.full(len(key_a), NO, np.int64)
    hit = np.flatnonzero((idx >= 0) & (idx < len(sort_b)))
    same = key_b[sort_b[idx[hit]]] == key_a[hit]
    found[hit[same]] = sort_b[idx[hit[same]]]
    return found


def lookup(keys_sorted: np.ndarray, values: np.ndarray, query: np.ndarray, fill: int | float) -> np.ndarray:
    """values[i] where keys_sorted[i] == query, else fill (keys_sorted ascending, distinct). The one exact-key
    lookup of the analyses (`steps.lookup` and `rulekit.StepIndex` call it)."""
    if len(keys_sorted) == 0 or len(query) == 0:
        return np.full(len(query), fill, dtype=np.result_type(values.dtype, type(fill)))
    idx = np.minimum(np.searchsorted(keys_sorted, query), len(keys_sorted) - 1)
    return np.where(keys_sorted[idx] == query, values[idx], fill)


def next_at_or_after(key_a: np.ndarray, pos_a: np.ndarray, key_b: np.ndarray, pos_b: np.ndarray,
                     strict: bool = False) -> np.ndarray:
    """For each a: the index into b of the first b with the same key and pos_b >= pos_a (> if strict), else -1."""
    return _search_by_key(key_a, pos_a, key_b, pos_b, 1 if strict else 0, "left", 0)


def last_before(key_a: np.ndarray, pos_a: np.ndarray, key_b: np.ndarray, pos_b: np.ndarray,
                strict: bool = True) -> np.ndarray:
    """For each a: the index into b of the last b with the same key and pos_b < pos_a (<= if not strict), else -1."""
    return _search_by_key(key_a, pos_a, key_b, pos_b, 0, "left" if strict else "right", -1)
