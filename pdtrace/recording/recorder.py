"""The per-process event recorder: one cheap call per event; a writer process (or thread) writes the part files.

    rec = Recorder(directory, instance="prefill-0", role="prefill", source="vllm-0.33.0", dp_rank=0)
    sched = rec.channel("scheduler")
    sched.emit("req_add", req="r1", n=40, detail={"remote_decode": True})
    sched.emit_many("req_sched", step=3, reqs=["r1", "r2"], ns=[16, 1])
    rec.close()

How it stays cheap on the caller's thread: `emit` builds ONE tuple of the row's ROW_WIDTH = 12 fields (timestamp,
channel id, the event's fields) and adds its fields to the end of ONE flat list with a pre-bound `list.extend`,
after one length check (in slots) against a threshold that the slow path and the writer maintain. Nothing else
happens there: no locks, no I/O, no JSON. `emit_many` and `emit_counts` (one event per request of a step) add one
batch entry (one row) for all of them, under the state lock, and the writer expands it. `seq` is not taken on the
caller's thread either: a `list.extend` from a tuple is atomic (it runs no Python code, so the GIL is not released
in it), so the list order IS the writer's exact event order, and the writer numbers rows by their position in that
stream (strictly increasing per writer, across part files too; rows lost to a drop or a failed write leave a
hole).
Within one thread, seq order is call order; across threads, `ts_ns` can be slightly out of seq order (a thread can
be preempted between reading the clock and adding the row).

Why a flat list rather than a list of row tuples: the tuple is then a temporary (freed at once) instead of a
GC-tracked object that lives until the writer takes it. vLLM `gc.freeze()`s its heap after start-up, so the
recorder's buffered rows were what triggered the engine loop's young collections, and each scanned every buffered
row; the flat list adds only the objects an event brings (block lists, detail dicts, emit_many's lists, and
emit_counts's one dict copy, which is why the vLLM hooks record a step's req_sched batch with it).
Measured on vLLM 0.33.0 (bench/engine_overhead.py's workload: 1000 requests, 580 steps, 24 423 events; a shared
2-core machine, so differences of ~1-2 % are noise), one tuple per row -> the flat buffer:
    in one process, a fresh EngineCore per run, the two recorders' modes alternating (10 rounds, writer in-thread
    for both): loop-thread CPU +9.8 -> +9.4 % over no hooks, paired median -2.8 ms of a 344 ms loop; the loop's
    garbage collections 26 (5.7 ms) -> 12 (4.2 ms);
    bench/engine_overhead.py --rounds 7 (separate processes, one tree after the other): loop wall +11.6 ->
    +9.8 %, process CPU (+flush) +14.0 -> +11.4 %;
    the emit alone (a loop of 24 000 adds, the heap frozen): ~190 -> ~130 ns, 42 -> 11 young collections;
    bench/recorder.py: emit p99.9 45 -> 3 us with the writer running; conversion + write 1392 -> 1111 ns/event.
So the buffer's own share is small now: most of recording's cost on the loop is the hooks' work and the emit
calls themselves.

The writer thread (a daemon, started lazily on the first event of each process) wakes every `flush_interval_s` or
when `flush_events` rows are waiting, and takes the rows out of the list with one slice copy and one slice delete
(each atomic, so an extend that races the take simply stays for the next part; every add is one whole row, so the
take is whole rows). It numbers them (`seq`), then hands them to this process's writer process
(`pdtrace.recording.writer_process`, spawned once per pid, at `warm_up` or by the first writer thread):
`encode_batch` marshals them (~300 ns per event on the engine's GIL, against ~1100 ns for conversion and Parquet:
bench/recorder.py), the child converts and writes them with `write_rows`, and answers once the part is on disk; the
writer thread waits for that answer without the GIL. Without a writer process (`PDTRACE_WRITER_PROCESS=0`, a
platform without one, a spawn that failed, a child lost or stalled past its timeout, a recorder given its own
`part_writer`) the writer thread calls `write_rows` itself: the same code, the same files.

`write_rows` converts column by column (`flat_rows_to_table`: each column one C-level slice
`flat[field::ROW_WIDTH]`, then Arrow buffers filled by C-level iteration, with the garbage collector paused, since
that creates many short-lived objects; never `pa.array` on Python lists, which would import pandas; a batch entry's
columns are built once and repeated per request by an Arrow `take`), JSON-encodes dict details there, maps channel
ids to component/dp/pp/tp, and writes `<directory>/<instance>/<pid>/part-NNNNNN.parquet` (zstd, Parquet dictionary
encoding for the dictionary columns and `req`; `pid` is the recording process's) under a temporary name starting
with `.`, then links it to its name: a crash leaves only whole part files (and perhaps a hidden temporary file).

Memory is bounded: events waiting plus events being written never exceed `max_buffered_events` (a batch entry
counts for its events). Past that, new events
are dropped and counted (the caller never waits for the writer); when there is room again a `recorder_gap` row
(n = events dropped, ts_ns = when the drop began) is put into the stream where the gap was. Every file carries
`pdtrace.dropped_events` = drops so far in this writer (so the last file of a writer holds its total). The writer
process's pipe cannot stall a caller either: a batch the child has not taken or answered stays in flight (the
buffer fills, and drops follow), and a child silent for `writer_process.REPLY_TIMEOUT_S` is killed (that batch
counted as dropped) and the writer thread carries on in-process.

Flushes happen on `flush()`, `close()`, at interpreter exit (atexit, and multiprocessing's exit finalizers in
forked children, which leave with `os._exit`), on SIGTERM and SIGINT (a handler installed once, from the main
thread, that flushes, switches the recorders to a few-millisecond pace for what the host emits while it shuts down,
and then chains to the previous handler, vLLM's included, or re-raises the default action), and when the buffer
stopped changing for a tick (`IDLE_TICK_S`: the batch is `settled`); each returns once the rows are on disk (the
writer process's answer), and the exit hooks then stop the writer process (BYE). A SIGKILL loses what was still
buffered here (at most what came since the last hand-over): the writer process, which is out of the recording
process's tree (vLLM SIGKILLs every descendant at `vllm serve`'s shutdown), reads EOF, writes every batch it
received whole, marks a `recorder_gap` (n null) if the last hand-over was not settled, and ends, so it never
outlives the recording process by more than that. A row recorded after a settled hand-over takes the slow path
(threshold 0 while `_settled_told`), which wakes the writer thread to tell the writer process at once (`UNSETTLED`,
no part file): what is left unmarked is the writer thread's wake-up, not a flush interval. A forked child keeps the parent's
recorders but empties their buffers: it writes only its own events, under its own pid folder, opened on its
first event, through its own writer process (it closes its copies of the parent's pipes).

Measured, not adopted (the first two with one tuple per buffered row, before the flat buffer): handing rows to the
writer process more often than once a second cuts the engine loop's garbage collections (bench/engine_overhead.py:
24 young collections in the loop at 1 s, ~15 at 0.1 s, ~6 at 0.03 s; their CPU ~9 -> ~6 -> ~3 ms) but the extra
hand-overs cost as much as they save (process CPU over the loop unchanged or higher at 0.03 s), multiply the part
files, and split more runs of empty steps that the vLLM hooks coalesce while they are still buffered
(`edit_recent`). Storing `blocks` and `emit_many`'s lists as tuples (so that the GC untracks buffered rows) did not
change the loop's collections either (24 young, ~9 ms of CPU). Block ids in one side list beside the flat buffer (the
row holding their count; both extends under a per-recorder lock, since they are two operations, and a SIGTERM
flush that interrupts a block emit must not wait on that lock): built and tested (branch issue-13h, ed5f88a), same
rows, the loop's collections 12 (4.4 ms) -> 6 (1.1 ms), but no measurable change of the loop's CPU (in-process
A/B, 10 rounds: -0.7 ms median of ~386 ms, rounds -11 .. +4 ms), since an emit of a 20-id list costs ~640 ns
instead of ~430 with the lock and the copy; not worth a lock and a second buffer on the emit path.

Callers must not mutate a `blocks` list or `detail` dict after passing it: the writer reads it later.

This module is the emit path (channels, the flat buffer, the writer thread and its hand-over); the conversion to
Arrow and the part files are `pdtrace.recording.conversion` (which the writer process runs too), the process-wide
hooks (exit, signals, fork, `request_flush`, `close_all`) `pdtrace.recording.process_hooks`. Their public names stay
importable from here.

Recording path: imports only the standard library and pyarrow.
"""

