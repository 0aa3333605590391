"""The recorders' process lifecycle: what every recorder of a process shares with the process itself. Exit
(atexit, and multiprocessing's exit finalizers in forked children), SIGTERM / SIGINT (flush, then the shutdown
pace, then the previous handler), the flush request of `pdtrace record` (FLUSH_REQUEST_SIGNAL, `request_flush`),
and fork (a child keeps the parent's recorders but none of their rows): see `pdtrace.recording.recorder`.

A recorder joins with `_LIVE.add(rec)`; the hooks below reach it through its lifecycle methods (`close`, `_drain`,
`_before_fork`, `_after_fork_parent`, `_after_fork_child`) and state (`_state`, `_pid`, the pace attributes):
this module imports no recorder.

Recording path: imports only the standard library, the writer process's module and the conversion's (whose
writer ids a forked child takes afresh).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from pdtrace.recording import conversion, writer_process

if TYPE_CHECKING:  # pragma: no cover
    from pdtrace.recording.recorder import Recorder

# Recorder states.
_NEW = "new"  # no writer in this process yet: the first event starts it (again after a fork)
_ON = "on"
_OFF = "off"  # recording_off(): nothing more is accepted, buffered rows are still written
_CLOSED = "closed"

#: After SIGTERM / SIGINT (vLLM's shutdown begins; `vllm serve` SIGKILLs the engine right after), the tick and the
#: flush interval drop to these, so that what vLLM emits while it shuts down follows within milliseconds.
SHUTDOWN_TICK_S = 0.005
SHUTDOWN_FLUSH_S = 0.02

_LIVE: "weakref.WeakSet[Recorder]" = weakref.WeakSet()
_exit_hooks_pid: int | None = None
_sigterm_installed = False
_flush_request_installed = False


def _live_recorders() -> list[Recorder]:
    return [rec for rec in list(_LIVE) if rec._pid == os.getpid()]


def close_all() -> None:
    """Close every open recorder of this process, then stop its writer process once everything is on disk (what
    the exit hooks do)."""
    for rec in _live_recorders():
        rec.close()
    try:
        writer_process.stop_shared()
    except Exception:
        pass


def _register_exit_hooks() -> None:
    """atexit once per process; in a multiprocessing child also its exit finalizers, because multiprocessing's
    fork/forkserver children leave with os._exit() and never run atexit."""
    global _exit_hooks_pid
    pid = os.getpid()
    if _exit_hooks_pid == pid:
        return
    _exit_hooks_pid = pid
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        try:
            util.Finalize(None, close_all, exitpriority=100)
        except Exception:
            pass


atexit.register(close_all)


#: The signals a recording process flushes on before its own handler runs: SIGTERM (vLLM's shutdown of its
#: children, `docker stop`, systemd) and SIGINT (Ctrl-C reaches the whole process group).
_FLUSH_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_signal_previous: dict[int, Any] = {}
#: The signal with which `pdtrace record` asks every recording process to hand its buffer over before it forwards a
#: stop to the command (`request_flush`): `vllm serve` SIGKILLs its engine and workers at once when it is stopped
#: (its engine gets a SIGTERM a moment before; its workers none), which lost up to a flush interval of every
#: process's events. vLLM handles SIGINT, SIGTERM and (one connector) SIGQUIT, never SIGUSR2; flight mode uses the
#: same signal for its dumps (a flight process writes nothing until one), so only a recorder that writes as it goes
#: installs the handler (`Recorder.WRITES_AS_IT_GOES`), and only over the default action.
FLUSH_REQUEST_SIGNAL = signal.SIGUSR2
#: Under the trace directory: the flush requests' acknowledgements, one file per process (its pid), holding the
#: `time.time_ns()` at which its buffers were on their way to disk.
FLUSH_ACK_DIR = ".pdtrace-flushed"


def _install_sigterm_handler() -> None:
    """Flush on SIGTERM and SIGINT: install once per process, only from the main thread, only over a Python-level
    handler (SIG_DFL, SIG_IGN or a callable, vLLM's own included) so that the previous one can always be chained
    or restored; it runs right after ours."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_installed = True
    for signum in _FLUSH_SIGNALS:
        try:
            previous = signal.getsignal(signum)
            if previous is None:  # installed from C: we could not chain it, so leave the host's handler alone
                continue
            signal.signal(signum, _on_sigterm)
            _signal_previous[signum] = previous
        except (ValueError, OSError, AttributeError):
            pass


def _on_sigterm(signum: int, frame: Any) -> None:
    """Hand every buffered event to the writer (bounded by the write lock's 5 s; the writer process answers in
    milliseconds), then switch every recorder of the process to the shutdown pace (SHUTDOWN_TICK_S), then run the
    previous handler: what vLLM emits while it shuts down follows at once, before `vllm serve`'s SIGKILL."""
    for rec in _live_recorders():
        try:
            if rec._state != _NEW:
                rec._drain(until_empty=True, lock_timeout=5.0)
                rec._tick_s = SHUTDOWN_TICK_S
                rec.flush_interval_s = min(rec.flush_interval_s, SHUTDOWN_FLUSH_S)
                rec._wake.set()
        except Exception:
            pass
    previous = _signal_previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL: die of the signal as the process would have without us, nothing left behind (BYE)
        try:
            writer_process.stop_shared(timeout=5.0)
        except Exception:
            pass
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_flush_request_handler() -> None:
    """Serve FLUSH_REQUEST_SIGNAL: once per process, only from the main thread, only over its default action (a
    handler of the host's, or flight mode's dump signal, stays)."""
    global _flush_request_installed
    if _flush_request_installed or threading.current_thread() is not threading.main_thread():
        return
    _flush_request_installed = True
    try:
        if signal.getsignal(FLUSH_REQUEST_SIGNAL) == signal.SIG_DFL:
            signal.signal(FLUSH_REQUEST_SIGNAL, _on_flush_request)
    except (ValueError, OSError, AttributeError):
        pass


def _on_flush_request(signum: int, frame: Any) -> None:
    """`pdtrace record` is about to stop its command (`request_flush`): hand every buffered event to the writer
    (bounded like the SIGTERM flush), then say so in FLUSH_ACK_DIR, only where every recorder of the directory
    got its rows out (a writer thread stuck on its batch keeps the lock: `pdtrace record` then counts this
    process as not handed over). The process goes on as before."""
    directories: dict[str, bool] = {}
    for rec in _live_recorders():
        directory = os.fspath(rec.directory)
        try:
            done = rec._state == _NEW or rec._drain(until_empty=True, lock_timeout=2.0)
        except Exception:
            done = False
        directories[directory] = directories.get(directory, True) and done
    for directory in (d for d, done in directories.items() if done):
        try:
            folder = os.path.join(directory, FLUSH_ACK_DIR)
            os.makedirs(folder, exist_ok=True)
            temporary = os.path.join(folder, f".{os.getpid()}.tmp")
            with open(temporary, "w", encoding="ascii") as handle:
                handle.write(str(time.time_ns()))
            os.replace(temporary, os.path.join(folder, str(os.getpid())))
        except Exception:
            pass


def request_flush(directory: str | os.PathLike[str], timeout: float = 2.0) -> tuple[int, int]:
    """Ask every live recording process of the trace under `directory` (its pid folders; a process that recorded
    nothing yet has nothing to lose) to hand its buffer over (FLUSH_REQUEST_SIGNAL, only to processes that catch
    it: its default action would kill them), and wait up to `timeout` for their acknowledgements. Returns
    (processes asked, processes that acknowledged)."""
    me, started = os.getpid(), time.time_ns()
    pids = set()
    for instance in os.scandir(directory):
        if instance.is_dir() and not instance.name.startswith("."):
            pids.update(int(p.name) for p in os.scandir(instance.path) if p.is_dir() and p.name.isdigit())
    asked = []
    for pid in sorted(pids - {me}):
        if _catches(pid, FLUSH_REQUEST_SIGNAL):
            try:
                os.kill(pid, FLUSH_REQUEST_SIGNAL)
                asked.append(pid)
            except OSError:
                pass
    folder = os.path.join(directory, FLUSH_ACK_DIR)
    deadline = time.monotonic() + timeout
    done: set[int] = set()
    while True:
        for pid in asked:
            if pid not in done:
                try:
                    with open(os.path.join(folder, str(pid)), encoding="ascii") as handle:
                        if int(handle.read() or 0) >= started:
                            done.add(pid)
                except (OSError, ValueError):
                    if not _alive(pid):
                        done.add(pid)  # gone meanwhile: nothing more to wait for
        if len(done) == len(asked) or time.monotonic() >= deadline:
            return len(asked), len(done)
        time.sleep(0.005)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux /proc SigCgt); False where unknown."""
    try:
        with open(f"/proc/{pid}/status", "r", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:
        return True


_fork_held: list[tuple[Recorder, tuple[bool, bool]]] = []


def _before_fork() -> None:
    for rec in _live_recorders():
        try:
            _fork_held.append((rec, rec._before_fork()))
        except Exception:
            pass


def _after_fork_parent() -> None:
    while _fork_held:
        rec, held = _fork_held.pop()
        try:
            rec._after_fork_parent(held)
        except Exception:
            pass


def _after_fork_child() -> None:
    conversion._writer_ids_lock = threading.Lock()  # the parent's writer thread may have held it at fork time
    _fork_held.clear()
    for rec in list(_LIVE):
        try:
            rec._after_fork_child()
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)
