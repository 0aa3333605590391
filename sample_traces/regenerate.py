"""Regenerate the shipped sample traces with the dry run (needs vLLM 0.33.0), and optionally their expected.json.

    python sample_traces/regenerate.py                 # every sample's trace/ (expected.json untouched)
    python sample_traces/regenerate.py starve          # one sample
    python sample_traces/regenerate.py --expected      # also rewrite expected.json from the current analyzer
    python sample_traces/regenerate.py --expected-only # only rewrite expected.json (no vLLM needed)
    python sample_traces/regenerate.py --readme        # rewrite README.md's table from the expected.json files

Each sample directory holds `trace/` (the trace, with `_manifest.json` holding the full dry-run config), `REGENERATE`
(the exact command) and `expected.json` (what `pdtrace analyze --format json` must report, compared by
tests/test_samples.py on rule, subrule, severity, instance and request counts, never timestamps).
`expected.json` is rewritten only with --expected, after checking by hand that the findings are the right ones.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pdtrace.dryrun import DryRunConfig, run_dry_run  # noqa: E402

#: name -> (what it shows, DryRunConfig fields that differ from the defaults)
SAMPLES: dict[str, tuple[str, dict]] = {
    "healthy_pd_pp1": ("healthy 1P1D, PP=1: no errors", dict(requests=24, rate=200.0, seed=1)),
    "healthy_pp4": ("healthy prefill instance at PP=4, a full pipeline (48 requests at once; a phantom decoder "
                    "reads the KV): no findings",
                    dict(requests=48, pp=4, instances="p", rate=0.0, prompt_len="uniform:32:96",
                         output_len="uniform:24:40", seed=2)),
    "completion_before_finish": ("P reports finished_sending for a request mid-prefill (PP=2): vLLM's assert "
                                 "in _free_blocks",
                                 dict(requests=8, pp=2, rate=400.0, faults=["completion_before_finish"], seed=3)),
    "lost_send_completion": ("a send completion never arrives: P's blocks leak",
                             dict(requests=12, rate=200.0, faults=["lost_send_completion"], end_hold_s=500.0,
                                  seed=4)),
    "abort_while_waiting_kv": ("a D request aborted while its KV read is in flight; vLLM 0.33 delays the free "
                               "until the read ends, so nothing is wrong: no findings (a negative control)",
                               dict(requests=12, rate=200.0, faults=["abort_while_waiting_kv"], seed=5)),
    "duplicate_completion": ("P rank 0 reports one send twice: vLLM's assert req_id in self.requests",
                             dict(requests=12, rate=200.0, faults=["duplicate_completion"], seed=6)),
    "duplicate_completion_tp2": ("TP=2: P rank 0 reports one send twice before rank 1 reports; the aggregator "
                                 "counts two ranks and P frees the blocks while rank 1 still sends",
                                 dict(requests=8, tp=2, rate=200.0, faults=["duplicate_completion"], seed=6)),
    "missing_rank_completion": ("TP=2: P's last rank never reports one send; the aggregator waits forever",
                                dict(requests=12, tp=2, rate=200.0, faults=["missing_rank_completion"],
                                     end_hold_s=500.0, seed=7)),
    "slow_transfer": ("one KV read outlasts the run: D waits for KV, P holds the blocks",
                      dict(requests=12, rate=200.0, faults=["slow_transfer"], slow_transfer_ms=1_000_000.0,
                           end_hold_s=500.0, seed=8)),
    "starve": ("a head-of-line request that needs the whole pool, after a leak pinned part of it",
               dict(requests=16, rate=200.0, num_blocks=64, max_num_batched_tokens=1024,
                    prompt_len="uniform:32:128", output_len="exp:16", faults=["starve"], end_hold_s=500.0,
                    seed=9)),
    "few_requests_pp": ("PP=4 with at most 2 requests in flight: pipeline bubbles",
                        dict(requests=8, pp=4, faults=["few_requests_pp"], seed=10)),
}


def cli_command(kw: dict) -> str:
    """The `pdtrace record --dry-run` command line for these config fields (options named after the fields)."""
    defaults = {f.name: f.default for f in fields(DryRunConfig) if f.name != "faults"}
    parts = ["pdtrace record --dry-run"]
    for name, value in kw.items():
        if name == "faults":
            parts += [f"--fault {v}" for v in value]
            continue
        if value == defaults.get(name):
            continue
        opt = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(opt if value else "--no-" + name.replace("_", "-"))
        else:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            parts.append(f"{opt} {value}")
    return " ".join(parts)


def regenerate(name: str, write_expected: bool) -> None:
    _, kw = SAMPLES[name]
    sample = HERE / name
    trace = sample / "trace"
    shutil.rmtree(trace, ignore_errors=True)
    sample.mkdir(parents=True, exist_ok=True)
    result = run_dry_run(DryRunConfig(**kw), trace)
    write_regenerate_file(name)
    print(f"{name}: {result.steps} steps, {result.events} events, error={result.error}, "
          f"injected={result.injected}", file=sys.stderr)
    if write_expected:
        write_expected_json(name, result)


def write_regenerate_file(name: str) -> None:
    """The sample's REGENERATE: the exact command line (and the script's equivalent)."""
    _, kw = SAMPLES[name]
    (HERE / name / "REGENERATE").write_text(
        "# the exact command that made trace/ (run from the repository root; needs vLLM 0.33.0):\n"
        f"{cli_command(kw)} -o sample_traces/{name}/trace\n"
        "# equivalently (the config is also in trace/_manifest.json):\n"
        f"python sample_traces/regenerate.py {name}\n")


def write_expected_json(name: str, result: Any = None) -> None:
    """expected.json from what `pdtrace analyze --format json` reports now (check it by hand before committing)."""
    import importlib.util
    import subprocess

    desc, kw = SAMPLES[name]
    sample = HERE / name
    spec = importlib.util.spec_from_file_location("test_samples", HERE.parent / "tests" / "test_samples.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    args = ANALYZE_ARGS.get(name, [])
    proc = subprocess.run([sys.executable, "-m", "pdtrace", "analyze", str(sample / "trace"), "--format", "json",
                           "--fail-on", "never", *args], capture_output=True, text=True, check=True)
    findings = json.loads(proc.stdout)["findings"]
    manifest = json.loads((sample / "trace" / "_manifest.json").read_text())
    expected = {"sample": name, "description": desc, "analyze_args": args, "config": manifest["dry_run"],
                "engine_error": getattr(result, "error", None) if result is not None else
                _previous(sample).get("engine_error"),
                "findings": mod.summarize_findings(findings)}
    (sample / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


def _previous(sample: Path) -> dict:
    p = sample / "expected.json"
    return json.loads(p.read_text()) if p.exists() else {}


#: Extra `pdtrace analyze` options per sample (none: every sample is analyzed with the defaults).
ANALYZE_ARGS: dict[str, list[str]] = {}


README_TEMPLATE = """# Sample traces