from __future__ import annotations

import marshal
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import pyarrow as pa

from pdtrace.format import COMPONENTS, ROLES
from pdtrace.recording import writer_process
# The Arrow conversion and the process lifecycle live in their own modules (`conversion`, `process_hooks`); the names
# below stay importable from here, as before the split (tests, bench, flight, third-party code).
from pdtrace.recording.conversion import (_BATCH, _BLOCKS, _TS, PARQUET_DICTIONARY_COLUMNS, ROW_WIDTH,  # noqa: F401
                                          PartWriter, _as_blocks, _as_int, _as_str, _claim_part, _claim_seq,
                                          _encode_detail, _write_parquet, flat_rows_to_table, holds_bytes,
                                          rows_to_table, warm_up_pyarrow, write_part, write_rows)
from pdtrace.recording.process_hooks import (_CLOSED, _LIVE, _NEW, _OFF, _ON, FLUSH_ACK_DIR,  # noqa: F401
                                         FLUSH_REQUEST_SIGNAL, SHUTDOWN_FLUSH_S, SHUTDOWN_TICK_S, _alive, _catches,
                                         _install_flush_request_handler, _install_sigterm_handler, _live_recorders,
                                         _register_exit_hooks, close_all, request_flush)

__all__ = ["Recorder", "Channel", "RowView", "ROW_WIDTH", "rows_to_table", "flat_rows_to_table", "write_part",
           "write_rows", "encode_batch", "PARQUET_DICTIONARY_COLUMNS"]

Clock = Callable[[], int]

#: How often the writer thread looks at the buffer between flushes. A buffer that did not change over one tick is
#: handed over at once (`settled`): a process that goes quiet has its events out of its memory ~one or two ticks
#: later, in the writer process, which vLLM's SIGKILL of its children does not reach (writer_process); while events
#: keep coming, parts are still written every `flush_interval_s`. Each tick costs the writer thread a wake-up and
#: a length check (~10 per second).
IDLE_TICK_S = 0.1
_RECORDER_DP = object()  # channel(dp_rank=...) not given: the recorder's
_IN_THREAD = object()  # no writer process for this batch: the writer thread converts and writes it


def _rank(value: Any) -> int | None:
    """A rank as the int16 column takes it (a numpy integer or a string digit from a hook included)."""
    if value is None:
        return None
    rank = int(value)
    if not -32768 <= rank <= 32767:
        raise ValueError(f"rank out of range: {value!r}")
    return rank


