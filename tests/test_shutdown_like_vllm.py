"""A recording process stopped the way vLLM stops its engine (issue 20, problem 3): nothing lost silently.

`vllm serve` ends its engine core with SIGTERM and, `shutdown_timeout` (default 0) later, SIGKILLs every descendant
psutil finds, then the engine (`kill_process_tree`, vllm/utils/system_utils.py in 0.28-0.33). Here a child process
plays the engine core (vLLM's own SIGTERM / SIGINT handler that only asks its loop to stop, as in
`run_engine_core`) with a forked "worker" that records too and gets no signal at all; the test plays vLLM's process
manager: SIGTERM, then at once the same psutil walk and SIGKILLs. Every event of either process must reach the
trace, or the writer's last row must be a `recorder_gap`."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import pdtrace
from pdtrace.recording import writer_process

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[1]

ENGINE = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pdtrace.recording.recorder import Recorder
    directory, mode = sys.argv[1], sys.argv[2]
    stop = threading.Event()

    def vllm_handler(signum, frame):  # EngineCoreProc's: shutdown requested, the loop exits later
        stop.set()

    signal.signal(signal.SIGTERM, vllm_handler)
    signal.signal(signal.SIGINT, vllm_handler)
    rec = Recorder(directory, instance="engine", role="both", source="test")
    rec.emit("engine_config", n=100)
    rec.flush()  # vLLM takes seconds to start: its writer process is up before the first request
    ready_read, ready_write = os.pipe()
    worker_pid = os.fork()
    if worker_pid == 0:  # a worker, forked by the engine: SIGKILLed without any signal before
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        chan = rec.channel("worker", pp_rank=0, tp_rank=0)
        chan.emit("exec_begin", step=None, n=0)  # the model's warm-up, while the engine starts
        rec.flush()
        for step in range(20):
            chan.emit("exec_begin", step=step, n=1)
            chan.emit("exec_end", step=step, n=1)
            time.sleep(0.005)
        os.write(ready_write, b"x")
        step = 20
        while mode == "busy":
            chan.emit("exec_begin", step=step, n=1)
            chan.emit("exec_end", step=step, n=1)
            step += 1
            time.sleep(0.001)
        time.sleep(600)
        os._exit(0)
    for i in range(20):
        rec.emit("req_add", req=f"r{i}", n=8)
        rec.emit("req_finish", req=f"r{i}", reason="stop")
        time.sleep(0.005)
    os.read(ready_read, 1)  # the worker has run its 20 steps
    print(worker_pid, flush=True)
    k = 0
    while not stop.is_set():
        if mode == "busy":
            rec.emit("sched", step=k, n=1)
            k += 1
        time.sleep(0.001)
    if mode == "busy":  # vLLM aborts what is in flight (nothing when quiet), then tears down
        rec.emit("req_finish", req="in-flight", reason="abort")
    time.sleep(600)
""")


def _kill_process_tree(pid: int) -> None:
    """vLLM's kill_process_tree: SIGKILL every descendant psutil finds, then the process."""
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for child in parent.children(recursive=True):
        try:
            os.kill(child.pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop_like_vllm(tmp_path: Path, mode: str, signum: int, quiet_s: float) -> list[dict]:
    trace = tmp_path / "trace"
    trace.mkdir()
    lock = trace / writer_process.LOCK_NAME
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env[writer_process.LOCK_ENV] = str(lock)  # what a configured session sets (pdtrace record waits on it)
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(trace), mode], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert engine.stdout is not None
        worker_pid = int(engine.stdout.readline())
        time.sleep(quiet_s)
        engine.send_signal(signum)  # shutdown(procs, timeout=0): terminate() ...
        _kill_process_tree(engine.pid)  # ... and no wait before the force kill
    finally:
        engine.kill()
        engine.wait(timeout=60)
    # The writers are out of the killed tree: wait until each has written what it received (the shared lock).
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    deadline = time.monotonic() + 60
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            assert time.monotonic() < deadline, "a writer process did not finish"
            time.sleep(0.05)
    os.close(fd)
    rows = pdtrace.open_trace(trace).table.to_pylist()
    rows.sort(key=lambda r: (r["pid"], r["seq"]))
    for pid in {r["pid"] for r in rows}:  # each writer: no hole (what is lost is lost at the end)
        assert [r["seq"] for r in rows if r["pid"] == pid] == list(range(sum(r["pid"] == pid for r in rows)))
    assert {r["pid"] for r in rows} == {engine.pid, worker_pid}
    return rows


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_quiet_engine_stopped_like_vllm_serve_loses_nothing(tmp_path, monkeypatch, signum, writer):
    # As after a client's last request: both processes went quiet before the stop.
    monkeypatch.setenv(writer_process.ENV_SWITCH, "1" if writer == "process" else "0")
    rows = _stop_like_vllm(tmp_path, "quiet", signum, quiet_s=0.5)
    kinds = [r["kind"] for r in rows]
    assert "recorder_gap" not in kinds
    assert sorted(r["req"] for r in rows if r["kind"] == "req_add") == sorted(f"r{i}" for i in range(20))
    assert sum(k == "req_finish" for k in kinds) >= 20
    assert [r["step"] for r in rows if r["kind"] == "exec_end"] == list(range(20))
    assert len(rows) == 1 + 40 + 1 + 40  # engine_config, adds and finishes; warm-up, 20 steps: everything


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_busy_engine_stopped_like_vllm_serve_marks_what_it_lost(tmp_path, monkeypatch, signum):
    # Killed mid-stream: each writer has a whole prefix of its events, and whoever lost events says so.
    monkeypatch.setenv(writer_process.ENV_SWITCH, "1")
    rows = _stop_like_vllm(tmp_path, "busy", signum, quiet_s=0.3)
    by_pid: dict[int, list[dict]] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], []).append(r)
    for pid, mine in by_pid.items():
        component = mine[0]["component"]
        if component == "worker":  # emitting every millisecond when SIGKILLed, with no signal: it lost some
            assert mine[-1]["kind"] == "recorder_gap", "a worker lost events and nothing says so"
            steps = [r["step"] for r in mine if r["kind"] == "exec_end"]
            assert steps == list(range(len(steps)))
        else:
            got = {r["req"] for r in mine if r["kind"] == "req_add"}
            assert got == {f"r{i}" for i in range(20)} or mine[-1]["kind"] == "recorder_gap"
            if not any(r["kind"] == "req_finish" and r["req"] == "in-flight" for r in mine):
                assert mine[-1]["kind"] == "recorder_gap", "the engine's abort was lost and nothing says so"
    gaps = [r for r in rows if r["kind"] == "recorder_gap"]
    assert all(g["n"] is None and "killed" in g["detail"] for g in gaps)