Small traces made on vLLM 0.33.0 (each trace's `_manifest.json` and `engine_config` events name the release and
the hook table, `v0_33`, which `pdtrace info` shows; the dry run runs on every release pdtrace supports, with that
release's semantics: docs/vllm-releases.md) by `pdtrace record --dry-run` (the release's real EngineCore and
Scheduler, with the NIXL
connector's scheduler side, on pdtrace's simulated workers and transfer engine; see `pdtrace/dryrun/`). They need
nothing but pdtrace to read:

```
pdtrace analyze sample_traces/lost_send_completion
pdtrace show sample_traces/completion_before_finish --req r00001-p
```

Each directory holds `trace/` (the trace; `trace/_manifest.json` has the full dry-run configuration), `REGENERATE`
(the exact command that made it) and `expected.json` (what `pdtrace analyze --format json` reports: rule, subrule,
severity, instance, number of findings and request ids; `tests/test_samples.py` checks it). Request ids are
`rNNNNN-p` on the prefill instance and `rNNNNN-d` on the decode instance (the same client request).

| sample | what it shows | findings (severity rule/subrule (instance, count)) | vLLM raised | size |
| --- | --- | --- | --- | --- |
@TABLE@

Notes:

- `completion_before_finish` and `duplicate_completion` end where vLLM's own assert stopped the engine
  (`engine_error` is the trace's last scheduler event): exactly what kills a real EngineCoreProc. In
  `duplicate_completion` the assert also kept another request's recorded send completion from freeing its blocks;
  the analyzer reports that leak as info ("engine failed at step K ... before ..."), a consequence of the crash
  rather than a second bug.
- `missing_rank_completion`'s leak finding names the silent rank (pp0/tp1) and cites the ranks that did report.
- The leak samples (`lost_send_completion`, `missing_rank_completion`, `slow_transfer`, `starve`) were made with
  `--end-hold-s 500`: once the run is stuck, the engines jump 500 s ahead and take one more step, so the wait
  outlasts the analyzer's default grace period (480 s, NIXL's D-side block TTL) without simulating the ~1000 empty
  steps a second that vLLM runs meanwhile.
- `starve`: vLLM 0.33 refuses a max_model_len its pool could never hold, so a request that can never fit needs
  blocks lost at run time; here request 0's send completion is lost (its blocks stay pinned) and the target needs the
  whole usable pool. The requests behind it wait too (FCFS head-of-line).
- `abort_while_waiting_kv` is a negative control: vLLM 0.33 keeps the aborted request's blocks until its KV read
  completes (scheduler.py:3015-3024), so nothing is wrong and nothing is reported. vLLM 0.10 / 0.11 free them at once
  instead, while the read may still write them (docs/vllm-releases.md).
- A 1P1D run at PP=4 shows large decode-side bubbles (the V1 runner puts every ready decode into one micro-batch, so
  the other stages wait); `healthy_pp4` is therefore a prefill instance, whose pipeline stays full.

Regenerate all of them (needs vLLM 0.33.0; about 2 minutes on 2 cores): `python sample_traces/regenerate.py`; add
`--expected` to rewrite expected.json from the current analyzer (then check the findings by hand); `--expected-only`
rewrites expected.json without vLLM; `--readme` rewrites this file's table.
"""


def write_readme() -> None:
    """sample_traces/README.md: the table of samples, from SAMPLES and each expected.json."""
    rows = []
    for name, (desc, _) in SAMPLES.items():
        e = json.loads((HERE / name / "expected.json").read_text())
        fs = "; ".join(f"{f['severity']} {f['rule']}/{f['subrule']} ({f['instance']}, {f['count']})"
                       for f in e["findings"]) or "none"
        size = sum(p.stat().st_size for p in (HERE / name / "trace").rglob("*") if p.is_file())
        rows.append(f"| `{name}` | {desc} | {fs} | {e.get('engine_error') or ''} | {size / 1024:.0f} KB |")
    (HERE / "README.md").write_text(README_TEMPLATE.replace("@TABLE@", "\n".join(rows)))


def main(argv: list[str]) -> int:
    write_expected = "--expected" in argv
    only_expected = "--expected-only" in argv
    if "--readme" in argv:
        write_readme()
        return 0
    names = [a for a in argv if not a.startswith("-")] or list(SAMPLES)
    for name in names:
        if name not in SAMPLES:
            print(f"unknown sample {name}; known: {', '.join(SAMPLES)}", file=sys.stderr)
            return 2
        if only_expected:
            write_expected_json(name)
        else:
            regenerate(name, write_expected)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