class Channel:
    """A bound emitter: one (component, dp_rank, pp_rank, tp_rank) of one recorder. Get it from `Recorder.channel`."""

    __slots__ = ("_rec", "_rows", "_extend", "_clock", "_id", "component", "dp_rank", "pp_rank",
                 "tp_rank")

    def __init__(self, recorder: "Recorder", channel_id: int, component: str, dp_rank: int | None,
                 pp_rank: int | None, tp_rank: int | None) -> None:
        self._rec = recorder
        self._rows = recorder._rows
        self._extend = recorder._rows.extend
        self._clock = recorder._clock
        self._id = channel_id
        self.component = component
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank

    @property
    def channel_id(self) -> int:
        """This channel's id in its recorder's rows (`Recorder.edit_recent`)."""
        return self._id

    def emit(self, kind: str, step: int | None = None, req: str | None = None, blocks: Any = None,
             n: int | None = None, reason: str | None = None, status: str | None = None,
             delay_free: bool | None = None, deferred: bool | None = None, detail: Any = None) -> None:
        """Record one event now (ts_ns from the recorder's clock). Never raises, never blocks.

        blocks: a list/tuple of block ids; detail: a dict (JSON-encoded later, on the writer thread) or a JSON
        string. Do not mutate either afterwards.
        """
        # The hot path: one length check (in slots) against a threshold, one tuple, one extend of the flat buffer
        # (atomic: list.extend from a tuple runs no Python code). Everything else (starting the writer, waking it,
        # dropping when full, closed/off) is in the slow path behind the threshold. The try costs nothing on
        # Python >= 3.11 until something raises (an injected clock that fails).
        try:
            if len(self._rows) < self._rec._accept_below:
                self._extend((self._clock(), self._id, kind, step, req, blocks, n, reason, status, delay_free,
                              deferred, detail))
            else:
                self._rec._slow_add((self._clock(), self._id, kind, step, req, blocks, n, reason, status,
                                     delay_free, deferred, detail))
        except Exception:
            self._rec._count_error()

    def emit_many(self, kind: str, step: int | None = None, reqs: Iterable[str] = (), ns: Iterable[int] | None = None,
                  reason: str | None = None, status: str | None = None) -> None:
        """Record one event per request in one call: same kind, step, timestamp, reason and status; `n` from `ns`
        (paired with `reqs` in order) or null. Never raises, never blocks. Lists are kept as they are (do not
        mutate them afterwards); other iterables are read once, now.

        The events are buffered as ONE batch entry (one row of the buffer: `_BATCH` in its blocks slot, the lists
        in req and n) that the writer expands into one row per request: a step's req_sched rows cost the
        scheduler's thread one row instead of one per request (measured with bench/engine_overhead.py when rows
        were tuples, 27 requests per step: the loop's young collections 41 -> 19, 16 230 fewer tuples on the loop
        thread)."""
        try:
            ts = self._clock()
            reqs = reqs if reqs.__class__ is list else list(reqs)
            if ns is not None:
                ns = ns if ns.__class__ is list else list(ns)
                if len(ns) != len(reqs):  # paired as zip() pairs them: the shorter one decides
                    count = min(len(ns), len(reqs))
                    reqs, ns = reqs[:count], ns[:count]
            if reqs:
                self._rec._slow_add((ts, self._id, kind, step, reqs, _BATCH, ns, reason, status, None, None, None),
                                    len(reqs))
        except Exception:  # a bad iterable or clock from a hook: counted, never raised
            self._rec._count_error()

    def emit_counts(self, kind: str, step: int | None, counts: Mapping[str, int], reason: str | None = None,
                    status: str | None = None) -> None:
        """`emit_many` of a mapping: one event per request of `counts` (request id -> n), in its order. Never
        raises, never blocks. A dict is copied (one C-level copy; other mappings read once, now), and the copy is
        the batch entry's req: one object where `emit_many` keeps two lists (bench/engine_overhead.py's req_sched
        batches of ~28 requests: 73 ns for the copy against 307 for `list(d)` and `list(d.values())`, and one
        buffered object fewer for the garbage collector to count per step)."""
        try:
            ts = self._clock()
            counts = counts.copy() if counts.__class__ is dict else dict(counts)
            if counts:
                self._rec._slow_add((ts, self._id, kind, step, counts, _BATCH, None, reason, status, None, None,
                                     None), len(counts))
        except Exception:  # a bad mapping or clock from a hook: counted, never raised
            self._rec._count_error()

    def __repr__(self) -> str:
        return (f"Channel({self.component!r}, dp_rank={self.dp_rank}, pp_rank={self.pp_rank}, "
                f"tp_rank={self.tp_rank}, instance={self._rec.instance!r})")


def _write_part_default(table: pa.Table, path: Path) -> None:
    write_part(table, path)  # looked up per call, so that tests can monkeypatch the module's write_part


def warm_up() -> None:
    """Get the writer ready while vLLM starts rather than in the engine loop's first steps: start this process's
    writer process (its interpreter and pyarrow import run in the child, on another core). Without one (switched
    off, or it cannot start), convert and write (to memory) a few rows of every column shape once, so that
    pyarrow's one-time costs (the compute kernels' first dispatch, the Parquet writer and zstd set-up) are paid
    now rather than by the first part file, which in bench/engine_overhead.py cost the writer ~30 ms more than
    the next ones (35 -> 8 ms to write 21 600 rows; the warm-up itself takes ~4 ms). Never raises."""
    try:
        if writer_process.shared() is not None:
            return
    except Exception:
        pass
    warm_up_pyarrow()


