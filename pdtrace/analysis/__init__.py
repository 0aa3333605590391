"""pdtrace's analyses: `analyze(trace_or_path, rules=None, config=None)` returns the findings as a DataFrame.

This is the one code path behind both the notebook API and `pdtrace analyze`:
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

import os
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.findings import (SEVERITY_ORDER, checked_findings, empty_findings, explained_once,
                                      named_findings)
from pdtrace.analysis.history import trace_window, window_findings, window_summary
from pdtrace.analysis.parallel import default_jobs, run_rules
from pdtrace.analysis.registry import Rule, load_rules
from pdtrace.analysis.slices import allocation_settings, window
from pdtrace.analysis.windows import judged, window_size
from pdtrace.errors import UsageError
from pdtrace.trace.model import Trace
from pdtrace.trace.names import names_of

__all__ = ["analyze", "available_rules", "select_rules", "summarize_findings", "window", "AnalysisConfig",
           "allocation_settings", "checked_findings", "ordered_findings"]


def available_rules() -> tuple[dict[str, Rule], list[str]]:
    """(registered rules by id, warnings). A plugin that fails to load is left out with a warning rather than
    hiding every other rule."""
    notes: list[str] = []
    return load_rules(errors=notes), notes


def select_rules(rules: Iterable[str | Rule] | None, registered: dict[str, Rule]) -> list[Rule]:
    """The rules to run: all registered ones, or the given ids / Rule objects (unknown ids raise UsageError)."""
    if rules is None:
        return list(registered.values())
    chosen: list[Rule] = []
    for item in rules:
        if isinstance(item, Rule):
            chosen.append(item)
            continue
        name = str(item).strip()
        if not name:
            continue
        if name not in registered:
            raise UsageError(f"unknown rule {name!r} (known: {', '.join(sorted(registered))})")
        chosen.append(registered[name])
    if not chosen:
        raise UsageError("no rule selected")
    return chosen


def _load(trace_or_path: Any) -> Trace:
    if isinstance(trace_or_path, Trace):
        return trace_or_path
    if isinstance(trace_or_path, (str, os.PathLike, Path)):
        from pdtrace.trace.reader import open_trace

        return open_trace(trace_or_path)
    raise UsageError(f"analyze() takes a Trace or a path, not {type(trace_or_path).__name__}")


def analyze(trace_or_path: Any, rules: Iterable[str | Rule] | None = None,
            config: AnalysisConfig | None = None, *, dask: Any = None, partitioned: bool | None = None,
            progress: Callable[[Any, Any], None] | None = None) -> pd.DataFrame:
    """Run the rules on a trace (or a trace path, or an AnalysisContext whose derived tables are then shared) and
    return the findings, errors first, then by time.

    A path to a trace of several instances is analysed partition by partition (`pdtrace.analysis.partitions`): on
    `config.jobs` worker processes (0: one per CPU; 1: one after the other in this process) when it has at least
    PARTITION_MIN_EVENTS events and no instance holds more than three quarters of them, or on a Dask cluster with
    `dask=` (a `distributed.Client` or a scheduler address; needs `pdtrace[dask]`). `partitioned=True` forces
    partitions (also for an in-memory Trace, one after the other), False forbids them. `progress(task, result)` is
    called as each partition finishes (and, in this process, as each window of an instance with more than
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
    if dask is not None or partitioned:
        return _analyze_partitioned(trace_or_path, chosen, config, notes, dask, progress)
    if partitioned is None and isinstance(trace_or_path, (str, os.PathLike)):
        from pdtrace.analysis.partitions import worth_partitioning

        plan = worth_partitioning(trace_or_path, config or AnalysisConfig())
        if plan is not None:
            return _analyze_partitioned(trace_or_path, chosen, config, notes, None, progress, plan)
    if partitioned is None and isinstance(trace_or_path, Trace) and \
            window_size(config or AnalysisConfig(), len(trace_or_path)):
        return _analyze_partitioned(trace_or_path, chosen, config, notes, None, progress)  # window by window
    if isinstance(trace_or_path, AnalysisContext) and config is None and window(
            trace_or_path.trace, trace_or_path.config) is trace_or_path.trace:
        ctx = trace_or_path  # reuse the caller's derived tables (plots and exports analyse the same context)
    else:
        if isinstance(trace_or_path, AnalysisContext):
            config = config or trace_or_path.config
            trace_or_path = trace_or_path.trace
        config = config or AnalysisConfig()
        ctx = AnalysisContext(trace=window(_load(trace_or_path), config), config=config)
    trace = ctx.trace
    jobs = int(ctx.config.jobs) or default_jobs()
    with allocation_settings():
        frames = [judged(ctx, window_findings(ctx, checked_findings(frame, rule), rule))
                  for frame, rule in zip(run_rules(ctx, chosen, jobs), chosen)]
    findings = explained_once(ordered_findings(frames), [r.id for r in chosen if r.fallback])
    findings.attrs = {"rules": [r.id for r in chosen], "events": len(trace), "trace": trace.path,
                      "warnings": notes, "window": window_summary(trace_window(ctx))}
    return named_findings(findings, names_of(trace))


def _analyze_partitioned(source: Any, chosen: list[Rule], config: AnalysisConfig | None, notes: list[str],
                         dask: Any, progress: Any, plan: Any = None) -> pd.DataFrame:
    from pdtrace.analysis.partitions import LocalRunner, ProcessRunner, analyze_partitioned, default_workers

    config = config or AnalysisConfig()
    if isinstance(source, AnalysisContext):
        source = source.trace
    if dask is not None:
        if isinstance(source, Trace):
            raise UsageError("analyze(dask=...) takes a trace path (the cluster reads the trace where it lives), "
                             "not a loaded Trace")
        from pdtrace.analysis.distributed import DaskRunner

        runner: Any = DaskRunner.connect(dask)
    elif isinstance(source, Trace) or int(config.jobs) == 1 or _one_partition(source, config, plan):
        runner = LocalRunner()
    else:
        runner = ProcessRunner(int(config.jobs) or default_workers())
    if not isinstance(source, (Trace, str, os.PathLike)):
        raise UsageError(f"analyze() takes a Trace or a path, not {type(source).__name__}")
    try:
        frames, events, trace_notes, parts, windows = analyze_partitioned(source, chosen, config, runner, plan,
                                                                          progress)
    finally:
        getattr(runner, "close", lambda: None)()
    findings = explained_once(ordered_findings(frames), [r.id for r in chosen if r.fallback])
    findings.attrs = {"rules": [r.id for r in chosen], "events": events,
                      "trace": source.path if isinstance(source, Trace) else str(source), "warnings": notes,
                      "trace_warnings": trace_notes, "partitions": parts, "windows": windows,
                      "window": window_summary(_partitioned_window(source, config))}
    return named_findings(findings, _names(source))


def _names(source: Any) -> dict[str, str]:
    """The instances' readable names of a partitioned analysis' trace: the whole trace's footers (what every read
    of it names them by), or an in-memory trace's own."""
    if isinstance(source, Trace):
        return names_of(source)
    from pdtrace.trace.reader import footer_names, read_footers

    return footer_names(read_footers(source))


def _one_partition(source: Any, config: AnalysisConfig, plan: Any) -> bool:
    """Whether a trace path holds one instance to analyse (a worker process would only add its start, and the
    windows of a windowed partition report their progress from this process)."""
    if plan is None:
        from pdtrace.analysis.partitions import is_directory, plan_partitions

        if not isinstance(source, (str, os.PathLike)) or not is_directory(source):
            return False
        plan = plan_partitions(source)  # footers only
    return len([p for p in plan.partitions if not config.instances or p.instance in config.instances]) == 1


def _partitioned_window(source: Any, config: AnalysisConfig) -> Any:
    """The window a partitioned analysis reads (`history.Window`), from what the reader knows: a loaded trace's
    own, else the files' footers and manifest and the config's since_ns (what each partition's reader finds)."""
    from pdtrace.analysis.history import Window

    if isinstance(source, Trace):
        trace = window(source, config)
        start, how = trace.window_start_ns, trace.window_source
    else:
        from pdtrace.trace.reader import read_footers, trace_window as reader_window

        footers = read_footers(source)
        start, how = reader_window(footers.manifest, footers.files, footers, config.since_ns)
    return None if start is None else Window(int(start), str(how))


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
