"""The Recorder across process boundaries: SIGKILL mid-stream leaves only whole part files, SIGTERM flushes (and
keeps the host's own handler working), forked children write their own events under their own pid, and
multiprocessing children flush at exit. Each scenario runs in a child Python process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import pdtrace
from pdtrace.trace.reader import find_part_files

@pytest.fixture(autouse=True, params=["process", "thread"])
def writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with each writer: the writer process (the default) and the in-thread fallback
    (`PDTRACE_WRITER_PROCESS=0`; child processes inherit the switch)."""
    monkeypatch.setenv("PDTRACE_WRITER_PROCESS", "1" if request.param == "process" else "0")
    return request.param


PRELUDE = """
import json, os, signal, sys, threading, time
from pdtrace.recording.recorder import Recorder
directory = sys.argv[1]
"""


def start_child(code: str, *args: object) -> subprocess.Popen:
    script = PRELUDE + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_child(code: str, *args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = start_child(code, *args)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"child hung; stderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rows_on_disk(directory: Path) -> int:
    """Rows in the complete part files (what a reader would count), without opening the data."""
    total = 0
    for path in find_part_files(directory):
        try:
            total += pq.read_metadata(path).num_rows
        except Exception:
            pass
    return total


def wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def events(directory: Path) -> list[dict]:
    table = pdtrace.open_trace(directory).table
    return sorted(table.to_pylist(), key=lambda r: (r["pid"], r["seq"]))


STREAMING_CHILD = """
rec = Recorder(directory, instance="crash", role="both", source="test", flush_events=2000, flush_interval_s=0.1,
               handle_sigterm=False)
k = int(sys.argv[2])
for i in range(k):
    rec.emit("req_sched", step=i, req="r", n=i)
print("emitted", k, flush=True)
i = k
while True:  # keep streaming: the kill lands while parts are being written
    for _ in range(500):
        rec.emit("req_sched", step=i, req="r", n=i)
        i += 1
    time.sleep(0.001)
"""


def test_sigkill_mid_stream_leaves_only_whole_files_and_loses_at_most_the_last_interval(tmp_path: Path) -> None:
    k = 20_000
    child = start_child(STREAMING_CHILD, tmp_path, k)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().split() == ["emitted", str(k)]
        # No flush() is ever called: the writer's own 0.1 s timer must get the first K events to disk.
        assert wait_for(lambda: rows_on_disk(tmp_path) >= k), "the writer did not flush by time"
        time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL

    files = find_part_files(tmp_path)
    for path in files:
        assert pq.read_table(path).num_rows > 0  # every part file is whole: it opens and reads entirely
    temporary = [p for p in tmp_path.rglob("*") if p.is_file() and p not in files]
    assert all(p.name.startswith(".") for p in temporary)  # leftovers are hidden temp files, never events
    rows = events(tmp_path)
    assert len(rows) == rows_on_disk(tmp_path) >= k
    assert [r["seq"] for r in rows] == list(range(len(rows)))
    steps = [r["step"] for r in rows if r["kind"] == "req_sched"]
    assert steps[:k] == list(range(k))  # everything emitted more than an interval before the kill
    assert all(b > a for a, b in zip(steps, steps[1:]))  # no duplicates after a crash


def test_kill_between_writing_and_naming_a_part_leaves_a_hidden_temp_file(tmp_path: Path) -> None:
    result = run_child("""
        import pdtrace.recording.recorder as recorder_module
        os.environ["PDTRACE_WRITER_PROCESS"] = "0"  # the in-thread writer: the link happens in this process
        rec = Recorder(directory, instance="crash", role="both", source="test", flush_interval_s=3600,
                       handle_sigterm=False)
        for i in range(10):
            rec.emit("sched", step=i)
        rec.flush()
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        recorder_module.os.link = die  # the temp file is complete; the process dies before giving it its name
        recorder_module.os.replace = die
        for i in range(10, 20):
            rec.emit("sched", step=i)
        rec.flush()
        print("not reached")
    """, tmp_path)
    assert result.returncode == -signal.SIGKILL and "not reached" not in result.stdout
    folder = next((tmp_path / "crash").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == [".part-000001.parquet.tmp", "part-000000.parquet"]
    assert [r["step"] for r in events(tmp_path)] == list(range(10))


SIGTERM_CHILD = """
mode = sys.argv[2]
if mode == "host_exits":
    def host_handler(signum, frame):
        # os.write, not print: the signal can land inside print("ready") below, and a print from the handler then
        # re-enters stdout's buffered writer (RuntimeError: reentrant call) where PYTHONUNBUFFERED is not set
        os.write(1, b"host handler ran\\n")
        sys.exit(3)
    signal.signal(signal.SIGTERM, host_handler)
elif mode == "host_ignores":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
rec = Recorder(directory, instance="term", role="decode", source="test", flush_interval_s=3600)
for i in range(1000):
    rec.emit("req_sched", step=i, req="r", n=i)
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""


def _terminate_after_ready(tmp_path: Path, mode: str) -> subprocess.Popen:
    child = start_child(SIGTERM_CHILD, tmp_path, mode)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    assert rows_on_disk(tmp_path) == 0  # an hour-long interval: nothing written yet
    child.send_signal(signal.SIGTERM)
    return child


def test_sigterm_flushes_then_dies_of_sigterm(tmp_path: Path) -> None:
    child = _terminate_after_ready(tmp_path, "default")
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM  # the default action still happens after the flush
    assert [r["step"] for r in events(tmp_path)] == list(range(1000))


def test_sigterm_flushes_then_runs_the_hosts_handler(tmp_path: Path) -> None:
    child = _terminate_after_ready(tmp_path, "host_exits")
    out, _err = child.communicate(timeout=60)
    assert child.returncode == 3 and "host handler ran" in out
    assert [r["step"] for r in events(tmp_path)] == list(range(1000))


def test_sigterm_ignored_by_the_host_still_flushes_and_the_process_lives(tmp_path: Path) -> None:
    child = _terminate_after_ready(tmp_path, "host_ignores")
    try:
        assert wait_for(lambda: rows_on_disk(tmp_path) == 1000)
        time.sleep(0.1)
        assert child.poll() is None  # SIG_IGN is respected
    finally:
        child.kill()
        child.communicate(timeout=60)


def test_sigterm_handler_is_installed_only_from_the_main_thread() -> None:
    result = run_child("""
        import tempfile
        def make():
            Recorder(tempfile.mkdtemp(), instance="t", role="none")
        thread = threading.Thread(target=make)
        thread.start(); thread.join()
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        Recorder(tempfile.mkdtemp(), instance="u", role="none")
        print(signal.getsignal(signal.SIGTERM).__name__)
    """, "unused")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "_on_sigterm"]


def test_forked_child_writes_its_own_events_under_its_pid(tmp_path: Path) -> None:
    result = run_child("""
        rec = Recorder(directory, instance="fork", role="both", source="test", flush_interval_s=3600)
        worker = rec.channel("worker", pp_rank=0, tp_rank=0)
        for i in range(5):
            rec.emit("sched", step=i, detail={"who": "parent"})  # buffered in the parent at fork time
        pid = os.fork()
        if pid == 0:
            try:
                for i in range(3):
                    worker.emit("exec_begin", step=100 + i, detail={"who": "child"})
                rec.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        silent = os.fork()
        if silent == 0:  # a child that records nothing opens no files
            try:
                rec.close()
            finally:
                os._exit(0)
        os.waitpid(silent, 0)
        for i in range(5, 8):
            rec.emit("sched", step=i, detail={"who": "parent"})
        rec.close()
        print(os.getpid(), pid)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    parent_pid, child_pid = map(int, result.stdout.split())
    assert sorted(p.name for p in (tmp_path / "fork").iterdir()) == sorted([str(parent_pid), str(child_pid)])
    rows = events(tmp_path)
    parent = [(r["step"], r["seq"], r["kind"]) for r in rows if r["pid"] == parent_pid]
    child = [(r["step"], r["seq"], r["kind"], r["tp_rank"]) for r in rows if r["pid"] == child_pid]
    assert parent == [(i, i, "sched") for i in range(8)]  # the parent's buffer was written once, by the parent
    assert child == [(100 + i, i, "exec_begin", 0) for i in range(3)]  # the child's own writer and seq
    assert all(f.parent.name == str(child_pid) for f in find_part_files(tmp_path) if "child" in
               str(pq.read_table(f).column("detail").to_pylist()))


def test_fork_while_the_writer_is_writing_does_not_deadlock_the_child(tmp_path: Path) -> None:
    result = run_child("""
        from pdtrace.recording.recorder import write_part
        entered = threading.Event()
        def slow_writer(table, path):
            entered.set()
            time.sleep(0.3)
            write_part(table, path)
        rec = Recorder(directory, instance="fork", role="both", source="test", flush_interval_s=3600,
                       part_writer=slow_writer)
        for i in range(5):
            rec.emit("sched", step=i)
        flusher = threading.Thread(target=rec.flush)
        flusher.start()
        entered.wait(30)
        pid = os.fork()  # the writer holds its lock: fork waits for the part to be written
        if pid == 0:
            try:
                rec.emit("sched", step=100)
                rec.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        flusher.join()
        rec.close()
        print(pid)
    """, tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    child_pid = int(result.stdout)
    steps = {(r["pid"], r["step"]) for r in events(tmp_path)}
    assert steps == {(child_pid, 100)} | {(p, i) for p, i in steps if p != child_pid}
    assert sorted(i for p, i in steps if p != child_pid) == list(range(5))


def test_multiprocessing_fork_child_flushes_at_exit_without_close(tmp_path: Path) -> None:
    result = run_child("""
        import multiprocessing
        rec = Recorder(directory, instance="mp", role="both", source="test", flush_interval_s=3600)
        rec.emit("sched", step=0)
        def child():  # returns normally: multiprocessing ends the process with os._exit (no atexit)
            for i in range(4):
                rec.channel("worker", pp_rank=1, tp_rank=0).emit("exec_begin", step=i)
        if __name__ == "__main__":
            process = multiprocessing.get_context("fork").Process(target=child)
            process.start()
            process.join()
            rec.close()
            print(process.pid, process.exitcode)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    child_pid, exitcode = map(int, result.stdout.split())
    assert exitcode == 0
    rows = events(tmp_path)
    assert [(r["kind"], r["step"]) for r in rows if r["pid"] == child_pid] == [("exec_begin", i) for i in range(4)]
    assert [(r["kind"], r["step"]) for r in rows if r["pid"] != child_pid] == [("sched", 0)]


def test_atexit_flushes_an_unclosed_recorder(tmp_path: Path) -> None:
    result = run_child("""
        rec = Recorder(directory, instance="exit", role="both", source="test", flush_interval_s=3600)
        for i in range(7):
            rec.emit("sched", step=i)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert [r["step"] for r in events(tmp_path)] == list(range(7))


def test_recording_imports_neither_pandas_nor_anything_outside_the_recording_path(tmp_path: Path) -> None:
    # pa.array() on Python lists would import pandas through pyarrow's pandas shim; the writer must not.
    result = run_child("""
        from pdtrace.recording.recorder import warm_up
        warm_up()  # what the plugin runs at vLLM's start-up: in memory, nothing on disk
        assert not os.listdir(directory)
        rec = Recorder(directory, instance="light", role="both", source="test", flush_interval_s=3600)
        chan = rec.channel("worker", pp_rank=0, tp_rank=1)
        rec.emit("blocks_free", step=1, req="r1", blocks=[1, 2], reason="finished", status="RUNNING",
                 delay_free=False, deferred=True, detail={"fence": 3})
        rec.emit("blocks_alloc", step="2", req=7, blocks=("3", 4), n=2.5)  # the coercion paths too
        chan.emit_many("kv_send_rank", step=2, reqs=["r1", None], ns=[1, None])  # a worker kind on a worker channel
        rec.close()
        heavy = sorted(m for m in ("pandas", "typer", "rich", "matplotlib") if m in sys.modules)
        print(json.dumps(heavy))
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert len(events(tmp_path)) == 4
