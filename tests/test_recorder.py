"""The Recorder in one process: every kind round-trips through Parquet, emit_many, details, threads, the bounded
buffer and its drop path, write failures, recording_off, close, the clock. Crash, SIGTERM and fork tests are in
test_recorder_crash.py (they need child processes)."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdtrace
from pdtrace.format import DICTIONARY_COLUMNS, KINDS, META_DROPPED, SCHEMA, file_metadata
from pdtrace.recording.recorder import Recorder, rows_to_table, write_part
from pdtrace.trace.reader import find_part_files

@pytest.fixture(autouse=True, params=["process", "thread"])
def writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with each writer: the writer process (the default) and the in-thread fallback
    (`PDTRACE_WRITER_PROCESS=0`; child processes inherit the switch)."""
    monkeypatch.setenv("PDTRACE_WRITER_PROCESS", "1" if request.param == "process" else "0")
    return request.param


T0 = 1_700_000_000_000_000_000


def counter_clock(start: int = T0, tick: int = 1000):
    """A virtual clock: each call returns the next tick (what a dry run's clock does)."""
    ticks = itertools.count(start, tick)
    return lambda: next(ticks)


def make(tmp_path: Path, **kwargs) -> Recorder:
    kwargs.setdefault("instance", "prefill-0")
    kwargs.setdefault("role", "prefill")
    kwargs.setdefault("source", "test")
    kwargs.setdefault("flush_interval_s", 60.0)  # the tests flush explicitly unless they test the timer
    kwargs.setdefault("handle_sigterm", False)
    return Recorder(tmp_path, **kwargs)


def rows_of(directory: Path) -> list[dict]:
    """All events of a trace directory through the project's reader, in (pid, seq) order."""
    table = pdtrace.open_trace(directory).table
    return sorted(table.to_pylist(), key=lambda r: (r["pid"], r["seq"]))


def part_files(directory: Path) -> list[Path]:
    return find_part_files(directory)


# One event per kind of the format, with values that exercise every column.
def every_kind_events() -> list[dict]:
    events = []
    for i, kind in enumerate(KINDS):
        comps = KINDS[kind]
        component = sorted(comps)[0] if comps else "connector"
        event: dict = {"kind": kind, "component": component, "step": 100 + i, "req": f"req-{i}", "n": i * 7}
        if component in ("worker", "connector"):
            event.update(pp_rank=i % 2, tp_rank=i % 3)
        if kind in ("blocks_alloc", "blocks_free", "blocks_pool_free", "req_wait_kv", "kv_recv_fail",
                    "remote_read"):
            event["blocks"] = [i + 1, i + 2, 70000]
        if kind == "req_finish":
            event.update(reason="abort", status="WAITING_FOR_REMOTE_KVS", delay_free=True)
        if kind == "blocks_free":
            event.update(reason="preempted", deferred=True, detail={"fence": 12})
        if kind == "blocks_pool_free":
            event.update(req=None, deferred=False, step=None)
        if kind in ("batch_add", "batch_remove"):
            event["reason"] = "new" if kind == "batch_add" else "unscheduled"
        if kind in ("kv_send_done", "kv_recv_done"):
            event["status"] = "unknown" if kind == "kv_send_done" else "FINISHED_STOPPED"
        if kind == "engine_config":
            event["detail"] = {"block_size": 16, "pp": 2, "async_scheduling": False, "connector": None}
        if kind == "recorder_off":
            event["detail"] = '{"error":"hook failed"}'
        events.append(event)
    return events


