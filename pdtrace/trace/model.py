"""The in-memory trace: one Arrow table of events plus what was learned while loading it.

The Arrow table is the source of truth. List (`blocks`) and JSON (`detail`) columns stay in Arrow: analyses flatten
`blocks` with `list_flatten` / `list_parent_indices` and parse `detail` only for the few rows that need it. `events`
is a pandas view of the scalar columns (dictionary columns become categoricals), built once on first use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.format import SCALAR_COLUMNS


def dictionary_decoded(column: Any) -> Any:
    """A column (Array or ChunkedArray) with dictionary encoding undone (its values' type); others as they are."""
    return column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column


@dataclass(frozen=True)
class TraceFile:
    """One Parquet part file that was loaded, with its pdtrace metadata."""

    path: str
    rows: int
    schema_version: str
    pdtrace_version: str
    source: str
    dropped_events: int
    #: `pdtrace.window_start_ns`: the file holds its writer's events from this time on only (a flight dump)
    window_start_ns: int | None = None


@dataclass(frozen=True)
class SkippedFile:
    """A part file that could not be read and was left out, with the reason in words."""

    path: str
    reason: str


_NULLABLE_INTS = {
    pa.int16(): pd.Int16Dtype(),
    pa.int32(): pd.Int32Dtype(),
    pa.int64(): pd.Int64Dtype(),
    pa.bool_(): pd.BooleanDtype(),
}


@dataclass
class Trace:
    """A loaded trace.

    Rows are in load order: files in path order, and within a file in `seq` order (one writer's exact order).
    Analyses that need a global order sort by (`ts_ns`, `pid`, `seq`) themselves, on the columns they use.
    """

    table: pa.Table
    path: str | None = None
    manifest: dict[str, Any] | None = None
    files: list[TraceFile] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    #: Tolerated problems found while loading (skipped files, unknown kinds, a bad manifest), one line each.
    warnings: list[str] = field(default_factory=list)
    #: The trace starts mid-run: it holds the events from this time on (ns since the epoch), while the run began
    #: earlier (a flight-recorder dump, a `--since` cut, a recording started late). None: the whole run, as far
    #: as the reader knows (pdtrace.analysis.history may still infer a window from the events).
    window_start_ns: int | None = None
    #: Where `window_start_ns` comes from: "metadata" (the files' `pdtrace.window_start_ns`), "manifest"
    #: (`window_start_ns` of a flight dump's `_manifest.json`) or "since" (a time cut of a longer trace).
    window_source: str | None = None
    #: instance -> readable name (`pdtrace.trace.names`), from the footers of the whole trace where it was read
    #: from a path, so that any part of a trace names its instances as the whole does; None: from the rows.
    instance_names: dict[str, str] | None = None

    @classmethod
    def from_table(cls, table: pa.Table, **kwargs: Any) -> "Trace":
        return cls(table=table, **kwargs)

    def __len__(self) -> int:
        return self.table.num_rows

    @cached_property
    def events(self) -> pd.DataFrame:
        """Scalar columns as pandas: categoricals for dictionary columns, nullable integer dtypes for ranks/step/n."""
        names = [c for c in SCALAR_COLUMNS if c in self.table.column_names]
        return self.table.select(names).to_pandas(types_mapper=_NULLABLE_INTS.get)

    def column(self, name: str, fill: int | None = None) -> np.ndarray:
        """One scalar column as a numpy array; nulls replaced by `fill` (required when the column has nulls)."""
        col = self.table.column(name)
        if fill is not None and col.null_count:
            col = pc.fill_null(col, fill)
        return dictionary_decoded(col).to_numpy()

    def block_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The `blocks` column flattened: (row index of each block, block id). No per-row Python objects."""
        blocks = self.table.column("blocks").combine_chunks()
        if len(blocks) == 0:
            return np.empty(0, np.int64), np.empty(0, np.int32)
        rows = pc.list_parent_indices(blocks).to_numpy().astype(np.int64, copy=False)
        ids = pc.list_flatten(blocks).to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
        return rows, ids

    def details(self, rows: np.ndarray) -> list[dict[str, Any]]:
        """Parse the `detail` JSON of the given rows only ({} where null or not an object)."""
        return parse_details(self.table.column("detail"), rows)

    @property
    def dropped_events(self) -> int:
        """Events the recorders dropped (`dropped_events` of its files)."""
        return dropped_events(self.files)

    @property
    def sources(self) -> list[str]:
        return sorted({f.source for f in self.files})

    def filter(self, mask: np.ndarray | pa.Array) -> "Trace":
        """A trace holding only the rows where `mask` is true (same manifest and file list)."""
        return Trace(
            table=self.table.filter(mask),
            path=self.path,
            manifest=self.manifest,
            files=self.files,
            skipped=self.skipped,
            warnings=self.warnings,
            window_start_ns=self.window_start_ns,
            window_source=self.window_source,
            instance_names=self.instance_names,
        )

    def cut(self, since_ns: int) -> "Trace":
        """The rows from `since_ns` on, marked as a window starting there (the trace itself when nothing is
        earlier): what `pdtrace analyze --since` analyses, and a flight dump of the same moment holds. Earlier
        `engine_config` rows are kept (`since_mask`)."""
        ts = self.table.column("ts_ns")
        if len(ts) == 0 or int(pc.min(ts).as_py()) >= since_ns:
            return self
        out = self.filter(since_mask(self.table, since_ns))
        out.window_start_ns, out.window_source = later_window(self.window_start_ns, self.window_source,
                                                              int(since_ns), "since")
        return out

    @property
    def name(self) -> str:
        return Path(self.path).name if self.path else "<memory>"


#: Kinds a window keeps from before its start: configuration, not history (a scheduler writes its engine_config
#: once, before its first step; the rules read the pool size, tp x pp and the connector from it).
WINDOW_KEEPS = ("engine_config",)


def since_mask(table: pa.Table, since_ns: int) -> Any:
    """Rows at or after since_ns, and the WINDOW_KEEPS rows of any time."""
    mask = pc.greater_equal(table.column("ts_ns"), pa.scalar(int(since_ns), pa.int64()))
    kind = dictionary_decoded(table.column("kind"))
    return pc.or_(mask, pc.is_in(kind, value_set=pa.array(list(WINDOW_KEEPS), pa.string())))


def later_window(start_ns: int | None, source: str | None, other_ns: int | None,
                 other_source: str) -> tuple[int | None, str | None]:
    """The later of two window starts with its source: events are complete only from the later one on."""
    if other_ns is None or (start_ns is not None and start_ns >= other_ns):
        return start_ns, source
    return int(other_ns), other_source


def dropped_events(files: list[TraceFile]) -> int:
    """Events the recorders of these files dropped. A file's `pdtrace.dropped_events` is its writer's running
    total, so this is the sum over writers (a writer's files share one folder) of the largest count among its
    files."""
    per_writer: dict[str, int] = {}
    for f in files:
        writer = str(Path(f.path).parent)
        per_writer[writer] = max(per_writer.get(writer, 0), f.dropped_events)
    return sum(per_writer.values())


def rows_by_chunk(column: pa.ChunkedArray, rows: np.ndarray) -> list[tuple[int, slice | np.ndarray, np.ndarray]]:
    """`rows` (in-bounds row indices, any order, repeats allowed) grouped by the chunk that holds them, chunks in
    order: (chunk index, where those rows are in `rows` (a slice when `rows` ascend), their indices within the
    chunk, ascending). One searchsorted of the chunk starts, and a stable argsort only when `rows` do not ascend;
    nothing of the column is copied."""
    rows = np.asarray(rows)
    if len(rows) == 0:
        return []
    starts = np.zeros(column.num_chunks + 1, np.int64)
    np.cumsum([len(c) for c in column.chunks], out=starts[1:])
    order = None if bool((rows[1:] >= rows[:-1]).all()) else np.argsort(rows, kind="stable")
    sorted_rows = rows if order is None else rows[order]
    cuts = np.searchsorted(sorted_rows, starts)
    parts = []
    for i in range(column.num_chunks):  # per chunk (a few per file)
        a, b = int(cuts[i]), int(cuts[i + 1])
        if a < b:
            parts.append((i, slice(a, b) if order is None else order[a:b], sorted_rows[a:b] - starts[i]))
    return parts


def take_rows(column: pa.ChunkedArray, rows: np.ndarray) -> pa.Array:
    """The column's values at `rows` (any order, repeats allowed), taken from the chunks that hold them:
    `ChunkedArray.take` concatenates every chunk first (a copy of a 10M-row string column for one row)."""
    rows = np.asarray(rows, dtype=np.int64)
    n = len(column)
    if column.num_chunks <= 1 or len(rows) == 0 or rows.min() < 0 or rows.max() >= n:
        return column.take(pa.array(rows))  # (also raises Arrow's own error for a row out of bounds)
    parts = rows_by_chunk(column, rows)
    got = pa.concat_arrays([column.chunk(i).take(pa.array(local)) for i, _, local in parts])
    if all(isinstance(where, slice) for _, where, _ in parts):  # rows ascending: got is in their order
        return got
    inverse = np.empty(len(rows), np.int64)
    inverse[np.concatenate([where for _, where, _ in parts])] = np.arange(len(rows))
    return got.take(pa.array(inverse))


def parse_details(column: pa.ChunkedArray, rows: np.ndarray) -> list[dict[str, Any]]:
    """The parsed `detail` JSON of the given rows ({} where null or not an object); a loop per cited row, few."""
    out: list[dict[str, Any]] = []
    for text in take_rows(column, rows).to_pylist():
        try:
            value = json.loads(text) if text else {}
        except ValueError:
            value = {}
        out.append(value if isinstance(value, dict) else {})
    return out
