"""Overhead of `pdtrace record` on vLLM 0.33.0's real engine loop, measured as users run it (by hand, vLLM venv).

    PYTHONPATH=. .venv-vllm/bin/python bench/engine_overhead.py [--requests 1000] [--rounds 7]

Each run is a separate process: vLLM's real `EngineCore` (PP=2, so `step_with_batch_queue` and a batch queue of
2; the NixlConnector's scheduler side, kv_producer, prefix caching on) on the vLLM tier's fake executor
(tests/vllm_tier/harness.py: resolved futures carrying real `ModelRunnerOutput`s, no token for a partial
prefill), driven as `EngineCoreProc._process_engine_step` does (`step_fn()` then `post_step()`, without the 1 ms
sleep after an empty step). With recording, the process only differs by `PDTRACE_TRACE_DIR`: EngineCore's own
`load_general_plugins()` finds pdtrace's `vllm.general_plugins` entry point, which installs the hooks, and the
recorder's writer thread runs in the same process, as in a live run.

Workload: `--requests` requests, half `do_remote_decode` (one token, then their blocks stay held until a
`finished_sending` that the next executor output carries), half local (16-48 output tokens); prompts of 64-512
tokens, a quarter sharing a 128-token prefix; `--arrivals` new requests handed to the scheduler before each step
(as the busy loop's input queue does) until all are in.

Rounds alternate (with/without first in turn) so drift on a shared machine cancels; each figure is the median
over the rounds, with the spread of the rounds' paired ratios. Measured in the child around the loop only
(engine construction and the vLLM import excluded): wall time, the loop thread's CPU time, the process's CPU
time (the writer thread included), and that plus the final flush at exit (`session.close_all()`: the writer's
remaining work, so that every event's conversion is counted whether or not a timed flush fell inside the loop),
and the writer thread's own CPU time during the loop. The recorder's writer process (pdtrace.recording.writer_process,
when it runs): its CPU time over the loop and the final flush (`writer proc (+flush)`: its total, read from /proc
once every batch is answered, before its BYE (its exit is not counted; it is no child of the engine, being out of
vLLM's kill tree), less what its start-up had used, from /proc, before the loop; the child waits for its READY
before the loop, as vLLM's own start-up is much longer), its total with the start-up (`writer proc (all)`), and the tree's CPU: the engine process's (+flush) plus the writer
process's (+flush), against the plain run's process. Percentages of the writer rows are of the plain run's
process CPU.
Events are counted from the trace written.

`--decompose` splits the cost: each round runs four children (order rotating), `plain` (no plugin), `off` (hooks
installed, RUNTIME.active False: the wrappers' pass-through; the remove_skipped_blocks wrapper sets itself aside at
its first call there, as a scheduler's first state does in the other modes), `null` (the hooks' own work:
Channel.emit / emit_many / emit_counts do nothing, no writer, no rows kept) and `full`; it prints each one's
medians of paired ratios to `plain`, the loop thread's added ns per event of the full run, and the loop's garbage
collections (count, ms).

`--flight SECONDS` runs plain, full and flight mode (PDTRACE_FLIGHT=SECONDS: the ring, nothing written) per round,
in separate processes (with `--in-process`: in one process, the loop thread's CPU), and prints each one's added
time per step and flight - full.

Measured 2026-12-02 (load average 25-33 from other sessions: the spreads are wide), --in-process --flight 0.2
--rounds 12, 580 steps, loop-thread CPU: plain 556 ms; full +40.4 % (rounds +6.6 .. +66.7 %; +346 +- 108 us per
step, mean +- 2 s.e.), flight +14.1 % (-20.3 .. +94.6 %; +125 +- 165 us per step): flight no dearer than full.
--flight 0.2 --rounds 4 (separate processes, load ~40): loop-thread CPU per step plain 860 us, full +227 (-166 ..
+1197), flight +300 (-174 .. +731), flight - full -120 (-561 .. +474) us; tree CPU flight - full -725 us (no writer
process). Noise at that load; bench/flight.py is the tighter view of the per-event cost.

`--in-process` runs the same four modes in ONE process, a fresh EngineCore per run (hooks installed and removed
between runs, the buffer flushed outside the timing): no interpreter start or first-step costs, so its paired
ratios spread less (a second view, for changes of 1-2 %). `--baseline DIR` alternates, in separate processes, a
plain child and a recorded child of this tree and of another pdtrace tree DIR per round, and prints both trees'
paired ratios and their paired difference: the way to measure a change to the recording path on a shared machine,
where the same tree measured twice minutes apart gave +8.0 % and +12.5 %.

Measured 2026-12-01 (2 CPUs, nothing else running; 1000 requests, 580 steps, 24 423 events; vLLM 0.33.0):
    --baseline (d84b7fc, the start of the day's third session) --rounds 8:
                          plain      d84b7fc   this tree   this - d84b7fc
      loop wall           355.4 ms   +11.4 %   +10.0 %     -2.1 ms
      process CPU (loop)             +11.3 %   +10.1 %     -2.1 ms
      process CPU (+flush)           +13.4 %   +12.0 %     -2.6 ms
      tree CPU (+flush)              +34.2 %   +33.5 %     +5.0 ms
      GC in the loop: plain 3 (0.3 ms), d84b7fc 25 (6.9 ms), this tree 12 (4.9 ms)
    --in-process --rounds 8, loop-thread CPU over plain (351.8 ms):
      d84b7fc:   off +1.5 %, null +4.9 %, full +9.8 % (GC 25, 6.7 ms)
      this tree: off +0.2 %, null +4.4 %, full +8.0 % (GC 12, 4.3 ms)
    The loop itself is ~13 % faster than in this bench's earlier figures (402 -> 350 ms plain, the same vLLM and
    pdtrace, child runs alternating) since the loop moved into its own function (_drive); the cause was not found.
    So the same added milliseconds are a larger share now: compare trees with --baseline, not with old figures.
Later that day (the hooks' req_sched batch through emit_counts, step_output's wait_ns as JSON text: 1 158 fewer
buffered objects per run), on a noisier machine (the plain loop 353-382 ms from round to round):
    GC in the loop 12 -> 10 collections (4.7 ms); --baseline (e3b3ec0) --rounds 10: loop wall e3b3ec0 +8.7 %, this
    tree +9.9 %, this - e3b3ec0 +3.2 +- 13.7 ms (mean +- 2 s.e.: noise; a tree against its own copy gave -7 ms in
    5 rounds); --in-process --rounds 10: null +6.0 %, full +10.4 %; --rounds 7: loop wall +11.0 %, 71 us added
    to a 643 us step (42 events per step).
Where the rest is (py-spy, 997 Hz, 12 in-process rounds of `null`, the hooks' own frames as a share of the loop):
the schedule wrapper with the step's block growth and the `sched` row 1.4 %, KVCacheManager.free 1.0 %, the
prefix-hit hook 0.5 %, _connector_finished 0.4 %, update_from_output 0.4 %, the executor wrappers and their timed
futures 0.9 %, _set_kv_fetch_stage 0.2 %, _update_from_kv_xfer_finished 0.15 %; then full adds the emits, the
buffered rows' garbage collections (12 instead of 3) and the hand-off to the writer process at each flush.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm_tier"))

from record_overhead import workload  # noqa: E402  (the scheduler-only bench's workload, the same requests)


def _engine_maker() -> Any:
    """A function building the benchmark's EngineCore (a new one per call; vLLM's plugin loading runs in the first
    one's __init__: pdtrace's entry point when PDTRACE_TRACE_DIR is set), and the executor class it uses."""
    import logging

    import harness as H

    logging.getLogger("vllm").setLevel(logging.ERROR)
    model_dir = H.tiny_model_dir(tempfile.mkdtemp(prefix="pdtrace-bench-model-"))
    from vllm.v1.engine.core import EngineCore

    class Executor(H.fake_executor_class(pp=2)):  # type: ignore[misc, valid-type]
        """The tier's fake executor, keeping no SchedulerOutputs: `to_send` goes into the next output."""

        to_send: set[str] = set()

        def _output(self, so):  # type: ignore[no-untyped-def]
            sending, Executor.to_send = Executor.to_send, set()
            return self.faker.output(so, finished_sending=sending)

    def make() -> Any:
        vc = H.make_vllm_config(model_dir, kv_role="kv_producer", engine_id="bench-p", max_num_seqs=64,
                                max_num_batched_tokens=2048, num_blocks=4000, pp=2)
        return EngineCore(vc, executor_class=Executor, log_stats=False)

    return make, Executor