def test_every_kind_round_trips_with_values_types_and_metadata(tmp_path: Path) -> None:
    rec = make(tmp_path, clock=counter_clock(), dp_rank=1)
    events = every_kind_events()
    for event in events:
        fields = dict(event)
        kind, component = fields.pop("kind"), fields.pop("component")
        pp, tp = fields.pop("pp_rank", None), fields.pop("tp_rank", None)
        rec.channel(component, pp_rank=pp, tp_rank=tp).emit(kind, **fields)
    rec.close()

    files = part_files(tmp_path)
    assert files and all(f.parent == tmp_path / "prefill-0" / str(os.getpid()) for f in files)
    for path in files:
        parquet = pq.ParquetFile(path)
        assert parquet.schema_arrow.remove_metadata().equals(SCHEMA), path  # exactly the format's types
        assert parquet.schema_arrow.metadata == file_metadata(pdtrace.__version__, "test", 0)
        names = parquet.schema_arrow.names
        for group in range(parquet.metadata.num_row_groups):
            for name in names:
                chunk = parquet.metadata.row_group(group).column(names.index(name))
                assert chunk.compression == "ZSTD"
                if name in DICTIONARY_COLUMNS:
                    assert any("DICTIONARY" in e for e in chunk.encodings), (name, chunk.encodings)
        for name in DICTIONARY_COLUMNS:  # read back as dictionary columns, not plain strings
            assert pa.types.is_dictionary(parquet.read().schema.field(name).type)

    rows = rows_of(tmp_path)
    assert len(rows) == len(events)
    assert [r["seq"] for r in rows] == list(range(len(events)))
    for i, (row, event) in enumerate(zip(rows, events)):
        detail = event.get("detail")
        expected = {
            "ts_ns": T0 + 1000 * i, "instance": "prefill-0", "role": "prefill", "pid": os.getpid(),
            "component": event["component"], "dp_rank": 1, "pp_rank": event.get("pp_rank"),
            "tp_rank": event.get("tp_rank"), "kind": event["kind"], "step": event.get("step"),
            "req": event.get("req"), "blocks": event.get("blocks"), "n": event["n"], "reason": event.get("reason"),
            "status": event.get("status"), "delay_free": event.get("delay_free"),
            "deferred": event.get("deferred"),
            "detail": detail if detail is None or isinstance(detail, str) else json.dumps(detail, separators=(",", ":")),
        }
        got = {k: row[k] for k in expected}
        assert got == expected, event["kind"]


def test_seq_strictly_increasing_across_parts_and_part_numbers(tmp_path: Path) -> None:
    rec = make(tmp_path, clock=counter_clock())
    for batch in range(3):
        for i in range(10):
            rec.emit("req_sched", step=batch, req=f"r{i}", n=i)
        rec.flush()
    rec.close()
    files = part_files(tmp_path)
    assert [f.name for f in files] == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    seqs = [pq.read_table(f, columns=["seq"]).column("seq").to_pylist() for f in files]
    assert seqs == [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]


def test_reopening_an_instance_continues_part_numbers_and_seq(tmp_path: Path) -> None:
    first = make(tmp_path)
    first.emit("sched", step=0, n=1)
    first.close()
    second = make(tmp_path)
    second.emit("sched", step=1, n=1)
    second.close()
    rows = rows_of(tmp_path)
    assert [(r["step"], r["seq"]) for r in rows] == [(0, 0), (1, 1)]
    assert [f.name for f in part_files(tmp_path)] == ["part-000000.parquet", "part-000001.parquet"]


def test_emit_many_one_row_per_request(tmp_path: Path) -> None:
    rec = make(tmp_path, clock=counter_clock())
    scheduled = {"r1": 16, "r2": 1, "r3": 300}
    rec.emit_many("req_sched", step=3, reqs=scheduled.keys(), ns=scheduled.values())
    rec.channel("scheduler").emit_many("req_preempt", step=4, reqs=iter(["r2"]))
    rec.emit_many("req_sched", step=5, reqs=[])  # nothing
    rec.channel("worker", pp_rank=0, tp_rank=1).emit_many("batch_remove", step=6, reqs=["r9"], reason="finished")
    rec.close()
    rows = rows_of(tmp_path)
    got = [(r["kind"], r["step"], r["req"], r["n"], r["reason"], r["component"], r["tp_rank"]) for r in rows]
    assert got == [
        ("req_sched", 3, "r1", 16, None, "scheduler", None),
        ("req_sched", 3, "r2", 1, None, "scheduler", None),
        ("req_sched", 3, "r3", 300, None, "scheduler", None),
        ("req_preempt", 4, "r2", None, None, "scheduler", None),
        ("batch_remove", 6, "r9", None, "finished", "worker", 1),
    ]
    assert len({r["ts_ns"] for r in rows[:3]}) == 1  # one call, one timestamp
    assert [r["seq"] for r in rows] == list(range(5))


