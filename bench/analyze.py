"""`pdtrace analyze` at 10M events next to the floor (run by hand; prints figures, asserts nothing).

    .venv/bin/python bench/analyze.py [--events 10000000] [--dir /tmp/pdtrace-bench-analyze] [--repeat 3]
                                      [--profile]

1. Writes (once; reused when the directory holds the same event count) a trace of healthy P/D traffic built with
   vectorised numpy/pyarrow: waves of 64 requests, each prefilled on P (delay_free, then kv_send_done and the free)
   and decoded on D (req_wait_kv, kv_recv_done, 128 decode steps with a block every 16 tokens, finish and free),
   PP=2 exec spans on every step, block ids reused wave after wave; one wave template tiled with offsets. Faults
   injected in four waves: a P send that never completes (indirect leak past the 480 s grace), a D request that
   never frees (definite leak), a kv_send_done for a running request (C02), a duplicated free (double free).
   Written per writer (instance, pid) in part files of 1M rows, zstd.
2. Alternates, --repeat times, these subprocesses and reports wall time and peak RSS (getrusage of the child):
   floor    imports pyarrow and numpy, reads every column of the trace, flattens the block lists and lexsorts
            (block, ts)
   floor malloc  the same on Arrow's system (malloc) memory pool (ARROW_DEFAULT_MEMORY_POOL=system), the pool
            open_trace reads into: the default mimalloc pool's huge-page arenas make the plain floor swing between
            ~0.7 and ~2.4 s wall with the machine's load, this one stays put
   analyze  `python -m pdtrace analyze TRACE --format json` (all rules) to /dev/null
   block rules  the same with --rules limited to the five KV-block rules
   and the ratios to the floor (targets: time <= 2.0x, peak RSS <= 2x), in wall time and in CPU time (user +
   system of the child: steadier when other work shares the machine).
3. With --profile, one in-process run timing the load, each shared table and each rule separately.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pdtrace.format import SCHEMA, file_metadata

START = 1_700_000_000_000_000_000
STEP_NS = 5_000_000
B = 64            # requests per wave
DECODE = 128      # decode steps per wave
PP = 2
KINDS = ["engine_config", "req_add", "sched", "req_sched", "req_wait_kv", "req_finish", "blocks_alloc",
         "blocks_free", "blocks_pool_free", "kv_send_done", "kv_recv_done", "step_submit", "step_output",
         "exec_begin", "exec_end"]
K = {k: i for i, k in enumerate(KINDS)}
COMPONENTS = ["scheduler", "engine", "worker"]
REASONS = ["length", "stop", "sent", "finished"]
STATUSES = ["RUNNING", "FINISHED_LENGTH_CAPPED", "WAITING_FOR_REMOTE_KVS"]
INSTANCES = ["P", "D"]
BLOCK_RULES = ["premature_free", "use_after_free", "double_free", "leaked_blocks", "completion_before_finish"]
ROLES = ["prefill", "decode"]


class Wave:
    """One wave's rows (wave-local steps, request indexes and times), as Python lists built once."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {c: [] for c in ("t", "inst", "pid", "comp", "pp", "kind", "step", "req",
                                                      "blocks", "n", "reason", "status", "delay", "deferred",
                                                      "detail")}

    def add(self, t: float, inst: int, kind: str, step: int = -1, req: int = -1, blocks: list[int] | None = None,
            n: int = -1, reason: int = -1, status: int = -1, delay: int = -1, deferred: int = -1,
            comp: int | None = None, pp: int = -1, detail: str | None = None) -> None:
        c = self.cols
        c["t"].append(t)
        c["inst"].append(inst)
        c["pid"].append(1000 * (inst + 1) + (pp + 1 if pp >= 0 else 0))
        c["comp"].append(comp if comp is not None else (2 if kind.startswith("exec") else
                                                        1 if kind.startswith("step_") else 0))
        c["pp"].append(pp)
        c["kind"].append(K[kind])
        c["step"].append(step)
        c["req"].append(req)
        c["blocks"].append(blocks)
        c["n"].append(n)
        c["reason"].append(reason)
        c["status"].append(status)
        c["delay"].append(delay)
        c["deferred"].append(deferred)
        c["detail"].append(detail)


