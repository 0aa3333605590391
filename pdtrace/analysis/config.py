"""Thresholds of the analysis rules. Defaults here; `[tool.pdtrace]` in a pyproject.toml and CLI flags override."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
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
    #: Steps with preemptions and no progress before a scheduler counts as livelocked (`no_progress`): vLLM 0.33's
    #: own dry runs under heavy preemption stay silent down to 1.
    livelock_steps: int = 4
    #: Idle gaps on a PP rank shorter than this are not reported as bubbles (nanoseconds).
    bubble_min_ns: int = 1_000_000
    #: A rank whose idle fraction is at least this gets a warning-level pipeline_bubble finding.
    bubble_warn_fraction: float = 0.10
    #: Window of the analysis (ns since the epoch); None means unbounded.
    since_ns: int | None = None
    until_ns: int | None = None
    #: Only these instances (None: all).
    instances: tuple[str, ...] | None = None
    #: Threads for the rules and their shared tables (`pdtrace.analysis.parallel`): 0 = one per CPU, at most 4;
    #: 1 = one after the other on the caller's thread. On a partitioned trace (`pdtrace.analysis.partitions`), the
    #: worker processes (0 = one per CPU; 1 = the partitions one after the other in this process). The findings
    #: are the same for every value.
    jobs: int = 0
    #: An instance with more events than this is analysed window by window, this many events a window
    #: (`pdtrace.analysis.windows`: memory bounded by the window, the same findings); 0 = never. The default
    #: (WINDOWS_AUTO) analyses an instance whole up to `windows.WHOLE_MAX_EVENTS` (15M: what one process holds) and
    #: above it in windows of `windows.DEFAULT_WINDOW_EVENTS` (5M: a window and its lookback in ~2 GiB);
    #: `windows.window_size` reads it.
    window_events: int = -1
    #: How far before its cut a window's analysis may start, in events, to hold the requests and steps open at the
    #: cut whole (0: half a window). A request opened earlier is carried alone (`pdtrace.analysis.windows`).
    window_lookback: int = 0

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


#: Keys of `[tool.pdtrace]` besides the AnalysisConfig fields: milliseconds for the bubble threshold, and the
#: analyze defaults (`rules`, `fail_on`).
PYPROJECT_EXTRA_KEYS = ("bubble_min_ms", "rules", "fail_on")


def find_pyproject(start: str | None = None) -> Path | None:
    """The nearest pyproject.toml with a `[tool.pdtrace]` table, from `start` (default: the cwd) upward."""
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file() and _has_tool_pdtrace(candidate):
            return candidate
    return None


def _has_tool_pdtrace(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return "pdtrace" in tomllib.load(handle).get("tool", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False


def load_pyproject_table(path: str | Path, required: bool = True) -> dict[str, Any]:
    """The `[tool.pdtrace]` table of a pyproject.toml ({} if absent and not required). Bad TOML -> UsageError."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML ({exc})") from None
    table = data.get("tool", {}).get("pdtrace")
    if table is None:
        if required:
            raise UsageError(f"{path}: no [tool.pdtrace] table")
        return {}
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [tool.pdtrace] must be a table")
    return table


def config_from_table(table: dict[str, Any], base: AnalysisConfig | None = None) -> tuple[AnalysisConfig, dict]:
    """(AnalysisConfig with the table's thresholds, the analyze defaults found: rules, fail_on). Unknown keys raise
    UsageError, so a typo in pyproject.toml does not silently fall back to a default."""
    base = base or AnalysisConfig()
    settings: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name == "bubble_min_ms":
            try:
                settings["bubble_min_ns"] = int(float(value) * 1_000_000)
            except (TypeError, ValueError):
                raise UsageError(f"[tool.pdtrace] bubble_min_ms must be a number, got {value!r}") from None
        elif name in ("rules", "fail_on"):
            defaults[name] = value
        elif name in ("since_ns", "until_ns", "instances"):
            raise UsageError(f"[tool.pdtrace] {key} is a per-run option; pass it on the command line")
        else:
            settings[name] = value
    return base.with_overrides(**settings), defaults
