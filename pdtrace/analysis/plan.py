"""One engine under two planners: how an analysis will run, decided once, printable (`pdtrace analyze --plan`).

`plan_analysis(source, config, dask=, partitioned=)` reads the trace's footers only (never a row) and decides:
- the mode: `whole` (one slice, the whole trace, in this process), `partitioned` (one slice per instance, then the
  cross-instance join of `pdtrace.analysis.partitions`) or `windowed` (one instance analysed in time windows,
  `pdtrace.analysis.windows`; in a partitioned trace, each slice says whether it is windowed);
- the slices: their instances, rows (the footers'; an in-memory trace's own) and files, and events per window;
- the runner: this process, N worker processes, or a Dask cluster, and the rule threads each slice gets.
`run_plan` carries it out: every slice goes through `engine.analyze_slice` (directly, in a partition task, or per
window), and the findings through `engine.merged`. `pdtrace.analyze` is `run_plan(plan_analysis(...))`.

The decision is the one `analyze` always made: a path to a directory whose instances are worth analysing apart
(`partitions.worth_partitioning`: an instance above the window size, or several instances, at least
PARTITION_MIN_EVENTS events and none above 3/4 of them), a loaded trace above the window size, or
`partitioned=True` / `dask=` take the partitioned path; everything else is analysed whole. Worker processes only
where there are several partitions and `jobs` is not 1.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pandas as pd

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.distributed import DaskRunner, _distributed
from pdtrace.analysis.engine import analyze_slice, merged
from pdtrace.analysis.findings import named_findings
from pdtrace.analysis.history import Window, trace_window, window_summary
from pdtrace.analysis.parallel import default_jobs
from pdtrace.analysis.partitions import (PARTITION_MIN_EVENTS, LocalRunner, Partition, PartitionPlan, ProcessRunner,
                                         analyze_partitioned, default_workers, is_directory, memory_partitions,
                                         plan_partitions, worth_partitioning)
from pdtrace.analysis.registry import Rule
from pdtrace.analysis.slices import window
from pdtrace.analysis.windows import window_size
from pdtrace.errors import UsageError
from pdtrace.trace.model import Trace
from pdtrace.trace.names import names_of
from pdtrace.trace.reader import is_url, open_trace, read_footers, trace_window as reader_window

MODES = ("whole", "partitioned", "windowed")
RUNNERS = ("this process", "processes", "dask")


@dataclass(frozen=True)
class PlanSlice:
    """What one slice reads: the rows of `instances` (empty: every instance of the trace)."""

    instances: tuple[str, ...]
    #: rows of its files per their footers (of every instance in them when `shared`), or of an in-memory trace;
    #: None where unknown before the read (a single-file trace analysed whole)
    rows: int | None
    #: part files read (0: an in-memory trace)
    files: int = 0
    #: its files hold other instances' rows too (read with an instance filter)
    shared: bool = False
    #: events per time window, 0: analysed whole
    window_events: int = 0

    @property
    def windows(self) -> int:
        """About how many windows (the cuts come from a cheap pass over the rows when it runs): rows / window."""
        if not self.window_events or not self.rows:
            return 1
        return max(1, math.ceil(self.rows / self.window_events))

    def as_dict(self) -> dict[str, Any]:
        return {"instances": list(self.instances), "rows": self.rows, "files": self.files, "shared": self.shared,
                "window_events": self.window_events, "windows": self.windows}


@dataclass
class Plan:
    """How an analysis runs (module docstring)."""

    mode: str
    #: why this mode, in words
    why: str
    #: the trace as named (a path, or a loaded trace's path); `source` is what is analysed
    trace: str | None
    #: events the plan reads (footers' rows, a loaded trace's rows), None where unknown before the read
    events: int | None
    slices: list[PlanSlice]
    #: "this process", "processes" or "dask"
    runner: str
    #: worker processes (processes), 1 (this process), 0 (dask: the cluster decides)
    workers: int
    #: rule threads per slice (`pdtrace.analysis.parallel`)
    threads: int
    #: the config as given (None: the defaults, or an AnalysisContext's own)
    config: AnalysisConfig | None = None
    source: Any = field(default=None, repr=False)
    #: the partitioned path's partitions (footers) and the ones analysed
    partitions: PartitionPlan | None = field(default=None, repr=False)
    parts: list[Partition] = field(default_factory=list, repr=False)
    #: `dask=`: a scheduler address or a distributed.Client
    dask: Any = field(default=None, repr=False)

    @property
    def settings(self) -> AnalysisConfig:
        """The config the analysis runs with."""
        if self.config is not None:
            return self.config
        if self.mode == "whole" and isinstance(self.source, AnalysisContext):
            return self.source.config
        return AnalysisConfig()

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready values (`pdtrace analyze --plan --format json`)."""
        config = self.settings
        dask = self.dask if isinstance(self.dask, str) or self.dask is None else type(self.dask).__name__
        return {
            "trace": self.trace, "mode": self.mode, "why": self.why, "events": self.events,
            "runner": {"kind": self.runner, "workers": self.workers, "threads_per_slice": self.threads,
                       "dask": dask},
            "time_window": {"since_ns": config.since_ns, "until_ns": config.until_ns},
            "instances": list(config.instances or []),
            "linked_groups": "re-read after phase 1, where partitions link" if len(self.slices) > 1 else None,
            "slices": [s.as_dict() for s in self.slices],
        }

    def describe(self) -> list[str]:
        """The plan in a few lines of text (`pdtrace analyze --plan`)."""
        config = self.settings
        events = "unknown until read" if self.events is None else f"{self.events:,} events"
        runner = {"this process": "this process", "processes": f"{self.workers} worker processes",
                  "dask": f"Dask cluster {self.as_dict()['runner']['dask']}"}[self.runner]
        lines = [f"trace:   {self.trace} ({events} per the footers)" if self.events is not None and
                 not isinstance(self.source, (Trace, AnalysisContext)) else f"trace:   {self.trace} ({events})",
                 f"mode:    {self.mode} ({self.why})",
                 f"runner:  {runner}, {self.threads} rule thread{'s' if self.threads != 1 else ''} per slice",
                 f"slices:  {len(self.slices)}"]
        if config.instances:
            lines.append(f"only:    {', '.join(config.instances)}")
        if config.since_ns is not None or config.until_ns is not None:
            lines.append(f"window:  ts_ns >= {config.since_ns}, < {config.until_ns} (rows are counted before it)")
        for s in self.slices:
            what = "+".join(s.instances) or "the whole trace"
            rows = "? rows" if s.rows is None else f"{s.rows:,} rows"
            files = f", {s.files} file{'s' if s.files != 1 else ''}" if s.files else ""
            shared = ", files shared with other instances" if s.shared else ""
            how = (f"in windows of {s.window_events:,} events (about {s.windows})" if s.window_events
                   else "whole")
            lines.append(f"  {what}: {rows}{files}{shared}; {how}")
        if len(self.slices) > 1:
            lines.append("then:    linked partitions (cross-instance findings) re-read together, known after the "
                         "slices ran")
        return lines

    def runner_object(self) -> Any:
        """The runner that carries out the partitioned path's tasks (`partitions.LocalRunner`, `ProcessRunner`,
        `distributed.DaskRunner`); the Dask client connects here, not when planning."""
        if self.runner == "dask":
            return DaskRunner.connect(self.dask)
        if self.runner == "processes":
            return ProcessRunner(self.workers)
        return LocalRunner()