def step_rows(w: Wave, t: float, inst: int, step: int, tokens: int) -> None:
    w.add(t, inst, "sched", step=step, n=tokens)
    w.add(t + 0.1, inst, "step_submit", step=step, n=1)
    for pp in range(PP):
        w.add(t + 0.1 + 0.15 * pp, inst, "exec_begin", step=step, n=tokens, pp=pp)
        w.add(t + 0.25 + 0.15 * pp, inst, "exec_end", step=step, n=tokens, pp=pp)
    w.add(t + 0.6, inst, "step_output", step=step)


def wave(fault: str | None = None) -> tuple[Wave, int, int, float]:
    """(rows, P steps, D steps, duration in steps) of one wave; times in units of STEP_NS."""
    w = Wave()
    P, D = 0, 1
    reqs = range(B)
    # P: admit and prefill in one step, finish with delay_free
    for j in reqs:
        w.add(0.01 * j / B, P, "req_add", req=j, n=64, detail='{"remote_decode":true}')
    w.add(0.05, P, "sched", step=0, n=64 * B)
    for j in reqs:
        w.add(0.06, P, "blocks_alloc", step=0, req=j, blocks=[1 + 4 * j + i for i in range(4)])
    for j in reqs:
        w.add(0.07, P, "req_sched", step=0, req=j, n=64)
    w.add(0.1, P, "step_submit", step=0, n=1)
    for pp in range(PP):
        w.add(0.1 + 0.15 * pp, P, "exec_begin", step=0, n=64 * B, pp=pp)
        w.add(0.25 + 0.15 * pp, P, "exec_end", step=0, n=64 * B, pp=pp)
    w.add(0.6, P, "step_output", step=0)
    for j in reqs:
        if fault == "c02" and j == 1:
            w.add(0.605, P, "kv_send_done", step=0, req=j, status=0)   # RUNNING: C02
        w.add(0.61, P, "req_finish", step=0, req=j, reason=0, status=0, delay=1)
    # D: requests wait for remote KV
    for j in reqs:
        w.add(0.7 + 0.001 * j / B, D, "req_add", req=j, n=64, detail='{"remote_prefill":true,"remote_instance":"P"}')
    w.add(1.0, D, "sched", step=0, n=0)
    for j in reqs:
        blocks = [1 + 12 * j + i for i in range(4)]
        w.add(1.01, D, "blocks_alloc", step=0, req=j, blocks=blocks)
        w.add(1.01, D, "req_wait_kv", step=0, req=j, blocks=blocks, n=64)
    w.add(1.1, D, "step_submit", step=0, n=1)
    w.add(1.6, D, "step_output", step=0)
    step_rows(w, 2.0, D, 1, 0)
    for j in reqs:
        w.add(2.61, D, "kv_recv_done", step=1, req=j, status=2)
    # P: the sends complete, blocks freed
    step_rows(w, 2.0, P, 1, 0)
    for j in reqs:
        if fault == "send_never" and j == 0:
            continue
        w.add(2.62, P, "kv_send_done", step=1, req=j, status=1)
        w.add(2.62, P, "blocks_free", step=1, req=j, blocks=[1 + 4 * j + i for i in range(4)], reason=2, deferred=0)
        w.add(2.62, P, "blocks_pool_free", step=1, req=j, blocks=[1 + 4 * j + i for i in range(4)])
    # D: decode
    for s in range(DECODE):
        t = 3.0 + s
        step = 2 + s
        w.add(t, D, "sched", step=step, n=B)
        if s % 16 == 0:
            for j in reqs:
                w.add(t + 0.01, D, "blocks_alloc", step=step, req=j, blocks=[1 + 12 * j + 4 + s // 16])
        for j in reqs:
            w.add(t + 0.02, D, "req_sched", step=step, req=j, n=1)
        w.add(t + 0.1, D, "step_submit", step=step, n=1)
        for pp in range(PP):
            w.add(t + 0.1 + 0.15 * pp, D, "exec_begin", step=step, n=B, pp=pp)
            w.add(t + 0.25 + 0.15 * pp, D, "exec_end", step=step, n=B, pp=pp)
        w.add(t + 0.6, D, "step_output", step=step)
    last = 2 + DECODE - 1
    t = 3.0 + DECODE - 1 + 0.61
    for j in reqs:
        blocks = [1 + 12 * j + i for i in range(12)]
        if not (fault == "never_free" and j == 5):
            w.add(t, D, "blocks_free", step=last, req=j, blocks=blocks, reason=3, deferred=0)
            if fault == "double_free" and j == 7:
                w.add(t, D, "blocks_free", step=last, req=j, blocks=blocks, reason=3, deferred=0)
            w.add(t, D, "blocks_pool_free", step=last, req=j, blocks=blocks)
        w.add(t + 0.001, D, "req_finish", step=last, req=j, reason=1, status=0, delay=0)
    return w, 2, 2 + DECODE, 3.0 + DECODE + 0.5


def build(events: int) -> pa.Table:
    normal, p_steps, d_steps, dur = wave()
    per_wave = len(normal.cols["t"])
    n_waves = max(events // per_wave, 40)
    faults = {3: "send_never", 10: "never_free", 20: "c02", 30: "double_free"}
    pieces = []
    for index in range(n_waves):
        pieces.append(faults.get(index))
    # runs of identical templates, tiled with numpy
    cache: dict[str | None, dict[str, np.ndarray]] = {}

    def template(fault: str | None) -> dict[str, np.ndarray]:
        if fault not in cache:
            w = wave(fault)[0]
            c = w.cols
            arrays = {k: np.asarray(v) for k, v in c.items() if k not in ("blocks", "detail")}
            lengths = np.array([len(b) if b is not None else 0 for b in c["blocks"]], np.int64)
            arrays["blen"] = lengths
            arrays["bvalid"] = np.array([b is not None for b in c["blocks"]])
            arrays["bvalues"] = np.array([x for b in c["blocks"] if b for x in b], np.int32)
            arrays["detail_idx"] = np.arange(len(c["t"]))
            cache[fault] = arrays
            cache[str(fault) + ":detail"] = c["detail"]  # type: ignore[assignment]
        return cache[fault]

    parts: dict[str, list[np.ndarray]] = {}
    detail_parts: list[pa.Array] = []
    for index, fault in enumerate(pieces):
        tpl = template(fault)
        rows = len(tpl["t"])
        off = {"t": index * dur, "step_p": index * p_steps, "step_d": index * d_steps, "req": index * B}
        step = tpl["step"].copy()
        has_step = step >= 0
        step[has_step & (tpl["inst"] == 0)] += off["step_p"]
        step[has_step & (tpl["inst"] == 1)] += off["step_d"]
        req = np.where(tpl["req"] >= 0, tpl["req"] + off["req"], -1)
        for key, value in (("t", tpl["t"] + off["t"]), ("step", step), ("req", req)):
            parts.setdefault(key, []).append(value)
        for key in ("inst", "pid", "comp", "pp", "kind", "n", "reason", "status", "delay", "deferred", "blen",
                    "bvalid", "bvalues"):
            parts.setdefault(key, []).append(tpl[key])
        detail_parts.append(pa.array(cache[str(fault) + ":detail"], pa.string()))  # type: ignore[arg-type]
        del rows
    col = {k: np.concatenate(v) for k, v in parts.items()}
    n = len(col["t"])
    ts = (START + col["t"] * STEP_NS).astype(np.int64)
    order = np.argsort(ts, kind="stable")
    # blocks: offsets from lengths, values in row order, then reorder rows by time
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(col["blen"], out=offsets[1:])
    blocks = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(col["bvalues"], pa.int32()),
                                      mask=pa.array(~col["bvalid"]))
    detail = pa.concat_arrays(detail_parts)
    take = pa.array(order)
    pid = col["pid"][order]
    # seq per writer in time order
    seq = np.empty(n, np.int64)
    by_pid = np.argsort(pid, kind="stable")
    pids_sorted = pid[by_pid]
    starts = np.flatnonzero(np.r_[True, pids_sorted[1:] != pids_sorted[:-1]])
    counts = np.diff(np.r_[starts, n])
    seq[by_pid] = np.arange(n) - np.repeat(starts, counts)

    def dict_arr(codes: np.ndarray, vocab: list[str]) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32), mask=codes < 0), vocab)

    def nullable(values: np.ndarray, typ: pa.DataType) -> pa.Array:
        return pa.array(values, typ, mask=values < 0)

    req = col["req"][order]
    req_str = pc.binary_join_element_wise("req-", pc.cast(pa.array(req, mask=req < 0), pa.string()), "")
    inst = col["inst"][order]
    pp = col["pp"][order]
    comp = col["comp"][order]
    arrays = [
        pa.array(ts[order]), pa.array(seq),
        dict_arr(inst, INSTANCES), dict_arr(inst, ROLES), pa.array(pid.astype(np.int32)),
        dict_arr(comp, COMPONENTS), pa.array(np.zeros(n, np.int16)),
        nullable(np.where(comp == 2, pp, -1).astype(np.int16), pa.int16()),
        nullable(np.where(comp == 2, 0, -1).astype(np.int16), pa.int16()),
        dict_arr(col["kind"][order], KINDS), nullable(col["step"][order], pa.int64()), req_str,
        blocks.take(take), nullable(col["n"][order], pa.int64()), dict_arr(col["reason"][order], REASONS),
        dict_arr(col["status"][order], STATUSES),
        pa.array(col["delay"][order] == 1, mask=col["delay"][order] < 0),
        pa.array(col["deferred"][order] == 1, mask=col["deferred"][order] < 0),
        detail.take(take),
    ]
    table = pa.Table.from_arrays(arrays, schema=SCHEMA)
    config = [{"ts_ns": START - 1000 + i, "seq": -1, "instance": name, "role": ROLES[i], "pid": 1000 * (i + 1),
               "component": "scheduler", "dp_rank": 0, "kind": "engine_config", "n": [512, 1024][i],
               "detail": f'{{"pp":{PP},"tp":1,"defer_block_free":false,"block_size":16}}'} for i, name in
              enumerate(INSTANCES)]
    from pdtrace.trace.builder import rows_to_table

    head = rows_to_table(config).cast(SCHEMA)
    table = pa.concat_tables([head, table], promote_options="permissive").combine_chunks()
    # engine_config rows get seq -1; shift every writer's seq by one so each stays a strict counter from 0
    seq_col = pc.add(table.column("seq"), 1)
    return table.set_column(1, "seq", seq_col)