def test_emit_counts_one_row_per_request_of_a_copy(tmp_path: Path) -> None:
    # What the vLLM hooks record a step's num_scheduled_tokens with: the mapping's order, its values as n, one
    # timestamp; the dict is copied at the call, so a later change of the caller's dict is not recorded.
    rec = make(tmp_path, clock=counter_clock())
    scheduled = {"r1": 16, "r2": 1, "r3": 300}
    rec.emit_counts("req_sched", 3, scheduled)
    scheduled["r4"] = 5
    scheduled["r1"] = 0
    rec.channel("worker", pp_rank=1).emit_counts("batch_add", 4, {"r9": 2}, reason="new")
    rec.emit_counts("req_sched", 5, {})  # nothing
    rec.emit_counts("req_sched", 6, _ReadOnce({"r7": 7}))  # another mapping: read once, now
    rec.close()
    rows = rows_of(tmp_path)
    got = [(r["kind"], r["step"], r["req"], r["n"], r["reason"], r["component"], r["pp_rank"]) for r in rows]
    assert got == [
        ("req_sched", 3, "r1", 16, None, "scheduler", None),
        ("req_sched", 3, "r2", 1, None, "scheduler", None),
        ("req_sched", 3, "r3", 300, None, "scheduler", None),
        ("batch_add", 4, "r9", 2, "new", "worker", 1),
        ("req_sched", 6, "r7", 7, None, "scheduler", None),
    ]
    assert len({r["ts_ns"] for r in rows[:3]}) == 1
    assert [r["seq"] for r in rows] == list(range(5))
    assert rec.errors == 0


class _ReadOnce(dict):
    """A mapping that is not a dict (a subclass): emit_counts must read it into its own dict."""


def test_emit_counts_with_a_broken_mapping_never_raises(tmp_path: Path) -> None:
    class Broken:
        def keys(self):
            raise RuntimeError("hook bug")

        def __getitem__(self, key):
            return 1

    rec = make(tmp_path)
    rec.emit_counts("req_sched", 1, Broken())  # type: ignore[arg-type]
    rec.emit_counts("req_sched", 2, None)  # type: ignore[arg-type]
    rec.emit("sched", step=1, n=1)
    rec.close()
    assert [r["kind"] for r in rows_of(tmp_path)] == ["sched"]
    assert rec.errors == 2


def test_emit_counts_counts_its_events_in_the_bound(tmp_path: Path) -> None:
    sink = SlowSink()
    rec = make(tmp_path, flush_events=10**6, max_buffered_events=100, part_writer=sink)
    rec.emit_counts("req_sched", 1, {f"r{j}": j for j in range(60)})
    rec.emit_counts("req_sched", 2, {f"r{j}": j for j in range(60)})  # 120 > 100: dropped whole
    assert rec.buffered_events == 60 and rec.dropped_events == 60
    sink.release.set()
    rec.close()


def test_emit_many_with_a_broken_iterable_never_raises(tmp_path: Path) -> None:
    def broken():
        yield "r1"
        raise RuntimeError("hook bug")

    rec = make(tmp_path)
    rec.emit_many("req_sched", step=1, reqs=broken())
    rec.emit("sched", step=1, n=1)
    rec.close()
    assert [r["kind"] for r in rows_of(tmp_path)] == ["sched"]
    assert rec.errors == 1


def test_detail_dict_str_and_unencodable(tmp_path: Path) -> None:
    rec = make(tmp_path)
    circular: dict = {"a": 1}
    circular["self"] = circular
    rec.emit("sched", step=0, detail={"running": 3, "waiting": 0, "remote": "P"})
    rec.emit("sched", step=1, detail='{"running": 3}')  # a string is stored verbatim
    rec.emit("sched", step=2, detail={"when": {1, 2}.__class__.__name__, "obj": object()})  # default=str
    rec.emit("sched", step=3, detail=circular)
    rec.emit("sched", step=4)
    rec.close()
    details = [r["detail"] for r in rows_of(tmp_path)]
    assert details[0] == '{"running":3,"waiting":0,"remote":"P"}'
    assert details[1] == '{"running": 3}'
    assert json.loads(details[2])["when"] == "set" and json.loads(details[2])["obj"].startswith("<object")
    assert "unencodable" in json.loads(details[3])
    assert details[4] is None