def encode_batch(flat: list[Any], *header: Any, sanitise: bool = False, settled: bool = False) -> bytes:
    """The writer process's message for one batch: `marshal` of (checked, settled, flat, *header), flat being the
    flat buffer's slice (ROW_WIDTH slots per row), header the rest of `write_rows`'s arguments, and `settled`
    whether the recorder had seen no new event for one tick when it took them (the writer process's rule for a
    recording process that dies: `writer_process.main`). Measured:
    bench/recorder.py's mix, 247 ns of the writer thread's CPU per event against 1218 ns for the in-thread
    conversion + write (4.9x); bench/engine_overhead.py's rows (8760 entries for 24 423 events), marshal v4
    ~200-240 ns per entry (v2 ~330, pickle 5 ~295), ~4 ms in all (measured with one tuple per row). The flat
    buffer marshals faster than the same rows as a list of tuples (196 608 rows of bench/recorder.py's mix in
    parts of 65 536, 7 alternating rounds in one process: 302 vs 351 ns per row, 49.5 vs 51.5 B) and unmarshals
    faster in the child (162 vs 240 ns).

    marshal takes the exact built-in types only: it raises on other objects (then, or with `sanitise`, each row
    holding a value that is not plain is replaced by its sanitised copy, `_plain_row`, and `checked` is True), but
    it silently writes an object with the buffer protocol (a numpy integer or array) as bytes. The writer process
    looks for bytes in an unchecked batch (`holds_bytes`, on its own CPU) and asks for it again, sanitised."""
    if not sanitise:
        try:
            return marshal.dumps((False, settled, flat, *header), writer_process.MARSHAL_VERSION)
        except ValueError:  # "unmarshallable object" somewhere
            pass
    plain: list[Any] = []
    for start in range(0, len(flat), ROW_WIDTH):  # the rare path: row by row
        row = flat[start:start + ROW_WIDTH]
        plain += row if _is_plain(row) else _plain_row(row)
    return marshal.dumps((True, settled, plain, *header), writer_process.MARSHAL_VERSION)


_PLAIN_ATOMS = frozenset({int, float, str, bool, type(None)})

def _is_plain(value: Any) -> bool:
    """Whether marshal carries `value` as itself: exact built-in atoms in exact tuples, lists and dicts (the
    `_BATCH` marker included); not a circular one."""
    try:
        return _is_plain_inner(value)
    except RecursionError:
        return False


def _is_plain_inner(value: Any) -> bool:
    kind = value.__class__
    if kind in _PLAIN_ATOMS or value is _BATCH:
        return True
    if kind is tuple or kind is list:
        return all(map(_is_plain_inner, value))
    if kind is dict:
        return all(map(_is_plain_inner, value)) and all(map(_is_plain_inner, value.values()))
    return False


def _plain(value: Any, coerce: Callable[[Any], Any]) -> Any:
    return value if _is_plain(value) else coerce(value)


def _plain_bool(value: Any) -> bool | None:
    try:
        return None if value is None else bool(value)
    except Exception:
        return None


def _plain_row(row: Iterable[Any]) -> tuple:
    """A row marshal carries as itself that `flat_rows_to_table` converts to the same values: each value that is not
    plain becomes what the conversion's own fallback makes of it (an int, a str, a block list, the detail's
    JSON text)."""
    ts, chan, kind, step, req, blocks, n, reason, status, delay_free, deferred, detail = row
    if blocks is _BATCH:
        if req.__class__ is dict:  # emit_counts
            req, n = list(req), list(req.values())
        req = [_plain(r, _as_str) for r in req]
        n = None if n is None else [_plain(x, _as_int) for x in n]
    else:
        req = _plain(req, _as_str)
        blocks = _plain(blocks, _as_blocks)
        n = _plain(n, _as_int)
    if detail is not None and detail.__class__ is not str:
        detail = _encode_detail(detail)  # what rows_to_table does to every non-str detail
    return (_plain(ts, lambda t: _as_int(t) or 0), chan, _plain(kind, _as_str), _plain(step, _as_int), req,
            blocks, n, _plain(reason, _as_str), _plain(status, _as_str), _plain(delay_free, _plain_bool),
            _plain(deferred, _plain_bool), detail)


class RowView:
    """The rows of a flat buffer as a list of row tuples, for `Recorder.edit_recent`: `len`, `view[i]` (row i as a
    new tuple), `view[i] = row` (ROW_WIDTH fields), `del view[i]`, negative indices included. Each is one slice
    operation on the flat list: atomic, so a row another thread adds meanwhile (at the end) is never split."""

    __slots__ = ("_flat",)

    def __init__(self, flat: list[Any]) -> None:
        self._flat = flat

    def __len__(self) -> int:
        return len(self._flat) // ROW_WIDTH

    def _start(self, index: int) -> int:
        rows = len(self._flat) // ROW_WIDTH
        if index < 0:
            index += rows
        if not 0 <= index < rows:
            raise IndexError("row index out of range")
        return index * ROW_WIDTH

    def __getitem__(self, index: int) -> tuple:
        start = self._start(index)
        return tuple(self._flat[start:start + ROW_WIDTH])

    def __setitem__(self, index: int, row: tuple) -> None:
        if len(row) != ROW_WIDTH:
            raise ValueError(f"a row has {ROW_WIDTH} fields, not {len(row)}")
        start = self._start(index)
        self._flat[start:start + ROW_WIDTH] = row

    def __delitem__(self, index: int) -> None:
        start = self._start(index)
        del self._flat[start:start + ROW_WIDTH]