def write(table: pa.Table, directory: Path, rows_per_file: int = 1_000_000) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    pid = table.column("pid").to_numpy()
    for writer in np.unique(pid).tolist():
        part = table.filter(pa.array(pid == writer))
        inst = part.column("instance")[0].as_py()
        folder = directory / inst / str(writer)
        folder.mkdir(parents=True, exist_ok=True)
        for i, off in enumerate(range(0, part.num_rows, rows_per_file)):
            chunk = part.slice(off, rows_per_file).replace_schema_metadata(file_metadata("bench", "synthetic", 0))
            pq.write_table(chunk, folder / f"part-{i:06d}.parquet", compression="zstd")
    (directory / "_events").write_text(str(table.num_rows))


FLOOR = r"""
import sys, numpy as np, pyarrow as pa, pyarrow.dataset as ds, pyarrow.compute as pc
files = sorted(str(p) for p in __import__('pathlib').Path(sys.argv[1]).rglob('*.parquet'))
t = ds.dataset(files, format='parquet').to_table()
blocks = t.column('blocks').combine_chunks()
rows = pc.list_parent_indices(blocks).to_numpy()
ids = pc.list_flatten(blocks).to_numpy()
ts = t.column('ts_ns').to_numpy()[rows]
order = np.lexsort((ts, ids))
print(t.num_rows, len(ids), int(order[0]))
"""