def plan_analysis(source: Any, config: AnalysisConfig | None = None, *, dask: Any = None,
                  partitioned: bool | None = None, footers: PartitionPlan | None = None) -> Plan:
    """The plan of an analysis of `source` (a trace path, a loaded Trace or an AnalysisContext): mode, slices,
    runner, from the footers and the config (module docstring). `footers`: the trace's `plan_partitions`, where
    the caller has read it."""
    if dask is not None or partitioned:
        return _partitioned(source, config, dask, None, "asked for" if partitioned and dask is None else
                            "on a Dask cluster")
    if partitioned is None and isinstance(source, (str, os.PathLike)):
        if footers is None and is_directory(source):
            footers = plan_partitions(source)  # footers only; kept for the plan of a whole analysis
        found = worth_partitioning(source, config or AnalysisConfig(), footers) if footers is not None else None
        if found is not None:
            return _partitioned(source, config, None, found, _worth_why(found, config or AnalysisConfig()))
        return _whole(source, config, footers, _whole_why(footers, config or AnalysisConfig()))
    if partitioned is None and isinstance(source, Trace) and window_size(config or AnalysisConfig(), len(source)):
        return _partitioned(source, config, None, None, "a loaded trace above the window size")
    return _whole(source, config, footers, "asked for" if partitioned is False else "a loaded trace")


