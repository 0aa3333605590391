"""Check event tables and Parquet part files against the trace format (pdtrace.format), naming the first violation.

Three levels, cheapest first, so that the reader can check every file of a 10M-event trace for almost nothing:

- `check_metadata(metadata, where)`: the Parquet key-value metadata (read from the footer). A missing or unknown
  `pdtrace.schema_version` is an error (this build reads `pdtrace.format.READABLE_SCHEMA_VERSIONS`); an unparsable
  `pdtrace.dropped_events` is only a note.
- `check_schema(schema, where)`: column names and Arrow types (from the footer). Every format column must be
  there. Accepted variants: dictionary columns and `req` may be plain or dictionary-encoded strings (any index
  width, `string` or `large_string` values); `detail` string or large_string; `blocks` a list or large_list of
  any integer type; integer columns any integer type (the reader casts them, safely, to the format's width);
  a nullable column may have Arrow's `null` type (all null, as some writers store a column they cannot type).
  Columns the format does not know are left alone (a newer minor format adds columns), with a note.
- `check_values(table, where, file_starts)`: non-null columns hold no null; `role`, `component` in their
  vocabularies; each known kind on a component `pdtrace.format.KINDS` allows for it (scheduler-side kinds on
  `scheduler`, engine-loop kinds on `engine`, worker kinds on `worker` or `connector`, recorder and optional kinds
  anywhere); `reason` in `pdtrace.format.REASONS` for the kinds listed there (null is allowed); `seq` strictly
  increasing within each writer's part file (`first_seq_violation`). Vectorised with pyarrow.compute and numpy:
  vocabulary checks look at the dictionaries (or `unique()`) first and only scan the rows to find the first
  offending one when something is wrong; `(kind, component, reason)` triples come from one hash group-by; the
  seq check is one comparison of each row with the previous one.

Why `seq` order is an error (exit 2) and not a warning: `seq` is the exact order of one writer's events, and a
writer writes its rows in that order, so a part file whose rows go backwards (or repeat a seq) was not written by
a conforming writer: rows spliced, duplicated or sorted by something else. The analyses order events by a stable
sort on `ts_ns` over load order, so such a file would be replayed silently in the wrong order wherever timestamps
tie or run backwards, and a finding drawn from a mis-ordered replay (a use after free, a double free) would be
wrong with nothing to say so. Refusing the trace, naming the file and row, is the honest answer; `validate=False`
still loads it for whoever wants to look.

What a writer is, for the seq check: one part file. The recorder writes `<instance>/<pid>/part-NNNNNN.parquet`
and numbers each file's rows consecutively, but two files of one (instance, pid) may legitimately restart or
interleave seq: a reused pid (a later process with the same pid continues the folder's part numbers, with seq from
0), and several recorders of one instance in one process, which share the seq counter but claim seq and part
numbers at different moments, so part order need not be seq order. So seq is only compared within a file, and
within a file only between adjacent rows of the same (instance, pid) (a table of several writers, like an
`EventBuilder` table, restarts at each writer change).

Event kinds the format does not know are NOT an error: the format is extended only by adding kinds, so a trace
from a newer pdtrace (or another engine's adapter) may carry kinds this build has never heard of. They are
reported as a note ("unknown event kinds ...") and the analyses ignore them. An unknown schema version, in
contrast, means the meaning of the columns may have changed, so that is an error.

Errors are `pdtrace.errors.TraceError` with one line naming the file (`where`), the row (counted from 0 within the
table or file), the column, what was expected and what was found. When a table has several violations, the one
reported is the one at the lowest row (ties: the column that comes first in the format).
"""

from __future__ import annotations

import os

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.errors import TraceError
from pdtrace.format import (
    COLUMNS,
    COMPONENTS,
    KINDS,
    META_DROPPED,
    META_WINDOW_START,
    META_SCHEMA_VERSION,
    META_SOURCE,
    META_VERSION,
    NON_NULL_COLUMNS,
    READABLE_SCHEMA_VERSIONS,
    REASONS,
    ROLES,
    SCHEMA,
)

#: Columns read as text: plain or dictionary-encoded strings are both fine.
_TEXT_COLUMNS = frozenset({"instance", "role", "component", "kind", "reason", "status", "req", "detail"})
_INTEGER_COLUMNS = frozenset(f.name for f in SCHEMA if pa.types.is_integer(f.type))
_BOOL_COLUMNS = frozenset(f.name for f in SCHEMA if pa.types.is_boolean(f.type))
_VOCABULARIES: dict[str, frozenset[str]] = {"role": ROLES, "component": COMPONENTS}