def _drive(engine: Any, executor_class: Any, args: argparse.Namespace, id_prefix: str = "") -> dict:
    """Drive `engine` through the workload until it is empty; the loop's wall, thread CPU and process CPU, steps,
    requests sent, garbage collections (count, ns)."""
    import harness as H

    reqs = [H.make_request(id_prefix + r["id"], len(r["prompt"]), prompt=r["prompt"], max_tokens=r["max_tokens"],
                           remote_decode=r["remote_decode"]) for r in workload(args.requests, args.seed)]
    remote = {r.request_id for r in reqs if r.kv_transfer_params}
    sched = engine.scheduler
    pending = list(reversed(reqs))
    sent: set[str] = set()
    steps = 0
    step_fn, post_step = engine.step_fn, engine.post_step
    gc_stats = _gc_counter()
    wall0, thread0, proc0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
    while pending or sched.has_requests() or engine.batch_queue:
        for _ in range(min(args.arrivals, len(pending))):
            H.engine_add(engine, pending.pop())
        outputs, executed = step_fn()
        post_step(executed)
        steps += 1
        # P side: the decode instance reads a finished remote-decode request's blocks at once; the completion
        # comes with the next executor output.
        for eco in outputs.values() if outputs else ():
            for out in eco.outputs:
                if out.finish_reason is not None and out.request_id in remote:
                    sent.add(out.request_id)
                    executor_class.to_send.add(out.request_id)
        if steps > 200_000:
            raise RuntimeError("workload did not drain")
    wall, thread, proc = (time.perf_counter_ns() - wall0, time.thread_time_ns() - thread0,
                          time.process_time_ns() - proc0)
    gc_stats.stop()
    return {"wall_ns": wall, "thread_ns": thread, "process_ns": proc, "steps": steps, "sent": len(sent),
            "gc_collections": gc_stats.collections, "gc_ns": gc_stats.ns}