def _worth_why(found: PartitionPlan, config: AnalysisConfig) -> str:
    parts = [p for p in found.partitions if not config.instances or p.instance in config.instances]
    if parts and window_size(config, max(p.rows for p in parts)):
        return "an instance above the window size"
    return f"several instances, at least {PARTITION_MIN_EVENTS:,} events, none above 3/4 of them"


def _whole_why(footers: PartitionPlan | None, config: AnalysisConfig) -> str:
    """Why a trace path is not worth partitioning (`partitions.worth_partitioning`), in words."""
    if footers is None:
        return "a single file"
    parts = [p for p in footers.partitions if not config.instances or p.instance in config.instances]
    events = sum(p.rows for p in parts)
    if len(parts) < 2:
        return "one instance"
    if events < PARTITION_MIN_EVENTS:
        return f"under {PARTITION_MIN_EVENTS:,} events"
    return "one instance holds more than 3/4 of the events"


def _whole(source: Any, config: AnalysisConfig | None, footers: PartitionPlan | None, why: str) -> Plan:
    if isinstance(source, AnalysisContext):
        trace: Any = source.trace
        settings = config or source.config
    else:
        trace, settings = source, config or AnalysisConfig()
    if isinstance(trace, Trace):
        name, events, files = trace.path, len(trace), 0
    elif isinstance(trace, (str, os.PathLike)):
        name = str(trace)  # the footers where read (a directory, or the CLI's); a single file's rows: at its read
        events = footers.events if footers is not None else None
        files = len(footers.footers.files) if footers is not None else 1
    else:
        raise UsageError(f"analyze() takes a Trace or a path, not {type(trace).__name__}")
    return Plan("whole", why, name, events, [PlanSlice((), events, files)], "this process", 1,
                int(settings.jobs) or default_jobs(), config, source)


def _partitioned(source: Any, config: AnalysisConfig | None, dask: Any, found: PartitionPlan | None,
                 why: str) -> Plan:
    settings = config or AnalysisConfig()
    if isinstance(source, AnalysisContext):
        source = source.trace
    if dask is not None:
        if isinstance(source, Trace):
            raise UsageError("analyze(dask=...) takes a trace path (the cluster reads the trace where it lives), "
                             "not a loaded Trace")
        _distributed()  # without the extra: the install hint now, not after planning
    if not isinstance(source, (Trace, str, os.PathLike)):
        raise UsageError(f"analyze() takes a Trace or a path, not {type(source).__name__}")
    name = source.path if isinstance(source, Trace) else str(source)
    if isinstance(source, Trace):
        parts = memory_partitions(source, settings)
        events = sum(p.rows for p in parts)
    else:
        if dask is not None and not is_url(source):
            source = os.path.abspath(source)  # the workers resolve paths in their own working directory
            found = None
        found = found or plan_partitions(source)
        parts = [p for p in found.partitions if not settings.instances or p.instance in settings.instances]
        events = found.events
    if dask is not None:
        runner, workers, threads = "dask", 0, 1
    elif isinstance(source, Trace) or int(settings.jobs) == 1 or len(parts) <= 1:
        runner, workers, threads = "this process", 1, int(settings.jobs) or default_jobs()
    else:
        workers = int(settings.jobs) or default_workers()
        runner, threads = "processes", ProcessRunner(workers).threads_per_task
    slices = [PlanSlice((p.instance,), p.rows, len(p.files), p.shared, window_size(settings, p.rows))
              for p in parts]
    mode = "windowed" if len(slices) == 1 and slices[0].window_events else "partitioned"
    return Plan(mode, why, name, events, slices, runner, workers, threads, config, source, found, parts, dask)


