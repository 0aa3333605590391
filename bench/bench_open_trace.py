"""How fast open_trace() loads a large trace, next to pyarrow reading the same columns (run by hand; prints figures).

    .venv/bin/python bench/bench_open_trace.py [--events 10000000] [--dir /tmp/pdtrace-bench-trace] [--repeat 3]

Writes (once; reused when the directory exists with the same event count) a synthetic trace laid out like the
Recorder's: 8 writers (2 instances x scheduler + 3 worker processes), part files of 65,536 rows, zstd, Parquet
dictionary encoding for the dictionary columns and `req`. Then times, best of --repeat:
  pyarrow      pyarrow.dataset over the part files, to_table() of the same columns (the floor)
  open_trace   validate=True and validate=False, all columns and the scalar columns
  filters      one instance; a 10% time window
  summarize    pdtrace info's computation on the loaded trace
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from pdtrace.format import COLUMNS, DICTIONARY_COLUMNS, SCALAR_COLUMNS, SCHEMA, file_metadata
from pdtrace.trace.reader import find_part_files, open_trace
from pdtrace.trace.summary import summarize

PART_ROWS = 65_536
START = 1_700_000_000_000_000_000


def _dict(values: np.ndarray, vocabulary: list[str]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(values, pa.int32()), pa.array(vocabulary, pa.string()))


def make_part(rng: np.random.Generator, rows: int, instance: str, role: str, pid: int, worker: int | None,
              seq0: int, ts0: int) -> pa.Table:
    if worker is None:
        kinds = ["req_sched", "sched", "blocks_alloc", "blocks_free", "req_add", "req_finish", "blocks_pool_free"]
        kind_idx = rng.choice(len(kinds), rows, p=[0.7, 0.05, 0.08, 0.05, 0.04, 0.04, 0.04])
        component = "scheduler"
    else:
        kinds = ["exec_begin", "exec_end"]
        kind_idx = np.arange(rows) % 2
        component = "worker"
    step = (seq0 + np.arange(rows)) // 20
    has_blocks = np.isin(np.asarray(kinds, dtype=object)[kind_idx], ["blocks_alloc", "blocks_free", "blocks_pool_free"])
    lengths = np.where(has_blocks, rng.integers(1, 8, rows), 0).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    blocks = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(1, 20_000, offsets[-1], dtype=np.int32)),
                                      mask=pa.array(~has_blocks))
    reqs = pa.array(np.char.add("req-", (rng.integers(0, 50_000, rows)).astype(str)))
    null16 = pa.nulls(rows, pa.int16())
    columns = {
        "ts_ns": pa.array(ts0 + np.arange(rows, dtype=np.int64) * 1_000),
        "seq": pa.array(seq0 + np.arange(rows, dtype=np.int64)),
        "instance": _dict(np.zeros(rows, np.int32), [instance]),
        "role": _dict(np.zeros(rows, np.int32), [role]),
        "pid": pa.array(np.full(rows, pid, np.int32)),
        "component": _dict(np.zeros(rows, np.int32), [component]),
        "dp_rank": pa.array(np.zeros(rows, np.int16)),
        "pp_rank": null16 if worker is None else pa.array(np.zeros(rows, np.int16)),
        "tp_rank": null16 if worker is None else pa.array(np.full(rows, worker, np.int16)),
        "kind": _dict(kind_idx.astype(np.int32), kinds),
        "step": pa.array(step.astype(np.int64)),
        "req": pa.nulls(rows, pa.string()) if worker is not None else reqs,
        "blocks": blocks,
        "n": pa.array(rng.integers(1, 512, rows, dtype=np.int64)),
        "reason": pa.nulls(rows, pa.string()).dictionary_encode(),
        "status": pa.nulls(rows, pa.string()).dictionary_encode(),
        "delay_free": pa.nulls(rows, pa.bool_()),
        "deferred": pa.nulls(rows, pa.bool_()),
        "detail": pa.nulls(rows, pa.string()),
    }
    return pa.Table.from_arrays([columns[c] for c in COLUMNS], schema=SCHEMA)


def write_trace(directory: Path, events: int) -> None:
    rng = np.random.default_rng(0)
    instances = (("prefill-0", "prefill", 1000), ("decode-0", "decode", 2000))
    writers = [(inst, role, pid, worker) for inst, role, base in instances
               for pid, worker in ((base, None), (base + 1, 0), (base + 2, 1), (base + 3, 2))]
    per_writer = events // len(writers)
    for index, (instance, role, pid, worker) in enumerate(writers):
        folder = directory / instance / str(pid)
        folder.mkdir(parents=True, exist_ok=True)
        rows = per_writer + (events - per_writer * len(writers) if index == 0 else 0)
        for part, offset in enumerate(range(0, rows, PART_ROWS)):
            n = min(PART_ROWS, rows - offset)
            table = make_part(rng, n, instance, role, pid, worker, offset, START + offset * 1_000)
            pq.write_table(table.replace_schema_metadata(file_metadata("bench", "synthetic", 0)),
                           folder / f"part-{part:06d}.parquet", compression="zstd",
                           use_dictionary=[*DICTIONARY_COLUMNS, "req"])
    (directory / "_bench.json").write_text(json.dumps({"events": events}))


def best_of(repeat: int, run) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pdtrace-bench-trace"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    stamp = args.dir / "_bench.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()).get("events") == args.events):
        print(f"writing {args.events:,} events to {args.dir} ...", flush=True)
        t0 = time.perf_counter()
        write_trace(args.dir, args.events)
        print(f"  written in {time.perf_counter() - t0:.1f} s")
    files = [str(p) for p in find_part_files(args.dir)]
    size = sum(Path(f).stat().st_size for f in files)
    print(f"trace: {args.events:,} events, {len(files)} part files, {size / 2**20:.1f} MiB on disk")

    scalars = list(SCALAR_COLUMNS)
    rows = [
        ("pyarrow dataset to_table, all columns", lambda: ds.dataset(files, format="parquet").to_table()),
        ("open_trace validate=True, all columns", lambda: open_trace(args.dir)),
        ("open_trace validate=False, all columns", lambda: open_trace(args.dir, validate=False)),
        ("pyarrow dataset to_table, scalar columns",
         lambda: ds.dataset(files, format="parquet").to_table(columns=scalars)),
        ("open_trace validate=True, scalar columns", lambda: open_trace(args.dir, columns=scalars)),
        ("open_trace one instance (of 2)", lambda: open_trace(args.dir, instances="decode-0")),
        ("open_trace 10% time window",
         lambda: open_trace(args.dir, since_ns=START, until_ns=START + args.events // 8 // 10 * 1_000)),
    ]
    loaded = None
    for label, run in rows:
        seconds, result = best_of(args.repeat, run)
        n = result.num_rows if isinstance(result, pa.Table) else len(result)
        print(f"{label:<45} {seconds:7.3f} s  {n:>12,} rows  {n / seconds / 1e6:6.1f} M rows/s")
        if label == "open_trace validate=True, all columns":
            loaded = result
    seconds, _ = best_of(args.repeat, lambda: summarize(loaded))
    print(f"{'summarize (pdtrace info) on the loaded trace':<45} {seconds:7.3f} s")


if __name__ == "__main__":
    main()