class TraceWarning(UserWarning):
    """Something in a trace that was tolerated: a skipped part file, unknown kinds, a bad manifest."""


def _describe(type_: pa.DataType) -> str:
    if pa.types.is_dictionary(type_):
        return f"dictionary<{type_.value_type}>"
    return str(type_)


def _is_string(type_: pa.DataType) -> bool:
    return pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_)


def type_accepted(column: str, type_: pa.DataType) -> bool:
    """Whether a column of this Arrow type can be read as the format's `column` (see the module docstring)."""
    if pa.types.is_null(type_):  # an all-null column from a writer that could not infer its type
        return SCHEMA.field(column).nullable
    if column in _TEXT_COLUMNS:
        if pa.types.is_dictionary(type_):
            return _is_string(type_.value_type)
        return _is_string(type_)
    if column in _INTEGER_COLUMNS:
        return pa.types.is_integer(type_)
    if column in _BOOL_COLUMNS:
        return pa.types.is_boolean(type_)
    if column == "blocks":
        return (pa.types.is_list(type_) or pa.types.is_large_list(type_)) and pa.types.is_integer(type_.value_type)
    return type_ == SCHEMA.field(column).type


def check_schema(schema: pa.Schema, where: str) -> list[str]:
    """Raise TraceError on the first missing column or unacceptable type (format order); return notes."""
    names = set(schema.names)
    for name in COLUMNS:
        expected = _describe(SCHEMA.field(name).type)
        if name not in names:
            raise TraceError(f"{where}: missing column '{name}' (expected {expected})")
        found = schema.field(name).type
        if not type_accepted(name, found):
            raise TraceError(f"{where}: column '{name}': expected {expected}, found {_describe(found)}")
    extra = [n for n in schema.names if n not in SCHEMA.names]
    if extra:
        return [f"{where}: columns unknown to this pdtrace ignored: {', '.join(extra)}"]
    return []