def test_wrong_value_types_are_coerced_not_lost(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    rec = make(tmp_path)
    rec.emit("blocks_alloc", step=2, req=123, blocks=("4", 5), n="not a number", delay_free=1)
    rec.emit("blocks_alloc", step="3", req="r2", blocks=[6], n=1.0)
    rec.emit("blocks_alloc", step=np.int64(4), req="r3", blocks=np.array([7, 8], dtype=np.int64), n=np.int32(9))
    rec.emit("blocks_alloc", step=2**70, req="r4", blocks=[2**40], n=-1)  # out of range: null, not an error
    rec.close()
    rows = rows_of(tmp_path)
    assert [(r["step"], r["req"], r["blocks"], r["n"], r["delay_free"]) for r in rows] == [
        (2, "123", [4, 5], None, True), (3, "r2", [6], 1, None), (4, "r3", [7, 8], 9, None),
        (None, "r4", None, -1, None)]


def test_channels_ranks_and_validation(tmp_path: Path) -> None:
    rec = make(tmp_path, dp_rank=2, component="engine")
    assert rec.channel("worker", pp_rank=1, tp_rank=0) is rec.channel("worker", pp_rank=1, tp_rank=0)
    rec.emit("step_submit", step=0, n=1)
    rec.channel("worker", pp_rank=1, tp_rank=3).emit("exec_begin", step=0, n=5)
    rec.channel("scheduler", dp_rank=None).emit("sched", step=0, n=5)
    with pytest.raises(ValueError):
        rec.channel("gpu")
    with pytest.raises(ValueError):
        make(tmp_path, instance="x", role="leader")
    rec.close()
    got = [(r["component"], r["dp_rank"], r["pp_rank"], r["tp_rank"]) for r in rows_of(tmp_path)]
    assert got == [("engine", 2, None, None), ("worker", 2, 1, 3), ("scheduler", None, None, None)]


def test_concurrent_threads_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    rec = make(tmp_path, flush_events=997, flush_interval_s=0.01)
    threads_n, per_thread = 6, 20_000
    start = threading.Barrier(threads_n)

    def work(t: int) -> None:
        chan = rec.channel("worker", pp_rank=0, tp_rank=t)
        start.wait()
        for i in range(per_thread):
            if i % 100 == 0:
                chan.emit_many("kv_send_rank", step=i, reqs=[f"t{t}-m{i}"], ns=[i])
            else:
                chan.emit("exec_begin", step=i, req=f"t{t}", n=i)

    done = threading.Event()

    def flusher() -> None:  # explicit flushes race the appends too, beside the writer thread's own takes
        while not done.is_set():
            rec.flush()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    flushing = threading.Thread(target=flusher)
    for thread in threads:
        thread.start()
    flushing.start()
    for thread in threads:
        thread.join()
    done.set()
    flushing.join()
    rec.close()
    assert rec.dropped_events == 0
    rows = rows_of(tmp_path)
    assert len(rows) == threads_n * per_thread
    assert [r["seq"] for r in rows] == list(range(len(rows)))  # unique and gapless
    for t in range(threads_n):
        steps = [r["step"] for r in rows if r["tp_rank"] == t]
        assert steps == list(range(per_thread))  # each thread's events complete, once each, in its order


class SlowSink:
    """A part writer that blocks until released: the disk the writer falls behind on."""

    def __init__(self, fail_first: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail_first = fail_first
        self.calls = 0

    def __call__(self, table: pa.Table, path: Path) -> None:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(30), "test never released the sink"
        if self.fail_first and self.calls == 1:
            raise OSError(28, "No space left on device")
        write_part(table, path)


def test_drop_path_bounds_memory_counts_and_marks_the_gap(tmp_path: Path) -> None:
    sink = SlowSink()
    ticks = itertools.count()
    rec = make(tmp_path, clock=lambda: next(ticks), flush_events=100, max_buffered_events=1000, part_writer=sink)
    for i in range(100):  # the 100th event wakes the writer, which takes these 100 and blocks in the sink
        rec.emit("req_sched", step=i, req="r", n=i)
    assert sink.entered.wait(30)
    assert rec.buffered_events == 100
    for i in range(100, 2100):
        rec.emit("req_sched", step=i, req="r", n=i)  # returns at once even though the writer is stuck
        assert rec.buffered_events <= 1000
    assert rec.buffered_events == 1000
    assert rec.dropped_events == 1100  # 900 fitted beside the 100 in flight; 1000..2099 were dropped
    sink.release.set()
    rec.flush()
    for i in range(2100, 2105):
        rec.emit("req_sched", step=i, req="r", n=i)
    rec.close()

    rows = rows_of(tmp_path)
    assert [r["seq"] for r in rows] == list(range(len(rows)))
    kinds = [r["kind"] for r in rows]
    assert kinds.count("recorder_gap") == 1
    gap_at = kinds.index("recorder_gap")
    gap = rows[gap_at]
    assert gap["n"] == 1100 and gap["ts_ns"] == 1000  # when the drop began (the first dropped event's time)
    assert gap["component"] == "scheduler" and gap["instance"] == "prefill-0"
    steps = [r["step"] for r in rows if r["kind"] == "req_sched"]
    assert steps == list(range(0, 1000)) + list(range(2100, 2105))
    assert [r["step"] for r in rows[gap_at - 1:gap_at + 2]] == [999, None, 2100]  # the gap sits where it was
    dropped_meta = [int(pq.read_schema(f).metadata[META_DROPPED.encode()]) for f in part_files(tmp_path)]
    assert dropped_meta[0] == 0 and dropped_meta[-1] == 1100 == rec.dropped_events


def test_emit_many_counts_its_events_in_the_bound_and_drops_them_whole(tmp_path: Path) -> None:
    # A step's emit_many is one buffered entry for several events: the bound, the drop counter, the gap row and
    # the seq numbers count the events, whether single emits or batches came first.
    sink = SlowSink()
    ticks = itertools.count()
    rec = make(tmp_path, clock=lambda: next(ticks), flush_events=100, max_buffered_events=1000, part_writer=sink)
    for i in range(10):  # 100 events: the writer takes them and blocks in the sink
        rec.emit_many("req_sched", step=i, reqs=[f"r{j}" for j in range(10)], ns=list(range(10)))
    assert sink.entered.wait(30)
    assert rec.buffered_events == 100
    for i in range(10, 40):
        rec.emit_many("req_sched", step=i, reqs=[f"r{j}" for j in range(40)], ns=[i] * 40)
        rec.emit("sched", step=i, n=40)
        assert rec.buffered_events <= 1000
    # 900 places beside the 100 in flight: 21 steps of 40 + 1 fit, then a batch of 40 no longer does while the
    # single sched rows still may (each after a gap row).
    assert rec.dropped_events >= 8 * 40
    sink.release.set()
    rec.close()
    rows = rows_of(tmp_path)
    assert [r["seq"] for r in rows] == list(range(len(rows)))
    gaps = [r for r in rows if r["kind"] == "recorder_gap"]
    assert gaps and sum(g["n"] for g in gaps) == rec.dropped_events
    assert len(rows) - len(gaps) == 100 + 30 * 41 - rec.dropped_events
    by_step: dict[int, list[dict]] = {}
    for r in rows:
        if r["kind"] == "req_sched":
            by_step.setdefault(r["step"], []).append(r)
    for step, step_rows in by_step.items():  # a batch is written whole or dropped whole, in request order
        assert len(step_rows) == (10 if step < 10 else 40)
        assert [r["req"] for r in step_rows] == [f"r{j}" for j in range(len(step_rows))]
        assert len({r["ts_ns"] for r in step_rows}) == 1


def test_edit_recent_replaces_and_deletes_buffered_rows_in_place(tmp_path: Path) -> None:
    # The buffer is flat (ROW_WIDTH slots per row); edit_recent hands a view of whole rows: what it replaces or
    # deletes is what gets written, and the rows around (a batch entry included) keep their order and events.
    from pdtrace.recording.recorder import _BATCH

    rec = make(tmp_path, clock=counter_clock())
    rec.emit("sched", step=1, n=0, detail={"running": 0})
    rec.emit_many("req_sched", step=2, reqs=["a", "b", "c"], ns=[1, 2, 3])
    rec.emit("step_submit", step=2)
    rec.emit("sched", step=3, n=5)

    def edit(rows):
        assert len(rows) == 4
        assert rows[1][4:7] == (["a", "b", "c"], _BATCH, [1, 2, 3])
        assert rows[-1] == rows[3] and rows[3][2:4] == ("sched", 3)
        with pytest.raises(IndexError):
            rows[4]
        with pytest.raises(ValueError):
            rows[0] = ("too", "short")
        rows[0] = rows[0][:11] + ({"running": 0, "empty_run": 2},)
        del rows[2]
        return [row[2] for row in rows]

    assert rec.edit_recent(edit) == ["sched", "req_sched", "sched"]
    assert rec.buffered_events == 5
    rec.close()
    rows = rows_of(tmp_path)
    assert [(r["kind"], r["step"], r["req"]) for r in rows] == [
        ("sched", 1, None), ("req_sched", 2, "a"), ("req_sched", 2, "b"), ("req_sched", 2, "c"), ("sched", 3, None)]
    assert json.loads(rows[0]["detail"]) == {"running": 0, "empty_run": 2}
    assert [r["seq"] for r in rows] == list(range(5))


def test_emit_many_pairs_requests_and_ns_as_zip_does(tmp_path: Path) -> None:
    rec = make(tmp_path, clock=counter_clock())
    rec.emit_many("req_sched", step=1, reqs=["a", "b", "c"], ns=[1, 2])
    rec.emit_many("req_sched", step=2, reqs=iter(["d"]), ns=(n for n in [4, 5]))
    rec.close()
    assert [(r["step"], r["req"], r["n"]) for r in rows_of(tmp_path)] == [(1, "a", 1), (1, "b", 2), (2, "d", 4)]


def test_a_part_that_cannot_be_written_is_counted_as_a_gap(tmp_path: Path, capfd) -> None:
    sink = SlowSink(fail_first=True)
    sink.release.set()
    rec = make(tmp_path, clock=counter_clock(), part_writer=sink)
    for i in range(5):
        rec.emit("sched", step=i, n=i)
    rec.flush()  # fails: disk full
    rec.emit("sched", step=5, n=5)
    rec.close()
    assert rec.errors == 1 and "No space left" in (rec.last_error or "")
    assert "could not write a part file, 5 events dropped" in capfd.readouterr().err
    rows = rows_of(tmp_path)
    assert [(r["kind"], r["step"], r["n"]) for r in rows] == [("recorder_gap", None, 5), ("sched", 5, 5)]
    assert [r["seq"] for r in rows] == [5, 6]  # seq 0..4 were the lost rows
    assert rec.dropped_events == 5


def test_recording_off_records_why_and_stops_accepting(tmp_path: Path) -> None:
    rec = make(tmp_path)
    rec.emit("sched", step=0, n=1)
    rec.recording_off("AttributeError: 'Scheduler' object has no attribute 'x'")
    rec.emit("sched", step=1, n=1)
    rec.channel("worker", pp_rank=0, tp_rank=0).emit_many("req_sched", step=1, reqs=["a"])
    rec.close()
    rows = rows_of(tmp_path)
    assert [r["kind"] for r in rows] == ["sched", "recorder_off"]
    assert json.loads(rows[1]["detail"]) == {"error": "AttributeError: 'Scheduler' object has no attribute 'x'"}
    assert rec.dropped_events == 0  # turned off, not overloaded


def test_close_is_idempotent_and_later_events_are_ignored(tmp_path: Path) -> None:
    rec = make(tmp_path)
    rec.emit("sched", step=0, n=1)
    rec.close()
    files = {f: f.stat().st_mtime_ns for f in part_files(tmp_path)}
    rec.close()
    rec.emit("sched", step=1, n=1)
    rec.flush()
    rec.close()
    assert rec.closed
    assert {f: f.stat().st_mtime_ns for f in part_files(tmp_path)} == files
    assert [r["step"] for r in rows_of(tmp_path)] == [0]


def test_no_event_no_files(tmp_path: Path) -> None:
    rec = make(tmp_path)
    rec.channel("worker", pp_rank=0, tp_rank=0)
    rec.flush()
    rec.close()
    assert list(tmp_path.iterdir()) == []


def test_injected_and_reassigned_clock_give_ts_ns(tmp_path: Path) -> None:
    rec = make(tmp_path, clock=lambda: 42)
    worker = rec.channel("worker", pp_rank=0, tp_rank=0)
    rec.emit("sched", step=0)
    worker.emit("exec_begin", step=0)
    rec.clock = lambda: 7_000  # settable: existing channels follow
    rec.emit("sched", step=1)
    worker.emit("exec_end", step=0)
    rec.emit_many("req_sched", step=1, reqs=["a"])
    rec.clock = None  # back to wall time
    before = time.time_ns()
    rec.emit("sched", step=2)
    rec.close()
    ts = [r["ts_ns"] for r in rows_of(tmp_path)]
    assert ts[:5] == [42, 42, 7_000, 7_000, 7_000]
    assert before <= ts[5] <= time.time_ns()


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_writer_flushes_by_time_without_being_asked(tmp_path: Path) -> None:
    rec = make(tmp_path, flush_interval_s=0.05)
    rec.emit("sched", step=0, n=1)
    assert wait_for(lambda: len(part_files(tmp_path)) == 1)
    rec.close()


def test_writer_flushes_by_count_without_being_asked(tmp_path: Path) -> None:
    rec = make(tmp_path, flush_events=50, flush_interval_s=3600)
    for i in range(49):
        rec.emit("sched", step=i)
    time.sleep(0.05)
    assert part_files(tmp_path) == []  # below the count, an hour-long interval: nothing yet
    rec.emit("sched", step=49)
    assert wait_for(lambda: len(part_files(tmp_path)) == 1)
    assert pq.read_metadata(part_files(tmp_path)[0]).num_rows == 50
    rec.close()


def test_instance_names_make_plain_folders(tmp_path: Path) -> None:
    rec = make(tmp_path, instance="_dp/odd")
    rec.emit("sched", step=0)
    rec.close()
    (path,) = part_files(tmp_path)  # found: the folder does not start with "_" (readers would skip it)
    assert path.relative_to(tmp_path).parts[0] == "i_dp_odd"
    assert rows_of(tmp_path)[0]["instance"] == "_dp/odd"


def test_recorders_of_one_instance_in_one_process_share_the_writers_seq_and_parts(tmp_path: Path) -> None:
    # The format's writer is (instance, pid): two dp ranks recorded by one process must not reuse seq or part names.
    dp0 = make(tmp_path, instance="engine", dp_rank=0)
    dp1 = make(tmp_path, instance="engine", dp_rank=1)
    for i in range(6):
        (dp0 if i % 2 else dp1).emit("sched", step=i)
        (dp1 if i % 2 else dp0).flush()
    dp0.close()
    dp1.close()
    rows = rows_of(tmp_path)
    assert sorted(r["step"] for r in rows) == list(range(6))  # no part file overwrote another
    assert len({r["seq"] for r in rows}) == 6
    for dp in (0, 1):
        seqs = [r["seq"] for r in rows if r["dp_rank"] == dp]
        assert seqs == sorted(seqs)


# ---- the writer's column conversion against pyarrow's own converter ------------------------------------------------

_CHANNELS = [("scheduler", 0, None, None), ("worker", 1, 2, 3), ("engine", None, None, None)]


def _maybe(strategy, null_weight: int):
    return st.one_of(*([st.none()] * null_weight), strategy)


_row = st.tuples(
    st.integers(0, 2**63 - 1),                                   # ts_ns
    st.integers(0, len(_CHANNELS) - 1),                          # channel id
    st.sampled_from(["sched", "req_sched", "blocks_free", "exec_begin", "ünïcode"]),
    _maybe(st.integers(-(2**63), 2**63 - 1), 1),                 # step
    _maybe(st.text(max_size=8), 1),                              # req
    _maybe(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5), 2),  # blocks
    _maybe(st.integers(-(2**63) + 1, 2**63 - 1), 1),             # n
    _maybe(st.sampled_from(["finished", "preempted", ""]), 3),   # reason
    _maybe(st.sampled_from(["RUNNING", "unknown"]), 3),          # status
    _maybe(st.booleans(), 3),                                    # delay_free
    _maybe(st.booleans(), 1),                                    # deferred
    _maybe(st.one_of(st.text(max_size=6), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)), 2),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(_row, max_size=150), seq_start=st.integers(0, 2**40))
