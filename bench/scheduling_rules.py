"""What the scheduling and pipeline analyses cost on a large trace (run by hand; prints figures, asserts nothing).

    .venv/bin/python bench/scheduling_rules.py [TRACE]    (default /tmp/pdtrace-bench-analyze, built by
                                                           `.venv/bin/python bench/analyze.py`: 10M events of P/D
                                                           traffic with PP=2 exec spans on every step)
    .venv/bin/python bench/scheduling_rules.py --pp4 N    (first builds a PP=4 trace of about N events with
                                                           tests/scenarios_pipeline.py's engine model, tiled)

In one process: open_trace, then twice on a fresh AnalysisContext: the shared column arrays and request state
(built by whichever rule runs first in `pdtrace analyze`; timed apart here), the pipeline_bubble rule (with the
internal step/span/gap tables it builds) and the unscheduled_request rule, then what only plots and `show` add
(the public step_table, exec_spans, bubbles); then `pdtrace show`'s request and step stories; wall time of each and
peak RSS. The second pass shows the cost without first-touch page faults (large on a loaded VM).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def timed(label: str, fn):  # noqa: ANN001, ANN202
    t0 = time.perf_counter()
    value = fn()
    print(f"  {label:<34} {time.perf_counter() - t0:7.2f} s", flush=True)
    return value


def build_pp4(directory: Path, events: int) -> None:
    """A PP=4 trace of about `events` rows: the engine model's healthy run tiled in time (ids offset per copy)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from scenarios_pipeline import simulate_pipeline

    from pdtrace.trace.builder import write_table

    base = simulate_pipeline(pp=4, n_requests=64, batch_cap=16, tokens=128).table
    copies = max(1, events // base.num_rows)
    span = int(pc.max(base.column("ts_ns")).as_py() - pc.min(base.column("ts_ns")).as_py()) + 1_000_000
    steps = int(pc.max(base.column("step")).as_py()) + 1
    parts = []
    req = pc.cast(base.column("req"), pa.string())
    for i in range(copies):
        cols = {name: base.column(name) for name in base.column_names}
        cols["ts_ns"] = pc.add(base.column("ts_ns"), i * span)
        cols["seq"] = pc.add(base.column("seq"), i * base.num_rows)
        cols["step"] = pc.add(base.column("step"), i * steps)
        cols["req"] = pc.binary_join_element_wise(req, pa.scalar(f"-{i}"), "")
        parts.append(pa.table(cols, schema=base.schema))
    write_table(pa.concat_tables(parts), directory, rows_per_file=1_000_000)
    print(f"built {directory}: {copies * base.num_rows:,} events (PP=4, {copies} copies)")


def one_pass(trace):  # noqa: ANN001, ANN201
    from pdtrace.analysis.columns import columns
    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.analysis.requests import request_state
    from pdtrace.analysis.rules import pipeline_bubble, unscheduled_request
    from pdtrace.analysis.steps import bubbles, exec_spans, step_table

    ctx = AnalysisContext(trace)
    cols = columns(ctx)
    timed("shared: columns (codes, pos, rk, step)", lambda: (cols.codes("kind"), cols.pos, cols.rk, cols.step))
    timed("shared: request_state", lambda: request_state(ctx))
    pb = timed("rule pipeline_bubble (with its tables)", lambda: pipeline_bubble.run(ctx))
    ur = timed("rule unscheduled_request", lambda: unscheduled_request.run(ctx))
    steps = timed("step_table (public: + plot-only keys)", lambda: step_table(ctx))
    spans = timed("exec_spans (public: + RPC names)", lambda: exec_spans(ctx))
    gaps = timed("bubbles (public)", lambda: bubbles(ctx))
    return ctx, pb, ur, steps, spans, gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", nargs="?", default="/tmp/pdtrace-bench-analyze")
    parser.add_argument("--pp4", type=int, default=0, help="build a PP=4 trace of about this many events first")
    args = parser.parse_args()
    directory = Path(args.trace)
    if args.pp4:
        directory = Path("/tmp/pdtrace-bench-pp4")
        if not directory.exists():
            build_pp4(directory, args.pp4)

    from pdtrace.analysis.columns import columns
    from pdtrace.analysis.story import request_story, step_ranks, step_story
    from pdtrace.trace.reader import open_trace

    trace = timed("open_trace", lambda: open_trace(directory, warn=False))
    print(f"  ({len(trace):,} events)")
    for attempt in (1, 2):  # a fresh context each time: the second pass shows the cost without first-touch paging
        print(f"pass {attempt} (fresh AnalysisContext)")
        ctx, pb, ur, steps, spans, gaps = one_pass(trace)
    print(f"  ({len(steps):,} steps, {len(spans):,} spans, {len(gaps):,} bubbles >= bubble_min_ns)")
    for name, found in (("pipeline_bubble", pb), ("unscheduled_request", ur)):
        counts = found["severity"].value_counts().to_dict() if len(found) else {}
        print(f"  {name} findings: {len(found)} {counts}")
    req = str(columns(ctx).rk_names["req"].iloc[len(columns(ctx).rk_names) // 2])
    mid = int(np.median(steps["step"].to_numpy()))
    story = timed(f"show --req {req} (request_story)", lambda: request_story(trace, req))
    timed(f"show --step {mid} (step_story)", lambda: step_story(trace, mid))
    timed(f"show --step {mid} (step_ranks)", lambda: step_ranks(trace, mid))
    print(f"  ({len(story)} events in the request story)")
    print(f"  peak RSS (this process)            {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:7.0f} MiB")


if __name__ == "__main__":
    main()