def _decode(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def file_info(metadata: Mapping[Any, Any] | None) -> dict[str, str | None]:
    """The pdtrace keys of a Parquet key-value metadata mapping (bytes or str keys), decoded; None where absent."""
    meta = {(_decode(k) or ""): _decode(v) for k, v in (metadata or {}).items()}
    return {
        "schema_version": meta.get(META_SCHEMA_VERSION),
        "pdtrace_version": meta.get(META_VERSION),
        "source": meta.get(META_SOURCE),
        "dropped_events": meta.get(META_DROPPED),
        "window_start_ns": meta.get(META_WINDOW_START),
    }


def check_metadata(metadata: Mapping[Any, Any] | None, where: str) -> tuple[dict[str, Any], list[str]]:
    """Check the pdtrace key-value metadata; return (schema_version, pdtrace_version, source, dropped_events as
    int) in a dict, and notes. Raises TraceError when the schema version is missing or unknown."""
    info = file_info(metadata)
    version = info["schema_version"]
    readable = ", ".join(sorted(READABLE_SCHEMA_VERSIONS))
    if version is None:
        raise TraceError(f"{where}: no '{META_SCHEMA_VERSION}' in the Parquet metadata: not a pdtrace trace file "
                         f"(expected schema version {readable})")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise TraceError(f"{where}: unknown trace schema version '{version}' ({META_SCHEMA_VERSION}); this "
                         f"pdtrace reads version {readable}: upgrade pdtrace")
    notes = []
    dropped_text = info["dropped_events"]
    try:
        dropped = int(dropped_text) if dropped_text is not None else 0
        if dropped < 0:
            raise ValueError
    except ValueError:
        notes.append(f"{where}: '{META_DROPPED}' is not a count ({dropped_text!r}); taken as 0")
        dropped = 0
    window_text = info["window_start_ns"]
    window_start = None
    if window_text is not None:
        try:
            window_start = int(window_text)
        except ValueError:
            notes.append(f"{where}: '{META_WINDOW_START}' is not a timestamp ({window_text!r}); ignored")
    return (
        {
            "schema_version": version,
            "pdtrace_version": info["pdtrace_version"] or "unknown",
            "source": info["source"] or "unknown",
            "dropped_events": dropped,
            "window_start_ns": window_start,
        },
        notes,
    )


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int | None:
    """Index of the first true value of a boolean array (nulls count as false), or None."""
    found = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if found is None or found < 0 else found


def _distinct_values(column: pa.ChunkedArray) -> list[Any]:
    """Candidate distinct values: the dictionaries' values for a dictionary column (cheap, possibly a superset of
    the values the rows use), else `unique()`."""
    if pa.types.is_dictionary(column.type):
        seen: set[Any] = set()
        for chunk in column.chunks:
            seen.update(chunk.dictionary.to_pylist())
        return list(seen)
    return pc.unique(column).to_pylist()


def _first_outside(column: pa.ChunkedArray, allowed: Iterable[str]) -> tuple[int, str] | None:
    """(row, value) of the first non-null value not in `allowed`, or None. Scans the rows only when a value that
    is not allowed is among the distinct values."""
    allowed = frozenset(allowed)
    if not any(v is not None and v not in allowed for v in _distinct_values(column)):
        return None
    outside = pc.invert(pc.is_in(column, value_set=pa.array(sorted(allowed), pa.string())))
    row = _first_true(pc.and_(outside, pc.is_valid(column)))
    if row is None:  # the bad value was only in an unused dictionary entry
        return None
    return row, column[row].as_py()


def _as_chunked(column: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray:
    return column if isinstance(column, pa.ChunkedArray) else pa.chunked_array([column])


def _allowed_text(values: Iterable[str], limit: int = 8) -> str:
    ordered = sorted(values)
    shown = ", ".join(ordered[:limit]) + (", ..." if len(ordered) > limit else "")
    return f"one of {shown}"


def first_seq_violation(table: pa.Table, where: str,
                        file_starts: Sequence[int] | None = None) -> tuple[int, str] | None:
    """The first row whose `seq` is not greater than the previous row's, within one writer's part file; (row,
    message), or None.

    `file_starts`: the rows where a new part file begins, when `table` is several files loaded one after another
    (seq may restart there); None when `table` is one file (or an in-memory table). A change of (instance, pid)
    between two rows is always a restart. Without `seq` in the table nothing is checked; without `instance` or
    `pid`, the rows of a file are taken as one writer's (which a part file is). Vectorised: each chunk's seq is
    compared with itself shifted by one (numpy, no copy); only the rows where seq does not increase, normally one
    per writer change, are then looked at further."""
    if "seq" not in table.column_names or table.num_rows < 2:
        return None
    seq = _as_chunked(table.column("seq"))
    if seq.null_count:  # a null seq is reported by the null check
        return None
    found: list[np.ndarray] = []
    offset = 0
    previous_last: Any = None
    for chunk in seq.chunks:
        if len(chunk) == 0:
            continue
        values = chunk.to_numpy()
        if previous_last is not None and values[0] <= previous_last:
            found.append(np.array([offset], dtype=np.int64))
        within = np.flatnonzero(values[1:] <= values[:-1])
        if within.size:
            found.append(within.astype(np.int64) + (offset + 1))
        previous_last = values[-1]
        offset += len(chunk)
    if not found:
        return None
    rows = np.concatenate(found)
    if file_starts is not None and len(file_starts):
        rows = rows[~np.isin(rows, np.asarray(file_starts, dtype=np.int64))]
    for name in ("instance", "pid"):
        if rows.size and name in table.column_names:
            column = _as_chunked(table.column(name))
            same = pc.fill_null(pc.equal(_rows_of(column, rows), _rows_of(column, rows - 1)), False)
            rows = rows[same.to_numpy(zero_copy_only=False)]
    if not rows.size:
        return None
    row = int(rows.min())
    value, previous = seq[row].as_py(), seq[row - 1].as_py()
    return row, (f"{where}: row {row}, column 'seq': expected more than {previous} (the previous row's seq: seq "
                 f"strictly increases within a writer's file), found {value}")


def _rows_of(column: pa.ChunkedArray, rows: np.ndarray) -> pa.Array:
    """The values of a chunked column at a few sorted rows (a dictionary column decoded), taken chunk by chunk:
    `ChunkedArray.take` first concatenates every chunk (5M-row window of 46 chunks: 8 ms a call against well under
    1 ms, 4 calls per window read; bench/long_trace.py)."""
    bounds = np.cumsum([0] + [len(c) for c in column.chunks])
    which = np.searchsorted(bounds, rows, side="right") - 1
    value_type = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    parts = []
    for i in np.unique(which).tolist():  # the chunks holding a row: few
        chunk = column.chunk(i).take(pa.array(rows[which == i] - bounds[i]))
        parts.append(chunk.cast(value_type) if chunk.type != value_type else chunk)
    return pa.concat_arrays(parts) if parts else pa.array([], value_type)


def check_values(table: pa.Table, where: str, file_starts: Sequence[int] | None = None,
                 check_seq: bool = True) -> list[str]:
    """Check the values of the format columns present in `table`; raise TraceError naming the first violation
    (lowest row), return notes (unknown kinds). Columns missing from `table` are not checked (a projection).

    `file_starts`: see `first_seq_violation` (None: `table` is one file). `check_seq=False` leaves the seq order
    out, for a table of several files whose boundaries are not known (the reader then checks it otherwise)."""
    names = set(table.column_names)
    order = {name: i for i, name in enumerate(COLUMNS)}
    violations: list[tuple[int, int, str]] = []  # (row, column order, message)

    for name in NON_NULL_COLUMNS:
        if name in names and table.column(name).null_count:
            row = _first_true(pc.is_null(table.column(name)))
            if row is not None:
                violations.append((row, order[name], f"{where}: row {row}, column '{name}': expected a value, "
                                                      "found null"))

    for name, vocabulary in _VOCABULARIES.items():
        if name in names:
            bad = _first_outside(_as_chunked(table.column(name)), vocabulary)
            if bad is not None:
                row, value = bad
                violations.append((row, order[name], f"{where}: row {row}, column '{name}': expected "
                                                     f"{_allowed_text(vocabulary)}, found {value!r}"))

    if "kind" in names and ("component" in names or "reason" in names):
        violations.extend(_pairing_violations(table, where, order))

    if check_seq:
        violation = first_seq_violation(table, where, file_starts)
        if violation is not None:
            violations.append((violation[0], order["seq"], violation[1]))

    if violations:
        raise TraceError(min(violations)[2])

    notes = []
    if "kind" in names:
        kind = _as_chunked(table.column("kind"))
        candidates = [v for v in _distinct_values(kind) if v is not None and v not in KINDS]
        if candidates:
            counts = pc.value_counts(kind.combine_chunks() if pa.types.is_dictionary(kind.type) else kind)
            unknown = {c["values"]: c["counts"] for c in counts.to_pylist() if c["values"] in candidates}
            if unknown:
                listed = ", ".join(f"'{k}' ({n} rows)" for k, n in sorted(unknown.items()))
                notes.append(f"{where}: event kinds unknown to this pdtrace, ignored by the analyses: {listed}")
    return notes


#: `_distinct_rows` counts codes over the product of the dictionaries' sizes up to this many (else a hash group-by).
_DENSE_PRODUCT = 1 << 20


def _distinct_rows(triples: pa.Table, keys: list[str]) -> list[dict[str, Any]]:
    """The distinct rows of `triples` over `keys`, as `group_by(keys).aggregate([]).to_pylist()` gives them (in
    another order). Dictionary columns of one dictionary each (`unify_dictionaries`) with a small product of sizes
    (kinds x components x reasons: a few thousand): one int32 code per row from the indices (a null is one more
    index), a scatter of the codes, and only the codes present decoded; 5M rows, CPU 0.03 s against 0.08 s for
    Arrow's hash group-by (bench/long_trace.py: every window of a long trace is validated). Else that group-by."""
    columns = [triples.column(name) for name in keys]
    if triples.num_rows == 0 or not all(pa.types.is_dictionary(c.type) and c.num_chunks for c in columns):
        return triples.group_by(keys).aggregate([]).to_pylist()
    dictionaries = [c.chunk(0).dictionary for c in columns]
    sizes = [len(d) + 1 for d in dictionaries]  # the last index of each: null
    if int(np.prod(sizes, dtype=np.float64)) > _DENSE_PRODUCT or any(
            not chunk.dictionary.equals(d) for c, d in zip(columns, dictionaries) for chunk in c.chunks[1:]) or len(
            {tuple(len(chunk) for chunk in c.chunks) for c in columns}) != 1:  # the columns chunked alike
        return triples.group_by(keys).aggregate([]).to_pylist()
    code = np.zeros(triples.num_rows, np.int32)  # < _DENSE_PRODUCT
    start = 0
    for i in range(columns[0].num_chunks):  # chunk by chunk: the temporaries stay small
        n = len(columns[0].chunk(i))
        piece = code[start:start + n]
        for column, size in zip(columns, sizes):
            indices = column.chunk(i).indices
            if indices.null_count:
                indices = pc.fill_null(indices, size - 1)
            piece *= size
            piece += indices.to_numpy(zero_copy_only=False)
        start += n
    seen = np.zeros(int(np.prod(sizes)), bool)
    seen[code] = True  # a scatter: bincount would copy the codes to int64 first
    present = np.flatnonzero(seen)
    names = [d.to_pylist() + [None] for d in dictionaries]
    out = []
    for value in present.tolist():  # per distinct row: a few dozen
        row = {}
        for name, size, values in zip(reversed(keys), reversed(sizes), reversed(names)):
            value, index = divmod(value, size)
            row[name] = values[index]
        out.append({name: row[name] for name in keys})
    return out


def _pairing_violations(table: pa.Table, where: str, order: Mapping[str, int]) -> list[tuple[int, int, str]]:
    """The first row of each offending pairing: a known kind on a component `KINDS` does not allow for it, a
    `reason` outside REASONS[kind] for the kinds REASONS lists. The distinct (kind, component, reason) triples come
    from one hash group-by (a few dozen, whatever the row count); rows are scanned only for an offending triple."""
    keys = [name for name in ("kind", "component", "reason") if name in table.column_names]
    if "reason" in keys and table.column("reason").null_count == table.num_rows:
        keys.remove("reason")  # all null: nothing to check, and a narrower group-by
    if keys == ["kind"]:
        return []
    triples = pa.table({name: table.column(name) for name in keys})
    if any(pa.types.is_dictionary(t) for t in triples.schema.types):
        triples = triples.unify_dictionaries()
    distinct = _distinct_rows(triples, keys)
    bad: dict[tuple[str, str, str], str] = {}  # (column, kind, value) -> the message after the row
    for triple in distinct:
        kind = triple["kind"]
        allowed = KINDS.get(kind)
        component = triple.get("component")
        if allowed is not None and component is not None and component in COMPONENTS and component not in allowed:
            # An unknown component is the vocabulary check's to report; an unknown kind is only a note.
            bad[("component", kind, component)] = (f"column 'component': expected {_allowed_text(allowed)} for kind "
                                                   f"'{kind}', found {component!r}")
        reason = triple.get("reason")
        if kind in REASONS and reason is not None and reason not in REASONS[kind]:
            bad[("reason", kind, reason)] = (f"column 'reason': expected {_allowed_text(REASONS[kind])} for kind "
                                             f"'{kind}', found {reason!r}")
    violations = []
    for (column, kind, value), text in bad.items():  # one vectorised scan per offending pair; there are few
        mask = pc.and_(pc.equal(triples.column("kind"), kind), pc.equal(triples.column(column), value))
        row = _first_true(mask)
        if row is not None:
            violations.append((row, order[column], f"{where}: row {row}, {text}"))
    return violations


def validate_table(table: pa.Table, where: str = "<table>", metadata: Mapping[Any, Any] | None = None,
                   require_metadata: bool = False) -> list[str]:
    """Validate an in-memory table: schema, values, and the pdtrace metadata when given (or required; defaults to
    the table's own schema metadata). Raises TraceError on the first violation; returns notes."""
    notes = check_schema(table.schema, where)
    if metadata is None:
        metadata = table.schema.metadata
    if metadata or require_metadata:
        notes += check_metadata(metadata, where)[1]
    notes += check_values(table, where)
    return notes


_PARQUET_MAGIC = b"PAR1"


def describe_parquet_bytes(size: int, head: bytes, tail: bytes, exc: BaseException) -> str:
    """Why a file of `size` bytes starting with `head` and ending with `tail` (4 bytes each) could not be read as
    Parquet: empty, not Parquet, truncated (no footer) or corrupt (`exc`'s words)."""
    if size == 0:
        return "empty file (0 bytes), not a Parquet file"
    if head != _PARQUET_MAGIC:
        return "not a Parquet file (no Parquet magic bytes at the start)"
    if tail != _PARQUET_MAGIC:
        return f"truncated Parquet file ({size} bytes, footer missing): a writer crashed or a copy was cut short"
    return f"corrupt Parquet file ({' '.join(str(exc).split())[:160]})"


def _describe_local_file(path: str, exc: BaseException) -> str:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(4)
            handle.seek(max(size - 4, 0))
            tail = handle.read(4)
    except OSError as os_exc:
        return f"cannot be read ({os_exc.strerror or os_exc})"
    return describe_parquet_bytes(size, head, tail, exc)


def validate_file(path: str) -> list[str]:
    """Validate one local Parquet part file completely (footer, then every value). Raises TraceError; returns
    notes."""
    import pyarrow.parquet as pq  # only this entry reads a file; the table checks need no Parquet

    try:
        with pq.ParquetFile(path) as parquet:
            schema = parquet.schema_arrow
            metadata = parquet.metadata.metadata
            notes = check_metadata(metadata, path)[1] + check_schema(schema, path)
            table = parquet.read()
    except TraceError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise TraceError(f"{path}: {_describe_local_file(path, exc)}") from None
    return notes + check_values(table, path)
