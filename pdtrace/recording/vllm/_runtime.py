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
from typing import Any, Callable

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


#: What a `guarded` wrapper's `before` returns to step aside: vLLM's original runs alone (nothing to record).
SKIP: Any = object()

#: The one shape of a guarded wrapper (`guarded`), specialised by what it has: `{params}` are the hooked method's
#: own parameters, so that a call passes through as cheaply as a hand-written wrapper (no *args/**kwargs packing).
_TEMPLATE = """\
def {name}(self{sig}):
    if not rt.active:
        return orig(self{args})
{before}{call}{after}    return out
"""
_BEFORE = """\
    try:
        ctx = before(self{args})
    except Exception as exc:
        rt.fail(where, exc)
        return orig(self{args})
    if ctx is SKIP:
        return orig(self{args})
"""
_CALL = "    out = orig(self{args})\n"
_CALL_RESTORE = """\
    try:
        out = orig(self{args})
    finally:
        restore(ctx)
"""
_AFTER = """\
    if rt.active:
        try:
            after(ctx, self, out{args})
        except Exception as exc:
            rt.fail(where, exc)
"""


def guarded(where: str, params: tuple[str, ...] | None, before: Callable[..., Any] | None = None,
            after: Callable[..., Any] | None = None, restore: Callable[[Any], Any] | None = None
            ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A hook's wrapper factory (`orig -> wrapper`) with the guard every hook keeps written once: with recording
    off, vLLM's original is called and nothing else; pdtrace's own work (`before`, `after`, `restore`) runs under
    try/except, an error there goes to `RUNTIME.fail` (counted, logged once, recording switched off) and vLLM's
    call goes on; vLLM's own exceptions pass through untouched.

    `params`: the method's parameters after self, passed positionally (None: `*args, **kwargs`, for a method whose
    parameters differ across releases). `before(self, *params) -> ctx`, before vLLM's call (`SKIP`: the original
    alone; on an error, too); `after(ctx, self, out, *params)` after it returned, while recording is still on;
    `restore(ctx)` after it, returned or raised (state set by `before` for the duration of the call: a free reason,
    say), only where `before` gave a ctx. `where` names the hook in the error report."""
    if params is None:
        sig, args = ", *args, **kwargs", ", *args, **kwargs"
    else:
        sig = args = "".join(f", {p}" for p in params)
    if before is None and restore is not None:
        raise ValueError("restore needs before (it undoes what before set)")
    source = _TEMPLATE.format(
        name="wrapper", sig=sig, args=args,
        before=_BEFORE.format(args=args) if before is not None else "    ctx = None\n",
        call=(_CALL_RESTORE if restore is not None else _CALL).format(args=args),
        after=_AFTER.format(args=args) if after is not None else "")

    def factory(orig: Callable[..., Any]) -> Callable[..., Any]:
        scope = {"rt": RUNTIME, "orig": orig, "before": before, "after": after, "restore": restore,
                 "where": where, "SKIP": SKIP}
        exec(source, scope)  # noqa: S102 - our own template: a wrapper with the method's exact parameters
        wrapper = scope["wrapper"]
        wrapper.__name__ = wrapper.__qualname__ = getattr(orig, "__name__", "wrapper")
        wrapper.__doc__ = getattr(orig, "__doc__", None)
        return wrapper

    factory.where = where  # type: ignore[attr-defined]
    return factory
