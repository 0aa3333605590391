"""The recorder's writer process: it (not the recording process) converts and writes the part files, gives the
same rows as the in-thread writer whatever the values, dies with its parent, is never shared with a forked
child, and when it is lost or stalls the recorder carries on in-thread, dropping (and counting) what it must,
never stalling its caller."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import pdtrace
from pdtrace.format import META_DROPPED
from pdtrace.recording import writer_process
from pdtrace.recording.recorder import Recorder
from pdtrace.trace.reader import find_part_files

from test_recorder_crash import events, run_child, start_child, wait_for


@pytest.fixture(autouse=True)
def process_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(writer_process.ENV_SWITCH, "1")


def make(directory: Path, **kwargs) -> Recorder:
    kwargs.setdefault("instance", "prefill-0")
    kwargs.setdefault("role", "prefill")
    kwargs.setdefault("source", "test")
    kwargs.setdefault("flush_interval_s", 60.0)
    kwargs.setdefault("handle_sigterm", False)
    return Recorder(directory, **kwargs)


# Child-script prelude: a recorder whose first `count` events are on disk, and its writer process's pid.
STARTED = """
from pdtrace.recording import writer_process
def started(instance, count):
    rec = Recorder(directory, instance=instance, role="both", source="test", flush_interval_s=3600,
                   handle_sigterm=False)
    for i in range(count):
        rec.emit("sched", step=i)
    rec.flush()
    return rec, writer_process.shared(spawn=False).pid
