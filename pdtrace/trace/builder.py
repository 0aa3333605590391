"""Build event tables by hand: tests, synthetic traces and benchmarks describe scenarios with it.

    b = EventBuilder(instance="P", role="prefill")
    b.add("req_add", req="r1", n=40, detail={"remote_decode": True})
    b.add("blocks_alloc", step=0, req="r1", blocks=[1, 2, 3])
    trace = b.trace()

Timestamps default to a clock that advances 1 µs per event; `seq` counts per writer (instance, pid).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pdtrace.format import COLUMNS, KINDS, SCHEMA, file_metadata
from pdtrace.trace.model import Trace, TraceFile

_DEFAULT_COMPONENT = {
    kind: sorted(comps)[0] if comps and len(comps) == 1 else None for kind, comps in KINDS.items()
}
_DEFAULT_COMPONENT.update({"exec_begin": "worker", "exec_end": "worker", "kv_send_rank": "worker",
                           "kv_recv_rank": "worker", "batch_add": "worker", "batch_remove": "worker",
                           "exec_wait_begin": "worker", "exec_wait_end": "worker"})


class EventBuilder:
    """Accumulates events as rows and turns them into a schema-conformant Arrow table or Trace.

    Per-event keyword arguments override the builder's defaults (instance, role, pid, dp_rank). `component`
    defaults from the kind. `ts` advances by `tick_ns` after each event unless given; `at(ts)` moves the clock.
    """

    def __init__(self, instance: str = "engine-0", role: str = "both", pid: int = 1000, dp_rank: int | None = 0,
                 start_ns: int = 1_700_000_000_000_000_000, tick_ns: int = 1_000) -> None:
        self.defaults = {"instance": instance, "role": role, "pid": pid, "dp_rank": dp_rank}
        self.now = start_ns
        self.tick_ns = tick_ns
        self._seq: dict[tuple[str, int], int] = {}
        self.rows: list[dict[str, Any]] = []

    def at(self, ts_ns: int) -> "EventBuilder":
        self.now = ts_ns
        return self

    def advance(self, ns: int) -> "EventBuilder":
        self.now += ns
        return self

    def add(self, kind: str, ts: int | None = None, **fields: Any) -> dict[str, Any]:
        """Append one event and return its row (with `ts_ns` and `seq` filled in)."""
        row: dict[str, Any] = dict(self.defaults)
        row.update(fields)
        row["kind"] = kind
        row.setdefault("component", _DEFAULT_COMPONENT.get(kind) or "scheduler")
        if row["component"] in ("scheduler", "engine"):
            row.setdefault("pp_rank", None)
            row.setdefault("tp_rank", None)
        if ts is None:
            ts = self.now
            self.now += self.tick_ns
        else:
            self.now = max(self.now, ts + self.tick_ns)
        row["ts_ns"] = ts
        writer = (row["instance"], row["pid"])
        row["seq"] = self._seq.get(writer, 0)
        self._seq[writer] = row["seq"] + 1
        detail = row.get("detail")
        if isinstance(detail, dict):
            row["detail"] = json.dumps(detail, separators=(",", ":"))
        self.rows.append(row)
        return row

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self.add(**row)

    def table(self) -> pa.Table:
        return rows_to_table(self.rows)

    def trace(self, source: str = "synthetic") -> Trace:
        table = self.table()
        return Trace.from_table(
            table,
            files=[TraceFile(path="<memory>", rows=table.num_rows, schema_version="1", pdtrace_version="test",
                             source=source, dropped_events=0)],
        )

    def write(self, directory: str | Path, source: str = "synthetic", rows_per_file: int | None = None) -> Path:
        """Write the events as a trace directory: one folder per writer (instance/pid), part files inside."""
        return write_table(self.table(), directory, source=source, rows_per_file=rows_per_file)


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows (dicts keyed by column name; missing keys are null) to a table with the format's schema."""
    columns = {name: [row.get(name) for row in rows] for name in COLUMNS}
    arrays = []
    for f in SCHEMA:
        if pa.types.is_dictionary(f.type):
            arrays.append(pa.array(columns[f.name], pa.string()).dictionary_encode())
        else:
            arrays.append(pa.array(columns[f.name], f.type))
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def write_table(table: pa.Table, directory: str | Path, source: str = "synthetic", version: str = "test",
                rows_per_file: int | None = None) -> Path:
    """Write a schema-conformant table as a trace directory, split by writer (instance, pid)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    instances = pc.cast(table.column("instance"), pa.string())
    pids = table.column("pid")
    writers = sorted(set(zip(instances.to_pylist(), pids.to_pylist())))
    for instance, pid in writers:
        part = table.filter(pc.and_(pc.equal(instances, instance), pc.equal(pids, pid)))
        folder = directory / instance / str(pid)
        folder.mkdir(parents=True, exist_ok=True)
        step = rows_per_file or max(part.num_rows, 1)
        for index, offset in enumerate(range(0, max(part.num_rows, 1), step)):
            chunk = part.slice(offset, step).replace_schema_metadata(file_metadata(version, source, 0))
            pq.write_table(chunk, folder / f"part-{index:06d}.parquet", compression="zstd")
    return directory
