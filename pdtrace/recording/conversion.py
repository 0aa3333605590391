"""The recorder's Arrow conversion and part files: buffered rows -> a table of `pdtrace.format.SCHEMA` -> one
zstd Parquet part file, written atomically and numbered per writer.

What the recording process's writer thread runs in-process, and what the writer process (`writer_process.serve`)
runs on each batch it receives, so both write the same files; `pdtrace.recording.recorder` says how rows are
buffered (ROW_WIDTH slots per row in one flat list) and why the conversion works column by column.

Recording path: imports only the standard library, pyarrow and pdtrace.format.
"""

from __future__ import annotations

import array
import gc
import itertools
import json
import operator
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pdtrace import __version__
from pdtrace.format import DICTIONARY_COLUMNS, SCHEMA, file_metadata

__all__ = ["ROW_WIDTH", "rows_to_table", "flat_rows_to_table", "write_part", "write_rows", "holds_bytes",
           "warm_up_pyarrow", "PARQUET_DICTIONARY_COLUMNS"]

PartWriter = Callable[[pa.Table, Path], None]

#: Columns written with Parquet dictionary encoding: the format's dictionary columns plus the repetitive `req`.
PARQUET_DICTIONARY_COLUMNS: list[str] = [*DICTIONARY_COLUMNS, "req"]

#: Slots per event in the recorder's flat buffer: `Channel.emit` adds (ts_ns, channel id, kind, step, req, blocks,
#: n, reason, status, delay_free, deferred, detail) as ROW_WIDTH consecutive slots of one list (the module docstring
#: says why), so row i is `buffer[i * ROW_WIDTH:(i + 1) * ROW_WIDTH]` and column c is `buffer[c::ROW_WIDTH]`.
ROW_WIDTH = 12
_TS = 0
_BLOCKS = 5


#: The marker of a batch entry (`Channel.emit_many`): in the blocks slot, with a list of requests in req and a
#: list of n (or None) in n, or (`Channel.emit_counts`) a dict request -> n in req and None in n; it stands for one
#: row per request. `...` because marshal carries it to the writer process as itself (the writer finds batch
#: entries by identity), and no hook passes `...` as blocks.
_BATCH = Ellipsis

_DICT_TYPE = pa.dictionary(pa.int32(), pa.string())
_LIST_TYPE = pa.list_(pa.int32())
_encode_json = json.JSONEncoder(separators=(",", ":"), default=str).encode


try:  # json's C encoder built once: JSONEncoder.encode builds one per call, half the cost of a small dict
    from json.encoder import c_make_encoder as _c_make_encoder
    from json.encoder import encode_basestring_ascii as _encode_basestring_ascii

    _C_ENCODE = (_c_make_encoder(None, str, _encode_basestring_ascii, None, ":", ",", False, False, True)
                 if _c_make_encoder is not None else None)
except (ImportError, TypeError):  # another Python's json: the public path
    _C_ENCODE = None


def _encode_detail(detail: Any) -> str:
    """JSON text of a detail (what json.dumps with compact separators and default=str gives); an object json
    cannot encode (a circular dict, odd keys) still gives one."""
    try:
        if _C_ENCODE is not None:
            return "".join(_C_ENCODE(detail, 0))
        return _encode_json(detail)
    except Exception:
        return _encode_json({"unencodable": repr(detail)[:200]})

def _write_parquet(table: pa.Table, where: Any) -> None:
    """The part files' Parquet settings: zstd, dictionary pages for the dictionary columns and `req`."""
    pq.write_table(table, where, compression="zstd", use_dictionary=PARQUET_DICTIONARY_COLUMNS)


def warm_up_pyarrow() -> None:
    """The in-memory conversion and Parquet write of `warm_up` (the writer process runs it as it starts)."""
    try:
        flat: list[Any] = [0, 0, "blocks_free", 1, "r0", [1, 2], 2, "finished", "RUNNING", False, True, {"fence": 1},
                           0, 0, "req_sched", 1, ["r0", "r1"], _BATCH, [1, 2], None, None, None, None, None]
        for i in range(70):
            flat += (i, 0, "sched", i, None, None, None, None, None, None, None, None)
        table = flat_rows_to_table(flat, 0, [("scheduler", 0, None, None)], "warm-up", "both", 0)
        _write_parquet(table.replace_schema_metadata(file_metadata(__version__, "warm-up", 0)),
                       pa.BufferOutputStream())
    except Exception:  # only a speed-up: the first part file pays instead
        pass