def child(args: argparse.Namespace) -> dict:
    """One run in this process: build the engine, drive it until empty, return the measurements."""
    make, executor_class = _engine_maker()
    engine = make()
    _set_mode(args.mode)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time_ns, 1e-9)  # CPU time: the machine may be shared
        profiler.enable()
    writer_pid, writer_start = _writer_process()
    result = _drive(engine, executor_class, args)
    writer = _writer_cpu_ns()  # the recorder's writer thread started with the loop's first event
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    from pdtrace.recording import session

    recording = session.is_configured()
    proc0 = time.process_time_ns()
    session.close_all()
    close = time.process_time_ns() - proc0
    writer_process_ns = writer_loop_ns = 0
    if writer_pid is not None:  # its CPU time once it has written everything (it is no child of ours: /proc)
        from pdtrace.recording import recorder

        writer_process_ns = _proc_cpu_ns(writer_pid)
        recorder.close_all()
        writer_loop_ns = writer_process_ns - writer_start
    proc = result["process_ns"]
    return {**result, "total_ns": proc + close, "writer_ns": writer, "writer_process_ns": writer_process_ns,
            "writer_process_loop_ns": writer_loop_ns, "tree_ns": proc + close + writer_loop_ns,
            "recording": recording}


#: --mode of a child run (--decompose runs all four): what of pdtrace is live in the loop.
MODES = {
    "plain": "no plugin (PDTRACE_TRACE_DIR unset)",
    "off": "hooks installed, RUNTIME.active False from the first step",
    "null": "hooks recording into a null recorder (Channel.emit / emit_many / emit_counts do nothing, no writer)",
    "full": "pdtrace record as users run it",
}


