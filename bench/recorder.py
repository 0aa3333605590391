"""Benchmark of the Recorder: per-emit latency on the caller's thread, and the writer's throughput alone.

    .venv/bin/python bench/recorder.py [--events 1000000] [--dir DIR]

1. Emit latency. A Recorder with its writer thread running (default flush settings, real part files in a temporary
   directory) receives `--events` events of a realistic mix: req_sched rows, block allocations and frees with block
   lists, sched rows with a detail dict, engine step rows, worker exec rows on another channel. Each emit is timed
   alone with `time.perf_counter_ns()` before and after the call; the timer's own cost (the median of back-to-back
   `perf_counter_ns()` pairs, measured over the same number of iterations) is subtracted from every sample. Arguments
   are prepared before the first timer read. Reported: median, mean, p99, p99.9, max, the minor page faults of
   the timed loop, and the plain cost per emit of an untimed loop (wall time, and this thread's CPU time, which
   leaves out time lost to other processes on a loaded machine). Run twice: with the writer thread running
   (default flush settings; it takes the GIL to convert rows, as it would in vLLM, which is what the tail and the
   mean show) and with the writer asleep until the end (the emit alone). Target: median <= 300 ns.
2. Writer alone. The same mix as buffered rows, converted (`flat_rows_to_table`, 65536 rows per part) and written
   (`write_part`: zstd Parquet, temporary name, then linked to its name), timed separately and together, on the main thread.
   Target: >= 1M events/s for conversion + write.
3. Hand-over. The same parts marshalled for the writer process (`encode_batch`: what the recording process's
   writer thread pays instead of 2), on this thread's CPU time, and one part's round trip through a real writer
   process (wall time; the child converts and writes).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pdtrace.recording.recorder import ROW_WIDTH, Recorder, encode_batch, flat_rows_to_table, write_part

PART_ROWS = 65536


def mixed_calls(rec: Recorder, count: int):
    """(bound emit, kind, kwargs): the same event mix as bench_emit, for building the writer's input."""
    sched = rec.channel("scheduler")
    engine = rec.channel("engine")
    worker = rec.channel("worker", pp_rank=0, tp_rank=0)
    reqs = [f"cmpl-{i:08x}-0" for i in range(512)]
    calls = []
    for i in range(count):
        step = i // 64
        slot = i % 20
        req = reqs[i % 512]
        if slot < 12:
            calls.append((sched.emit, "req_sched", {"step": step, "req": req, "n": 1}))
        elif slot < 14:
            calls.append((sched.emit, "blocks_alloc", {"step": step, "req": req, "blocks": (i % 4096, i % 4096 + 1),
                                                        "detail": {"hit": 0}}))
        elif slot == 14:
            calls.append((sched.emit, "blocks_free", {"step": step, "req": req, "blocks": (i % 4096,),
                                                       "reason": "finished", "deferred": False}))
        elif slot == 15:
            calls.append((sched.emit, "sched", {"step": step, "n": 64, "detail": {
                "running": 64, "waiting": 3, "waiting_kv": 0, "free_blocks": 1000, "dur_ns": 150000}}))
        elif slot == 16:
            calls.append((engine.emit, "step_submit", {"step": step, "n": 1}))
        elif slot == 17:
            calls.append((engine.emit, "step_output", {"step": step}))
        elif slot == 18:
            calls.append((worker.emit, "exec_begin", {"step": step, "n": 64}))
        else:
            calls.append((worker.emit, "exec_end", {"step": step, "n": 64}))
    return calls


def percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def timer_cost(count: int) -> int:
    clock = time.perf_counter_ns
    samples = [0] * count
    for i in range(count):
        t0 = clock()
        t1 = clock()
        samples[i] = t1 - t0
    return int(statistics.median(samples))


