"""Thresholds of the analysis rules. Defaults here; `[tool.pdtrace]` in a pyproject.toml and CLI flags override."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from pdtrace.errors import UsageError


@dataclass(frozen=True)
class AnalysisConfig:
    #: How long a request may hold blocks waiting on a peer before it counts as leaked / stuck (seconds). 480 s is the
    #: longest of vLLM's connector timeouts (NIXL's decode-side TTL, Mooncake's abort timeout).
    grace_s: float = 480.0
    #: Steps a waiting request may go unscheduled while others run and capacity exists before it is `starved`.
    starve_steps: int = 50
    #: Steps a running request may be neither scheduled nor finished before it is a `zombie`.
    zombie_steps: int = 50
    #: Idle gaps on a PP rank shorter than this are not reported as bubbles (nanoseconds).
    bubble_min_ns: int = 1_000_000
    #: A rank whose idle fraction is at least this gets a warning-level pipeline_bubble finding.
    bubble_warn_fraction: float = 0.10
    #: Window of the analysis (ns since the epoch); None means unbounded.
    since_ns: int | None = None
    until_ns: int | None = None
    #: Only these instances (None: all).
    instances: tuple[str, ...] | None = None

    def with_overrides(self, **values: Any) -> "AnalysisConfig":
        """A copy with the given fields replaced; unknown names or bad types raise UsageError."""
        known = {f.name: f for f in fields(self)}
        clean: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise UsageError(f"unknown analysis setting {key!r} (known: {', '.join(sorted(known))})")
            if value is None:
                continue
            default = getattr(self, name)
            try:
                if isinstance(default, bool):
                    value = bool(value)
                elif isinstance(default, int) and not isinstance(value, bool):
                    value = int(value)
                elif isinstance(default, float):
                    value = float(value)
            except (TypeError, ValueError):
                raise UsageError(f"analysis setting {key!r} must be a number, got {value!r}") from None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise UsageError(f"analysis setting {key!r} must not be negative, got {value!r}")
            clean[name] = value
        return replace(self, **clean)