def _set_mode(mode: str) -> None:
    """After the engine is built (the plugin ran in its __init__): switch the hooks off, or null the recorder."""
    if mode == "off":
        from pdtrace.recording.vllm._runtime import RUNTIME

        RUNTIME.active = False
    elif mode == "null":
        from pdtrace.recording.recorder import Channel

        Channel.emit = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
        Channel.emit_many = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
        Channel.emit_counts = lambda self, *args, **kwargs: None  # type: ignore[method-assign]


class _gc_counter:
    """Collections and time spent in them (this process, all generations) from now until stop()."""

    def __init__(self) -> None:
        import gc

        self.collections = 0
        self.ns = 0
        self._t0 = 0
        self._gc = gc
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.collections += 1
            self.ns += time.perf_counter_ns() - self._t0

    def stop(self) -> None:
        self._gc.callbacks.remove(self._callback)


def _writer_process() -> tuple[int | None, int]:
    """The recorder's writer process of this engine process, if any, and the CPU time it has used so far (its
    start-up: interpreter and pyarrow import; /proc, clock-tick resolution)."""
    try:
        from pdtrace.recording import writer_process
    except ImportError:  # a pdtrace without a writer process (the in-thread writer only)
        return None, 0
    import sys as _sys

    if "pdtrace.recording.recorder" not in _sys.modules:  # not recording: nothing was started
        return None, 0
    writer = writer_process.shared(spawn=False)
    if writer is None:
        return None, 0
    # Its start-up finishes before the loop (as it does during vLLM's much longer start-up).
    pid = writer.wait_ready() if hasattr(writer, "wait_ready") else (time.sleep(0.5), writer.pid)[1]
    return pid, _proc_cpu_ns(pid)


def _proc_cpu_ns(pid: int | None) -> int:
    """A live process's CPU time from /proc (clock-tick resolution); 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return 0


def _writer_cpu_ns() -> int:
    """CPU time of this process's recorder writer threads so far."""
    import threading

    total = 0
    for thread in threading.enumerate():
        if thread.name.startswith("pdtrace-recorder") and thread.ident is not None:
            try:
                total += time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):  # the thread just ended, or no per-thread clocks here
                pass
    return total


def count_events(trace: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in trace.rglob("part-*.parquet"))


