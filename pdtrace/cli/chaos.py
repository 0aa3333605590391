"""`pdtrace chaos -o DIR [--budget 10m] [--seed N] [--workload pd|pp|single|offload|all]`, and `pdtrace chaos --repro
FAILURE`: forced orderings on the installed vLLM's real scheduler (pdtrace.chaos); exit 1 when a legal-timing
failure was found (or a re-run reproduced its failure), 0 when not, 2 on bad usage or an unsupported vLLM."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from pdtrace.cli.app import app, err_console, installed_release, out_console
from pdtrace.dryrun import offload_supported
from pdtrace.errors import EXIT_FINDINGS, EXIT_OK, UsageError


class Workload(str, Enum):
    pd = "pd"
    pp = "pp"
    single = "single"
    offload = "offload"
    all = "all"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(s|m|min|h)?\s*$")
_UNIT_S = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_budget(text: str) -> float:
    """Seconds of `--budget`: 90, 90s, 10m, 1h."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--budget takes a duration such as 90s, 10m or 1h; got {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


@app.command("chaos")
def chaos(
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Directory for the failures found "
                                          "(failure-NNNN/: trace, failure.json)."),
    budget: str = typer.Option("10m", "--budget", help="How long to search: 90s, 10m, 1h."),
    seed: int = typer.Option(0, "--seed", help="Seed of the campaign: the same seed draws the same trials."),
    workload: Workload = typer.Option(Workload.all, "--workload", help="pd: a prefill/decode pair; pp: the pair at "
                                      "PP=2; single: one engine under KV pressure; offload: one engine with vLLM's "
                                      "OffloadingConnector (vLLM 0.23+); all: each in turn (offload where the "
                                      "release has it)."),
    max_runs: int = typer.Option(0, "--max-runs", help="Stop after this many trials (0: when the budget ends)."),
    repro_dir: Optional[Path] = typer.Option(None, "--repro", help="Re-run one saved failure (a failure-NNNN "
                                             "directory) and say whether it still fails the same way."),
) -> None:
    """Force the orderings nobody tests (aborts at every point, transfer reports late, lost, repeated, failed reads,
    a small pool) on the installed vLLM's real EngineCore and Scheduler, judge each run, and minimise and save every
    new failure; legal timing (a vLLM bug) apart from faulty peer (a robustness gap)."""
    # lazy: the campaign runs the analysis stack; the CLI starts without it
    from pdtrace.chaos import Campaign, repro, run_campaign, runnable_workloads
    from pdtrace.dryrun import zygote  # lazy: pdtrace --help loads no dry-run server code (CLI start-up)
    # lazy: pdtrace --help loads no chaos reporter (CLI start-up)
    from pdtrace.report.chaos_report import progress_line, render_campaign, render_repro

    version = installed_release()
    if repro_dir is not None:
        if output is not None:
            raise UsageError("--repro re-runs a saved failure; it takes no -o")
        try:
            record, outcome = repro(repro_dir)
        finally:
            zygote.stop()
        render_repro(out_console, record, outcome, version)
        raise typer.Exit(EXIT_FINDINGS if outcome.signature == record["signature"] else EXIT_OK)
    if output is None:
        raise UsageError("pdtrace chaos needs -o DIR (where the failures go), or --repro FAILURE")
    if output.exists() and any(output.glob("failure-*")):
        raise UsageError(f"{output} already holds failures of a campaign; choose a new directory")
    names = tuple(w.value for w in Workload if w is not Workload.all) if workload is Workload.all else (workload.value,)
    if workload is Workload.offload and not offload_supported(version):
        raise UsageError(f"--workload offload needs vLLM 0.23 or later (its OffloadingConnector reports stores "
                         f"and loads per job); this is vLLM {version}")
    names = runnable_workloads(names, version)
    campaign = Campaign(output=output, budget_s=parse_budget(budget), seed=seed, workloads=names,
                        max_runs=max(0, max_runs))
    err_console.print(f"pdtrace chaos: vLLM {version}, {campaign.budget_s:.0f} s, seed {seed}", markup=False)
    try:
        with err_console.status("chaos: starting (importing vLLM once)") as status:
            result = run_campaign(campaign, zygote.spawn, version,
                                  progress=lambda r, c: status.update(progress_line(r, c)))
    finally:
        zygote.stop()
    render_campaign(out_console, result, campaign)
    raise typer.Exit(EXIT_FINDINGS if result.legal_failures else EXIT_OK)