class Recorder:
    """The writer of one engine instance in one process (see the module docstring).

    directory: the trace directory; files go to `<directory>/<instance>/<pid>/`.
    instance, role, source, dp_rank: the constant columns of every row (dp_rank per channel, this by default).
    component: the component of `rec.emit` (the default channel).
    clock: a callable returning ns since the epoch (default `time.time_ns`); settable later as `rec.clock = f`.
    flush_events, flush_interval_s: the writer writes a part when this many rows wait, or this often.
    max_buffered_events: rows waiting plus rows being written never exceed this; past it events are dropped.
    handle_sigterm: install the flushing SIGTERM / SIGINT handler (once per process, main thread only).
    part_writer: `f(table, final_path)` that writes one part file (default `write_part`); tests inject slow ones.
        A recorder given one converts and writes on its writer thread (in-process), as without a writer process.
    idle_tick_s: how often the writer thread checks whether events stopped coming (IDLE_TICK_S).
    """

    #: Whether parts are written while the process runs (a flight recorder writes only on a dump).
    WRITES_AS_IT_GOES = True

    def __init__(self, directory: str | os.PathLike[str], instance: str, role: str = "both",
                 source: str = "unknown", dp_rank: int | None = 0, component: str = "scheduler",
                 clock: Clock | None = None, flush_events: int = 65536, flush_interval_s: float = 1.0,
                 max_buffered_events: int = 2_000_000, *, handle_sigterm: bool = True,
                 part_writer: PartWriter | None = None, idle_tick_s: float = IDLE_TICK_S) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, not {role!r}")
        if flush_events < 1 or max_buffered_events < 1 or flush_interval_s <= 0:
            raise ValueError("flush_events and max_buffered_events must be >= 1, flush_interval_s > 0")
        self.directory = Path(directory)
        self.instance = str(instance)
        self.role = role
        self.source = str(source)
        self.dp_rank = dp_rank
        self.flush_events = int(flush_events)
        self.flush_interval_s = float(flush_interval_s)
        self.max_buffered_events = int(max_buffered_events)
        self._handle_sigterm = handle_sigterm
        self._tick_s = float(idle_tick_s)
        self._part_writer: PartWriter = part_writer or _write_part_default

        self._rows: list[Any] = []  # the flat buffer: ROW_WIDTH slots per row
        self._clock: Clock = clock or time.time_ns
        # Channel table: id -> (component, dp, pp, tp). Appended before a channel is handed out, so every id in a
        # batch is known when the writer converts it.
        self._channel_keys: list[tuple[str, int | None, int | None, int | None]] = []
        self._channels: dict[tuple[str, int | None, int | None, int | None], Channel] = {}

        self._state_lock = threading.RLock()  # slow path + writer bookkeeping (reentrant: the SIGTERM handler)
        self._write_lock = threading.Lock()  # one take-convert-write at a time
        self._write_owner: int | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._init_writer_state()
        self._state = _NEW
        self._accept_below = 0  # 0: the first event takes the slow path, which starts the writer

        self._write_failed_before = False
        self.errors = 0  # failed part writes and failed calls (a bad clock or iterable): counted, never raised
        self.last_error: str | None = None
        self._default = self.channel(component)
        # The default channel's bound methods as instance attributes: `rec.emit(...)` costs what `chan.emit` does.
        self.emit = self._default.emit  # type: ignore[method-assign]
        self.emit_many = self._default.emit_many  # type: ignore[method-assign]
        self.emit_counts = self._default.emit_counts  # type: ignore[method-assign]
        _LIVE.add(self)
        if handle_sigterm:
            self._install_signal_handlers()

    def _install_signal_handlers(self) -> None:
        """Flush on SIGTERM / SIGINT; a recorder that writes as it goes also serves `pdtrace record`'s flush requests
        (a flight recorder writes only on a dump, and its dump signal may be the same). Once per process, from the
        main thread (each installer checks)."""
        _install_sigterm_handler()
        if self.WRITES_AS_IT_GOES:
            _install_flush_request_handler()

    def _init_writer_state(self) -> None:
        """Per-writer (per-process) counters; a forked child starts from here again."""
        self._pid = os.getpid()
        # The writer identity of the format is (instance, pid): recorders of one instance in one process (several
        # dp ranks, or one reopened after a close) share its seq and part numbers through this key.
        self._writer_key = (os.path.abspath(self.directory), self.instance, self._pid)
        self._in_flight = 0
        self._batched = 0  # events that batch entries in the buffer stand for beyond their one row each
        self._wake_pending = False
        self._dropped = 0
        self._gap_count = 0
        self._gap_start = 0
        # What the writer thread saw at its last tick (buffer slots, edit count) and since when nothing changed.
        self._edits = 0
        self._unsettled_sent = False  # the last batch handed to the writer process was not settled
        # Whether the writer process was told that nothing is on its way from this writer (a settled batch or
        # message), so that it would lose a new row silently if this process died before the row's batch. While
        # true, the hot path's threshold is 0: the first new row takes the slow path, which wakes the writer thread
        # to say otherwise at once (`_unsettle_pending`). A writer the child has not heard of yet is handed over at
        # the writer thread's first tick.
        self._settled_told = False
        self._unsettle_pending = False
        self._newest_taken_ts: Any = None  # ts_ns of the newest row of the last batch taken
        self._tick_slots = 0
        self._tick_edits = 0
        self._quiet_since = time.monotonic()

    # ---- public API ---------------------------------------------------------------------------------------------

    @property
    def clock(self) -> Clock:
        return self._clock

    @clock.setter
    def clock(self, clock: Clock | None) -> None:
        self._clock = clock or time.time_ns
        for chan in list(self._channels.values()):
            chan._clock = self._clock

    @property
    def dropped_events(self) -> int:
        """Events dropped by this writer (this process) so far: buffer full, or a part that could not be written."""
        return self._dropped

    @property
    def buffered_events(self) -> int:
        """Rows in memory: waiting in the buffer plus being written now (bounded by `max_buffered_events`)."""
        return len(self._rows) // ROW_WIDTH + self._batched + self._in_flight

    @property
    def folder(self) -> Path:
        """This process's folder of part files."""
        name = self.instance.replace("/", "_").replace(os.sep, "_") or "instance"
        if name.startswith(("_", ".")):  # readers skip names starting with these
            name = "i" + name
        return self.directory / name / str(self._pid)

    @property
    def closed(self) -> bool:
        return self._state == _CLOSED

    def channel(self, component: str, pp_rank: int | None = None, tp_rank: int | None = None,
                dp_rank: Any = _RECORDER_DP) -> Channel:
        """The emitter for one component and ranks (dp_rank defaults to the recorder's). Cached per key."""
        if component not in COMPONENTS:
            raise ValueError(f"component must be one of {sorted(COMPONENTS)}, not {component!r}")
        dp = self.dp_rank if dp_rank is _RECORDER_DP else dp_rank
        key = (component, _rank(dp), _rank(pp_rank), _rank(tp_rank))
        with self._state_lock:
            chan = self._channels.get(key)
            if chan is None:
                self._channel_keys.append(key)
                chan = Channel(self, len(self._channel_keys) - 1, component, dp, pp_rank, tp_rank)  # type: ignore
                self._channels[key] = chan
        return chan

    def emit(self, kind: str, step: int | None = None, req: str | None = None, blocks: Any = None,
             n: int | None = None, reason: str | None = None, status: str | None = None,
             delay_free: bool | None = None, deferred: bool | None = None, detail: Any = None) -> None:
        """Record one event on the default channel (see `Channel.emit`). Replaced per instance by the bound method."""
        self._default.emit(kind, step, req, blocks, n, reason, status, delay_free, deferred, detail)

    def emit_many(self, kind: str, step: int | None = None, reqs: Iterable[str] = (),
                  ns: Iterable[int] | None = None, reason: str | None = None, status: str | None = None) -> None:
        """One event per request on the default channel (see `Channel.emit_many`)."""
        self._default.emit_many(kind, step, reqs, ns, reason, status)

    def emit_counts(self, kind: str, step: int | None, counts: Mapping[str, int], reason: str | None = None,
                    status: str | None = None) -> None:
        """One event per request of `counts` (request id -> n) on the default channel (see `Channel.emit_counts`)."""
        self._default.emit_counts(kind, step, counts, reason, status)

    def recording_off(self, error: str) -> None:
        """A hook disabled itself: record `recorder_off` (detail error) and accept nothing more. Never raises."""
        try:
            self._default.emit("recorder_off", detail={"error": str(error)})
            with self._state_lock:
                if self._state in (_NEW, _ON):
                    self._state = _OFF
                self._set_threshold()
            self._wake.set()
        except Exception:
            self._count_error()

    def edit_recent(self, edit: Callable[["RowView"], Any]) -> Any:
        """Call `edit(rows)` on the events not yet taken by the writer (oldest first), under the lock the writer
        takes them with, and return its result. For a hook that rewrites its own latest rows (the vLLM hooks
        coalesce runs of empty steps): `edit` may replace or delete rows, never reorder them, and must be quick.
        `rows` is a `RowView` of the flat buffer: `rows[i]` is row i as a new tuple (compare rows by value, not
        identity), `rows[i] = row` replaces it, `del rows[i]` deletes it. Row layout: (ts_ns, channel id, kind,
        step, req, blocks, n, reason, status, delay_free, deferred, detail); an `emit_many` batch entry has the
        `_BATCH` marker as blocks and must be left in place."""
        with self._state_lock:
            self._edits += 1
            return edit(RowView(self._rows))

    def flush(self) -> None:
        """Write every row emitted before this call (blocks the caller until it is on disk). Never raises."""
        if self._state == _NEW or self._pid != os.getpid():
            return
        try:
            self._drain(until_empty=False)
        except Exception:
            self._count_error()

    def close(self) -> None:
        """Flush everything and stop the writer; idempotent. Later events are ignored. Never raises."""
        try:
            with self._state_lock:
                if self._state == _CLOSED:
                    return
                was_started = self._state != _NEW
                self._state = _CLOSED
                self._set_threshold()
            _LIVE.discard(self)
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                self._stop = True
                self._wake.set()
                thread.join(timeout=30.0)
            if was_started:
                self._drain(until_empty=True)
                if self._unsettled_sent:
                    self._tell_writer_process_settled()
        except Exception:
            self._count_error()

    def _tell_writer_process_settled(self) -> None:
        """Nothing of this writer is on its way (quiet since its last batch, or closed): the writer process must
        not mark a gap for it if this process dies now (a forked child leaving with os._exit, vLLM's SIGKILL)."""
        writer = self._note_writer()
        if writer is None:
            return
        with self._state_lock:
            if self._rows:  # a row came meanwhile: not settled
                return
            self._settled_told = True  # a row from now on goes through the slow path: see _settled_told
            self._unsettle_pending = False
            self._set_threshold()
        if self._send_note(writer, writer_process.settled_message(self._writer_key)):
            self._unsettled_sent = False

    def _tell_writer_process_unsettled(self) -> None:
        """A row came after the writer process was told that nothing is on its way from this writer (settled): tell
        it otherwise now, without handing anything over (no part file per quiet period), so that it marks a gap
        should this process be killed before the row's batch. Called by the writer thread when the slow path woke it;
        after the batch in flight, if any (the write lock)."""
        with self._write_lock:
            with self._state_lock:
                if not self._unsettle_pending:
                    return
                self._unsettle_pending = False
            writer = self._note_writer()
            if writer is not None and self._send_note(writer, writer_process.unsettled_message(self._writer_key)):
                self._unsettled_sent = True

    def _note_writer(self) -> Any:
        """The writer process that settled / unsettled notes go to: this process's, running (never spawned for a
        note), unless the recorder writes in-thread (a custom part writer) or is a forked copy; else None."""
        if self._part_writer is not _write_part_default or self._pid != os.getpid():
            return None
        writer = writer_process.shared(spawn=False)
        return writer if writer is not None and writer.pid is not None else None

    def _send_note(self, writer: Any, message: tuple) -> bool:
        """Send a settled / unsettled message to the writer process; whether it went (a failure is said or counted,
        never raised)."""
        try:
            writer.send(marshal.dumps(message, writer_process.MARSHAL_VERSION))
            return True
        except writer_process.WriterProcessLost as exc:
            self._say_writer_process_lost(exc)
        except Exception:
            self._count_error()
        return False

    def _say_writer_process_lost(self, exc: Exception) -> None:
        try:
            sys.stderr.write(f"pdtrace: the writer process of recorder {self.instance!r} was lost ({exc}); "
                             "writing in-process from now on\n")
        except Exception:
            pass

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Recorder({str(self.directory)!r}, instance={self.instance!r}, role={self.role!r}, "
                f"state={self._state}, buffered={self.buffered_events}, dropped={self._dropped})")

    # ---- slow path (caller's thread) ----------------------------------------------------------------------------

    def _slow_add(self, row: tuple, events: int = 1) -> None:
        """Everything behind the threshold: start the writer, wake it, drop when full, ignore when off/closed.
        `row`: one row of ROW_WIDTH fields; `events`: how many events it stands for (a batch entry, several)."""
        try:
            with self._state_lock:
                if self._state == _NEW:
                    self._start()
                if self._state != _ON:
                    return
                room = self.max_buffered_events - self._in_flight
                self._end_gap_locked(room)
                buffered = len(self._rows) // ROW_WIDTH + self._batched
                if self._gap_count == 0 and buffered + events <= room:
                    self._rows.extend(row)
                    self._batched += events - 1
                    if buffered + events >= self.flush_events and not self._wake_pending:
                        self._wake_pending = True
                        self._wake.set()
                    if self._settled_told:  # the writer process must hear of it before it could be lost
                        self._settled_told = False
                        self._unsettle_pending = True
                        self._wake.set()
                else:
                    if self._gap_count == 0:
                        self._gap_start = row[_TS]
                    self._gap_count += events
                    self._dropped += events
                self._set_threshold()
        except Exception:
            self._count_error()

    def _set_threshold(self) -> None:
        """Recompute what the hot path accepts without the slow path (call with the state lock held). The hot path
        compares the buffer's length in slots with it (one comparison), so the threshold is in slots: the rows it
        accepts times ROW_WIDTH, after taking off the events batch entries stand for beyond their one row each
        (`_batched`). A buffer of r rows passes while r < rows accepted, exactly as when it held one tuple per row."""
        if self._state != _ON or self._gap_count:
            self._accept_below = -1
            return
        if self._settled_told:
            self._accept_below = 0
            return
        room = self.max_buffered_events - self._in_flight
        if self._wake_pending:
            accept = room - self._batched
        else:
            accept = min(room, self.flush_events - 1) - self._batched
        self._accept_below = accept * ROW_WIDTH

    def _end_gap_locked(self, room: int) -> None:
        """If events were dropped and there is room again, put the `recorder_gap` row into the stream now."""
        if self._gap_count and len(self._rows) // ROW_WIDTH + self._batched < room:
            self._rows.extend((self._gap_start, self._default._id, "recorder_gap", None, None, None,
                               self._gap_count, None, None, None, None, None))
            self._gap_count = 0

    def _count_error(self) -> None:
        self.errors += 1

    def _start(self) -> None:
        """First event of this process: start the writer thread and the exit hooks (state lock held)."""
        self._state = _ON
        _register_exit_hooks()
        if self._handle_sigterm:
            self._install_signal_handlers()
            if self.WRITES_AS_IT_GOES:
                try:  # the process is findable from now on, before its first part (request_flush)
                    os.makedirs(self.folder, exist_ok=True)
                except OSError:
                    pass
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"pdtrace-recorder-{self.instance}", daemon=True)
        self._thread.start()

    # ---- writer -------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._part_writer is _write_part_default:
            try:  # the writer process starts (python + pyarrow, in the child) while the first rows come in
                writer_process.shared()
            except Exception:
                self._count_error()
        last_flush = -float("inf")  # the first tick hands over what there is: the writer process then knows this
        # writer, and can mark a gap for it should this process be killed before its next hand-over
        while not self._stop:
            try:
                woke = self._wake.wait(min(self.flush_interval_s, self._tick_s))
                if self._stop:
                    break
                if woke:
                    self._wake.clear()
                    if self._unsettle_pending and not self._wake_pending:
                        self._tell_writer_process_unsettled()
                        continue
                    self._drain(until_empty=False)
                    last_flush = time.monotonic()
                    continue
                slots, edits, now = len(self._rows), self._edits, time.monotonic()
                if slots != self._tick_slots or edits != self._tick_edits:
                    self._tick_slots, self._tick_edits, self._quiet_since = slots, edits, now
                if slots and (self._settled(now) or now - last_flush >= self.flush_interval_s):
                    self._drain(until_empty=False)
                    last_flush = now
                elif not slots and self._unsettled_sent and self._settled(now):
                    with self._write_lock:  # after any batch in flight
                        if not self._rows:
                            self._tell_writer_process_settled()
            except Exception:  # the writer thread never dies: a later flush may succeed
                self._count_error()

    def _settled(self, now: float) -> bool:
        """Whether the buffer has not changed for a whole tick (no event, no edit): see IDLE_TICK_S. With the wall
        clock, the newest row must also be a tick old by its own ts_ns: the writer thread may have slept through the
        tick itself (vLLM's CPU workers spin OpenMP threads on every core), and its own sleep is not the process's
        quiet; a batch wrongly taken as settled is lost without a gap if the process is killed next."""
        if not (len(self._rows) == self._tick_slots and self._edits == self._tick_edits
                and now - self._quiet_since >= self._tick_s * 0.999):
            return False
        if self._clock is time.time_ns:
            try:
                rows = self._rows
                newest = rows[len(rows) - ROW_WIDTH + _TS] if rows else self._newest_taken_ts
            except IndexError:  # taken meanwhile (a flush on another thread)
                return False
            if isinstance(newest, int) and time.time_ns() - newest < self._tick_s * 0.999e9:
                return False
        return True

    def _drain(self, until_empty: bool, lock_timeout: float = -1) -> bool:
        """Take the waiting rows and write them as one part; with `until_empty`, repeat until nothing is left (a gap
        row may follow the last batch). Serialised by the write lock. Returns whether it got to write (False: the
        lock stayed taken for `lock_timeout`, or this thread was already mid-write)."""
        me = threading.get_ident()
        if self._write_owner == me:  # re-entered (a signal handler interrupted this thread mid-write)
            return False
        if not self._write_lock.acquire(timeout=lock_timeout):
            return False
        self._write_owner = me
        try:
            for _ in range(4 if until_empty else 1):
                if not self._write_one_batch() and not self._gap_count:
                    break
        finally:
            self._write_owner = None
            self._write_lock.release()
        return True

    def _write_one_batch(self) -> bool:
        """Take all waiting rows, convert and write them. Returns whether there was anything."""
        with self._state_lock:
            slots = len(self._rows)
            if slots == 0:
                self._end_gap_locked(self.max_buffered_events - self._in_flight)
                slots = len(self._rows)
                if slots == 0:
                    return False
            # Slice copy then slice delete: an extend racing between them lands after slot `slots` and stays (a
            # batch entry is added under this lock, so every one of them is in the slice). Every add is one whole
            # row of ROW_WIDTH slots, atomically, so the take is whole rows.
            assert slots % ROW_WIDTH == 0, "the flat buffer holds whole rows"
            # Settled (no event or edit for a whole tick) or closed: nothing more is on its way from this recorder.
            settled = self._state == _CLOSED or self._settled(time.monotonic())
            batch = self._rows[:slots]
            del self._rows[:slots]
            self._newest_taken_ts = batch[slots - ROW_WIDTH + _TS]
            # The batch holds every row so far. Settled: rows from now on must say so (the slow path, see
            # _settled_told); the child reads messages in order, so a note sent after this batch follows it.
            self._unsettle_pending = False
            self._settled_told = settled
            count = slots // ROW_WIDTH + self._batched
            self._batched = 0
            seq_start = _claim_seq(self._writer_key, count)
            self._in_flight = count
            self._wake_pending = False
            self._end_gap_locked(self.max_buffered_events - count)
            self._set_threshold()
            channels = list(self._channel_keys)
            dropped = self._dropped
        ok = False
        try:
            header = (seq_start, channels, self.instance, self.role, self._pid, self.source, dropped,
                      self._writer_key, str(self.folder))
            error = self._send_to_writer_process(batch, header, settled)
            if error is not _IN_THREAD:
                self._unsettled_sent = not settled
            if error is _IN_THREAD:
                write_rows(batch, *header, part_writer=self._part_writer)
            elif error is not None:
                raise RuntimeError(f"writer process: {error}")
            ok = True
        except Exception as exc:  # disk full, a bad value that survived sanitising: never let the thread die
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            if not self._write_failed_before:  # one line on stderr per recorder, not one per part
                self._write_failed_before = True
                try:
                    sys.stderr.write(f"pdtrace: recorder {self.instance!r} could not write a part file, "
                                     f"{count} events dropped ({self.last_error})\n")
                except Exception:
                    pass
        finally:
            del batch
            with self._state_lock:
                self._in_flight = 0
                if not ok:
                    # The lost batch is a gap like a full buffer: counted, and marked in the stream.
                    if self._gap_count == 0:
                        self._gap_start = self._clock()
                    self._gap_count += count
                    self._dropped += count
                self._end_gap_locked(self.max_buffered_events)
                self._set_threshold()
        return True

    def _send_to_writer_process(self, batch: list[Any], header: tuple, settled: bool = False) -> Any:
        """Hand the batch to this process's writer process and wait until it is on disk: None, or the child's
        error text; `_IN_THREAD` when there is no writer process (switched off, failed, a custom part_writer) or it
        was lost before taking the batch, so that this thread writes it. A batch the child took but did not
        confirm before it was lost raises (counted as dropped: it may or may not be on disk)."""
        if self._part_writer is not _write_part_default:
            return _IN_THREAD
        writer = writer_process.shared()
        if writer is None:
            return _IN_THREAD
        try:
            error = writer.send(encode_batch(batch, *header, settled=settled))
            if error is writer_process.RESEND_SANITISED:
                error = writer.send(encode_batch(batch, *header, sanitise=True, settled=settled))
            return error
        except writer_process.WriterProcessLost as exc:
            self._say_writer_process_lost(exc)
            if exc.sent:
                raise
            return _IN_THREAD

    # ---- fork ---------------------------------------------------------------------------------------------------

    def _before_fork(self) -> tuple[bool, bool]:
        # Hold the locks across fork() so that no write or slow-path update is half done in the child's copy.
        got_write = self._write_lock.acquire(timeout=10.0)
        got_state = self._state_lock.acquire(timeout=10.0)
        return got_write, got_state

    def _after_fork_parent(self, held: tuple[bool, bool]) -> None:
        if held[1]:
            self._state_lock.release()
        if held[0]:
            self._write_lock.release()

    def _after_fork_child(self) -> None:
        # A new writer: fresh locks (the parent's writer thread does not exist here), an empty buffer (the parent
        # writes its own rows), new counters, files under this pid, opened on the first event.
        self._state_lock = threading.RLock()
        self._write_lock = threading.Lock()
        self._write_owner = None
        self._wake = threading.Event()
        self._thread = None
        self._stop = False
        del self._rows[:]
        self._init_writer_state()
        if self._state == _ON:
            self._state = _NEW
        self._accept_below = 0 if self._state == _NEW else -1
