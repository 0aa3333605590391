"""Traces in memory: `Trace` (model.py), `open_trace` (reader.py), the format checks (validate.py), hand-made
event tables (builder.py) and `summarize` (summary.py, what `pdtrace info` prints)."""

from __future__ import annotations

from pdtrace.trace.model import SkippedFile, Trace, TraceFile
from pdtrace.trace.reader import open_trace
from pdtrace.trace.validate import TraceWarning

__all__ = ["Trace", "TraceFile", "SkippedFile", "TraceWarning", "open_trace"]
