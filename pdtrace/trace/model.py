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


@dataclass(frozen=True)
class TraceFile:
    """One Parquet part file that was loaded, with its pdtrace metadata."""

    path: str
    rows: int
    schema_version: str
    pdtrace_version: str
    source: str
    dropped_events: int


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
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        return col.to_numpy()

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
        raw = self.table.column("detail").take(pa.array(np.asarray(rows, dtype=np.int64))).to_pylist()
        out: list[dict[str, Any]] = []
        for text in raw:
            try:
                value = json.loads(text) if text else {}
            except ValueError:
                value = {}
            out.append(value if isinstance(value, dict) else {})
        return out

    @property
    def dropped_events(self) -> int:
        """Events the recorders dropped. A file's `pdtrace.dropped_events` is its writer's running total, so this
        is the sum over writers (a writer's files share one folder) of the largest count among its files."""
        per_writer: dict[str, int] = {}
        for f in self.files:
            writer = str(Path(f.path).parent)
            per_writer[writer] = max(per_writer.get(writer, 0), f.dropped_events)
        return sum(per_writer.values())

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
        )

    @property
    def name(self) -> str:
        return Path(self.path).name if self.path else "<memory>"
