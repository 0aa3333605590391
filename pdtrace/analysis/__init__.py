"""pdtrace's analyses: `analyze(trace_or_path, rules=None, config=None)` returns the findings as a DataFrame.

This is the one code path behind both the notebook API and `pdtrace analyze`, planned once (`pdtrace.analysis.plan`:
whole, partitioned or windowed; each slice analysed by `engine.analyze_slice`, the findings joined by `engine.merged`):
1. load the trace if given a path (`pdtrace.trace.reader.open_trace`);
2. keep the rows inside `config.since_ns` / `config.until_ns` and `config.instances` (one vectorised mask);
3. run the selected rules from the registry (`pdtrace.analysis.registry.load_rules`, the `pdtrace.rules`
   entry-point group) on one shared AnalysisContext, so derived tables (columns, request and ownership tables,
   step index) are computed once; rules and the tables they declare run side by side on `config.jobs` threads
   (`pdtrace.analysis.parallel`), with the same findings as one after the other;
4. concatenate their findings and sort them by severity (errors first), then time, rule and instance
   (`ordered_findings`).
A path to a large trace of several instances takes the partitioned path instead (`pdtrace.analysis.partitions`):
steps 1-3 per instance in worker processes or Dask tasks, a cross-instance join, then step 4; same findings. An
instance with more than `config.window_events` events is analysed in time windows inside its partition
(`pdtrace.analysis.windows`): memory bounded by the window; same findings, pipeline_bubble measured per window.

`summarize_findings(findings)` turns a findings DataFrame into the summary the reporters print: counts per
severity and rule, "N errors from M contexts", the leak summary in blocks per instance (and % of the pool), and
the bubble summary per rank from `pipeline_bubble` findings.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import pandas as pd

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.engine import ordered_findings
from pdtrace.analysis.findings import SEVERITY_ORDER, checked_findings
from pdtrace.analysis.plan import Plan, plan_analysis, run_plan
# select_rules: defined in the registry (the partition workers resolve ids too); importable from here as before
from pdtrace.analysis.registry import Rule, load_rules, select_rules
from pdtrace.analysis.slices import allocation_settings, window

__all__ = ["analyze", "available_rules", "select_rules", "summarize_findings", "window", "AnalysisConfig",
           "allocation_settings", "checked_findings", "ordered_findings", "Plan", "plan_analysis", "run_plan"]


def available_rules() -> tuple[dict[str, Rule], list[str]]:
    """(registered rules by id, warnings). A plugin that fails to load is left out with a warning rather than
    hiding every other rule."""
    notes: list[str] = []
    return load_rules(errors=notes), notes


def analyze(trace_or_path: Any, rules: Iterable[str | Rule] | None = None,
            config: AnalysisConfig | None = None, *, dask: Any = None, partitioned: bool | None = None,
            progress: Callable[[Any, Any], None] | None = None, plan: Plan | None = None) -> pd.DataFrame:
    """Run the rules on a trace (or a trace path, or an AnalysisContext whose derived tables are then shared) and
    return the findings, errors first, then by time.

    How it runs is planned once (`pdtrace.analysis.plan.plan_analysis`, printed by `pdtrace analyze --plan`);
    `plan=`: a plan made already, whose source and config are then the ones analysed. A path to a trace of several
    instances is analysed partition by partition (`pdtrace.analysis.partitions`): on `config.jobs` worker
    processes (0: one per CPU; 1: one after the other in this process) when it has at least PARTITION_MIN_EVENTS
    events and no instance holds more than three quarters of them, or on a Dask cluster with `dask=` (a
    `distributed.Client` or a scheduler address; needs `pdtrace[dask]`). `partitioned=True` forces partitions
    (also for an in-memory Trace, one after the other), False forbids them. `progress(task, result)` is called as
    each partition finishes (and, in this process, as each window of an instance with more than
    `config.window_events` events finishes: `pdtrace.analysis.windows.WindowInfo`). The findings are the same
    either way.

    The DataFrame has the columns of `pdtrace.analysis.findings.FINDING_COLUMNS` and `instance_name` (the
    instance's readable name, `pdtrace.trace.names`; `instance` stays vLLM's id); `attrs` holds `instance_names`
    (every instance's), `rules` (the ids
    that ran), `events` (rows analysed), `trace` (its path), `warnings` (rule plugins that failed to load) and,
    when partitioned, `trace_warnings` (what opening the partitions tolerated, one line each), `partitions` and
    `windows` ({instance: windows, carried} of the instances analysed window by window).
    """
    registered, notes = available_rules()
    chosen = select_rules(rules, registered)
    if plan is None:
        plan = plan_analysis(trace_or_path, config, dask=dask, partitioned=partitioned)
    return run_plan(plan, chosen, notes, progress)


def _leak_summary(leaks: pd.DataFrame) -> list[dict[str, Any]]:
    """Leaked blocks per (instance, dp_rank), by class, with their share of the pool. Leaks that are consequences of
    an engine failure (extra `downgraded` == "engine_error", the crash policy of rulekit) are left out: the blocks
    were still in use when the engine died, not lost by a bug. Blocks `still_held` at the end of the trace (a
    transfer within its grace period: valgrind's "still reachable") are counted apart, in `still_held` and
    `still_held_requests`, not in the lost `blocks` or the pool share."""
    rows: dict[tuple[str, Any], dict[str, Any]] = {}
    for rec in leaks.to_dict("records"):  # one per leak finding
        extra = rec.get("extra") or {}
        if extra.get("downgraded") == "engine_error":
            continue
        key = (str(rec.get("instance")), rec.get("dp_rank"))
        entry = rows.setdefault(key, {"instance": key[0], "dp_rank": key[1], "blocks": 0, "definitely": 0,
                                      "indirectly": 0, "possibly": 0, "requests": 0, "pool_blocks": None})
        n = int(extra.get("n_blocks") or len(rec.get("blocks") or []))
        cls = str(extra.get("class") or rec.get("subrule"))
        if extra.get("pool_blocks"):
            entry["pool_blocks"] = int(extra["pool_blocks"])
        if cls == "still_held":
            entry["still_held"] = entry.get("still_held", 0) + n
            entry["still_held_requests"] = entry.get("still_held_requests", 0) + 1
            continue
        entry["blocks"] += n
        if cls in ("definitely", "indirectly", "possibly"):
            entry[cls] += n
        entry["requests"] += 1
    out = []
    for entry in rows.values():
        pool = entry["pool_blocks"]
        entry["pool_percent"] = round(100.0 * entry["blocks"] / pool, 2) if pool else None
        out.append(entry)
    return sorted(out, key=lambda e: (e["instance"], -1 if e["dp_rank"] is None else e["dp_rank"]))


def _bubble_summary(bubbles: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for rec in bubbles.to_dict("records"):  # pipeline_bubble findings are per rank, few
        extra = dict(rec.get("extra") or {})
        entry = {"instance": rec.get("instance"), "dp_rank": rec.get("dp_rank"), "severity": rec.get("severity"),
                 "message": rec.get("message")}
        entry["cause"] = rec.get("subrule")
        for key in ("p", "pp_rank", "tp_rank", "wall_ns", "idle_fraction", "lost_fraction", "avoidable_fraction",
                    "idle_ns_by_cause", "intervals"):
            if key in extra:
                entry[key] = extra[key]
        out.append(entry)
    return out


def summarize_findings(findings: pd.DataFrame) -> dict[str, Any]:
    """Counts per severity and rule, errors and contexts, leak summary per instance, bubble summary per rank, and
    `window` (start_ns, source, how, meaning) when the trace starts mid-run."""
    by_severity = {s: int((findings["severity"] == s).sum()) if len(findings) else 0 for s in SEVERITY_ORDER}
    by_rule: dict[str, int] = {}
    if len(findings):
        by_rule = {str(k): int(v) for k, v in findings["rule"].value_counts(sort=False).items()}
    errors = findings[findings["severity"] == "error"] if len(findings) else findings
    contexts = int(errors["context"].astype(str).nunique()) if len(errors) else 0
    leaks = findings[findings["rule"] == "leaked_blocks"] if len(findings) else findings
    bubbles = findings[findings["rule"] == "pipeline_bubble"] if len(findings) else findings
    out: dict[str, Any] = {
        "findings": int(len(findings)),
        "by_severity": by_severity,
        "by_rule": by_rule,
        "errors": by_severity["error"],
        "error_contexts": contexts,
        "rules": list(findings.attrs.get("rules", [])),
        "events": findings.attrs.get("events"),
        "leaks": _leak_summary(leaks) if len(leaks) else [],
        "bubbles": _bubble_summary(bubbles) if len(bubbles) else [],
    }
    if findings.attrs.get("window"):  # a trace that starts mid-run (pdtrace.analysis.history)
        out["window"] = findings.attrs["window"]
    if findings.attrs.get("windows"):  # instances analysed window by window (pdtrace.analysis.windows)
        out["windows"] = findings.attrs["windows"]
    return out
