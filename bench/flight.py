"""Flight mode's cost per event against full recording, on the emitting thread and the process, without vLLM.

    PYTHONPATH=. .venv/bin/python bench/flight.py [--events 300000] [--rounds 10] [--seconds 2] [--rate 100000]

Each round runs the two modes in one process, the order alternating: `full` (a Recorder as the vLLM plugin opens
it: writer thread and writer process) and `flight` (a FlightRecorder keeping `--seconds`, trimmed every 0.5 s by
its thread, nothing written). Both receive `--events` events of bench/recorder.py's mix (req_sched rows, block
allocations and frees with block lists, sched rows with a detail dict, engine and worker rows), paced at `--rate`
events a second (the emitting loop sleeps 1 ms whenever it is ahead: as an engine loop does between steps, which
lets the writer or trimmer thread take the GIL in between, as in vLLM). Measured per event: the emitting thread's
CPU (thread_time), the process's CPU until the mode's end (`close()` of full recording: its last part written; of
flight: nothing to write) and, for full recording, the writer process's CPU (the tree). Reported: each mode's
median and the median of the rounds' paired differences flight - full, with their spread (min .. max).
Then one dump of a full window (`--seconds` at `--rate`): its wall time, until the part file is on disk, and the
emitting thread's CPU per event while it runs against before it.

Measured 2026-12-02 on the shared 2-CPU machine, load average 17-33 from other sessions (so: paired rounds, and
differences under ~50 ns are noise), 100k events/s:
    --events 500000 --rounds 4 (a 2 s window):  emitting thread full 522, flight 577 ns/event, flight - full +44
        (+11 .. +288); process CPU 3745 vs 3457, -204 (-808 .. +308); tree (with full's writer process) -5.4 us
    --events 500000 --rounds 4 --seconds 0.05:  emitting thread +32 (-66 .. +54); process CPU -284 (-555 .. +106)
    the ring before it was chunked (the window in the Recorder's one flat list, its head deleted by each trim),
    --events 100000 --rounds 2: emitting thread 526 vs 976 ns/event, +450 (+293 .. +608)
    a dump of the 2 s window (200 000 events): 8.4 s until on disk (the writer process's start included), the
    emitting thread 674 -> 888 ns/event while it runs
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recorder import mixed_calls  # noqa: E402  (bench/recorder.py: the same event mix)

from pdtrace.recording import flight, writer_process  # noqa: E402
from pdtrace.recording.recorder import Recorder  # noqa: E402


def drive(rec: Recorder, count: int, rate: float) -> int:
    """Emit `count` events of the mix at about `rate` per second; the emitting thread's CPU ns."""
    calls = mixed_calls(rec, count)
    start = time.perf_counter()
    cpu0 = time.thread_time_ns()
    for i, (emit, kind, kwargs) in enumerate(calls):
        emit(kind, **kwargs)
        if i & 255 == 0 and i / rate > time.perf_counter() - start:
            time.sleep(0.001)
    return time.thread_time_ns() - cpu0


def children_cpu_ns() -> int:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return int((usage.ru_utime + usage.ru_stime) * 1e9)


def run_mode(mode: str, directory: Path, args: argparse.Namespace) -> dict[str, int]:
    proc0 = time.process_time_ns()
    child0 = children_cpu_ns()
    if mode == "full":
        rec = Recorder(directory, instance="bench", role="both", source="bench", handle_sigterm=False)
    else:
        rec = flight.FlightRecorder(directory, "bench", seconds=args.seconds, role="both", source="bench",
                                    handle_sigterm=False)
    thread = drive(rec, args.events, args.rate)
    rec.close()
    if mode == "full":
        writer_process.stop_shared()  # reaped: its CPU is in RUSAGE_CHILDREN now
    return {"thread": thread, "process": time.process_time_ns() - proc0,
            "tree": time.process_time_ns() - proc0 + children_cpu_ns() - child0}


def dump_once(directory: Path, args: argparse.Namespace) -> None:
    config = flight.FlightConfig(seconds=args.seconds)
    ctl = flight.FlightController(directory, config)
    rec = flight.FlightRecorder(directory, "bench", seconds=args.seconds, controller=ctl, role="both",
                                source="bench", handle_sigterm=False)
    window = int(args.seconds * args.rate)
    before = drive(rec, window, args.rate) / window
    t0 = time.perf_counter()
    rec.flush()  # the engine-error trigger
    during_events = 0
    during_cpu = 0
    while ctl.dumps == [] and time.perf_counter() - t0 < 120:
        during_cpu += drive(rec, 2000, args.rate)
        during_events += 2000
    wall = time.perf_counter() - t0
    parts = list(directory.glob("dump-0001/*/*/part-*.parquet"))
    print(f"dump of a {args.seconds:g} s window ({window} events emitted; {ctl.dumps and 'written' or 'NOT written'}, "
          f"{len(parts)} part file): {wall:.2f} s wall until on disk, writer process started for it; the emitting "
          f"thread's CPU {before:.0f} ns/event before, {during_cpu / max(during_events, 1):.0f} ns/event during "
          f"({during_events} events)")
    rec.close()
    writer_process.stop_shared()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=2.0, help="flight window")
    ap.add_argument("--rate", type=float, default=100_000.0, help="events per second")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pdtrace-flight-bench-"))
    try:
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.events} events per run at "
              f"{args.rate:.0f}/s, flight window {args.seconds:g} s, {args.rounds} rounds alternating")
        runs: dict[str, list[dict[str, int]]] = {"full": [], "flight": []}
        for i in range(args.rounds):
            for mode in (("full", "flight") if i % 2 == 0 else ("flight", "full")):
                runs[mode].append(run_mode(mode, root / f"{mode}-{i}", args))
            print(f"round {i}: " + "  ".join(f"{m} {runs[m][-1]['thread'] / args.events:5.0f}" for m in runs)
                  + " ns/event (emitting thread)", file=sys.stderr, flush=True)
        if any(root.glob("flight-*/**/*.parquet")):
            raise SystemExit("flight mode wrote part files while healthy")
        print(f"{'ns per event':24s}{'full':>8s}{'flight':>8s}{'flight - full (min .. max)':>34s}")
        for key, label in (("thread", "emitting thread CPU"), ("process", "process CPU"),
                           ("tree", "tree CPU (+writer proc)")):
            full = [r[key] / args.events for r in runs["full"]]
            fl = [r[key] / args.events for r in runs["flight"]]
            diff = [b - a for a, b in zip(full, fl)]
            print(f"{label:24s}{statistics.median(full):8.0f}{statistics.median(fl):8.0f}"
                  f"{statistics.median(diff):+14.0f} ({min(diff):+.0f} .. {max(diff):+.0f})")
        dump_once(root / "dump", args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