def run_child(args: argparse.Namespace, trace: Path | None, mode: str | None = None, tree: Path = ROOT,
              flight: float | None = None) -> dict:
    """One child run (this script with --child) importing pdtrace from `tree` (default this checkout); with
    `flight`, in flight mode (PDTRACE_FLIGHT: nothing written, so its events are not counted here)."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": str(tree) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    for name in ("PDTRACE_TRACE_DIR", "PDTRACE_FLIGHT", "PDTRACE_FLIGHT_MB", "PDTRACE_FLIGHT_DUMP_ON_EXIT"):
        env.pop(name, None)
    if trace is not None:
        env["PDTRACE_TRACE_DIR"] = str(trace)
    if flight is not None:
        env["PDTRACE_FLIGHT"] = str(flight)
    cmd = [sys.executable, __file__, "--child", "--requests", str(args.requests), "--seed", str(args.seed),
           "--arrivals", str(args.arrivals), "--mode", mode or ("full" if trace is not None else "plain")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["recording"] != (trace is not None):
        raise SystemExit("the child's recording state is not what was asked (is pdtrace's entry point installed "
                         "in this venv?)")
    result["events"] = count_events(trace) if trace is not None and flight is None else 0
    if flight is not None and any(trace.rglob("*.parquet")):
        raise SystemExit("flight mode wrote part files while healthy")
    return result


def flight_rounds(args: argparse.Namespace) -> None:
    """--flight SECONDS: per round a plain child, a fully recorded child and a child in flight mode (the ring of
    the last SECONDS, trimmed every 0.5 s, nothing written), in separate processes, the order rotating. Prints
    each mode's median added time per step over plain, with the spread of the rounds' paired differences, and the
    flight - full difference: flight mode must cost no more per event than full recording."""
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="pdtrace-engine-bench-"))

    def run(kind: str, i: int) -> dict:
        if kind == "plain":
            return run_child(args, None)
        return run_child(args, tmp / f"{kind}-{i}", flight=args.flight if kind == "flight" else None)

    runs = _rotating_rounds(args.rounds, ["plain", "full", "flight"], run, "wall_ns", "loop wall")
    steps = statistics.median(r["steps"] for r in runs["full"])
    events = statistics.median(r["events"] for r in runs["full"])
    print(f"workload: {args.requests} requests, {steps:.0f} steps, {events:.0f} events (full recording); "
          f"--flight {args.flight} s; {args.rounds} rotating rounds, separate processes, {os.cpu_count()} CPUs")
    print(f"{'':22s}{'plain':>10s}  {'full: us/step added':>30s}  {'flight: us/step added':>30s}  "
          f"{'flight - full':>22s}")
    for key, label in (("wall_ns", "loop wall"), ("thread_ns", "loop thread CPU"),
                       ("process_ns", "process CPU (loop)"), ("total_ns", "process CPU (+exit)"),
                       ("tree_ns", "tree CPU (+exit)")):
        plain = runs["plain"]
        base = statistics.median(r[key] for r in plain) / steps / 1e3

        def added(kind: str) -> list[float]:
            return [(y[key] - x[key]) / steps / 1e3 for x, y in zip(plain, runs[kind])]

        full, fl = added("full"), added("flight")
        diff = [b - a for a, b in zip(full, fl)]
        cells = [f"{statistics.median(v):+7.1f} ({min(v):+6.1f} .. {max(v):+6.1f})" for v in (full, fl, diff)]
        print(f"{label:22s}{base:8.0f}us  {cells[0]:>30s}  {cells[1]:>30s}  {cells[2]:>22s}")


def spread(values: list[float]) -> str:
    return f"{min(values) * 100:+.1f} .. {max(values) * 100:+.1f} %"


def two_se(values: list[float]) -> float:
    """Twice the standard error of the mean of paired differences: a difference inside +- this is noise. On the
    shared 2-CPU machine of 2026-12-01, 25 in-process rounds of two modes gave +- 8 ms of a ~400 ms loop, and
    --baseline of a tree against its own copy (5 rounds) gave -7 ms: the rounds needed to see a 1 % change there
    are many more than the default."""
    if len(values) < 2:
        return float("nan")
    return 2 * statistics.stdev(values) / len(values) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--arrivals", type=int, default=4, help="requests handed to the scheduler before each step")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", help="keep the traces under this directory")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", help="with --child: cProfile the loop into this pstats file (a wrapper's "
                    "tottime there includes the freeing of its callee's locals: see v0_33._w_engine_step)")
    ap.add_argument("--mode", choices=MODES, default=None,
                    help="with --child: " + "; ".join(f"{k}: {v}" for k, v in MODES.items()))
    ap.add_argument("--baseline", metavar="DIR",
                    help="compare this tree's pdtrace with the pdtrace source tree DIR (separate processes)")
    ap.add_argument("--in-process", action="store_true",
                    help="run the four --mode variants in one process (fresh engine per run): a tighter A/B")
    ap.add_argument("--decompose", action="store_true",
                    help="run the four --mode variants per round (rotating order) and print each one's cost")
    ap.add_argument("--flight", type=float, metavar="SECONDS",
                    help="compare plain, full recording and flight mode (PDTRACE_FLIGHT=SECONDS) per round (with "
                         "--in-process: in one process)")
    args = ap.parse_args()
    if args.flight is not None and not args.child and not args.in_process:
        flight_rounds(args)
        return
    if args.child:
        if args.mode is None:
            args.mode = "full" if os.environ.get("PDTRACE_TRACE_DIR") else "plain"
        print(json.dumps(child(args)))
        return
    if args.decompose:
        decompose(args)
        return
    if args.in_process:
        in_process(args)
        return
    if args.baseline:
        against_baseline(args)
        return

    tmp = Path(args.keep or tempfile.mkdtemp(prefix="pdtrace-engine-bench-"))
    off, on = [], []
    for i in range(args.rounds):
        order = [False, True] if i % 2 == 0 else [True, False]
        for recording in order:
            res = run_child(args, tmp / f"trace-{i}" if recording else None)
            (on if recording else off).append(res)
        a, b = off[-1], on[-1]
        print(f"round {i}: wall {a['wall_ns'] / 1e6:7.1f} -> {b['wall_ns'] / 1e6:7.1f} ms "
              f"({(b['wall_ns'] - a['wall_ns']) / a['wall_ns'] * 100:+5.1f} %)  process CPU "
              f"{a['process_ns'] / 1e6:7.1f} -> {b['process_ns'] / 1e6:7.1f} ms "
              f"({(b['process_ns'] - a['process_ns']) / a['process_ns'] * 100:+5.1f} %)  "
              f"{b['events']} events, {b['steps']} steps", file=sys.stderr, flush=True)
        if a["steps"] != b["steps"]:
            raise SystemExit("recording changed the engine's behaviour (step counts differ)")

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    events, steps = med(on, "events"), med(on, "steps")
    print(f"workload: {args.requests} requests (half do_remote_decode), {steps:.0f} steps, vLLM 0.33.0 EngineCore "
          f"step_with_batch_queue PP=2 + NixlConnector (scheduler side), fake executor; {args.rounds} alternating "
          f"rounds, separate processes, {os.cpu_count()} CPUs (shared machine: medians, spread of paired ratios)")
    print(f"{'':22s}{'without':>12s}{'with':>12s}{'added':>9s}  {'rounds':>17s}{'ns/event':>10s}{'us/step':>9s}")
    for key, label in (("wall_ns", "loop wall"), ("thread_ns", "loop thread CPU"),
                       ("process_ns", "process CPU (loop)"), ("total_ns", "process CPU (+flush)"),
                       ("writer_ns", "writer thread (loop)"), ("writer_process_loop_ns", "writer proc (+flush)"),
                       ("writer_process_ns", "writer proc (all)"), ("tree_ns", "tree CPU (+flush)")):
        a, b = med(off, key), med(on, key)
        if key == "tree_ns":  # the plain run has no writer process: its tree is its process
            a = med(off, "total_ns")
        if key.startswith("writer"):  # no writer without recording: its share of the plain run's process CPU
            a = med(off, "process_ns")
            print(f"{label:22s}{'':12s}{b / 1e6:10.1f}ms{b / a * 100:+8.1f}%  {'':>17s}{b / events:10.0f}"
                  f"{b / steps / 1e3:9.1f}")
            continue
        paired = [(y[key] - x[key]) / x[key] for x, y in zip(off, on)]
        print(f"{label:22s}{a / 1e6:10.1f}ms{b / 1e6:10.1f}ms{(b - a) / a * 100:+8.1f}%  {spread(paired):>17s}"
              f"{(b - a) / events:10.0f}{(b - a) / steps / 1e3:9.1f}")
    # The added time per step is what carries over to a real engine: there the step also waits on the GPU, so the
    # same microseconds are a smaller share of a longer step.
    print(f"events: {events:.0f} per run, {events / steps:.1f} per step; plain loop "
          f"{med(off, 'wall_ns') / steps / 1e3:.0f} us per step")


def _rotating_rounds(rounds: int, kinds: list[str], run: Callable[[str, int], dict], key: str,
                     label: str) -> dict[str, list[dict]]:
    """`rounds` rounds of one `run(kind, round)` per kind, the order rotating per round so that drift on a shared
    machine cancels; a progress line per round on stderr (each run's `key`, in ms, then `label`). Raises
    SystemExit if a round's runs differ in steps (recording changed the engine's behaviour)."""
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for i in range(rounds):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            runs[kind].append(run(kind, i))
        print(f"round {i}: " + "  ".join(f"{k} {runs[k][-1][key] / 1e6:6.1f}" for k in kinds) + f" ms {label}",
              file=sys.stderr, flush=True)
        if len({runs[k][-1]["steps"] for k in kinds}) != 1:
            raise SystemExit("recording changed the engine's behaviour (step counts differ)")
    return runs


def against_baseline(args: argparse.Namespace) -> None:
    """--baseline DIR: this checkout's pdtrace against another source tree's (e.g. `git worktree add /tmp/base
    main`), in separate processes as users run it: per round a plain child, a recorded child importing this tree's
    pdtrace and one importing DIR's (this script drives both), the order rotating; each row is the median of the
    paired ratios to the round's plain child, and `this - base` the median of the paired differences."""
    baseline = Path(args.baseline).resolve()
    if not (baseline / "pdtrace" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {baseline}: not a pdtrace source tree (no pdtrace/__init__.py)")
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="pdtrace-engine-bench-"))
    kinds = ["plain", "this", "base"]

    def run(kind: str, i: int) -> dict:
        trace = None if kind == "plain" else tmp / f"trace-{kind}-{i}"
        return run_child(args, trace, tree=baseline if kind == "base" else ROOT)

    runs = _rotating_rounds(args.rounds, kinds, run, "wall_ns", "loop wall")
    print(f"this tree ({ROOT}) against {baseline}: {args.requests} requests, {runs['this'][0]['steps']} steps, "
          f"{runs['this'][0]['events']} events, {args.rounds} rounds rotating the order; medians of paired ratios to "
          f"the round's plain child")
    print(f"{'':22s}{'plain':>10s}{'base':>10s}{'this':>10s}{'this - base':>14s}{'mean +- 2 s.e.':>22s}")
    for key, label in (("wall_ns", "loop wall"), ("thread_ns", "loop thread CPU"), ("process_ns", "process CPU (loop)"),
                       ("total_ns", "process CPU (+flush)"), ("tree_ns", "tree CPU (+flush)")):
        plain_key = "total_ns" if key == "tree_ns" else key
        cells = [f"{statistics.median(r[plain_key] for r in runs['plain']) / 1e6:8.1f}ms"]
        for kind in ("base", "this"):
            ratios = [(r[key] - p[plain_key]) / p[plain_key] for r, p in zip(runs[kind], runs["plain"])]
            cells.append(f"{statistics.median(ratios) * 100:+9.1f}%")
        diffs = [(t[key] - b[key]) / 1e6 for t, b in zip(runs["this"], runs["base"])]
        print(f"{label:22s}" + "".join(cells) + f"{statistics.median(diffs):+12.1f}ms"
              f"{statistics.mean(diffs):+12.1f} +- {two_se(diffs):.1f} ms")
    gc_line = "  ".join(f"{k} {statistics.median(r['gc_collections'] for r in runs[k]):.0f} / "
                        f"{statistics.median(r['gc_ns'] for r in runs[k]) / 1e6:.1f} ms" for k in kinds)
    print(f"GC in the loop (collections / ms): {gc_line}")