def child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, int, float]:
    """(wall s, peak RSS KiB, exit status, CPU s = user + system) of one subprocess. CPU time is the steadier
    figure on a shared machine."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1):
        print(f"  child failed ({proc.returncode}): {err.strip()[-400:]}", file=sys.stderr)
    return wall, usage.ru_maxrss, proc.returncode, usage.ru_utime + usage.ru_stime


def profile(directory: Path) -> None:
    """One process, one thread: the load, then every shared table the rules declare (in the order the scheduler
    would start them, each timed without the tables it builds on) and every rule."""
    from pdtrace.analysis import allocation_settings, available_rules
    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.analysis.parallel import _graph
    from pdtrace.malloc import single_arena
    from pdtrace.trace.reader import open_trace

    single_arena()  # as the CLI does
    t0 = time.perf_counter()
    trace = open_trace(directory, warn=False)
    print(f"  open_trace                    {time.perf_counter() - t0:7.2f} s  ({len(trace):,} events)")
    ctx = AnalysisContext(trace)
    rules, _ = available_rules()
    tables = [node for node in _graph(list(rules.values()))[0] if not isinstance(node, tuple)]
    with allocation_settings():  # as analyze() runs the rules: small pages, glibc keeps freed blocks
        for table in tables:
            t0 = time.perf_counter()
            table(ctx)
            print(f"  table {table.__name__:<23} {time.perf_counter() - t0:7.2f} s")
        for rule in rules.values():
            t0 = time.perf_counter()
            found = rule.run(ctx)
            counts = found["severity"].value_counts().to_dict() if len(found) else {}
            print(f"  rule {rule.id:<24} {time.perf_counter() - t0:7.2f} s  findings {len(found)} {counts}")
    print(f"  peak RSS (this process)       {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:7.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pdtrace-bench-analyze"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also time each shared table and rule")
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_only:
        table = build(args.events)
        write(table, args.dir)
        print(f"wrote {table.num_rows:,} events to {args.dir}")
        return
    if args.profile_only:
        profile(args.dir)
        return
    # Building and profiling run in child processes: a child's peak RSS (getrusage) includes the memory it
    # inherited at fork, so this process stays small.
    marker = args.dir / "_events"
    if not marker.exists() or abs(int(marker.read_text()) - args.events) > args.events // 10:
        t0 = time.perf_counter()
        if args.dir.exists():
            import shutil

            shutil.rmtree(args.dir)
        subprocess.run([sys.executable, __file__, "--build-only", "--events", str(args.events), "--dir",
                        str(args.dir)], check=True)
        print(f"  in {time.perf_counter() - t0:.1f} s")
    else:
        print(f"reusing {args.dir} ({int(marker.read_text()):,} events)")
    if args.profile:
        subprocess.run([sys.executable, __file__, "--profile-only", "--dir", str(args.dir)], check=True)
    floor_cmd = [sys.executable, "-c", FLOOR, str(args.dir)]
    analyze_cmd = [sys.executable, "-m", "pdtrace", "analyze", str(args.dir), "--format", "json"]
    block_cmd = analyze_cmd + ["--rules", ",".join(BLOCK_RULES)]
    malloc_env = dict(os.environ, ARROW_DEFAULT_MEMORY_POOL="system")
    runs: dict[str, list[tuple[float, int, int, float]]] = {"floor": [], "floor malloc": [], "analyze": [],
                                                            "block rules": []}
    for i in range(args.repeat):
        for name, cmd, env in (("floor", floor_cmd, None), ("floor malloc", floor_cmd, malloc_env),
                               ("analyze", analyze_cmd, None), ("block rules", block_cmd, None)):
            runs[name].append(child(cmd, env))
        print(f"  run {i + 1}: " + " | ".join(
            f"{name} {r[-1][0]:6.2f} s wall {r[-1][3]:6.2f} s cpu {r[-1][1] / 1024:6.0f} MiB"
            for name, r in runs.items()))
    if args.repeat < 1:
        return
    fig = {name: (statistics.median(x[0] for x in r), statistics.median(x[3] for x in r), max(x[1] for x in r))
           for name, r in runs.items()}
    for name, (wall, cpu, rss) in fig.items():
        print(f"{name:<12} median {wall:6.2f} s wall {cpu:6.2f} s cpu   peak RSS {rss / 1024:6.0f} MiB")
    f_wall, f_cpu, f_rss = fig["floor"]
    for name in ("analyze", "block rules"):
        wall, cpu, rss = fig[name]
        print(f"{name:<12} / floor: time {wall / f_wall:4.2f}x wall, {cpu / f_cpu:4.2f}x cpu (target <= 2.0x)   "
              f"RSS {rss / f_rss:4.2f}x (target <= 2x)")
    m_wall, m_cpu, m_rss = fig["floor malloc"]
    for name in ("analyze", "block rules"):
        wall, cpu, rss = fig[name]
        print(f"{name:<12} / floor malloc: time {wall / m_wall:4.2f}x wall, {cpu / m_cpu:4.2f}x cpu   "
              f"RSS {rss / m_rss:4.2f}x")


if __name__ == "__main__":
    main()
