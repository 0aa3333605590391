"""The report of `pdtrace chaos`: the campaign's summary table, legal timing apart from faulty peer. Only renders:
the tally is `pdtrace.chaos.CampaignResult`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from pdtrace.chaos import Campaign, CampaignResult, Outcome

#: What each label means for the reader of the report.
VERDICT = {"legal timing": "vLLM bugs (or false alarms of pdtrace's rules): a correct peer can produce these orderings",
           "faulty peer": "robustness gaps: these need a connector or worker that misbehaves"}


def progress_line(result: CampaignResult, campaign: Campaign) -> str:
    """One line of progress for stderr."""
    legal = len(result.legal_failures)
    return (f"chaos: {result.runs} runs, {result.elapsed_s:.0f}/{campaign.budget_s:.0f} s, signatures: {legal} "
            f"legal timing, {len(result.failures) - legal} faulty peer")


def render_campaign(console: Console, result: CampaignResult, campaign: Campaign) -> None:
    """The summary: the campaign's figures, then one table per label."""
    how = " (interrupted)" if result.interrupted else ""
    console.print(f"pdtrace chaos: vLLM {result.vllm_version}, workloads {', '.join(campaign.workloads)}, seed "
                  f"{campaign.seed}: {result.runs} runs in {result.elapsed_s:.0f} s{how}", markup=False)
    if result.harness_errors:
        console.print(f"  {result.harness_errors} runs the dry run could not do (first: {result.first_harness_error})",
                      markup=False)
    for label, verdict in VERDICT.items():
        failures = [f for f in result.failures if f.label == label]
        console.print(f"{label}: {len(failures)} signature(s): {verdict}", markup=False)
        if not failures:
            continue
        table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for column in ("signature", "runs", "first found", "minimised", "reproduce"):
            table.add_column(column, overflow="fold")
        for f in failures:
            table.add_row(f.signature, str(f.runs), f"{f.found_after_s:.0f} s",
                          f"{f.perturbations_after} of {f.perturbations_before} perturbations, {f.requests_after} "
                          "requests", f"pdtrace chaos --repro {f.path}")
        console.print(table)


def render_repro(console: Console, record: dict[str, Any], outcome: Outcome, installed: str) -> None:
    """What a failure's re-run gave against what was saved."""
    console.print(f"saved on vLLM {record.get('vllm_version')}: {record['signature']} ({record['label']})",
                  markup=False)
    console.print(f"  perturbations: {'; '.join(record.get('perturbations') or ['none'])}", markup=False)
    if outcome.harness_error:
        console.print(f"re-run on vLLM {installed}: the dry run could not run it: {outcome.harness_error}",
                      markup=False)
    elif outcome.signature == record["signature"]:
        console.print(f"re-run on vLLM {installed}: reproduced: {outcome.signature}: {outcome.detail}", markup=False)
    else:
        now = outcome.signature or "no failure"
        console.print(f"re-run on vLLM {installed}: not reproduced (now: {now})", markup=False)
