"""What a rule receives: the trace, the thresholds, and a cache of derived tables shared between rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, TypeVar

import pyarrow.compute as pc

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.once import OnceCache
from pdtrace.trace.model import Trace

if TYPE_CHECKING:  # pragma: no cover
    from pdtrace.analysis.windows import WindowEnd

T = TypeVar("T")


@dataclass
class AnalysisContext:
    trace: Trace
    config: AnalysisConfig = field(default_factory=AnalysisConfig)
    _cache: OnceCache = field(default_factory=OnceCache, repr=False)
    #: (first, last) `ts_ns` of the whole analysed trace when `trace` is one partition of it
    #: (`pdtrace.analysis.partitions`); None: `trace` is the whole trace.
    span_ns: tuple[int, int] | None = None
    #: Where `trace` is a time window of a longer trace that goes on after it (`pdtrace.analysis.windows.
    #: read_time_window`): its end and the requests' last rows, so that a finding about a request it holds only
    #: the beginning of is left out (`windows.judged`). None: the trace ends where the run does, as far as known.
    window_end: WindowEnd | None = None

    def cached(self, key: str, build: Callable[[], T]) -> T:
        """Compute a derived table once per analysis run (e.g. the sorted event order, block ownership), also when
        rules running on several threads ask for it at the same time."""
        return self._cache.get(key, build)


def trace_span(ctx: AnalysisContext) -> tuple[int, int]:
    """(first, last) `ts_ns` of the whole analysed trace; (0, 0) for an empty trace. On a partition, the whole
    trace's (`AnalysisContext.span_ns`), so "open at the end of the trace" means the same in every partition."""
    if ctx.span_ns is not None:
        return ctx.span_ns
    ts = ctx.trace.table.column("ts_ns")
    if len(ts) == 0:
        return 0, 0
    bounds = pc.min_max(ts).as_py()
    return int(bounds["min"]), int(bounds["max"])