def bench_emit(directory: Path, count: int, writer_idle: bool = False) -> None:
    """Time each emit of `count` events. With `writer_idle`, flush thresholds above `count` keep the writer asleep
    during the timed loop: the emit alone, without the writer thread taking the GIL in between."""
    limits = {"flush_events": count + 1, "flush_interval_s": 3600.0, "max_buffered_events": count + 1} \
        if writer_idle else {}
    rec = Recorder(directory / ("idle" if writer_idle else "emit"), instance="bench", role="both", source="bench",
                   handle_sigterm=False, **limits)
    sched = rec.channel("scheduler").emit
    engine = rec.channel("engine").emit
    worker = rec.channel("worker", pp_rank=0, tp_rank=0).emit
    # Arguments prepared in advance (what a hook has at hand anyway); each call site below has literal keywords,
    # as hooks do. Slot mix per 20 events: 12 req_sched, 2 blocks_alloc, 1 blocks_free, 1 sched, 2 engine, 2 worker.
    reqs = [f"cmpl-{i:08x}-0" for i in range(512)]
    blocks = [(i, i + 1) for i in range(4096)]
    hit = {"hit": 0}
    sched_detail = {"running": 64, "waiting": 3, "waiting_kv": 0, "free_blocks": 1000, "dur_ns": 150000}
    clock = time.perf_counter_ns
    samples = [0] * count
    overhead = timer_cost(count)
    gc.collect()
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(count):
        slot = i % 20
        step = i >> 6
        req = reqs[i & 511]
        if slot < 12:
            t0 = clock()
            sched("req_sched", step=step, req=req, n=1)
            t1 = clock()
        elif slot < 14:
            ids = blocks[i & 4095]
            t0 = clock()
            sched("blocks_alloc", step=step, req=req, blocks=ids, detail=hit)
            t1 = clock()
        elif slot == 14:
            ids = blocks[i & 4095]
            t0 = clock()
            sched("blocks_free", step=step, req=req, blocks=ids, reason="finished", deferred=False)
            t1 = clock()
        elif slot == 15:
            t0 = clock()
            sched("sched", step=step, n=64, detail=sched_detail)
            t1 = clock()
        elif slot == 16:
            t0 = clock()
            engine("step_submit", step=step, n=1)
            t1 = clock()
        elif slot == 17:
            t0 = clock()
            engine("step_output", step=step)
            t1 = clock()
        elif slot == 18:
            t0 = clock()
            worker("exec_begin", step=step, n=64)
            t1 = clock()
        else:
            t0 = clock()
            worker("exec_end", step=step, n=64)
            t1 = clock()
        samples[i] = t1 - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    if writer_idle:
        rec.flush()
    # The plain cost of the most common call without timers, minus the same loop calling nothing; in wall time and
    # in this thread's CPU time (which leaves out time lost to other processes and to the writer thread's GIL use).
    start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
    for i in range(count):
        sched("req_sched", step=i, req="r", n=1)
    loop_ns, loop_cpu = time.perf_counter_ns() - start, time.thread_time_ns() - start_cpu
    start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
    for i in range(count):
        pass
    empty_ns, empty_cpu = time.perf_counter_ns() - start, time.thread_time_ns() - start_cpu
    rec.close()
    lat = sorted(max(s - overhead, 0) for s in samples)
    state = "writer asleep until the end" if writer_idle else "writer thread running (default flush settings)"
    print(f"emit latency, {count:,} events of the mix, {state}; timer cost {overhead} ns subtracted:")
    print(f"  median {percentile(lat, 0.5)} ns   mean {statistics.fmean(lat):.0f} ns   p99 {percentile(lat, 0.99)} ns"
          f"   p99.9 {percentile(lat, 0.999)} ns   max {lat[-1] / 1e6:.2f} ms")
    print(f"  minor page faults in the timed loop: {faults:,} ({faults * 1000 / count:.0f} per 1000 events: fresh "
          "memory for the buffered rows)")
    print("  (on a loaded machine the mean and the tail are mostly time this process spent without a CPU; compare "
          "the CPU-time figure below)")
    print(f"  untimed loop of req_sched emits (empty loop subtracted): {(loop_ns - empty_ns) / count:.0f} ns wall, "
          f"{(loop_cpu - empty_cpu) / count:.0f} ns of this thread's CPU per emit")
    print(f"  dropped {rec.dropped_events}, write errors {rec.errors}, "
          f"part files {sum(1 for _ in rec.directory.rglob('part-*.parquet'))}")