def run_plan(plan: Plan, rules: Sequence[Rule], notes: list[str],
             progress: Callable[[Any, Any], None] | None = None) -> pd.DataFrame:
    """Carry out the plan with `rules` (`notes`: the rule plugins that failed to load) and return the findings
    (`pdtrace.analyze`'s DataFrame and attrs)."""
    if plan.mode == "whole":
        return _run_whole(plan, rules, notes)
    runner = plan.runner_object()
    try:
        frames, events, trace_notes, parts, windows = analyze_partitioned(
            plan.source, rules, plan.settings, runner, plan.partitions, progress, parts=plan.parts,
            window_events=[s.window_events for s in plan.slices])
    finally:
        getattr(runner, "close", lambda: None)()
    findings = merged(frames, rules, {"rules": [r.id for r in rules], "events": events, "trace": plan.trace,
                                      "warnings": notes, "trace_warnings": trace_notes, "partitions": parts,
                                      "windows": windows,
                                      "window": window_summary(_partitioned_window(plan.source, plan.settings))})
    return named_findings(findings, _names(plan.source))


def _run_whole(plan: Plan, rules: Sequence[Rule], notes: list[str]) -> pd.DataFrame:
    source, config = plan.source, plan.config
    if isinstance(source, AnalysisContext) and config is None and window(source.trace, source.config) is source.trace:
        ctx = source  # reuse the caller's derived tables (plots and exports analyse the same context)
    else:
        if isinstance(source, AnalysisContext):
            config = config or source.config
            source = source.trace
        config = config or AnalysisConfig()
        ctx = AnalysisContext(trace=window(_load(source), config), config=config)
    result = analyze_slice(ctx, rules, int(ctx.config.jobs) or default_jobs())
    findings = merged(result.frames, rules, {"rules": [r.id for r in rules], "events": len(ctx.trace),
                                             "trace": ctx.trace.path, "warnings": notes,
                                             "window": window_summary(trace_window(ctx))})
    return named_findings(findings, names_of(ctx.trace))


def _names(source: Any) -> dict[str, str]:
    """The instances' readable names of a partitioned analysis' trace: the whole trace's footers (what every read
    of it names them by), or an in-memory trace's own."""
    if isinstance(source, Trace):
        return names_of(source)
    from pdtrace.trace.reader import footer_names, read_footers  # the reader's footer pass, for a path only

    return footer_names(read_footers(source))


def _load(source: Any) -> Trace:
    if isinstance(source, Trace):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_trace(source)
    raise UsageError(f"analyze() takes a Trace or a path, not {type(source).__name__}")


def _partitioned_window(source: Any, config: AnalysisConfig) -> Any:
    """The window a partitioned analysis reads (`history.Window`), from what the reader knows: a loaded trace's
    own, else the files' footers and manifest and the config's since_ns (what each partition's reader finds)."""
    if isinstance(source, Trace):
        trace = window(source, config)
        start, how = trace.window_start_ns, trace.window_source
    else:
        footers = read_footers(source)
        start, how = reader_window(footers.manifest, footers.files, footers, config.since_ns)
    return None if start is None else Window(int(start), str(how))
