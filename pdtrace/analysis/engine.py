"""The analysis of one slice and the one merge, shared by every way an analysis runs (`pdtrace.analysis.plan`).

A *slice* is what one AnalysisContext holds: the whole trace, one instance's rows (a partition, or a linked group
of them: `pdtrace.analysis.partitions`), or one time window of an instance (`pdtrace.analysis.windows`).
`analyze_slice` builds nothing itself but runs the rules on the context, checks each rule's findings
(`checked_findings`), judges them by the slice's history (`history.window_findings`: a slice that starts mid-run)
and its end (`AnalysisContext.window_end`: a slice cut off before the run ends), then lets the caller keep what the
slice owns (a window's ownership) and summarise it (a partition's `LinkSummary`). `merged` joins the slices'
findings into the report: ordered (`ordered_findings`), then the fallback rules' explained findings left out once
(`explained_once`). Below `windows`, `partitions` and the package's `__init__`, which all call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.findings import SEVERITY_ORDER, checked_findings, empty_findings, explained_once
from pdtrace.analysis.history import window_findings
from pdtrace.analysis import parallel
from pdtrace.analysis.registry import Rule
from pdtrace.analysis.slices import allocation_settings

#: keep(index of the rule, its judged findings, the rule) -> the findings the slice owns
Keep = Callable[[int, pd.DataFrame, Rule], pd.DataFrame]


@dataclass
class SliceResult:
    #: per rule (in the order given), its checked, judged and kept findings
    frames: list[pd.DataFrame]
    #: what `summarize(ctx, frames)` returned (None without one)
    summary: Any = None


def analyze_slice(ctx: AnalysisContext, rules: Sequence[Rule], jobs: int, keep: Keep | None = None,
                  summarize: Callable[[AnalysisContext, list[pd.DataFrame]], Any] | None = None) -> SliceResult:
    """Run `rules` on the slice `ctx` on `jobs` threads, check and judge their findings, keep (`keep`) and
    summarise (`summarize`) them: the one rule loop of every analysis (module docstring)."""
    with allocation_settings():  # parallel.run_rules looked up per call: bench/long_trace.py --profile replaces it
        frames = [_judged(ctx, window_findings(ctx, checked_findings(frame, rule), rule))
                  for frame, rule in zip(parallel.run_rules(ctx, rules, jobs), rules)]
        if keep is not None:
            frames = [keep(i, frame, rule) for i, (frame, rule) in enumerate(zip(frames, rules))]
        summary = summarize(ctx, frames) if summarize is not None else None
    return SliceResult(frames, summary)


def _judged(ctx: AnalysisContext, frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` less the findings the slice's rows cannot judge (`windows.judged`: a slice that ends before the
    run, `AnalysisContext.window_end`); all of them otherwise."""
    return frame if ctx.window_end is None else ctx.window_end.judged(frame)


def merged(frames: Iterable[pd.DataFrame], rules: Sequence[Rule], attrs: dict[str, Any]) -> pd.DataFrame:
    """The report's findings from the per-rule findings of every slice (already joined per rule): ordered, the
    fallback rules' explained findings left out, `attrs` set."""
    findings = explained_once(ordered_findings(frames), [r.id for r in rules if r.fallback])
    findings.attrs = attrs
    return findings


def ordered_findings(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """The rules' findings in one frame: errors first, then by time, rule and instance; ties keep the order the
    rules returned them in (rules in the given order). One function for the whole-trace and partitioned paths, so
    both order a report the same way."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return empty_findings()
    findings = pd.concat(frames, ignore_index=True)
    rank = findings["severity"].map(SEVERITY_ORDER).fillna(-1).to_numpy()
    ts = pd.to_numeric(findings["ts_ns"], errors="coerce").fillna(0).to_numpy(np.float64)
    instance = findings["instance"].astype(str).to_numpy()
    order = np.lexsort((instance, findings["rule"].astype(str).to_numpy(), ts, -rank))
    return findings.iloc[order].reset_index(drop=True)
