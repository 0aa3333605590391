"""Findings per sample and scenario, before and after a change (run by hand; prints a table, asserts nothing).

    .venv/bin/python bench/findings_before_after.py --before /tmp/pdmain [--after .] [--out DIR] [--traces DIR]

`--before` / `--after` are pdtrace source trees (e.g. `git archive d232191 | tar -x -C /tmp/pdmain`). Every
trace under sample_traces/*/trace and every scenario of this tree's tests/scenarios*.py (the healthy ones, the
pipeline models and the named faulty ones of `scenarios.FAULTY`, written to Parquet once) is analysed by each tree's
own `pdtrace analyze --format json` (a subprocess with that tree first on PYTHONPATH). Prints one line per trace:
(errors, warnings, info) before and after, the (rule/subrule, severity) pairs gained and lost, and whether the JSON
is byte-identical once the `trace` path and `pdtrace` version are set aside. The JSON reports are kept under --out.
`--traces DIR` adds every trace directory under DIR (e.g. one per test of vLLM's own suite, recorded through the
hooks) and prints the totals of those.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def scenario_traces(out: Path) -> dict[str, Path]:
    """Write every scenario of tests/scenarios*.py as a trace directory; {name: path}."""
    sys.path.insert(0, str(HERE / "tests"))
    sys.path.insert(0, str(HERE))
    import scenarios
    import scenarios_pipeline
    from pdtrace.trace.builder import write_table

    makers = {f"scenario:{k}": v for k, v in scenarios.HEALTHY.items()}
    makers.update({f"faulty:{k}": v for k, v in getattr(scenarios, "FAULTY", {}).items()})
    makers.update({f"pipeline:{k}": getattr(scenarios_pipeline, k) for k in dir(scenarios_pipeline)
                   if k.endswith("_pp4") and callable(getattr(scenarios_pipeline, k))})
    for seed in range(3):
        makers[f"random_healthy:{seed}"] = (lambda s=seed: scenarios.random_healthy(s))
    paths = {}
    for name, make in makers.items():
        path = out / "traces" / name.replace(":", "_")
        if not path.exists():
            write_table(make().table, path)
        paths[name] = path
    return paths


def analyze(tree: Path, trace: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-m", "pdtrace", "analyze", "--format", "json", str(trace)],
                          capture_output=True, text=True, env=env, cwd=str(tree))
    if proc.returncode not in (0, 1):
        return {"error": proc.stderr.strip().splitlines()[-1:] or ["?"]}
    return json.loads(proc.stdout)


def counts(report: dict) -> tuple[int, int, int]:
    c = Counter(f["severity"] for f in report.get("findings", []))
    return c["error"], c["warning"], c["info"]


def keys(report: dict) -> Counter:
    return Counter(f"{f['severity'][0]}:{f['rule']}/{f['subrule']}" for f in report.get("findings", []))


def comparable(report: dict) -> str:
    report = dict(report)
    report.pop("trace", None)
    report.pop("pdtrace", None)
    return json.dumps(report, sort_keys=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=HERE)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "pdtrace-findings-before-after")
    ap.add_argument("--traces", type=Path, help="also every trace directory under this one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    traces = {f"sample:{p.parent.name}": p for p in sorted((HERE / "sample_traces").glob("*/trace"))}
    traces.update(scenario_traces(args.out))
    if args.traces:
        traces.update({f"dir:{p.name}": p for p in sorted(args.traces.iterdir())
                       if p.is_dir() and any(p.rglob("*.parquet"))})
    totals = {"before": [0, 0, 0, 0], "after": [0, 0, 0, 0]}  # errors, warnings, info, traces with errors
    print(f"{'trace':46} {'before e/w/i':>12} {'after e/w/i':>12}  same-json  gained | lost")
    for name, path in traces.items():
        before, after = analyze(args.before.resolve(), path), analyze(args.after.resolve(), path)
        for label, rep in (("before", before), ("after", after)):
            (args.out / f"{name.replace(':', '_')}.{label}.json").write_text(json.dumps(rep, indent=1))
        if "error" in before or "error" in after:
            print(f"{name:46} failed: {before.get('error') or after.get('error')}")
            continue
        for label, rep in (("before", before), ("after", after)):
            c = counts(rep)
            totals[label] = [t + x for t, x in zip(totals[label], c + (int(c[0] > 0),))]
        gained = keys(after) - keys(before)
        lost = keys(before) - keys(after)
        same = "yes" if comparable(before) == comparable(after) else "no"
        print(f"{name:46} {'%d/%d/%d' % counts(before):>12} {'%d/%d/%d' % counts(after):>12}  {same:9}  "
              f"{' '.join(sorted(gained.elements())) or '-'} | {' '.join(sorted(lost.elements())) or '-'}")
    for label, (e, w, i, n) in totals.items():
        print(f"total {label}: {e} errors, {w} warnings, {i} info; {n} of {len(traces)} traces with errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
