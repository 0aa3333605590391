"""The recording session of one process: where traces go, and one Recorder per (process, instance, dp rank).

A live run turns recording on with the environment variable `PDTRACE_TRACE_DIR` (the vLLM plugin calls
`configure_from_env()`); a dry run calls `configure(directory, source="dryrun", clock=...)` itself. Recorders are
opened lazily, on the first event of an instance in a process: vLLM forks its children after the plugin ran in
the parent, so a child finds the parent's configuration and opens its own recorders under its own pid.

Recording path: imports only the standard library (the Recorder, which needs pyarrow, is imported on first use).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdtrace.recording import switch
# The recording switch (`PDTRACE_TRACE_DIR`): defined in `switch`, importable from here as before.
from pdtrace.recording.switch import TRACE_DIR_ENV

if TYPE_CHECKING:  # pragma: no cover
    from pdtrace.recording.flight import FlightConfig
    from pdtrace.recording.recorder import Recorder

log = logging.getLogger("pdtrace")

_lock = threading.Lock()
_directory: str | None = None
_source = "dryrun"
_clock: Callable[[], int] | None = None
_flight: "FlightConfig | None" = None
#: (pid, instance, dp_rank) -> Recorder. Keyed by pid so that a forked child never reuses its parent's writers.
_recorders: dict[tuple[int, str, int | None], "Recorder"] = {}


def configure(directory: str | os.PathLike[str], source: str = "dryrun",
              clock: Callable[[], int] | None = None, flight: "FlightConfig | None" = None) -> None:
    """Record into `directory` from now on (closing this process's recorders of an earlier session first); with
    `flight`, in flight mode (pdtrace.recording.flight: a ring per process, written only on a dump)."""
    global _directory, _source, _clock, _flight
    close_all()
    with _lock:
        _directory = switch.trace_directory = os.fspath(directory)
        _source = source
        _clock = clock
        _flight = flight
    if flight is not None or "pdtrace.recording.flight" in sys.modules:
        # lazy: flight loads the recorder and pyarrow; the session loads in every vLLM process (plugin.py)
        from pdtrace.recording import flight as flight_mode

        flight_mode.configure(_directory if flight is not None else None, flight)


def configure_from_env(source: str) -> bool:
    """Configure from `PDTRACE_TRACE_DIR` (and flight mode from `PDTRACE_FLIGHT`) unless a session is already
    configured; False when the switch is off, or when flight mode's settings are bad (one line on stderr: a
    production process asked to keep a window must not write a full trace instead)."""
    directory = os.environ.get(TRACE_DIR_ENV)
    if not directory:
        return False
    if _directory is None:
        flight = None
        if os.environ.get("PDTRACE_FLIGHT", "").strip():
            # lazy: flight loads the recorder and pyarrow; the session loads in every vLLM process (plugin.py)
            from pdtrace.recording.flight import config_from_env

            try:
                flight = config_from_env()
            except ValueError as exc:
                sys.stderr.write(f"pdtrace: recording off: {exc}\n")
                return False
        configure(directory, source=source, flight=flight)
    return True


def flight() -> "FlightConfig | None":
    """Flight mode's settings of this session, or None (full recording, or no session)."""
    return _flight


def is_configured() -> bool:
    """Whether a session is configured (recorders can be opened)."""
    return _directory is not None


def duration_clock() -> Callable[[], int]:
    """The clock hooks take durations from (`dur_ns`, `wait_ns`): the configured clock (a dry run's virtual one,
    so that the same seed gives the same trace), else `time.perf_counter_ns` (monotonic, unlike the
    `time.time_ns` that stamps live events)."""
    clock = _clock
    return clock if clock is not None else time.perf_counter_ns


def directory() -> str | None:
    """The configured trace directory, or None."""
    return _directory


def recorder(instance: str, role: str, dp_rank: int | None = None) -> "Recorder":
    """This process's Recorder for one engine instance (created on first use)."""
    key = (os.getpid(), instance, dp_rank)
    rec = _recorders.get(key)
    if rec is not None:
        return rec
    with _lock:
        rec = _recorders.get(key)
        if rec is None:
            if _directory is None:
                raise RuntimeError("pdtrace recording session is not configured")
            if _flight is not None:
                # lazy: flight loads the recorder and pyarrow; the session loads in every vLLM process (plugin.py)
                from pdtrace.recording.flight import make_recorder as make
            else:
                from pdtrace.recording.recorder import Recorder as make  # type: ignore[assignment]

            rec = make(_directory, instance=instance, role=role, source=_source, dp_rank=dp_rank,
                       component="scheduler", clock=_clock)
            _recorders[key] = rec
    return rec


def recorders() -> list["Recorder"]:
    """This process's open recorders."""
    pid = os.getpid()
    return [rec for (rec_pid, _, _), rec in list(_recorders.items()) if rec_pid == pid]


def flush_all() -> None:
    """Flush this process's recorders (after an engine error, before the process may die)."""
    for rec in recorders():
        try:
            rec.flush()
        except Exception:  # a recorder must never take its host down
            log.debug("pdtrace: flush failed", exc_info=True)


def recording_off_all(error: str) -> None:
    """Emit `recorder_off` on every recorder of this process and stop them accepting events."""
    for rec in recorders():
        try:
            rec.recording_off(error)
        except Exception:
            log.debug("pdtrace: recording_off failed", exc_info=True)


def close_all() -> None:
    """Close this process's recorders (flushing them) and forget every recorder, the parent's included."""
    with _lock:
        mine = recorders()
        _recorders.clear()
    for rec in mine:
        try:
            rec.close()
        except Exception:
            log.debug("pdtrace: close failed", exc_info=True)


def reset() -> None:
    """Close everything and forget the configuration (tests, and a dry run that ends its session)."""
    global _directory, _clock, _flight
    close_all()
    with _lock:
        _directory = switch.trace_directory = None
        _clock = None
        _flight = None
    if "pdtrace.recording.flight" in sys.modules:
        sys.modules["pdtrace.recording.flight"].configure(None, None)
