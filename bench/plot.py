"""Benchmark `pdtrace plot` (and `export --to chrome`) on a large synthetic trace, against the time to read it.

    .venv/bin/python bench/plot.py [--events 1000000] [--dir /tmp/pdtrace-bench] [--kinds pipeline,requests,...]

The trace is generated with numpy/pyarrow, no Python loop per event: one engine (PP=4, four steps in flight),
a step every 0.5 ms with ~32 requests in each batch, each request living 100 steps (8 KV blocks allocated at its
first step, freed at its finish), a 5 ms stall every 200 steps (bubbles on every rank). Figures printed:
- read: `open_trace` of the directory (what every verb pays first), cold (the first in the process) and warm;
- the one-off import of matplotlib (every `pdtrace plot` process pays it once);
- per kind, cold: a fresh context, all the analysis the figure needs (analyze's rules included) plus drawing
  and saving the PNG, against the cold read; warm: drawing and saving again on the same context (the analyses
  cached), i.e. the cost of the plotting itself, against a warm read (the issue's target: plot <= 3x read);
- as whole processes, what a user waits for (median of --repeat runs, alternating): `pdtrace plot TRACE --kind K`
  against a process that imports pdtrace's reader and reads the same trace (`open_trace`), and the ratio;
- one fresh process per kind: the read and the plot, both cold, and their ratio (the strictest view).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

START_NS = 1_700_000_000_000_000_000
US = 1_000


def synthetic_table(target_events: int, seed: int = 0) -> pa.Table:
    """About `target_events` events of one PP=4 engine, built column-wise."""
    from pdtrace.format import SCHEMA

    rng = np.random.default_rng(seed)
    pp, batch, life = 4, 32, 100
    per_step = 3 + 2 * pp + batch + 6 * batch / life  # sched, submit, output, exec pairs, req_sched, lifecycles
    steps = max(int(target_events / per_step), life + 1)
    period = 500 * US
    stall = np.where(np.arange(steps) % 200 == 199, 5_000 * US, 0)
    t_step = START_NS + np.arange(steps, dtype=np.int64) * period + np.cumsum(stall) \
        + rng.integers(0, 20 * US, steps)
    n_req = int(steps * batch / life)
    first = np.linspace(0, steps - life - 1, n_req).astype(np.int64)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("ts", "pid", "comp", "pp", "kind", "step", "req", "n",
                                                          "reason", "status", "delay", "deferred")}

    def add(ts, pid, comp, kind, step=None, req=None, n=None, pp_rank=None, reason=None, status=None,
            delay=None, deferred=None):
        m = len(ts)
        cols["ts"].append(np.asarray(ts, np.int64))
        cols["pid"].append(np.full(m, pid, np.int32) if np.isscalar(pid) else np.asarray(pid, np.int32))
        cols["comp"].append(np.full(m, comp, object))
        cols["pp"].append(np.full(m, -1, np.int16) if pp_rank is None else np.asarray(pp_rank, np.int16))
        cols["kind"].append(np.full(m, kind, object))
        cols["step"].append(np.full(m, -1, np.int64) if step is None else np.asarray(step, np.int64))
        cols["req"].append(np.full(m, None, object) if req is None else np.asarray(req, object))
        cols["n"].append(np.full(m, -1, np.int64) if n is None else np.asarray(n, np.int64))
        cols["reason"].append(np.full(m, None, object) if reason is None else np.full(m, reason, object))
        cols["status"].append(np.full(m, None, object) if status is None else np.full(m, status, object))
        cols["delay"].append(np.full(m, None, object) if delay is None else np.full(m, delay, object))
        cols["deferred"].append(np.full(m, None, object) if deferred is None else np.full(m, deferred, object))

    k = np.arange(steps, dtype=np.int64)
    # per-request rows: one per (request, step of its life)
    rid = np.repeat(np.arange(n_req), life)
    rstep = np.repeat(first, life) + np.tile(np.arange(life), n_req)
    names = np.char.add("req-", np.arange(n_req).astype(str)).astype(object)
    tokens_per_step = np.bincount(rstep, weights=np.where(np.tile(np.arange(life), n_req) == 0, 128, 1),
                                  minlength=steps).astype(np.int64)
    add(t_step[:1] - 10 * US, 1000, "scheduler", "engine_config", n=[4096])
    add(t_step[first] - 50 * US, 1000, "scheduler", "req_add", req=names, n=np.full(n_req, 128))
    add(t_step, 1000, "scheduler", "sched", step=k, n=tokens_per_step)
    add(t_step[first] + 1 * US, 1000, "scheduler", "blocks_alloc", step=first, req=names)
    add(t_step[rstep] + 2 * US, 1000, "scheduler", "req_sched", step=rstep, req=names[rid],
        n=np.where(np.tile(np.arange(life), n_req) == 0, 128, 1))
    add(t_step + 100 * US, 1000, "engine", "step_submit", step=k, n=np.minimum(k + 1, pp))
    for r in range(pp):  # per PP rank (four)
        b = t_step + 120 * US + r * 110 * US
        add(b, 1001 + r, "worker", "exec_begin", step=k, n=tokens_per_step, pp_rank=np.full(steps, r))
        add(b + 100 * US, 1001 + r, "worker", "exec_end", step=k, n=tokens_per_step, pp_rank=np.full(steps, r))
    out_ts = t_step + 120 * US + pp * 110 * US + 10 * US
    add(out_ts, 1000, "engine", "step_output", step=k)
    last = first + life - 1
    add(out_ts[last] + 1 * US, 1000, "scheduler", "blocks_free", step=last, req=names, reason="finished",
        deferred=False)
    add(out_ts[last] + 2 * US, 1000, "scheduler", "blocks_pool_free", step=last, req=names)
    add(out_ts[last] + 3 * US, 1000, "scheduler", "req_finish", step=last, req=names, reason="length",
        status="RUNNING", delay=False)

    ts = np.concatenate(cols["ts"])
    kind = np.concatenate(cols["kind"])
    req = np.concatenate(cols["req"])
    pid = np.concatenate(cols["pid"])
    order = np.lexsort((ts, pid))
    ts, kind, req, pid = ts[order], kind[order], req[order], pid[order]
    seq = np.arange(len(ts)) - np.searchsorted(pid, pid, side="left")  # per writer, in time order

    # blocks lists: 8 blocks per request on blocks_alloc / blocks_free / blocks_pool_free rows
    with_blocks = np.isin(kind, ["blocks_alloc", "blocks_free", "blocks_pool_free"])
    req_num = np.zeros(len(ts), np.int64)
    req_num[with_blocks] = np.char.replace(req[with_blocks].astype(str), "req-", "").astype(np.int64)
    lengths = np.where(with_blocks, 8, 0)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = ((np.repeat(req_num[with_blocks], 8) * 8 + np.tile(np.arange(8), int(with_blocks.sum()))) % 4000 + 1)
    blocks = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int32)),
                                      mask=pa.array(~with_blocks))

    def col(name):
        return np.concatenate(cols[name])[order]

    def nullable_int(values, typ):
        return pa.array(values, typ, mask=values < 0)

    detail = np.full(len(ts), None, object)
    detail[kind == "engine_config"] = json.dumps({"block_size": 16, "pp": pp, "tp": 1, "dp": 1,
                                                   "batch_queue_size": pp})
    dictionary = lambda values: pa.array(values, pa.string()).dictionary_encode()  # noqa: E731
    arrays = [
        pa.array(ts, pa.int64()), pa.array(seq, pa.int64()),
        dictionary(np.full(len(ts), "engine-0", object)), dictionary(np.full(len(ts), "both", object)),
        pa.array(pid, pa.int32()), dictionary(col("comp")),
        pa.array(np.zeros(len(ts), np.int16), pa.int16()), nullable_int(col("pp"), pa.int16()),
        nullable_int(np.where(col("pp") >= 0, 0, -1).astype(np.int16), pa.int16()),
        dictionary(kind), nullable_int(col("step"), pa.int64()), pa.array(req, pa.string()), blocks,
        nullable_int(col("n"), pa.int64()), dictionary(col("reason")), dictionary(col("status")),
        pa.array(col("delay"), pa.bool_()), pa.array(col("deferred"), pa.bool_()), pa.array(detail, pa.string()),
    ]
    table = pa.Table.from_arrays(arrays, schema=pa.schema([f.with_nullable(True) for f in SCHEMA]))
    return table.cast(SCHEMA)


READ_PROCESS = "import sys; from pdtrace.trace.reader import open_trace; open_trace(sys.argv[1], warn=False)"
# One fresh process per kind, imports done first: the read, then the plot (all its analysis, drawing, PNG), both
# cold in the same process, so neither finds memory the other already faulted in.
READ_THEN_PLOT = r"""
import sys, time
import pdtrace.plot.figures
from pdtrace.analysis.context import AnalysisContext
from pdtrace.malloc import single_arena
from pdtrace.plot import render
from pdtrace.trace.reader import open_trace
single_arena()
t0 = time.perf_counter()
trace = open_trace(sys.argv[1], warn=False)
t1 = time.perf_counter()
render(AnalysisContext(trace), sys.argv[2], sys.argv[3])
print(t1 - t0, time.perf_counter() - t1)
"""


def _wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if proc.returncode not in (0, 1):
        print(f"  failed ({proc.returncode}): {proc.stderr.decode().strip()[-300:]}", file=sys.stderr)
    return time.perf_counter() - start


def processes(trace_dir: Path, kinds: list[str], repeat: int, out_dir: Path) -> None:
    """Whole processes, alternating: the read process, then `pdtrace plot` of each kind; medians and ratios."""
    if repeat < 1:
        return
    read_cmd = [sys.executable, "-c", READ_PROCESS, str(trace_dir)]
    walls: dict[str, list[float]] = {"read": []}
    for _ in range(repeat):
        walls["read"].append(_wall(read_cmd))
        for kind in kinds:
            walls.setdefault(kind, []).append(_wall([sys.executable, "-m", "pdtrace", "plot", str(trace_dir),
                                                     "--kind", kind, "-o", str(out_dir / f"p_{kind}.png")]))
    read_s = statistics.median(walls["read"])
    print(f"processes (median of {repeat}): read {read_s:.2f} s")
    for kind in kinds:
        wall = statistics.median(walls[kind])
        print(f"  pdtrace plot --kind {kind:<9} {wall:5.2f} s  {wall / read_s:4.1f}x the read process")
    print(f"fresh process per kind, imports first, then read and plot both cold (median of {repeat}):")
    for kind in kinds:
        pairs = []
        for _ in range(repeat):
            out = subprocess.run([sys.executable, "-c", READ_THEN_PLOT, str(trace_dir), kind,
                                  str(out_dir / f"q_{kind}.png")], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"  failed: {out.stderr.strip()[-300:]}", file=sys.stderr)
                break
            pairs.append(tuple(float(v) for v in out.stdout.split()))
        if pairs:
            read_c = statistics.median(p[0] for p in pairs)
            plot_c = statistics.median(p[1] for p in pairs)
            print(f"  {kind:<9} read {read_c:5.3f} s  plot {plot_c:5.3f} s  {plot_c / read_c:4.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pdtrace-bench-plot"))
    parser.add_argument("--kinds", default="pipeline,requests,blocks,steps")
    parser.add_argument("--keep", action="store_true", help="keep the generated trace and images")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each process (median)")
    args = parser.parse_args()

    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.export import export
    from pdtrace.plot import render
    from pdtrace.trace.builder import write_table
    from pdtrace.trace.reader import open_trace

    shutil.rmtree(args.dir, ignore_errors=True)
    t = time.perf_counter()
    table = synthetic_table(args.events)
    trace_dir = write_table(table, args.dir / "trace", source="synthetic", rows_per_file=250_000)
    print(f"generated {table.num_rows:,} events in {time.perf_counter() - t:.2f} s -> {trace_dir}")

    t = time.perf_counter()
    import pdtrace.plot.figures  # noqa: F401  (matplotlib: paid once per process, reported apart)
    print(f"import matplotlib + pdtrace.plot.figures: {time.perf_counter() - t:.3f} s")

    reads = []
    for _ in range(3):
        t = time.perf_counter()
        trace = open_trace(trace_dir, warn=False)
        reads.append(time.perf_counter() - t)
    cold_read_s, read_s = reads[0], min(reads[1:])
    print(f"read (open_trace): first (cold) {cold_read_s:.3f} s, best of the next two (warm) {read_s:.3f} s")

    # cold plots against the cold read, warm plots against a warm read: like for like
    print(f"{'kind':<10} {'cold s':>8} {'x cold read':>12} {'warm s':>8} {'x warm read':>12}")
    for kind in args.kinds.split(","):
        trace = open_trace(trace_dir, warn=False)
        ctx = AnalysisContext(trace)
        out = args.dir / f"{kind}.png"
        t = time.perf_counter()
        render(ctx, kind, out)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        render(ctx, kind, out)
        warm = time.perf_counter() - t
        print(f"{kind:<10} {cold:8.3f} {cold / cold_read_s:12.1f} {warm:8.3f} {warm / read_s:12.1f}")
    processes(trace_dir, args.kinds.split(","), args.repeat, args.dir)
    trace = open_trace(trace_dir, warn=False)
    t = time.perf_counter()
    model = export(AnalysisContext(trace), "chrome", args.dir / "out.json")
    print(f"export chrome: {time.perf_counter() - t:.2f} s, {model.counts()}, "
          f"{(args.dir / 'out.json').stat().st_size / 1e6:.1f} MB")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
