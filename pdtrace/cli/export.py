"""`pdtrace export TRACE --to chrome|perfetto -o FILE`: a trace for ui.perfetto.dev (or chrome://tracing).

The export is built by `pdtrace.export` from the analyses' tables; this module reads the options, loads the trace
and reports what was written.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from pdtrace.cli.app import (TraceArgument, WindowOptions, app, err_console, load_shown, out_console,
                             window_options)


class ExportFormat(str, Enum):
    chrome = "chrome"
    perfetto = "perfetto"


@app.command()
@window_options
def export(
    trace: TraceArgument,
    to: ExportFormat = typer.Option(ExportFormat.chrome, "--to",
                                    help="chrome: Trace Event JSON; perfetto: protobuf (needs `pip install "
                                         "perfetto`)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Output file (default: <trace>.json or <trace>.pftrace)."),
    shown: WindowOptions = WindowOptions(),
) -> None:
    """Export a trace to Chrome Trace Event JSON or Perfetto protobuf: processes per instance, threads per rank
    and request, slices, block counters and P->D transfer flows.

    With --request, the request threads kept are the named requests' and their P/D peers' (so that a transfer
    flow has both ends), over the window that --request narrowed."""
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.context import AnalysisContext
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.export import export as run_export
    from pdtrace.plot import trace_stem  # lazy: matplotlib and the analysis stack load only to draw

    if to is ExportFormat.perfetto:
        # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
        from pdtrace.export.perfetto import _builder_classes

        _builder_classes()  # a missing optional package fails before the trace is read
    stem = trace_stem(str(trace))
    target = output or Path(f"{stem}.{'json' if to is ExportFormat.chrome else 'pftrace'}")
    window = shown.window()
    # --instance: theirs and their peers' partitions; with --since/--until on a long trace, only that window's rows
    loaded, span, window_end = load_shown(trace, window, shown.window_events, memory_check=shown.memory_check)
    err_console.print(f"pdtrace: exporting {len(loaded):,} events to {to.value} ...", markup=False)
    model = run_export(AnalysisContext(loaded, span_ns=span, window_end=window_end), to.value, target,
                       window=window, trace_name=str(trace))
    counts = model.counts()
    out_console.print(f"{target}: {counts['processes']} processes, {counts['threads']} threads, "
                      f"{counts['slices']:,} slices, {counts['counters']:,} counter samples, "
                      f"{counts['flows']:,} flows", markup=False)