def test_rows_to_table_matches_pyarrows_converter(rows: list[tuple], seq_start: int) -> None:
    # Dense, mostly-null and all-null columns take different paths in the writer; pa.array is the reference.
    table = rows_to_table(rows, seq_start, _CHANNELS, "inst", "both", 4242)
    table.validate(full=True)
    assert table.schema.equals(SCHEMA)
    got = table.to_pylist()
    assert len(got) == len(rows)
    for index, (row, out) in enumerate(zip(rows, got)):
        ts, chan, kind, step, req, blocks, n, reason, status, delay_free, deferred, detail = row
        component, dp, pp, tp = _CHANNELS[chan]
        if detail is not None and not isinstance(detail, str):
            detail = json.dumps(detail, separators=(",", ":"))
        assert out == {
            "ts_ns": ts, "seq": seq_start + index, "instance": "inst", "role": "both", "pid": 4242,
            "component": component, "dp_rank": dp, "pp_rank": pp, "tp_rank": tp, "kind": kind, "step": step,
            "req": req, "blocks": blocks, "n": n, "reason": reason, "status": status, "delay_free": delay_free,
            "deferred": deferred, "detail": detail,
        }


_batch = st.tuples(
    st.integers(0, 2**63 - 1),
    st.integers(0, len(_CHANNELS) - 1),
    st.sampled_from(["req_sched", "batch_add"]),
    _maybe(st.integers(-(2**63), 2**63 - 1), 1),
    st.lists(_maybe(st.text(max_size=8), 3), min_size=1, max_size=70),
    _maybe(st.lists(_maybe(st.integers(-(2**63) + 1, 2**63 - 1), 3), min_size=70, max_size=70), 1),
    _maybe(st.sampled_from(["new", "resumed"]), 1),
    _maybe(st.sampled_from(["RUNNING"]), 3),
)


