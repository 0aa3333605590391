"""What a rule receives: the trace, the thresholds, and a cache of derived tables shared between rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, TypeVar

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.once import OnceCache
from pdtrace.trace.model import Trace

T = TypeVar("T")


@dataclass
class AnalysisContext:
    trace: Trace
    config: AnalysisConfig = field(default_factory=AnalysisConfig)
    _cache: OnceCache = field(default_factory=OnceCache, repr=False)

    def cached(self, key: str, build: Callable[[], T]) -> T:
        """Compute a derived table once per analysis run (e.g. the sorted event order, block ownership), also when
        rules running on several threads ask for it at the same time."""
        return self._cache.get(key, build)