def in_process(args: argparse.Namespace) -> None:
    """--in-process: the four --mode variants in ONE process, a fresh EngineCore per run, the order rotating per
    round; each mode's median loop-thread CPU and its paired ratio to `plain`. A second view for changes of 1-2 %,
    which the separate-process runs (interpreter start, import, a new heap each) blur: no first-step costs, the
    hooks installed and removed between runs (install_hooks / uninstall_hooks), the recorder's buffer flushed
    between runs, outside the timing."""
    import gc

    os.environ.setdefault("PDTRACE_TRACE_DIR", str(Path(args.keep or tempfile.mkdtemp(prefix="pdtrace-engine-bench-"))))
    from pdtrace.recording import session
    from pdtrace.recording.recorder import Channel
    from pdtrace.recording.vllm import install_hooks, uninstall_hooks
    from pdtrace.recording.vllm._runtime import RUNTIME

    make, executor_class = _engine_maker()
    session.configure_from_env(source="vllm-bench")
    emits = Channel.emit, Channel.emit_many, Channel.emit_counts

    directory = os.environ["PDTRACE_TRACE_DIR"]

    def set_mode(mode: str) -> None:
        Channel.emit, Channel.emit_many, Channel.emit_counts = emits
        if args.flight is not None and mode in ("full", "flight"):  # a new session: fresh recorders of the mode
            from pdtrace.recording.flight import FlightConfig

            session.configure(directory, source="vllm-bench",
                              flight=FlightConfig(args.flight) if mode == "flight" else None)
        if mode == "plain":
            uninstall_hooks()
            return
        install_hooks()
        if mode == "off":
            RUNTIME.active = False
        elif mode == "null":
            _set_mode("null")

    def run(mode: str, i: int) -> dict:
        set_mode(mode)
        engine = make()
        result = _drive(engine, executor_class, args, f"r{i}-{mode}-")
        engine.shutdown()
        del engine
        if mode != "flight":  # a flight recorder's flush is a dump (the engine-error path): nothing to write here
            session.flush_all()
        gc.collect()
        return result

    modes = list(MODES) if args.flight is None else ["plain", "full", "flight"]
    set_mode("plain")
    engine = make()  # warm-up run: vLLM's and pdtrace's first-call costs, out of every mode's figures
    _drive(engine, executor_class, args, "warm-")
    del engine
    runs = _rotating_rounds(args.rounds, modes, run, "thread_ns", "loop-thread CPU")
    set_mode("plain")
    print(f"in one process: {args.requests} requests, {runs['full'][0]['steps']} steps, {args.rounds} rounds "
          f"rotating the order, a fresh EngineCore per run; medians, paired ratios to plain")
    print(f"{'mode':8s}{'loop thread CPU':>24s}{'rounds':>18s}{'GC n':>6s}{'GC ms':>7s}{'- plain, +- 2 s.e.':>24s}")
    for mode in modes:
        value = statistics.median(r["thread_ns"] for r in runs[mode])
        ratios = [(r["thread_ns"] - p["thread_ns"]) / p["thread_ns"] for r, p in zip(runs[mode], runs["plain"])]
        diffs = [(r["thread_ns"] - p["thread_ns"]) / 1e6 for r, p in zip(runs[mode], runs["plain"])]
        print(f"{mode:8s}{value / 1e6:13.1f}ms {statistics.median(ratios) * 100:+7.1f}%{spread(ratios):>18s}"
              f"{statistics.median(r['gc_collections'] for r in runs[mode]):6.0f}"
              f"{statistics.median(r['gc_ns'] for r in runs[mode]) / 1e6:7.1f}"
              f"{statistics.mean(diffs):+12.1f} +- {two_se(diffs):.1f} ms")
    print("; ".join(f"{k}: {v}" for k, v in {**MODES, "flight": f"flight mode, {args.flight} s"}.items()
                    if k in modes))


