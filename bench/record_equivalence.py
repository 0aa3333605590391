"""Check that a change to the recording path writes the same rows: two pdtrace source trees, the same recordings.

    PYTHONPATH=. .venv-vllm/bin/python bench/record_equivalence.py --baseline /path/to/pdtrace-before
    PYTHONPATH=. .venv-vllm/bin/python bench/record_equivalence.py --compare TRACE_A TRACE_B [--wall-clock]

The first form records `pdtrace record --dry-run` scenarios (fixed seeds; vLLM's real EngineCore on the dry run's
virtual clock) once with the baseline tree's pdtrace and once with this checkout's, each in its own process, and
compares the traces: every column but `pid` must be identical, `ts_ns` and the `dur_ns` / `wait_ns` durations
included, since the dry run's clock is virtual. The second form compares two existing traces (e.g. two runs of
bench/engine_overhead.py --keep, one per tree); `--wall-clock` drops `ts_ns` and the durations in `detail`, which
come from the real clock there. Rows are compared per instance in `seq` order, whatever the part files.
Exit status 1 on a difference, with the first differing rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Dry-run scenarios: P/D at PP=2 (batch queue, NIXL both sides), P/D at TP=2 with
#: faults, prefill-only starving, one engine at TP=2.
SCENARIOS: dict[str, list[str]] = {
    "pd-pp2": ["--instances", "pd", "--pp", "2", "--requests", "64", "--seed", "3"],
    "pd-faults": ["--instances", "pd", "--tp", "2", "--requests", "48", "--seed", "5", "--fault",
                  "abort_while_waiting_kv", "--fault", "lost_send_completion", "--end-hold-s", "2"],
    "p-starve": ["--instances", "p", "--requests", "32", "--seed", "6", "--fault", "starve", "--num-blocks", "64",
                 "--max-num-batched-tokens", "1024"],
    "single-tp2": ["--instances", "single", "--tp", "2", "--requests", "40", "--seed", "7"],
}
#: Keys of `detail` measured on the real clock (live runs); dropped with --wall-clock.
WALL_CLOCK_DETAIL = ("dur_ns", "wait_ns")


def load(trace: Path, wall_clock: bool) -> dict[str, list[dict]]:
    """instance -> rows (dicts, `pid` dropped, and with `wall_clock` the real-clock fields) in seq order."""
    import pyarrow.parquet as pq

    rows: dict[str, list[dict]] = {}
    for path in sorted(trace.rglob("part-*.parquet")):
        if any(part.startswith(("_", ".")) for part in path.relative_to(trace).parts):
            continue
        for row in pq.read_table(path).to_pylist():
            row.pop("pid")
            if wall_clock:
                row.pop("ts_ns")
                if row["detail"]:
                    detail = json.loads(row["detail"])
                    for key in WALL_CLOCK_DETAIL:
                        detail.pop(key, None)
                    row["detail"] = json.dumps(detail, sort_keys=True)
            rows.setdefault(row["instance"], []).append(row)
    for instance_rows in rows.values():
        instance_rows.sort(key=lambda r: r["seq"])
    return rows


def compare(a: Path, b: Path, wall_clock: bool) -> list[str]:
    """Differences between two traces, as lines (empty: the same rows)."""
    ra, rb = load(a, wall_clock), load(b, wall_clock)
    problems = []
    if sorted(ra) != sorted(rb):
        problems.append(f"instances differ: {sorted(ra)} vs {sorted(rb)}")
    for instance in sorted(set(ra) & set(rb)):
        xa, xb = ra[instance], rb[instance]
        if len(xa) != len(xb):
            problems.append(f"{instance}: {len(xa)} rows vs {len(xb)}")
        for i, (x, y) in enumerate(zip(xa, xb)):
            if x != y:
                problems.append(f"{instance}: row {i} differs:\n  {x}\n  {y}")
                break
    return problems


def dry_run(tree: Path, out: Path, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("PDTRACE_TRACE_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "pdtrace", "record", "--dry-run", "-o", str(out), *args], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"dry run failed with {tree}: {proc.stderr[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="the pdtrace source tree to compare this checkout with")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("TRACE_A", "TRACE_B"))
    ap.add_argument("--wall-clock", action="store_true", help="with --compare: drop ts_ns and detail durations")
    args = ap.parse_args()
    if args.compare:
        problems = compare(*args.compare, wall_clock=args.wall_clock)
        print("\n".join(problems) or f"same rows ({'ts_ns and durations dropped, ' if args.wall_clock else ''}"
                                     "pid dropped)")
        return 1 if problems else 0
    if args.baseline is None:
        ap.error("--baseline or --compare is required")
    failed = False
    with tempfile.TemporaryDirectory(prefix="pdtrace-equivalence-") as tmp:
        for name, scenario in SCENARIOS.items():
            before, after = Path(tmp) / f"{name}-before", Path(tmp) / f"{name}-after"
            dry_run(args.baseline.resolve(), before, scenario)
            dry_run(ROOT, after, scenario)
            problems = compare(before, after, wall_clock=False)
            rows = sum(len(v) for v in load(after, False).values())
            print(f"{name}: {rows} rows, " + ("same rows (pid dropped)" if not problems else "DIFFERENT"))
            for line in problems:
                print("  " + line)
            failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