"""


def with_started(code: str) -> str:
    return STARTED + textwrap.dedent(code)


def gone(pid: int) -> bool:
    """Whether a process has ended (no such process, or a zombie waiting for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_the_writer_process_writes_the_parts_not_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pdtrace.recording.recorder as recorder_module

    def not_here(table, path):
        raise AssertionError("the recording process wrote a part itself")

    monkeypatch.setattr(recorder_module, "write_part", not_here)
    rec = make(tmp_path)
    for i in range(50):
        rec.emit("sched", step=i, detail={"running": i})
    rec.emit_many("req_sched", step=50, reqs=["a", "b"], ns=[3, 4])
    rec.flush()  # returns once the child has the part on disk
    assert sum(pq.read_metadata(p).num_rows for p in find_part_files(tmp_path)) == 52
    writer = writer_process.shared(spawn=False)
    assert writer is not None and writer.pid != os.getpid() and not gone(writer.pid)
    assert rec.errors == 0
    rec.close()


class Opaque:
    def __str__(self) -> str:
        return "opaque!"


class Label(str):
    pass


def odd_events(rec: Recorder) -> None:
    """Values marshal cannot carry (it raises) or carries as bytes (buffer-protocol objects), beside plain ones."""
    rec.emit("sched", step=0, detail={"running": 1})
    rec.emit("blocks_alloc", step=np.int64(1), req="r1", blocks=np.array([5, 6, 7], dtype=np.int32),
             n=np.int32(3), detail={"hit": np.int64(2), "ids": (np.int16(1), 2)})
    rec.emit("blocks_free", step=2, req=Label("r2"), blocks=(np.int64(8),), reason=Label("finished"),
             deferred=np.bool_(True), delay_free=np.bool_(False), detail=Label("plain text"))
    rec.emit("sched", step=3, detail={"obj": Opaque(), "set": {3, 1, 2}, "bytes": b"\x01"})
    rec.emit("req_add", step=np.uint8(4), req=Opaque(), n=2.5, detail=b"raw")
    circular: dict = {"a": 1}
    circular["self"] = circular
    rec.emit("sched", step=5, detail=circular)
    rec.emit("blocks_alloc", step=6, req="r3", blocks=range(3), detail=[np.float32(0.5)])
    rec.emit_many("req_sched", step=7, reqs=["r1", Label("r2"), np.str_("r3")], ns=[1, np.int64(2), None])
    rec.emit("sched", step=8, detail={"running": 2})
    rec.emit_counts("req_sched", step=9, counts={"r1": 1, Label("r2"): np.int64(2)})


def test_odd_values_give_the_same_rows_as_the_in_thread_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tables = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(writer_process.ENV_SWITCH, switch)
        directory = tmp_path / switch
        rec = make(directory, clock=iter(range(10**9, 2 * 10**9, 1000)).__next__)
        odd_events(rec)
        rec.close()
        assert rec.errors == 0
        tables[switch] = pdtrace.open_trace(directory).table.drop_columns(["pid"]).sort_by("seq").to_pylist()
    assert len(tables["1"]) == 13
    assert tables["1"] == tables["0"]
    assert [(row["req"], row["n"]) for row in tables["1"] if row["step"] == 9] == [("r1", 1), ("r2", 2)]
    by_step = {row["step"]: row for row in tables["1"]}
    assert by_step[1]["blocks"] == [5, 6, 7] and by_step[1]["n"] == 3 and by_step[1]["detail"] == \
        '{"hit":"2","ids":["1",2]}'


def test_the_writer_process_ends_when_its_parent_is_killed_and_marks_what_it_lost(tmp_path: Path) -> None:
    child = start_child(with_started("""
        rec, writer_pid = started("k", 100)
        rec._tick_s = 3600  # no hand-over of a quiet buffer: the next 100 stay in this process
        print(writer_pid, flush=True)
        for i in range(100, 200):
            rec.emit("sched", step=i)  # buffered only: lost with the process (the last interval)
        time.sleep(600)
    """), tmp_path)
    try:
        assert child.stdout is not None
        writer_pid = int(child.stdout.readline())
        assert not gone(writer_pid)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert wait_for(lambda: gone(writer_pid), timeout=30), "the writer process outlived its parent"
    rows = events(tmp_path)
    assert [r["step"] for r in rows[:100]] == list(range(100))  # what was flushed is whole on disk
    # ... and the loss is marked: one recorder_gap after the last event received, count unknown.
    assert [(r["kind"], r["n"], r["seq"]) for r in rows[100:]] == [("recorder_gap", None, 100)]
    assert "killed before its final flush" in rows[100]["detail"] and rows[100]["ts_ns"] > rows[99]["ts_ns"]


def test_a_quiet_recorder_hands_its_events_over_and_a_kill_loses_nothing(tmp_path: Path) -> None:
    # The healthy look-alike: the process went quiet before it was killed (as a served engine between requests):
    # its events reached the writer process, settled, and no gap is claimed.
    child = start_child(with_started("""
        rec, writer_pid = started("k", 100)
        for i in range(100, 200):
            rec.emit("sched", step=i)
        print(writer_pid, flush=True)
        time.sleep(600)
    """), tmp_path)
    try:
        assert child.stdout is not None
        writer_pid = int(child.stdout.readline())
        assert wait_for(lambda: len(events(tmp_path)) == 200, timeout=30)
        time.sleep(0.5)  # still quiet: it said so (settled) to its writer process
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert wait_for(lambda: gone(writer_pid), timeout=30)
    assert [r["step"] for r in events(tmp_path)] == list(range(200))


def test_events_after_a_quiet_spell_are_marked_lost_when_the_process_is_killed_before_their_hand_over(
        tmp_path: Path) -> None:
    # vLLM serve's shutdown after a lone last request: the worker went quiet between requests (its writer process
    # was told so: settled), then recorded the request's steps, and vLLM SIGKILLed it before their hand-over (while
    # events keep coming, once per flush interval). That loss used to go unmarked (a real-engine run lost a
    # request's worker rows with no recorder_gap): the first event after the quiet spell now tells the writer
    # process at once.
    child = start_child(with_started("""
        rec = Recorder(directory, instance="k", role="both", source="test", flush_interval_s=3600,
                       handle_sigterm=False)
        for i in range(100):
            rec.emit("sched", step=i)
        for busy in (lambda: rec._rows, lambda: not rec._unsettled_sent, lambda: rec._unsettled_sent):
            while busy():  # the writer thread's first tick hands them over, and a tick later it says "settled"
                time.sleep(0.005)
        writer_pid = writer_process.shared(spawn=False).pid
        for i in range(100, 200):
            rec.emit("sched", step=i)
            time.sleep(0.002)  # never quiet for a tick again, and the flush interval is an hour: no hand-over
        print(writer_pid, flush=True)
        while True:
            rec.emit("sched", step=-1)
            time.sleep(0.002)
    """), tmp_path)
    try:
        assert child.stdout is not None
        writer_pid = int(child.stdout.readline())
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert wait_for(lambda: gone(writer_pid), timeout=30)
    rows = events(tmp_path)
    # What was handed over is whole (the writer thread's first tick may take some of the new events), and the
    # loss after it is marked: one recorder_gap, last.
    kept = [r["step"] for r in rows[:-1]]
    assert kept == list(range(len(kept))) and len(kept) >= 100
    assert (rows[-1]["kind"], rows[-1]["n"], rows[-1]["seq"]) == ("recorder_gap", None, len(kept))


def test_a_writer_thread_that_slept_through_the_tick_does_not_take_a_busy_buffer_for_settled(
        tmp_path: Path) -> None:
    # On 2 cores vLLM's CPU workers spin OpenMP threads on both: the writer thread can sleep far past its tick.
    # What it then sees (the buffer unchanged since its last look, long ago) is its own sleep, not the process's
    # quiet; the newest row's own time decides.
    rec = make(tmp_path, flush_interval_s=3600)
    try:
        rec._tick_s = 3600.0  # the writer thread, started by the first event, never wakes by itself
        rec.emit("sched", step=1)
        rec._tick_s = 2.0
        rec._tick_slots, rec._tick_edits, rec._quiet_since = len(rec._rows), rec._edits, time.monotonic() - 60
        assert not rec._settled(time.monotonic())  # the row is under a tick old
        rec._rows[0] -= 5_000_000_000  # its ts_ns: five seconds ago
        assert rec._settled(time.monotonic())
    finally:
        rec.close()


def test_a_lost_writer_process_hands_over_to_the_writer_thread(tmp_path: Path) -> None:
    result = run_child(with_started("""
        rec, writer_pid = started("lost", 10)
        os.kill(writer_pid, signal.SIGKILL)
        time.sleep(0.2)
        for i in range(10, 20):
            rec.emit("sched", step=i)
        rec.flush()  # the pipe is broken before the batch went over: this thread writes it
        for i in range(20, 30):
            rec.emit("sched", step=i)
        rec.close()
        print(json.dumps([rec.errors, rec.dropped_events, writer_process.shared(spawn=False) is None]))
    """), tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [0, 0, True]
    assert "writer process" in result.stderr and "lost" in result.stderr
    rows = events(tmp_path)
    assert [(r["seq"], r["step"]) for r in rows] == [(i, i) for i in range(30)]
    assert [p.name for p in find_part_files(tmp_path)] == [f"part-{i:06d}.parquet" for i in range(3)]


def test_a_stalled_writer_process_turns_into_counted_drops_not_a_stalled_caller(tmp_path: Path) -> None:
    result = run_child("""
        from pdtrace.recording import writer_process
        writer_process.REPLY_TIMEOUT_S = 2.0
        rec = Recorder(directory, instance="stall", role="both", source="test", flush_events=200,
                       flush_interval_s=0.05, max_buffered_events=1000, handle_sigterm=False)
        rec.emit("sched", step=0)
        rec.flush()
        writer_pid = writer_process.shared(spawn=False).pid
        os.kill(writer_pid, signal.SIGSTOP)  # takes nothing, answers nothing
        slowest = 0
        for i in range(1, 20001):
            t = time.perf_counter()
            rec.emit("sched", step=i)
            slowest = max(slowest, time.perf_counter() - t)
            if i % 1000 == 0:
                time.sleep(0.02)
        dropped_while_stalled = rec.dropped_events
        time.sleep(3.0)  # past the timeout: the stalled child is given up, the thread writes from now on
        for i in range(20001, 20101):
            rec.emit("sched", step=i)
        rec.close()
        print(json.dumps([slowest, dropped_while_stalled, rec.dropped_events]))
    """, tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    slowest, dropped_while_stalled, dropped = json.loads(result.stdout)
    assert slowest < 0.5  # the caller never waited for the stalled child
    assert dropped_while_stalled > 15_000 and dropped >= dropped_while_stalled
    rows = events(tmp_path)
    steps = [r["step"] for r in rows if r["kind"] == "sched"]
    gaps = [r for r in rows if r["kind"] == "recorder_gap"]
    assert len(steps) + dropped == 20101 and gaps and sum(g["n"] for g in gaps) == dropped
    assert steps[-100:] == list(range(20001, 20101))  # after the hand-over nothing more is lost
    last = max(find_part_files(tmp_path), key=lambda p: p.name)
    assert int(pq.read_metadata(last).metadata[META_DROPPED.encode()]) == dropped


def test_a_forked_child_gets_its_own_writer_process_and_leaves_its_parents_alone(tmp_path: Path) -> None:
    result = run_child("""
        from pdtrace.recording import writer_process
        rec = Recorder(directory, instance="fork", role="both", source="test", flush_interval_s=3600)
        rec.emit("sched", step=0)
        rec.flush()
        parent_writer = writer_process.shared(spawn=False).pid
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                rec.emit("sched", step=100)
                rec.flush()
                os.write(write, str(writer_process.shared(spawn=False).pid).encode())
                rec.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        child_writer = int(os.read(read, 100))
        rec.emit("sched", step=1)
        rec.flush()  # the parent's writer process still serves the parent
        same = writer_process.shared(spawn=False).pid == parent_writer
        rec.close()
        print(json.dumps([pid, parent_writer, child_writer, same]))
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    child_pid, parent_writer, child_writer, same = json.loads(result.stdout)
    assert child_writer != parent_writer and same
    rows = events(tmp_path)
    assert [(r["step"], r["seq"]) for r in rows if r["pid"] == child_pid] == [(100, 0)]
    assert [(r["step"], r["seq"]) for r in rows if r["pid"] != child_pid] == [(0, 0), (1, 1)]


def test_the_switch_and_a_custom_part_writer_keep_writing_in_thread(tmp_path: Path) -> None:
    result = run_child("""
        from pdtrace.recording import writer_process
        from pdtrace.recording.recorder import write_part
        os.environ["PDTRACE_WRITER_PROCESS"] = "0"
        rec = Recorder(directory + "/a", instance="off", role="both", source="test", handle_sigterm=False)
        rec.emit("sched", step=0)
        rec.close()
        switched_off = writer_process.shared() is None
        os.environ["PDTRACE_WRITER_PROCESS"] = "1"
        written = []
        def mine(table, path):
            written.append(table.num_rows)
            write_part(table, path)
        rec = Recorder(directory + "/b", instance="custom", role="both", source="test", handle_sigterm=False,
                       part_writer=mine)
        rec.emit("sched", step=0)
        rec.close()
        print(json.dumps([switched_off, written]))
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [True, [1]]
    assert len(events(tmp_path / "a")) == 1 and len(events(tmp_path / "b")) == 1


def test_close_all_stops_and_reaps_the_writer_process(tmp_path: Path) -> None:
    result = run_child("""
        from pdtrace.recording import recorder, writer_process
        rec = Recorder(directory, instance="stop", role="both", source="test", handle_sigterm=False)
        rec.emit("sched", step=0)
        rec.flush()
        writer = writer_process.shared(spawn=False)
        recorder.close_all()
        print(json.dumps([writer._proc.returncode, writer_process.shared(spawn=False) is None]))
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [0, True]
    assert len(events(tmp_path)) == 1


@pytest.mark.parametrize("interpreter", ["/nonexistent/python", "/bin/false"])
def test_a_writer_process_that_cannot_start_leaves_the_batch_to_the_thread(tmp_path: Path, interpreter: str) -> None:
    result = run_child(f"""
        sys.executable = {interpreter!r}  # Popen fails, or the child exits before it is ready
        rec = Recorder(directory, instance="nostart", role="both", source="test", handle_sigterm=False)
        for i in range(5):
            rec.emit("sched", step=i)
        rec.close()
        print(json.dumps([rec.errors, rec.dropped_events]))
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [0, 0]
    assert [(r["seq"], r["step"]) for r in events(tmp_path)] == [(i, i) for i in range(5)]


def test_the_writer_process_runs_the_recording_processs_pdtrace_whatever_its_working_directory(tmp_path: Path) -> None:
    shadow = tmp_path / "cwd" / "pdtrace"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the wrong pdtrace')\n")
    result = run_child(f"""
        os.chdir({str(shadow.parent)!r})  # a pdtrace folder where the writer process starts
        rec = Recorder(directory, instance="cwd", role="both", source="test", handle_sigterm=False)
        rec.emit("sched", step=0)
        rec.flush()
        from pdtrace.recording import writer_process
        print(json.dumps(writer_process.shared(spawn=False) is not None))
        rec.close()
    """, tmp_path / "trace")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) is True and "wrong pdtrace" not in result.stderr
    assert len(events(tmp_path / "trace")) == 1


def test_a_part_the_writer_process_cannot_write_is_counted_as_a_gap(tmp_path: Path, capfd) -> None:
    (tmp_path / "prefill-0").write_text("a file where the instance's folder should be\n")
    rec = make(tmp_path)
    for i in range(5):
        rec.emit("sched", step=i)
    rec.flush()  # the child cannot make the folder: it answers with its error
    assert rec.errors == 1 and rec.dropped_events == 5 and "could not write" in capfd.readouterr().err
    assert writer_process.shared(spawn=False) is not None  # the child itself carries on
    (tmp_path / "prefill-0").unlink()
    rec.emit("sched", step=5)
    rec.close()
    rows = events(tmp_path)
    assert [(r["kind"], r["n"], r["step"]) for r in rows] == [("recorder_gap", 5, None), ("sched", None, 5)]
    assert [r["seq"] for r in rows] == [5, 6]  # the lost rows leave their hole (0-4), the gap row is in place
    (part,) = find_part_files(tmp_path)
    assert int(pq.read_metadata(part).metadata[META_DROPPED.encode()]) == 5


def test_the_writer_process_leaves_the_process_group_but_stays_in_the_session(tmp_path: Path) -> None:
    # Its own process group: a terminal's Ctrl-C and `kill -- -PGID` do not reach it (it writes what it holds).
    # The recording process's session: Linux's autogroup weighs a session as one task group, and a writer alone in
    # a session of its own got 0.4 s of CPU in 2 minutes beside a vLLM worker's spinning threads.
    result = run_child(with_started("""
        rec, writer_pid = started("grouped", 3)
        print(json.dumps({"pid": os.getpid(), "session": os.getsid(0), "group": os.getpgid(0),
                          "writer_session": os.getsid(writer_pid), "writer_group": os.getpgid(writer_pid),
                          "writer_parent": int(open(f"/proc/{writer_pid}/stat").read().rsplit(")", 1)[1].split()[1])}))
        rec.close()
    """), tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["writer_session"] == doc["session"]
    assert doc["writer_group"] not in (doc["group"], doc["session"])
    assert doc["writer_parent"] != doc["pid"]  # no descendant: vLLM's shutdown SIGKILLs every one it finds



def test_a_flush_request_is_acknowledged_only_once_the_rows_are_out(tmp_path: Path) -> None:
    # `pdtrace record` says how many recording processes handed their events over before it stops the command: a
    # process whose writer thread is stuck on a batch (holding the write lock past the handler's bound) must not
    # be counted, and is once the writer is free again.
    from pdtrace.recording.recorder import request_flush

    trace = tmp_path / "trace"
    proc = start_child("""
        import pathlib
        rec = Recorder(directory, instance="stuck", role="both", source="test", flush_interval_s=3600)
        for i in range(10):
            rec.emit("sched", step=i)
        rec.flush()
        rec.emit("sched", step=10)
        rec._write_lock.acquire()  # the writer thread in a send that does not come back
        print("held", flush=True)
        for phase in ("release", "close"):
            while not pathlib.Path(sys.argv[2], phase).exists():
                time.sleep(0.01)
            if phase == "release":
                rec._write_lock.release()
                print("released", flush=True)
        rec.close()
    """, trace, tmp_path)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert request_flush(trace, timeout=4.0) == (1, 0)
        (tmp_path / "release").touch()
        assert proc.stdout.readline().strip() == "released"
        assert request_flush(trace, timeout=4.0) == (1, 1)
        assert sorted(r["step"] for r in events(trace)) == list(range(11))  # on disk before the acknowledgement
        (tmp_path / "close").touch()
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()
