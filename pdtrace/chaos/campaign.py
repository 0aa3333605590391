"""A chaos campaign: trials until the budget ends, each failure minimised and saved; and `repro` of one failure."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from pdtrace.chaos.trials import WORKLOADS, Outcome, Spawner, draw_trial, run_trial
from pdtrace.dryrun.config import DryRunConfig, offload_supported
from pdtrace.dryrun.perturb import LEGAL, describe, label_of
from pdtrace.errors import RecordingError, UsageError

FAILURE_FILE = "failure.json"
#: Runs one minimisation may spend (each a full dry run of about a second), and its share of what is left.
MINIMISE_MAX_RUNS = 48
MINIMISE_MAX_SHARE = 0.25
#: The campaign stops (exit 2) when this many trials in a row could not run: the harness is broken, not vLLM.
HARNESS_ERRORS_IN_A_ROW = 20


@dataclass(frozen=True)
class Campaign:
    """What `pdtrace chaos` was asked: where failures go, how long, which seed and workloads."""

    output: Path
    budget_s: float = 600.0
    seed: int = 0
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    max_runs: int = 0  # 0: until the budget ends
    minimise_runs: int = MINIMISE_MAX_RUNS  # the most runs one failure's minimisation may spend


@dataclass
class Failure:
    """One signature's first failure, minimised and saved under `path`; `runs` counts every trial that hit it."""

    signature: str
    label: str
    path: Path
    found_after_s: float
    runs: int
    perturbations_before: int
    perturbations_after: int
    requests_after: int
    detail: str


@dataclass
class CampaignResult:
    """The campaign's tally; `failures` in the order their signatures were first found."""

    runs: int = 0
    elapsed_s: float = 0.0
    harness_errors: int = 0
    first_harness_error: str | None = None
    failures: list[Failure] = field(default_factory=list)
    interrupted: bool = False
    vllm_version: str = ""

    @property
    def legal_failures(self) -> list[Failure]:
        return [f for f in self.failures if f.label == LEGAL]


Progress = Callable[[CampaignResult, Campaign], None]


def runnable_workloads(workloads: tuple[str, ...], vllm_version: str | None) -> tuple[str, ...]:
    """The workloads of `workloads` the installed release's dry run drives, in order: `offload` only where its
    OffloadingConnector reports per job (`offload_supported`: vLLM 0.23+). The one place a campaign's workloads
    are narrowed, for the CLI and for campaigns built in code alike."""
    return tuple(w for w in workloads if w != "offload" or offload_supported(vllm_version))


def run_campaign(campaign: Campaign, spawn: Spawner | None, vllm_version: str,
                 progress: Progress | None = None) -> CampaignResult:
    """Trials drawn from `campaign.seed` until its budget (or max_runs) ends. Each new signature is minimised and
    saved as `output/failure-NNNN/` (its trace, `failure.json`); a KeyboardInterrupt ends the campaign cleanly
    with what was found (`interrupted`). Scratch runs live in a temporary directory removed at the end."""
    workloads = runnable_workloads(campaign.workloads, vllm_version)
    if not workloads:
        raise UsageError(f"no workload of {', '.join(campaign.workloads)} runs on vLLM {vllm_version} (offload needs "
                         f"vLLM 0.23 or later)")
    out = campaign.output
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(campaign.seed)
    result = CampaignResult(vllm_version=vllm_version)
    by_signature: dict[str, Failure] = {}
    t0 = time.monotonic()
    deadline = t0 + campaign.budget_s
    in_a_row = 0
    with tempfile.TemporaryDirectory(prefix="pdtrace-chaos-") as scratch:
        try:
            while time.monotonic() < deadline and not (campaign.max_runs and result.runs >= campaign.max_runs):
                workload = workloads[result.runs % len(workloads)]
                config = draw_trial(rng, workload)
                outcome = _run(config, Path(scratch), spawn)
                result.runs += 1
                result.elapsed_s = time.monotonic() - t0
                if outcome.harness_error:
                    result.harness_errors += 1
                    result.first_harness_error = result.first_harness_error or outcome.harness_error
                    in_a_row += 1
                    if in_a_row >= HARNESS_ERRORS_IN_A_ROW:
                        raise RecordingError(f"the dry run could not run {in_a_row} trials in a row on this vLLM; "
                                             f"the first: {result.first_harness_error}")
                    continue
                in_a_row = 0
                if outcome.failed:
                    known = by_signature.get(outcome.signature)  # type: ignore[arg-type]
                    if known is not None:
                        known.runs += 1
                    else:
                        left = max(0.0, deadline - time.monotonic())
                        failure = save_failure(campaign, config, outcome, len(by_signature) + 1,
                                               result.elapsed_s, Path(scratch), spawn, left, vllm_version)
                        by_signature[failure.signature] = failure
                        result.failures.append(failure)
                if progress is not None:
                    progress(result, campaign)
        except KeyboardInterrupt:
            result.interrupted = True
    result.elapsed_s = time.monotonic() - t0
    return result


