"""`pdtrace plot TRACE --kind pipeline|requests|blocks|steps`: draw a trace to a png, svg or pdf file.

The figures come from `pdtrace.plot` (which draws the analyses' tables and `analyze`'s findings); this module only
reads the options, loads the trace and reports where the image went.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Iterator, Optional

import typer

from pdtrace.cli.app import (TraceArgument, WindowOptions, app, err_console, out_console, shown_pieces,
                             window_options)


class PlotKind(str, Enum):
    pipeline = "pipeline"
    requests = "requests"
    blocks = "blocks"
    steps = "steps"


@app.command()
@window_options
def plot(
    trace: TraceArgument,
    kind: PlotKind = typer.Option(PlotKind.pipeline, "--kind", "-k",
                                  help="pipeline (exec spans and bubbles per PP rank), requests (phases per "
                                       "request, findings marked), blocks (KV blocks in use by owner state), "
                                       "steps (schedule() time and tokens per step)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Image file: .png, .svg or .pdf (default: <trace>-<kind>.png)."),
    shown: WindowOptions = WindowOptions(),
    dpi: float = typer.Option(100.0, "--dpi", help="Resolution: the image is 14 in wide, so 100 dpi = 1400 px."),
) -> None:
    """Plot a trace: pipeline bubbles, request lifecycles, KV block usage or scheduler steps.

    With --request, `--kind requests` draws only the named requests' lanes; the other kinds draw everything in the
    window that --request narrowed."""
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.context import AnalysisContext
    # lazy: matplotlib and the analysis stack load only to draw
    from pdtrace.plot import IN_PIECES, Piece, default_output, render

    target = output or default_output(str(trace), kind.value)
    window = shown.window()
    # --instance: theirs and their peers' partitions; with --since/--until on a long trace, only that window's rows;
    # the blocks of a long trace (or a long window of it) piece by piece
    pieces = shown_pieces(trace, window, shown.window_events, memory_check=shown.memory_check,
                          in_pieces=kind.value in IN_PIECES)

    def contexts() -> Iterator[Piece]:
        for k, piece in enumerate(pieces):
            loaded = piece.read()
            err_console.print(f"pdtrace: drawing {kind.value} for {len(loaded):,} events"
                              + (f" (piece {k + 1}/{len(pieces)})" if len(pieces) > 1 else "") + " ...", markup=False)
            yield AnalysisContext(loaded, span_ns=piece.span, window_end=piece.window_end), piece.since, piece.until
            del loaded

    if len(pieces) == 1:
        (ctx, _, _), = contexts()
        result = render(ctx, kind.value, target, window=window, dpi=dpi)
    else:
        result = render(contexts(), kind.value, target, window=window, dpi=dpi)
    out_console.print(f"{result.path} ({result.width_px}x{result.height_px} px, {kind.value})", markup=False)