@settings(max_examples=60, deadline=None)
@given(entries=st.lists(st.one_of(_row, _batch), max_size=80), seq_start=st.integers(0, 2**40))
def test_rows_to_table_spreads_emit_many_batches_into_their_rows(entries: list[tuple], seq_start: int) -> None:
    # A batch entry (as Channel.emit_many buffers it) must give exactly the rows of one emit per request.
    from pdtrace.recording.recorder import _BATCH

    buffered, expanded = [], []
    for entry in entries:
        if len(entry) == 12:
            buffered.append(entry)
            expanded.append(entry)
            continue
        ts, chan, kind, step, reqs, ns, reason, status = entry
        ns = None if ns is None else ns[:len(reqs)]
        buffered.append((ts, chan, kind, step, reqs, _BATCH, ns, reason, status, None, None, None))
        expanded += [(ts, chan, kind, step, req, None, None if ns is None else ns[i], reason, status, None, None, None)
                     for i, req in enumerate(reqs)]
    table = rows_to_table(buffered, seq_start, _CHANNELS, "inst", "both", 7)
    table.validate(full=True)
    assert table.schema.equals(SCHEMA)
    assert table.to_pylist() == rows_to_table(expanded, seq_start, _CHANNELS, "inst", "both", 7).to_pylist()


