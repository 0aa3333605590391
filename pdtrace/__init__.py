"""pdtrace: memcheck for the KV cache of LLM serving engines.

`pdtrace.open_trace(path)` loads a trace; `pdtrace.analyze(trace)` returns the findings as a DataFrame.
Importing this package stays cheap (the recording path loads it into every vLLM process), so the reader and the
analyses are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from pdtrace.trace.model import Trace


def open_trace(path: Any, **kwargs: Any) -> "Trace":
    """Open a trace directory (or one Parquet file); see `pdtrace.trace.reader.open_trace`."""
    # lazy: every pdtrace import (the hooks in each vLLM process too) runs this file; no reader at import
    from pdtrace.trace.reader import open_trace as _open_trace

    return _open_trace(path, **kwargs)


def analyze(trace: Any, **kwargs: Any) -> Any:
    """Run the analysis rules on a trace (or a path) and return the findings DataFrame; see `pdtrace.analysis`."""
    # lazy: every pdtrace import (the hooks in each vLLM process too) runs this file; no analysis at import
    from pdtrace.analysis import analyze as _analyze

    return _analyze(trace, **kwargs)


__all__ = ["__version__", "open_trace", "analyze"]
