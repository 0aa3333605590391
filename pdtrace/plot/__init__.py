"""`pdtrace plot`: pipeline timelines with bubbles, request lifecycles, KV block usage and scheduler steps.

Importing this package does not import matplotlib; `render` loads `pdtrace.plot.figures`, which selects the Agg
backend, on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from pdtrace.analysis import allocation_settings
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.parallel import build_tables, default_jobs
from pdtrace.errors import UsageError
from pdtrace.plot.window import EmptySelection, Selection, Window, resolve

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

KINDS: tuple[str, ...] = ("pipeline", "requests", "blocks", "steps")
FORMATS: tuple[str, ...] = ("png", "svg", "pdf")


@dataclass
class PlotResult:
    path: Path
    kind: str
    width_px: int
    height_px: int


def trace_stem(trace_path: str) -> str:
    """A short name for a trace path: its folder name, or the parent's when the folder is just `trace`."""
    path = Path(trace_path.rstrip("/") or ".").resolve()
    if path.suffix == ".parquet":
        path = path.parent
    if path.name == "trace" and path.parent.name:
        return path.parent.name
    return path.name or "trace"


def default_output(trace_name: str, kind: str) -> Path:
    """`<trace name>-<kind>.png` in the current directory."""
    return Path(f"{trace_stem(trace_name)}-{kind}.png")


def build_figure(ctx: AnalysisContext, kind: str, window: Window | None = None, dpi: float = 100.0) -> "Figure":
    """The matplotlib Figure of one plot kind for the selection (EmptySelection when there is nothing to draw)."""
    if kind not in KINDS:
        raise UsageError(f"unknown plot kind {kind!r} (kinds: {', '.join(KINDS)})")
    if dpi <= 0:
        raise UsageError(f"--dpi must be positive, got {dpi:g}")
    # lazy: matplotlib loads only to draw (export, and the CLI's window choice, import this package)
    from pdtrace.plot.figures import FIGURE_TABLES, FIGURES

    with allocation_settings():  # as analyze runs its rules (at 10M events: blocks figure 1.1-1.6 -> 0.9 s)
        sel = resolve(ctx, window or Window())
        build_tables(ctx, FIGURE_TABLES[kind], int(ctx.config.jobs) or default_jobs())
        return FIGURES[kind](ctx, sel, dpi)


#: The kinds drawn from a window read in pieces (`build_figure_in_pieces`, `figures.PIECES`): lines per scheduler,
#: reduced per pixel.
IN_PIECES: tuple[str, ...] = ("blocks", "steps")

#: A piece of a long window: its context and its own span [since, until) (None: from the start, to the end).
Piece = tuple[AnalysisContext, "int | None", "int | None"]


def build_figure_in_pieces(pieces: Iterable[Piece], kind: str, window: Window | None = None,
                           dpi: float = 100.0) -> "Figure":
    """The Figure of one plot kind (IN_PIECES) for a window read in consecutive pieces, one at a time, in time
    order: each piece's rows reduced per pixel of the whole window's axis, joined, and reduced again
    (`figures.PIECES`): the figure of the whole window read at once. The selection is resolved on the first piece
    (the trace's span is every piece's)."""
    if kind not in IN_PIECES:
        raise UsageError(f"plot kind {kind!r} is not drawn in pieces (kinds: {', '.join(IN_PIECES)})")
    if dpi <= 0:
        raise UsageError(f"--dpi must be positive, got {dpi:g}")
    # lazy: matplotlib loads only to draw (export, and the CLI's window choice, import this package)
    from pdtrace.plot.figures import FIGURE_TABLES, PIECES, time_axis

    points_of, joined, draw = PIECES[kind]

    drawn = []
    sel: Selection | None = None
    with allocation_settings():
        for k, (ctx, since, until) in enumerate(pieces):
            if sel is None:
                sel = resolve(ctx, window or Window())
                axis = time_axis(sel, dpi)
            lo = sel.lo_ns if since is None else max(sel.lo_ns, since)
            hi = sel.hi_ns if until is None else min(sel.hi_ns, until - 1)
            if lo <= hi:
                build_tables(ctx, FIGURE_TABLES[kind], int(ctx.config.jobs) or default_jobs())
                drawn.append(points_of(ctx, replace(sel, lo_ns=lo, hi_ns=hi), axis, sel.lo_ns, held=k == 0))
            del ctx  # the piece's rows go before the next piece is read
    if sel is None:
        raise UsageError("nothing to draw: no piece of the trace was read")
    return draw(joined(drawn, sel, axis), sel, axis, dpi)


def render(ctx: AnalysisContext | Iterable[Piece], kind: str, output: str | Path, window: Window | None = None,
           dpi: float = 100.0) -> PlotResult:
    """Draw one plot kind and save it; the format follows the file's extension (png, svg or pdf). `ctx`: the
    context, or a window's pieces (`build_figure_in_pieces`)."""
    output = Path(output)
    fmt = output.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise UsageError(f"{output}: unknown image format {output.suffix or '(none)'!r}; use .png, .svg or .pdf")
    fig = (build_figure(ctx, kind, window, dpi) if isinstance(ctx, AnalysisContext)
           else build_figure_in_pieces(ctx, kind, window, dpi))
    try:
        fig.savefig(output, format=fmt, dpi=dpi)
    except OSError as exc:
        raise UsageError(f"{output}: cannot write the image: {exc.strerror or exc}") from None
    width, height = fig.get_size_inches()
    return PlotResult(output, kind, int(round(width * dpi)), int(round(height * dpi)))


__all__ = ["KINDS", "FORMATS", "IN_PIECES", "Piece", "PlotResult", "Window", "Selection", "EmptySelection",
           "build_figure", "build_figure_in_pieces", "render",
           "default_output", "trace_stem"]