def _run(config: DryRunConfig, scratch: Path, spawn: Spawner | None) -> Outcome:
    out = Path(tempfile.mkdtemp(prefix="run-", dir=scratch))
    try:
        return run_trial(config, out, spawn)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def minimise(config: DryRunConfig, signature: str, test: Callable[[DryRunConfig], bool],
             max_runs: int = MINIMISE_MAX_RUNS) -> tuple[DryRunConfig, int]:
    """The smallest trial found that still fails with `signature` (`test` says whether a candidate does), and the
    runs spent. ddmin over the perturbations (complements, then subsets, at granularity 2, 4, ...), then the workload
    cut to one more than the highest request a perturbation targets."""
    runs = 0

    def fails(candidate: DryRunConfig) -> bool:
        nonlocal runs
        runs += 1
        return test(candidate)

    items = list(config.perturbations)
    n = 2
    while len(items) >= 2 and runs < max_runs:
        chunk = -(-len(items) // n)
        subsets = [items[i:i + chunk] for i in range(0, len(items), chunk)]
        reduced = False
        for i in range(len(subsets)):
            complement = [p for j, s in enumerate(subsets) if j != i for p in s]
            if runs < max_runs and fails(replace(config, perturbations=complement)):
                items, n, reduced = complement, max(n - 1, 2), True
                break
        if not reduced:
            for subset in subsets:
                if len(subset) < len(items) and runs < max_runs and fails(replace(config, perturbations=subset)):
                    items, n, reduced = subset, 2, True
                    break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    if len(items) == 1 and runs < max_runs and fails(replace(config, perturbations=[])):
        items = []
    best = replace(config, perturbations=items)
    needed = max([int(p["req"]) + int(p.get("count", 1)) for p in items], default=1)
    for requests in sorted({needed, max(1, best.requests // 2)}):
        if requests < best.requests and runs < max_runs:
            candidate = replace(best, requests=max(requests, needed))
            if fails(candidate):
                best = candidate
                break
    return best, runs


def save_failure(campaign: Campaign, config: DryRunConfig, outcome: Outcome, index: int, found_after_s: float,
                 scratch: Path, spawn: Spawner | None, left_s: float, vllm_version: str) -> Failure:
    """Minimise a new signature's failure, run the minimal trial into `failure-NNNN/trace`, write failure.json."""
    signature = outcome.signature or ""
    spent = [0.0]

    def same(candidate: DryRunConfig) -> bool:
        t = time.monotonic()
        got = _run(candidate, scratch, spawn)
        spent[0] += time.monotonic() - t
        return got.signature == signature

    per_run = max(outcome.wall_s, 0.5)
    runs_allowed = int(min(campaign.minimise_runs, MINIMISE_MAX_SHARE * left_s / per_run))
    small, _ = minimise(config, signature, same, max(0, runs_allowed))
    path = campaign.output / f"failure-{index:04d}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    final = run_trial(small, path / "trace", spawn)
    if final.signature != signature:  # cannot happen for a deterministic run; keep the unminimised trial then
        shutil.rmtree(path / "trace", ignore_errors=True)
        small, final = config, run_trial(config, path / "trace", spawn)
    label = label_of(small.perturbations)
    failure = Failure(signature=signature, label=label, path=path, found_after_s=round(found_after_s, 1), runs=1,
                      perturbations_before=len(config.perturbations), perturbations_after=len(small.perturbations),
                      requests_after=small.requests, detail=final.detail or outcome.detail)
    record = {"signature": signature, "label": label, "detail": failure.detail, "traceback": final.traceback,
              "findings": final.findings, "vllm_version": vllm_version, "found_after_s": failure.found_after_s,
              "campaign": {"seed": campaign.seed, "workloads": list(campaign.workloads)},
              "perturbations": [describe(p) for p in small.perturbations],
              "minimised_from": {"perturbations": len(config.perturbations), "requests": config.requests},
              "config": small.to_dict(), "repro": f"pdtrace chaos --repro {path}"}
    (path / FAILURE_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n")
    return failure


def load_failure(path: Path) -> dict[str, Any]:
    """A saved failure's record (UsageError, one line, when `path` holds none or an unreadable one)."""
    file = path / FAILURE_FILE
    try:
        record = json.loads(file.read_text())
        DryRunConfig(**record["config"])
    except FileNotFoundError:
        raise UsageError(f"{path} holds no {FAILURE_FILE}: give a failure directory `pdtrace chaos` wrote") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{file} is not a chaos failure record: {exc}") from None
    return record


def repro(path: Path, spawn: Spawner | None = None, keep: Path | None = None) -> tuple[dict[str, Any], Outcome]:
    """Re-run a saved failure's trial on the installed vLLM (into `keep`, else a temporary directory): its record
    and the new outcome. The run is deterministic: the same release gives the same signature."""
    record = load_failure(path)
    config = DryRunConfig(**record["config"]).validate()
    if keep is not None:
        return record, run_trial(config, keep, spawn)
    with tempfile.TemporaryDirectory(prefix="pdtrace-chaos-repro-") as tmp:
        return record, run_trial(config, Path(tmp) / "trace", spawn)
