"""Runtime switch and error policy shared by every vLLM hook.

A hook must never crash or stall vLLM. Each wrapper checks `RUNTIME.active` first (one attribute read) and calls
vLLM's original unchanged when recording is off; pdtrace's own code inside a wrapper runs under try/except, and an
error there goes to `RUNTIME.fail`: counted, logged once with its traceback, `recorder_off` emitted on this
process's recorders, and recording switched off for the rest of the process. vLLM's own exceptions are never
caught by pdtrace (the engine-loop wrapper records them as `engine_error` and re-raises them).
"""

from __future__ import annotations

import logging
import threading

from pdtrace.recording import session

log = logging.getLogger("pdtrace")


class Runtime:
    """Process-wide state of the hooks: whether they record, and what went wrong."""

    __slots__ = ("active", "errors", "first_error", "_warned", "_lock")

    def __init__(self) -> None:
        self.active = False
        self.errors = 0
        self.first_error: str | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def fail(self, where: str, exc: BaseException) -> None:
        """An error inside pdtrace: count it, log it once, switch recording off; vLLM carries on."""
        with self._lock:
            self.errors += 1
            first = self.first_error is None
            if first:
                self.first_error = f"{where}: {type(exc).__name__}: {exc}"
            was_active, self.active = self.active, False
        if first:
            log.warning("pdtrace: internal error in the %s hook; recording is off for this process (vLLM is not "
                        "affected)", where, exc_info=(type(exc), exc, exc.__traceback__))
        if was_active:
            session.recording_off_all(self.first_error or where)

    def reset(self) -> None:
        """Forget errors and warnings (tests; a new session in the same process)."""
        with self._lock:
            self.errors = 0
            self.first_error = None
            self._warned.clear()

    def warn_once(self, key: str, message: str) -> None:
        """Log `message` as a warning the first time `key` is seen in this process."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("%s", message)


RUNTIME = Runtime()
