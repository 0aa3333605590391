"""Partitioned `pdtrace analyze` on a large multi-instance trace (run by hand; prints figures, asserts nothing).

    .venv/bin/python bench/multi_instance.py [--copies 16] [--events 3000000] [--dir /tmp/pdtrace-bench-multi]
                                             [--jobs 2] [--repeat 1] [--build-only] [--whole]

1. Generator: builds (once) the healthy P/D trace of bench/analyze.py with --events events (instances P and D, its
   four injected faults), then copies it --copies times under new instance names `P00`/`D00`, `P01`/`D01`, ...:
   the `instance` dictionary renamed, the decode side's `remote_instance` detail pointing at its own copy's P, pids
   shifted by 10,000 per copy (each copy is its own set of writers), the same file layout `TRACE/<instance>/<pid>/
   part-*.parquet`. 16 copies of 3M events: 48M events, 32 instances (each copy's D holds ~96% of its events), about
   210 MB of zstd Parquet. Reused while `TRACE/_copies` says the same copies and events.
2. Benchmark, each as a subprocess, alternating --repeat rounds:
   floor    for each instance in turn, a fresh process that imports pyarrow and numpy, reads every column of that
            instance, flattens the block lists and lexsorts (block, ts); the figure is the sum of their wall times
            (and the largest of their peak RSS)
   analyze  `python -m pdtrace analyze TRACE --format json --jobs J` to a file
   For analyze, the peak RSS of the whole process tree: a sampler thread reads VmRSS of the child and of every
   descendant (/proc/<pid>/task/*/children, recursively) every 50 ms and keeps the largest *sum* seen at one
   instant (a lower bound of the true peak), and the sum of each process's own peak (VmHWM; an upper bound).
3. Checks the findings: every copy must report the same findings as copy 00 (instance names and pids mapped back).
   With --whole (a few copies only: the whole-trace analysis needs ~370 bytes per event), also runs `analyze
   --whole` and checks that its JSON report is the same text as the partitioned one.
Targets (issue 14): tree peak RSS <= 4 GiB, wall <= 2.0x the summed floor.

Measured on the shared 2-core machine (load average 6-9 from other work), 16 copies = 47,971,184 events, 32
instances, 120 MB: floor summed 57-67 s (23 s CPU, 32 interpreter starts included); analyze --jobs 2 40-59 s wall
(0.62-0.94x), tree peak 1.43-1.47 GiB sampled (sum of the processes' own peaks 1.50-1.65 GiB); --jobs 1 (one
process) 48 s wall, 15.2 s CPU, 709 MiB; every copy the same findings. 4 copies (12M events): --whole 27.4 s and
2.28 GiB, --jobs 2 19.6 s and 1.45 GiB, the two JSON reports the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyze as single  # noqa: E402  (bench/analyze.py: the one-trace generator and its floor)

PID_SHIFT = 10_000


def copy_name(base: str, k: int) -> str:
    return f"{base}{k:02d}"


def build(directory: Path, copies: int, events: int) -> Path:
    """The multi-instance trace under directory/trace (built once per (copies, events))."""
    base = directory / "base"
    trace = directory / "trace"
    marker = trace / "_copies"
    want = f"{copies} {events}"
    if marker.exists() and marker.read_text() == want:
        print(f"reusing {trace} ({want.replace(' ', ' copies of ')} events)")
        return trace
    if not (base / "_events").exists() or abs(int((base / "_events").read_text()) - events) > events // 10:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, single.__file__, "--build-only", "--events", str(events), "--dir",
                        str(base)], check=True)
        print(f"  base trace in {time.perf_counter() - t0:.1f} s")
    if trace.exists():
        import shutil

        shutil.rmtree(trace)
    t0 = time.perf_counter()
    files = sorted(p for p in base.rglob("*.parquet"))
    for k in range(copies):
        for path in files:
            table = pq.read_table(path)
            meta = table.schema.metadata
            names = {name: copy_name(name, k) for name in single.INSTANCES}
            inst = table.column("instance").combine_chunks()
            renamed = pa.DictionaryArray.from_arrays(
                inst.indices, pa.array([names[n] for n in inst.dictionary.to_pylist()], pa.string()))
            table = table.set_column(table.schema.get_field_index("instance"), "instance", renamed)
            detail = pc.replace_substring(table.column("detail"), '"remote_instance":"P"',
                                          f'"remote_instance":"{names["P"]}"')
            table = table.set_column(table.schema.get_field_index("detail"), "detail", detail)
            pid = pc.add(table.column("pid"), pa.scalar(PID_SHIFT * k, pa.int32()))
            table = table.set_column(table.schema.get_field_index("pid"), "pid", pid.cast(pa.int32()))
            rel = path.relative_to(base)
            out = trace / names[rel.parts[0]] / str(int(rel.parts[1]) + PID_SHIFT * k) / rel.name
            out.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table.replace_schema_metadata(meta), out, compression="zstd")
    marker.write_text(want)
    size = sum(p.stat().st_size for p in trace.rglob("*.parquet"))
    print(f"wrote {copies} copies of {base} to {trace} ({size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    return trace


FLOOR_ONE = single.FLOOR  # reads every column of the files under argv[1]


def tree_memory_kib(pid: int) -> dict[int, tuple[int, int]]:
    """{pid: (VmRSS, VmHWM) in KiB} of pid and all its descendants now; processes that vanish meanwhile are left
    out."""
    found: dict[int, tuple[int, int]] = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            rss = hwm = 0
            with open(f"/proc/{p}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1])
                    elif line.startswith("VmHWM:"):
                        hwm = int(line.split()[1])
            found[p] = (rss, hwm)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as handle:
                    stack.extend(int(c) for c in handle.read().split())
        except (OSError, ValueError):
            continue
    return found


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process so far (/proc/PID/stat), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_tree(cmd: list[str], stdout_path: Path | None = None, cpu: dict[int, float] | None = None,
             env: dict[str, str] | None = None) -> tuple[float, int, int, int]:
    """(wall s, tree peak KiB, tree bound KiB, exit status). The tree peak is the largest sum of VmRSS over the
    process tree seen at one instant, sampled every 50 ms (a lower bound of the true peak: a spike between two
    samples is missed); the bound is the sum over every process ever seen of its own peak (VmHWM), an upper
    bound (it adds peaks that may not coincide). `cpu`, where given, gets {pid: CPU seconds last seen} of every
    process of the tree (a lower bound: at most a sample's worth of each is missed), which counts what
    getrusage's children miss: descendants that are not reaped by the command (a forkserver's workers)."""
    out = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE,
                            env=None if env is None else {**os.environ, **env})  # env: variables added
    peak = [0]
    hwm: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = tree_memory_kib(proc.pid)
            peak[0] = max(peak[0], sum(rss for rss, _ in now.values()))
            for p, (_, high) in now.items():
                hwm[p] = max(hwm.get(p, 0), high)
                seen = process_cpu_s(p) if cpu is not None else None
                if seen is not None:
                    cpu[p] = max(cpu.get(p, 0.0), seen)  # type: ignore[index]
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if stdout_path:
        out.close()  # type: ignore[union-attr]
    if proc.returncode not in (0, 1):
        print(f"  child failed ({proc.returncode}): {err.decode().strip()[-400:]}", file=sys.stderr)
    return wall, peak[0], sum(hwm.values()), proc.returncode


def floor(trace: Path) -> tuple[float, int]:
    """(summed wall s, largest peak RSS KiB) of the floor run for each instance in turn."""
    total = 0.0
    rss = 0
    for folder in sorted(p for p in trace.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        wall, peak, _, _ = run_tree([sys.executable, "-c", FLOOR_ONE, str(folder)])
        total += wall
        rss = max(rss, peak)
    return total, rss


def _unshift(value: object) -> object:
    """A finding with each copy's pids mapped back to the base trace's."""
    if isinstance(value, dict):
        return {k: (v % PID_SHIFT if k == "pid" and isinstance(v, int) else _unshift(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshift(v) for v in value]
    return value


def check_copies(report_path: Path, copies: int) -> str:
    """Every copy's findings equal copy 00's with the instance names and pids mapped back; a one-line verdict."""
    report = json.loads(report_path.read_text())
    findings = report["findings"]
    by_copy: dict[int, list[str]] = {}
    pattern = re.compile(r"\b([PD])(\d\d)\b")
    for f in findings:
        k = int(pattern.search(str(f.get("instance"))).group(2))
        text = pattern.sub(lambda m: m.group(1), json.dumps(_unshift(f), sort_keys=True))
        by_copy.setdefault(k, []).append(text)
    first = by_copy.get(0, [])
    same = all(sorted(by_copy.get(k, [])) == sorted(first) for k in range(copies))
    return (f"{len(findings)} findings, {len(first)} per copy, every copy the same: {same}"
            f"{'' if same else ' (MISMATCH)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--events", type=int, default=3_000_000, help="events of one copy (P and D together)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pdtrace-bench-multi"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--whole", action="store_true",
                        help="also run the whole-trace analysis (--whole) and compare the JSON reports; about 370 "
                             "bytes per event: at most 4 copies on a shared 24 GiB machine")
    parser.add_argument("--check", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check:
        print(check_copies(args.check, args.copies))
        return
    trace = build(args.dir, args.copies, args.events)
    if args.build_only:
        return
    report = args.dir / "report.json"
    analyze_cmd = [sys.executable, "-m", "pdtrace", "analyze", str(trace), "--format", "json", "--jobs",
                   str(args.jobs)]
    floors, runs = [], []
    for i in range(args.repeat):
        floors.append(floor(trace))
        runs.append(run_tree(analyze_cmd, report))
        print(f"  round {i + 1}: floor (summed) {floors[-1][0]:6.1f} s | analyze {runs[-1][0]:6.1f} s wall, tree "
              f"peak {runs[-1][1] / 1048576:5.2f} GiB (sum of per-process peaks {runs[-1][2] / 1048576:5.2f} GiB), "
              f"exit {runs[-1][3]}")
    f_wall = min(f[0] for f in floors)
    a_wall = min(r[0] for r in runs)
    tree = max(r[1] for r in runs)
    bound = max(r[2] for r in runs)
    print(f"floor, summed over instances  {f_wall:7.1f} s   (largest instance's floor peak "
          f"{max(f[1] for f in floors) / 1048576:.2f} GiB)")
    print(f"analyze --jobs {args.jobs}             {a_wall:7.1f} s   {a_wall / f_wall:4.2f}x the floor "
          f"(target <= 2.0x)")
    print(f"peak RSS of the process tree  {tree / 1048576:7.2f} GiB sampled (target <= 4 GiB); sum of the "
          f"processes' own peaks {bound / 1048576:.2f} GiB (upper bound)")
    print(check_copies(report, args.copies))
    if args.whole:
        whole_report = args.dir / "report-whole.json"
        wall, peak, _, code = run_tree(analyze_cmd[:-2] + ["--whole"], whole_report)  # one process: peak = HWM
        same = whole_report.read_text() == report.read_text()
        print(f"analyze --whole (one process) {wall:7.1f} s   peak RSS {peak / 1048576:5.2f} GiB, exit {code}; "
              f"JSON report identical to the partitioned one: {same}")


if __name__ == "__main__":
    main()