def write_part(table: pa.Table, path: Path) -> None:
    """Write one part file atomically: to `.<name>.tmp` beside it (skipped by Parquet readers), then give it its
    name. A hard link never replaces an existing file: a name already taken raises FileExistsError (the recorder
    then takes the next number); on filesystems without hard links it falls back to a rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        _write_parquet(table, temporary)
        try:
            os.link(temporary, path)
        except FileExistsError:
            raise
        except OSError:
            os.replace(temporary, path)
        else:
            os.unlink(temporary)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def write_rows(flat: list[Any], seq_start: int, channels: list[tuple[str, Any, Any, Any]], instance: str,
               role: str, pid: int, source: str, dropped: int, writer_key: tuple[str, str, int], folder: str,
               part_writer: PartWriter | None = None, metadata: Mapping[str, str] | None = None) -> int:
    """Convert one batch of buffered rows (a flat buffer: ROW_WIDTH slots per row) and write it as the writer's next
    part file (`<folder>/part-NNNNNN.parquet`, numbered per `writer_key`, after any part already there). What the
    recorder's writer thread does in-process, and what the writer process does with each message (`encode_batch`
    packs these arguments). `metadata`: more file metadata keys (a flight dump's window). Returns the number of rows
    written. Raises on failure."""
    table = flat_rows_to_table(flat, seq_start, channels, instance, role, pid)
    del flat
    meta = file_metadata(__version__, source, dropped)
    if metadata:
        meta.update({str(key).encode(): str(value).encode() for key, value in metadata.items()})
    table = table.replace_schema_metadata(meta)
    write = part_writer or write_part
    directory = Path(folder)
    key = (writer_key[0], writer_key[1], int(writer_key[2]))
    for _ in range(1000):
        try:
            write(table, directory / f"part-{_claim_part(key, directory):06d}.parquet")
            return table.num_rows
        except FileExistsError:  # another writer took this number (a reused pid folder): take the next
            continue
    raise FileExistsError(f"no free part number in {folder}")



# ---- part numbers and seq, per writer (directory, instance, pid) -------------------------------------------------

# Per writer (directory, instance, pid): [next seq, next part number or None until the folder is scanned].
_writer_ids: dict[tuple[str, str, int], list[Any]] = {}
_writer_ids_lock = threading.Lock()


def _claim_seq(key: tuple[str, str, int], count: int) -> int:
    """The first of `count` consecutive seq numbers of this writer."""
    with _writer_ids_lock:
        ids = _writer_ids.setdefault(key, [0, None])
        start = ids[0]
        ids[0] += count
        return start


def _claim_part(key: tuple[str, str, int], folder: Path) -> int:
    """The next part number of this writer (after any part already in its folder: a reused pid)."""
    with _writer_ids_lock:
        ids = _writer_ids.setdefault(key, [0, None])
        if ids[1] is None:
            folder.mkdir(parents=True, exist_ok=True)
            existing = [int(p.name[5:11]) for p in folder.glob("part-*.parquet") if p.name[5:11].isdigit()]
            ids[1] = max(existing, default=-1) + 1
        index = ids[1]
        ids[1] += 1
        return index


_CONTAINERS = (tuple, list, dict)



def holds_bytes(rows: list[Any]) -> bool:
    """Whether any value in the rows (a flat buffer, or any list), at any depth, is bytes: what marshal made of a
    buffer-protocol object. Level by level with C-level iteration (type() of every value, then the containers'
    contents). Deeper than
    `_HOLDS_BYTES_DEPTH` (a circular detail) counts as holding bytes: the sanitised copy has no such nesting."""
    level: list[Any] = [rows]
    for _ in range(_HOLDS_BYTES_DEPTH):
        if not level:
            return False
        types = set(map(type, level))
        if bytes in types:
            return True
        inner: list[Iterable[Any]] = []
        for container in _CONTAINERS:
            if container in types:
                found = list(itertools.compress(level, map(operator.is_, map(type, level),
                                                          itertools.repeat(container))))
                inner.append(itertools.chain.from_iterable(found))
                if container is dict:
                    inner.append(itertools.chain.from_iterable(map(dict.values, found)))
        level = list(itertools.chain.from_iterable(inner))
    return bool(level)


_HOLDS_BYTES_DEPTH = 64


# ---- conversion: buffered rows -> Arrow table ----------------------------------------------------------------------
#
# Columns are built with `pa.Array.from_buffers` over `array.array` / `bytes` buffers filled by C-level iteration
# (map, itertools, dict lookups), never with `pa.array(python_list)` or `pa.scalar`: those ask pyarrow's pandas shim
# whether the input is a pandas object, which imports pandas (about half a second holding the GIL, tens of MB) into
# every recording process. It is also several times faster than `pa.array` for ns timestamps.

_NONE_TO_ZERO = {None: 0}
_NONES = itertools.repeat(None)
_ZEROS = itertools.repeat(0)


def _u8(data: bytes) -> pa.Array:
    return pa.Array.from_buffers(pa.uint8(), len(data), [None, pa.py_buffer(data)])


def _validity_by_identity(values: Sequence[Any]) -> tuple[pa.Buffer | None, int]:
    """(validity bitmap or None, null count) of a column whose nulls are None, comparing by identity: for columns
    that may hold objects whose `== None` is not a bool (numpy arrays of block ids), where `tuple.count` fails."""
    is_null = bytes(map(operator.is_, values, _NONES))
    nulls = is_null.count(1)
    if nulls == 0:
        return None, 0
    return pc.equal(_u8(is_null), _repeat(pa.uint8(), "B", 0, len(values))).buffers()[1], nulls


_NULL_SENTINEL = {"q": -(2**63), "h": -(2**15)}  # stands for None in an integer buffer (then masked out)
_NONE_TO_SENTINEL = {code: {None: value} for code, value in _NULL_SENTINEL.items()}
_BOOL_CODES = {None: 2, True: 1, False: 0}


def _scatter(values: Sequence[Any], build: Callable[[tuple], pa.Array], arrow_type: pa.DataType) -> pa.Array:
    """A mostly-null column: build only its values (`build` on the non-None ones), then put them in place with one
    vectorised `replace_with_mask` (cheaper than a per-row pass of the dense builders over the None rows)."""
    present = bytes(map(operator.is_not, values, _NONES))
    built = build(tuple(itertools.compress(values, present)))
    mask = pc.cast(_u8(present), pa.bool_())
    if isinstance(built, pa.DictionaryArray):
        indices = pc.replace_with_mask(pa.nulls(len(values), pa.int32()), mask, built.indices)
        return pa.DictionaryArray.from_arrays(indices, built.dictionary)
    return pc.replace_with_mask(pa.nulls(len(values), arrow_type), mask, built)


def _mostly_null(nulls: int, count: int) -> bool:
    return nulls * 2 > count and count >= 64


def _masked(arrow_type: pa.DataType, data: array.array, valid: pa.Array, nulls: int) -> pa.Array:
    """`data` as an array of `arrow_type` whose validity is the boolean array `valid`."""
    return pa.Array.from_buffers(arrow_type, len(data), [valid.buffers()[1], pa.py_buffer(data)], null_count=nulls)


def _repeat(arrow_type: pa.DataType, code: str, value: int, length: int) -> pa.Array:
    return pa.Array.from_buffers(arrow_type, length, [None, pa.py_buffer(array.array(code, [value]) * length)])


_Builder = Callable[..., pa.Array]


def _nullable(arrow_type_of: Callable[..., pa.DataType]) -> Callable[[_Builder], _Builder]:
    """The null handling every column builder shares. `dense(values, count, nulls, *args)` builds a column with
    some values; the decorated builder `(values, *args)` returns `pa.nulls` for an all-null column and, for a
    mostly-null one, builds only its values and scatters them (`_scatter`). `arrow_type_of(*args)` is the type."""

    def wrap(dense: _Builder) -> _Builder:
        def build(values: Sequence[Any], *args: Any) -> pa.Array:
            count = len(values)
            nulls = values.count(None)
            if nulls == count:
                return pa.nulls(count, arrow_type_of(*args))
            if _mostly_null(nulls, count):
                return _scatter(values, lambda present: build(present, *args), arrow_type_of(*args))
            return dense(values, count, nulls, *args)

        build.__doc__, build.__name__ = dense.__doc__, dense.__name__
        return build

    return wrap


@_nullable(lambda arrow_type, code: arrow_type)
def _int_column(values: Sequence[Any], count: int, nulls: int, arrow_type: pa.DataType, code: str) -> pa.Array:
    """A nullable integer column (`code`: the array.array type code of `arrow_type`). None becomes a sentinel in
    one C-level pass, and the validity is one vectorised comparison with it."""
    try:
        if not nulls:
            return pa.Array.from_buffers(arrow_type, count, [None, pa.py_buffer(array.array(code, values))])
        sentinel = _NULL_SENTINEL[code]
        data = array.array(code, map(_NONE_TO_SENTINEL[code].get, values, values))
    except (TypeError, ValueError, OverflowError):  # a float, a string, an out-of-range value from a hook
        return _int_column(tuple(map(_as_int, values, itertools.repeat(code))), arrow_type, code)
    plain = pa.Array.from_buffers(arrow_type, count, [None, pa.py_buffer(data)])
    valid = pc.not_equal(plain, _repeat(arrow_type, code, sentinel, count))
    if valid.false_count != nulls:  # a real value equal to the sentinel: take the validity from the Nones
        valid = pc.cast(_u8(bytes(map(operator.is_not, values, _NONES))), pa.bool_())
    return _masked(arrow_type, data, valid, nulls)


@_nullable(pa.bool_)
def _bool_column(values: Sequence[Any], count: int, nulls: int) -> pa.Array:
    """A nullable bool column: one code per row (False 0, True 1, None 2), then two vectorised comparisons."""
    try:
        codes = _u8(bytes(map(_BOOL_CODES.get, values, values)))
    except (TypeError, ValueError):  # truthy values that are not bools
        return _bool_column(tuple(None if v is None else bool(v) for v in values))
    bits = pc.equal(codes, _repeat(pa.uint8(), "B", 1, count)).buffers()[1]
    validity = pc.not_equal(codes, _repeat(pa.uint8(), "B", 2, count)).buffers()[1] if nulls else None
    return pa.Array.from_buffers(pa.bool_(), count, [validity, bits], null_count=nulls)


def _strings(values: list) -> pa.Array:
    """A non-null string array from a list of str."""
    encoded = [value.encode("utf-8", "replace") for value in values]
    offsets = array.array("i", itertools.accumulate(map(len, encoded), initial=0))
    return pa.Array.from_buffers(pa.string(), len(values),
                                 [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])


@_nullable(lambda: _DICT_TYPE)
def _dictionary_column(values: Sequence[Any], count: int, nulls: int) -> pa.DictionaryArray:
    """A nullable dictionary<int32, string> column: codes by one dict lookup per row, strings encoded once each."""
    try:
        codes = dict.fromkeys(values)
        codes.pop(None, None)
        distinct = list(codes)
        dictionary = _strings(distinct)
    except (TypeError, AttributeError):  # an unhashable or non-str value: use its str()
        return _dictionary_column(tuple(map(_as_str, values)))
    for code, value in enumerate(distinct):
        codes[value] = code
    codes[None] = -1  # a null slot (masked out below; Arrow ignores the index under a null)
    data = array.array("i", map(codes.__getitem__, values))
    if nulls:
        plain = pa.Array.from_buffers(pa.int32(), count, [None, pa.py_buffer(data)])
        indices = _masked(pa.int32(), data, pc.not_equal(plain, _repeat(pa.int32(), "i", -1, count)), nulls)
    else:
        indices = pa.Array.from_buffers(pa.int32(), count, [None, pa.py_buffer(data)])
    return pa.DictionaryArray.from_arrays(indices, dictionary)


@_nullable(pa.string)
def _string_column(values: Sequence[Any], count: int, nulls: int) -> pa.Array:
    """A nullable plain string column (through the dictionary path: repeated values are encoded once)."""
    encoded = _dictionary_column(values)
    return encoded.dictionary.take(encoded.indices)


def _blocks_column(values: Sequence[Any]) -> pa.Array:
    """A nullable list<int32> column from lists/tuples of block ids."""
    count = len(values)
    validity, nulls = _validity_by_identity(values)
    if nulls == count:
        return pa.nulls(count, _LIST_TYPE)
    try:
        offsets = array.array("i", itertools.accumulate(map(operator.length_hint, values, _ZEROS), initial=0))
        flat = array.array("i", itertools.chain.from_iterable(filter(None, values)))
        if len(flat) != offsets[-1]:
            raise ValueError("an iterator without a length")
    except (TypeError, ValueError, OverflowError):
        return _blocks_column(tuple(map(_as_blocks, values)))
    child = pa.Array.from_buffers(pa.int32(), len(flat), [None, pa.py_buffer(flat)])
    return pa.Array.from_buffers(_LIST_TYPE, count, [validity, pa.py_buffer(offsets)], null_count=nulls,
                                 children=[child])


def _as_int(value: Any, code: str = "q") -> int | None:
    """An int a column of type `code` can hold, or None."""
    try:
        number = None if value is None else int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if number is not None and not -_INT_LIMITS[code] <= number < _INT_LIMITS[code]:
        return None
    return number


_INT_LIMITS = {"q": 2**63, "i": 2**31, "h": 2**15}


def _as_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _as_blocks(value: Any) -> list[int] | None:
    try:
        blocks = None if value is None else [int(b) for b in value]
    except (TypeError, ValueError, OverflowError):
        return None
    if blocks is not None and not all(-(2**31) <= b < 2**31 for b in blocks):
        return None
    return blocks


def _constant_dictionary(value: str, length: int) -> pa.DictionaryArray:
    indices = pa.Array.from_buffers(pa.int32(), length, [None, pa.py_buffer(bytes(4 * length))])
    return pa.DictionaryArray.from_arrays(indices, _strings([value]))


def _int_buffer_column(arrow_type: pa.DataType, data: array.array) -> pa.Array:
    return pa.Array.from_buffers(arrow_type, len(data), [None, pa.py_buffer(data)])


def _spread_batches(req: Sequence[Any], n: Sequence[Any], blocks: Sequence[Any]
                    ) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any], pa.Array | None]:
    """The `emit_many` batch entries among the buffered entries, spread into one row per request without building
    a tuple per row: (req and n per row, blocks per entry with the markers nulled, and the entry index of each
    row, by which every other column, built per entry, is taken). The last is None when there is no batch."""
    at = list(itertools.compress(range(len(blocks)), map(operator.is_, blocks, itertools.repeat(_BATCH))))
    if not at:
        return req, n, blocks, None
    copies = [1] * len(blocks)
    req_parts: list[Iterable[Any]] = []
    n_parts: list[Iterable[Any]] = []
    previous = 0
    for i in at:
        reqs, ns = req[i], n[i]
        if reqs.__class__ is dict:  # emit_counts: request -> n
            reqs, ns = reqs.keys(), reqs.values()
        copies[i] = len(reqs)
        req_parts += (req[previous:i], reqs)
        n_parts += (n[previous:i], itertools.repeat(None, len(reqs)) if ns is None else ns)
        previous = i + 1
    req_parts.append(req[previous:])
    n_parts.append(n[previous:])
    blocks_list = list(blocks)
    for i in at:
        blocks_list[i] = None
    offsets = array.array("i", itertools.accumulate(copies, initial=0))
    rows = pa.ListArray.from_arrays(_int_buffer_column(pa.int32(), offsets), pa.nulls(offsets[-1]))
    return (tuple(itertools.chain.from_iterable(req_parts)), tuple(itertools.chain.from_iterable(n_parts)),
            tuple(blocks_list), rows.value_parent_indices())


def rows_to_table(rows: Iterable[tuple], seq_start: int, channels: list[tuple[str, Any, Any, Any]], instance: str,
                  role: str, pid: int) -> pa.Table:
    """Rows as tuples of ROW_WIDTH fields (in the order `Channel.emit` buffers them; an `emit_many` batch entry
    as one row) to a table with exactly `pdtrace.format.SCHEMA`: `flat_rows_to_table` of their fields, one after
    the other."""
    return flat_rows_to_table(list(itertools.chain.from_iterable(rows)), seq_start, channels, instance, role, pid)


def flat_rows_to_table(flat: list[Any], seq_start: int, channels: list[tuple[str, Any, Any, Any]], instance: str,
                       role: str, pid: int) -> pa.Table:
    """Buffered rows, as the recorder's flat buffer holds them (ROW_WIDTH slots per row, as `Channel.emit` and
    `Channel.emit_many` add them), to a table with exactly `pdtrace.format.SCHEMA`.

    seq_start: the seq of the first row (rows are numbered in order); channels: id -> (component, dp, pp, tp).
    Each column of the rows is one C-level slice, `flat[field::ROW_WIDTH]` (bench/recorder.py's mix, 7
    alternating rounds: 850 ns per row against 970 for `zip(*rows)` over a list of row tuples).
    Values of the wrong type are coerced (a numeric string, a numpy integer) or nulled; a row is never lost.
    A batch entry of `emit_many` becomes its rows in its place: `req` and `n` are read from its lists, every
    other column is built once per entry and repeated by one Arrow `take` (bench/engine_overhead.py's mix, 2/3
    req_sched rows: conversion 900 -> 510 ns of CPU per row, 21 600 rows).
    """
    if len(flat) % ROW_WIDTH:
        raise ValueError(f"a flat buffer of {len(flat)} slots is not whole rows of {ROW_WIDTH}")
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the conversions make many objects the GC would scan for nothing
    try:
        entries = len(flat) // ROW_WIDTH
        if entries == 0:
            return SCHEMA.empty_table()
        (ts, chan, kind, step, req, blocks, n, reason, status, delay_free, deferred, detail) = (
            flat[field::ROW_WIDTH] for field in range(ROW_WIDTH))
        req, n, blocks, spread = _spread_batches(req, n, blocks)
        count = entries if spread is None else len(spread)
        if count == 0:
            return SCHEMA.empty_table()

        if detail.count(None) != entries:  # JSON-encode dict details: a Python loop over those rows only
            for index in itertools.compress(range(entries), map(operator.is_not, detail, _NONES)):
                value = detail[index]
                if value.__class__ is not str:
                    detail[index] = _encode_detail(value)  # `detail` is this call's own slice
        try:
            ts_data = array.array("q", ts)
        except (TypeError, ValueError, OverflowError):  # a clock returning floats
            ts_data = array.array("q", [_as_int(t) or 0 for t in ts])

        # The channel columns by one take of the per-channel table, the per-entry columns spread to rows by one
        # take of their table: each pyarrow compute call lets the GIL go, and every time it does the writer
        # hands it to the engine loop and must wait to get it back (a forced switch, at least 5 ms of the
        # writer's time and a scheduling delay for the loop on a busy machine).
        channel_ids = _int_buffer_column(pa.int32(), array.array("i", chan))
        component = _dictionary_column(tuple(key[0] for key in channels))
        by_channel = pa.Table.from_arrays(
            [component.indices, *(_int_column(tuple(key[i] for key in channels), pa.int16(), "h") for i in (1, 2, 3))],
            names=["component", "dp_rank", "pp_rank", "tp_rank"]).take(channel_ids)
        per_entry = pa.Table.from_arrays(
            [_int_buffer_column(pa.int64(), ts_data), *by_channel.columns, _dictionary_column(kind),
             _int_column(step, pa.int64(), "q"), _blocks_column(blocks), _dictionary_column(reason),
             _dictionary_column(status), _bool_column(delay_free), _bool_column(deferred), _string_column(detail)],
            names=["ts_ns", "component", "dp_rank", "pp_rank", "tp_rank", "kind", "step", "blocks", "reason",
                   "status", "delay_free", "deferred", "detail"])
        if spread is not None:
            per_entry = per_entry.take(spread)
        column = per_entry.column
        arrays = [
            column("ts_ns"),
            _int_buffer_column(pa.int64(), array.array("q", range(seq_start, seq_start + count))),
            _constant_dictionary(instance, count),
            _constant_dictionary(role, count),
            _int_buffer_column(pa.int32(), array.array("i", [pid]) * count),
            pa.chunked_array([pa.DictionaryArray.from_arrays(chunk, component.dictionary)
                              for chunk in column("component").chunks], _DICT_TYPE),
            column("dp_rank"),
            column("pp_rank"),
            column("tp_rank"),
            column("kind"),
            column("step"),
            _string_column(req),
            column("blocks"),
            _int_column(n, pa.int64(), "q"),
            column("reason"),
            column("status"),
            column("delay_free"),
            column("deferred"),
            column("detail"),
        ]
        return pa.Table.from_arrays(arrays, schema=SCHEMA)
    finally:
        if gc_was_enabled:
            gc.enable()