def decompose(args: argparse.Namespace) -> None:
    """--decompose: where the recording's cost is, mode by mode (each against `plain`, median of paired ratios)."""
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="pdtrace-engine-bench-"))
    modes = list(MODES)

    def run(mode: str, i: int) -> dict:
        return run_child(args, None if mode == "plain" else tmp / f"trace-{mode}-{i}", mode)

    runs = _rotating_rounds(args.rounds, modes, run, "thread_ns", "loop-thread CPU")
    events = statistics.median(r["events"] for r in runs["full"])
    steps = statistics.median(r["steps"] for r in runs["full"])
    print(f"decomposition: {args.requests} requests, {steps:.0f} steps, {events:.0f} events (full), "
          f"{args.rounds} rounds rotating the order; medians of each mode's paired ratio to plain")
    print(f"{'mode':8s}{'loop wall':>22s}{'loop thread CPU':>24s}{'process CPU':>22s}{'ns/event':>10s}"
          f"{'GC n':>6s}{'GC ms':>7s}")
    for mode in modes:
        cells = []
        for key in ("wall_ns", "thread_ns", "process_ns"):
            value = statistics.median(r[key] for r in runs[mode])
            ratio = statistics.median((r[key] - p[key]) / p[key] for r, p in zip(runs[mode], runs["plain"]))
            cells.append(f"{value / 1e6:9.1f}ms {ratio * 100:+6.1f}%")
        added = statistics.median(r["thread_ns"] - p["thread_ns"] for r, p in zip(runs[mode], runs["plain"]))
        gc_n = statistics.median(r["gc_collections"] for r in runs[mode])
        gc_ms = statistics.median(r["gc_ns"] for r in runs[mode]) / 1e6
        print(f"{mode:8s}" + "".join(f"{c:>23s}" for c in cells) + f"{added / events:10.0f}{gc_n:6.0f}{gc_ms:7.1f}")
    print("ns/event: the loop thread's added CPU time over the full run's events. " +
          "; ".join(f"{k}: {v}" for k, v in MODES.items()))


if __name__ == "__main__":
    main()
