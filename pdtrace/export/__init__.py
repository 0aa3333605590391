"""`pdtrace export`: a trace as Chrome Trace Event JSON or a Perfetto protobuf, for ui.perfetto.dev.

Both formats serialise one model (`pdtrace.export.model.build_model`) built from the analyses' tables.
"""

from __future__ import annotations

from pathlib import Path

from pdtrace.analysis import allocation_settings
from pdtrace.analysis.context import AnalysisContext
from pdtrace.errors import UsageError
from pdtrace.export.chrome import write_chrome
from pdtrace.export.model import ExportModel, build_model
from pdtrace.export.perfetto import _builder_classes, write_perfetto
from pdtrace.plot.window import Window, resolve

FORMATS: tuple[str, ...] = ("chrome", "perfetto")


def export(ctx: AnalysisContext, to: str, output: str | Path, window: Window | None = None,
           trace_name: str = "") -> ExportModel:
    """Write the selection of a trace in format `to` (chrome or perfetto) and return what was written."""
    if to not in FORMATS:
        raise UsageError(f"unknown export format {to!r} (formats: {', '.join(FORMATS)})")
    if to == "perfetto":
        _builder_classes()  # fail on a missing package before any work
    with allocation_settings():  # as analyze runs its rules
        sel = resolve(ctx, window or Window())
        model = build_model(ctx, sel)
    try:
        if to == "chrome":
            write_chrome(model, output, trace_name)
        else:
            write_perfetto(model, output)
    except OSError as exc:
        raise UsageError(f"{output}: cannot write the export: {exc.strerror or exc}") from None
    return model


__all__ = ["FORMATS", "ExportModel", "build_model", "export"]