def buffered_rows(count: int) -> tuple[list, list[tuple]]:
    """The mix as Channel.emit buffers it (the recorder's flat buffer: ROW_WIDTH slots per row), and the channel
    table, without a running writer."""
    rec = Recorder(tempfile.mkdtemp(), instance="bench", role="both", source="bench", handle_sigterm=False,
                   max_buffered_events=count + 1, flush_events=count + 1)
    rec.clock = iter(range(1_700_000_000_000_000_000, 1_700_000_000_000_000_000 + 2 * count, 1)).__next__
    for emit, kind, kwargs in mixed_calls(rec, count):
        emit(kind, **kwargs)
    captured = list(rec._rows)
    channels = list(rec._channel_keys)
    del rec._rows[:]
    rec.close()
    return captured, channels


def bench_writer(directory: Path, count: int) -> None:
    flat, channels = buffered_rows(count)
    folder = directory / "writer"
    folder.mkdir(parents=True, exist_ok=True)
    wall = [0.0, 0.0]  # conversion, write
    cpu = [0.0, 0.0]
    parts = 0
    gc.collect()
    for index, offset in enumerate(range(0, count, PART_ROWS)):
        batch = flat[offset * ROW_WIDTH:(offset + PART_ROWS) * ROW_WIDTH]
        w0, c0 = time.perf_counter(), time.thread_time()
        table = flat_rows_to_table(batch, offset, channels, "bench", "both", os.getpid())
        w1, c1 = time.perf_counter(), time.thread_time()
        write_part(table, folder / f"part-{index:06d}.parquet")
        w2, c2 = time.perf_counter(), time.thread_time()
        wall[0] += w1 - w0
        wall[1] += w2 - w1
        cpu[0] += c1 - c0
        cpu[1] += c2 - c1
        parts += 1
    size = sum(p.stat().st_size for p in folder.glob("*.parquet"))
    print(f"writer alone, {count:,} events in {parts} parts of {PART_ROWS} rows ({size / count:.1f} bytes/event):")
    for name, times in (("wall clock", wall), ("thread CPU time", cpu)):
        print(f"  {name:15s}: conversion {count / times[0] / 1e6:.2f} M events/s   write {count / times[1] / 1e6:.2f} "
              f"M events/s   together {count / sum(times) / 1e6:.2f} M events/s")
    print("  (thread CPU time excludes time this thread waited for a CPU: the figure for an idle machine; Arrow's "
          "own threads, if any, are not counted)")
    bench_handover(directory, flat, channels, sum(cpu))


def bench_handover(directory: Path, flat: list, channels: list[tuple], in_thread_cpu: float) -> None:
    """What the recording process pays with a writer process: `encode_batch` (marshal) per part, on this thread,
    against the in-thread conversion + write above; and the round trip of one part through a real writer process
    (wall: the child converts and writes meanwhile, this thread only waits)."""
    from pdtrace.recording.writer_process import WriterProcess

    count = len(flat) // ROW_WIDTH
    folder = directory / "handover"
    folder.mkdir(parents=True, exist_ok=True)
    cpu = 0.0
    payloads = []
    for offset in range(0, count, PART_ROWS):
        batch = flat[offset * ROW_WIDTH:(offset + PART_ROWS) * ROW_WIDTH]
        c0 = time.thread_time()
        payload = encode_batch(batch, offset, channels, "bench", "both", os.getpid(), "bench", 0,
                               (str(folder), "bench", os.getpid()), str(folder))
        cpu += time.thread_time() - c0
        payloads.append(payload)
    size = sum(map(len, payloads))
    writer = WriterProcess()
    try:
        writer.send(payloads[0])  # start-up and first part out of the timing
        w0 = time.perf_counter()
        for payload in payloads[1:]:
            writer.send(payload)
        round_trip = time.perf_counter() - w0
    finally:
        writer.stop()
    parts = max(1, len(payloads) - 1)
    print(f"hand-over to a writer process ({size / count:.0f} bytes/event marshalled):")
    print(f"  this thread's CPU: {cpu / count * 1e9:.0f} ns/event (in-thread conversion + write: "
          f"{in_thread_cpu / count * 1e9:.0f} ns/event, {in_thread_cpu / cpu:.1f}x)   round trip per part of "
          f"{PART_ROWS} rows: {round_trip / parts * 1e3:.1f} ms wall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=None, help="where part files go (default: a temporary dir)")
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="pdtrace-bench-"))
    try:
        print(f"pid {os.getpid()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
        bench_emit(directory, args.events)
        bench_emit(directory, args.events, writer_idle=True)
        bench_writer(directory, args.events)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
