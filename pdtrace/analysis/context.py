"""What a rule receives: the trace, the thresholds, and a cache of derived tables shared between rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.trace.model import Trace

T = TypeVar("T")


@dataclass
class AnalysisContext:
    trace: Trace
    config: AnalysisConfig = field(default_factory=AnalysisConfig)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def cached(self, key: str, build: Callable[[], T]) -> T:
        """Compute a derived table once per analysis run (e.g. the sorted event order, block ownership)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]