def test_rows_to_table_mostly_null_and_dense_columns_agree() -> None:
    # 200 rows: above the size where the writer scatters mostly-null columns; every null density is covered.
    for every in (1, 2, 3, 10, 200):
        rows = [(i, 0, "k", i if i % every == 0 else None, f"r{i % 7}" if i % every == 0 else None,
                 (i, i + 1) if i % every == 0 else None, i if i % every == 0 else None,
                 "finished" if i % every == 0 else None, None, (i % 2 == 0) if i % every == 0 else None,
                 None, {"i": i} if i % every == 0 else None) for i in range(200)]
        table = rows_to_table(rows, 0, _CHANNELS, "inst", "both", 1)
        table.validate(full=True)
        expected_present = [i % every == 0 for i in range(200)]
        for name in ("step", "req", "blocks", "n", "reason", "delay_free", "detail"):
            assert [v is not None for v in table.column(name).to_pylist()] == expected_present, (every, name)
        assert table.column("step").to_pylist() == [i if p else None for i, p in enumerate(expected_present)]
        assert table.column("detail").to_pylist()[0] == '{"i":0}'


def test_a_failing_clock_never_raises_into_the_caller(tmp_path: Path) -> None:
    def broken_clock() -> int:
        raise RuntimeError("virtual clock not started")

    rec = make(tmp_path, clock=broken_clock)
    rec.emit("sched", step=0)
    rec.emit_many("req_sched", step=0, reqs=["a"])
    rec.clock = counter_clock()
    rec.emit("sched", step=1)
    rec.close()
    assert rec.errors == 2
    assert [r["step"] for r in rows_of(tmp_path)] == [1]
