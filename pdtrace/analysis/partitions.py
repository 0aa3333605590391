"""Partitioned analysis: a multi-instance trace analysed one instance at a time, then joined across instances.

Nearly every rule works per scheduler (instance, dp_rank), so a trace splits by instance. A *partition* is one
instance's rows: its own part files (the recorder writes `TRACE/<instance>/<pid>/part-*.parquet`), or its rows of
files it shares with other instances (read with an instance filter). `plan_partitions` finds them from the footers
alone (the `instance` column's row-group statistics; a file whose statistics span several names has its
`instance` column read to list them).

Phase 1 (`run_partition`, one task per partition, in any order, anywhere): open the partition, run the rules on it
exactly as on a whole trace, and return its findings plus a `LinkSummary`, the little each cross-instance rule
needs from it (what its `Rule.cross_instance.summarize` returns). Two facts of the whole trace are handed to every partition: the analysed span (first and last
`ts_ns`, so "open at the end of the trace" means the same everywhere; `AnalysisContext.span_ns`) and the rules'
configuration.

A rule declares its cross-instance part on its `Rule` (`cross_instance`: `pdtrace.analysis.registry.CrossInstance`,
the subrule, what a partition contributes, how the contributions link partitions); this module names no rule.
What crosses instances in the built-in rules today (grep `remote_instance`, `remote_req`, peer) and what it needs:
- use_after_free `remote_read`: a `remote_read` on the reader (D) names the owner's instance and request (detail
  `remote_instance` / `remote_req`); the finding is a read inside one of the owner's (P's) release gaps. Summary:
  D's reads naming an instance outside D (owner, req, ts), and P's release gaps (req, first and last ts).
- unscheduled_request `stuck_waiting_kv` open at the end of the trace: the decode request's prefill side (req_add
  detail `remote_instance` / `remote_req`) decides severity and evidence (the sender expired the transfer or saw
  the send finish, counted in D's steps after it) and cites the sender's engine failure. Summary: the instances
  outside D that D's open waits name.
- leaked_blocks: a NIXL prefill side's open send (0.22+) is judged by a lease counted from the end of its decode
  side's wait (`leaked_blocks.send_lease`). Summary: whether the partition reported a leak, and the instances its
  requests name as their prefill side.
- (`pdtrace.analysis.story` follows the same links for `show`, not for analyze; no rule estimates clock skew today.)

Phase 2 (`link_groups`): join the summaries, per rule by its `CrossInstance.links`. A read whose (owner, req, ts)
falls inside a gap of another partition (compared on ts, inclusive: a superset of the rule's exact test on global
positions), or an open wait naming another partition, links the two partitions for that rule; linked partitions
form groups (connected components). For each
group the one rule runs again on the group's rows together, which is the whole-trace computation for those
instances (the rule consults only the reader and the owner), and its findings for the group's instances replace
the phase-1 ones. A healthy trace has no links; a buggy one re-reads only the instances involved.
With one partition analysed nothing can link, and its summary is left empty (`PartitionTask.links`).

Combining: per rule, the partitions' findings in partition order; then the order of `pdtrace.analysis.analyze`
(errors first, then time, rule and instance; ties keep each rule's own order, which is the same on a partition as
on the whole trace since request and scheduler codes are numbered by first appearance). The report is that of the
whole-trace analysis (tests/test_partitions.py checks every sample, every scenario and the bench trace).

Where tasks run is a *runner*: in this process one after the other (`LocalRunner`, bounded by the largest
partition), in a pool of worker processes (`ProcessRunner`, bounded by the partitions in flight), or as Dask tasks
(`pdtrace.analysis.distributed.DaskRunner`). Memory of phase 2 is bounded by the largest linked group.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pdtrace.analysis import engine
from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext, trace_span
from pdtrace.analysis.findings import empty_findings
from pdtrace.analysis.parallel import default_jobs, usable_cpus
from pdtrace.analysis.registry import Rule, load_rules, select_rules
from pdtrace.analysis.windows import (MemorySource, PathSource, TimeWindow, analyze_windows, plan_time_windows,
                                      read_time_window, window_size)
from pdtrace.analysis.slices import window
from pdtrace.errors import PdtraceError, TraceError
from pdtrace.trace.model import Trace, dictionary_decoded
from pdtrace.trace.reader import (TraceFooters, column_stats, dataset, footer_names, is_url, location, open_trace,
                                  read_columns, read_footers)

#: Below this many events (footer rows) a multi-instance trace is analysed whole, in this process: partitions
#: would only add the start of the worker processes (about 1 s).
PARTITION_MIN_EVENTS = 2_000_000



# ----------------------------------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Partition:
    """One instance's part of a trace: the files holding its rows (`shared`: they hold other instances' too)."""

    instance: str
    files: tuple[str, ...]
    #: rows of its files per their footers (of every instance in them when shared)
    rows: int
    shared: bool


@dataclass
class PartitionPlan:
    """The partitions of a trace and the whole trace's facts, from the footers only."""

    path: str
    partitions: list[Partition]
    footers: TraceFooters
    #: (first, last) ts_ns of the whole trace per the row-group statistics; None when a file has none
    stats_span: tuple[int, int] | None

    @property
    def instances(self) -> list[str]:
        return [p.instance for p in self.partitions]

    @property
    def events(self) -> int:
        return sum(f.rows for f in self.footers.files)

    @property
    def warnings(self) -> list[str]:
        """The footers' notes and skipped files, one line each (as `Trace.warnings` starts)."""
        return list(self.footers.notes) + [f"{s.path}: skipped: {s.reason}" for s in self.footers.skipped]


def file_instances(path: str, metadata: pq.FileMetaData) -> list[str]:
    """The instances a part file holds: its `instance` statistics when every row group names one and the same
    instance (the recorder's layout), else the distinct values of its `instance` column (one column read)."""
    stats = column_stats(metadata, "instance")
    if stats is not None and stats:
        names = {v for pair in stats for v in pair}
        if len(names) == 1:
            name = names.pop()
            return [name.decode() if isinstance(name, bytes) else str(name)]
    if metadata.num_rows == 0:
        return []
    column = dictionary_decoded(read_columns(path, ["instance"]).column("instance"))
    return sorted(str(v) for v in pc.unique(column).drop_null().to_pylist())


def plan_partitions(path: str | os.PathLike[str]) -> PartitionPlan:
    """Read and check the trace's footers (`pdtrace.trace.reader.read_footers`: bad schema, unknown version or
    nothing readable raise TraceError) and list its partitions in the order their first rows load."""
    footers = read_footers(path)
    by_instance: dict[str, list[str]] = {}
    rows: dict[str, int] = {}
    shared: set[str] = set()
    lows, highs = [], []
    for file in footers.files:
        metadata = footers.metadata[file.path]
        names = file_instances(file.path, metadata)
        for name in names:
            by_instance.setdefault(name, []).append(file.path)
            rows[name] = rows.get(name, 0) + file.rows
            if len(names) > 1:
                shared.add(name)
        ts = column_stats(metadata, "ts_ns")
        if ts is None and metadata.num_rows:
            lows.append(None)
        for low, high in ts or []:
            lows.append(low)
            highs.append(high)
    stats_span = None if not lows or None in lows else (int(min(lows)), int(max(highs)))
    partitions = [Partition(name, tuple(files), rows[name], name in shared) for name, files in by_instance.items()]
    return PartitionPlan(str(path), partitions, footers, stats_span)


def is_directory(path: str | os.PathLike[str]) -> bool:
    """Whether a trace location (local path or URL) is a directory of part files rather than one file."""
    fs, inner = location(path)
    if fs is None:
        return Path(path).is_dir()
    return fs.get_file_info(inner).type == pafs.FileType.Directory


def analysed_span(plan: PartitionPlan, partitions: Sequence[Partition], config: AnalysisConfig) -> tuple[int, int]:
    """(first, last) ts_ns of the rows the analysis reads: the statistics when they are exact for it (no time
    window, no file shared with an instance left out), else one pass over the `ts_ns` column (and `instance` where
    files are shared) of those files, with the window pushed down."""
    everything = len(partitions) == len(plan.partitions)
    if (config.since_ns is None and config.until_ns is None and plan.stats_span is not None
            and (everything or not any(p.shared for p in partitions))):
        lows, highs = [], []
        for name in sorted({f for p in partitions for f in p.files}):
            for low, high in column_stats(plan.footers.metadata[name], "ts_ns") or []:
                lows.append(low)
                highs.append(high)
        return (int(min(lows)), int(max(highs))) if lows else (0, 0)
    files = sorted({f for p in partitions for f in p.files})
    expression = None
    if not everything and any(p.shared for p in partitions):
        expression = ds.field("instance").isin([p.instance for p in partitions])
    if config.since_ns is not None:
        part = ds.field("ts_ns") >= int(config.since_ns)
        expression = part if expression is None else expression & part
    if config.until_ns is not None:
        part = ds.field("ts_ns") < int(config.until_ns)
        expression = part if expression is None else expression & part
    low, high = None, None
    try:
        for batch in dataset(files).to_batches(columns=["ts_ns"], filter=expression):
            if batch.num_rows:
                bounds = pc.min_max(batch.column(0)).as_py()
                low = bounds["min"] if low is None else min(low, bounds["min"])
                high = bounds["max"] if high is None else max(high, bounds["max"])
    except (OSError, pa.ArrowException) as exc:
        raise TraceError(f"{plan.path}: cannot read the ts_ns column ({' '.join(str(exc).split())[:160]})") from None
    return (int(low), int(high)) if low is not None else (0, 0)


#: The kinds whose detail names another instance (`remote_instance`): the reader's remote_read and a decode-side
#: req_add, what the built-in rules' cross-instance links follow.
_LINK_KINDS = ("remote_read", "req_add")
_REMOTE_INSTANCE = r'"remote_instance"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"'


def instance_links(plan: PartitionPlan) -> set[tuple[str, str]]:
    """(instance, the instance its detail names) for every remote_read and req_add row that names one: the links
    the rules' cross-instance parts follow. Reads two columns of the rows of those two kinds (a filter on `kind` handed to the
    Parquet reader, which skips row groups by their statistics), and matches `remote_instance` in the JSON text
    with a vectorised regular expression; only the distinct names are decoded.
    A file that cannot be read here is left to the reader, which skips it with a warning."""
    pairs: set[tuple[str, str]] = set()
    kinds = pa.array(_LINK_KINDS)
    for file in plan.footers.files:
        try:
            fs, inner = location(file.path)
            table = pq.read_table(inner, columns=["instance", "detail"], filesystem=fs,
                                  filters=ds.field("kind").isin(kinds))
        except (OSError, pa.ArrowException):
            continue
        detail = dictionary_decoded(table.column("detail"))
        named = pc.match_substring(detail, "remote_instance")
        table, detail = table.filter(named), detail.filter(named)
        if not table.num_rows:
            continue
        found = pc.extract_regex(detail, _REMOTE_INSTANCE)
        both = pa.table({"instance": dictionary_decoded(table.column("instance")),
                         "name": pc.struct_field(found, "name")}).drop_null()
        for row in both.group_by(["instance", "name"]).aggregate([]).to_pylist():
            try:
                name = json.loads(f'"{row["name"]}"')
            except ValueError:
                continue
            pairs.add((str(row["instance"]), str(name)))
    return pairs


def linked_instances(plan: PartitionPlan, instances: Iterable[str]) -> list[str]:
    """The instances, other than `instances`, that a finding on one of `instances` can depend on: those they name
    as their peer (remote_instance) and those naming them. One hop is enough: a cross-instance finding consults
    only the reader and the owner (see the module docstring)."""
    mine = set(instances)
    linked = {other for pair in instance_links(plan) if mine & set(pair) for other in pair}
    return sorted((linked - mine) & set(plan.instances))


def instance_partitions(plan: PartitionPlan, instances: Sequence[str], with_links: bool = False) -> list[Partition]:
    """The partitions of `instances`, with `with_links` also those of their `linked_instances` (what
    `open_instances` reads)."""
    chosen = set(instances)
    if with_links and any(p.instance in chosen for p in plan.partitions):
        chosen |= set(linked_instances(plan, chosen))
    return [p for p in plan.partitions if p.instance in chosen]


def open_instances(path: str | os.PathLike[str], instances: Sequence[str], columns: Iterable[str] | None = None,
                   with_links: bool = False, plan: PartitionPlan | None = None
                   ) -> tuple[Trace | None, tuple[int, int] | None, PartitionPlan]:
    """(the rows of `instances` only, read from their partitions' files; the whole trace's span per the footers,
    so times stay relative to the trace start; the plan). The trace is None when none of them is in the trace.
    `with_links`: also the rows of their `linked_instances`, so that findings on `instances` are those of the
    whole trace (the caller shows only `instances`). `plan`: the trace's, where the caller has read it."""
    plan = plan_partitions(path) if plan is None else plan
    wanted = instance_partitions(plan, instances, with_links)
    if not wanted:
        return None, plan.stats_span, plan
    files = sorted({f for p in wanted for f in p.files})
    trace = open_trace(path, columns=columns, instances=[p.instance for p in wanted] if any(p.shared for p in wanted)
                       else None, warn=False, only_files=files)
    trace.instance_names = footer_names(plan.footers)  # the whole trace's names, not those of the files read
    span = plan.stats_span or analysed_span(plan, plan.partitions, AnalysisConfig())
    return trace, span, plan


def open_window(path: str | os.PathLike[str], instances: Sequence[str], since_ns: int | None, until_ns: int | None,
                config: AnalysisConfig, with_links: bool = False, plan: PartitionPlan | None = None,
                check: Callable[[int], None] | None = None) -> tuple[Trace | None, TimeWindow | None]:
    """The rows of the time window [since_ns, until_ns) of `instances` (all where empty; `with_links` as
    `open_instances`), read as the windowed analysis reads a window (`pdtrace.analysis.windows.plan_time_windows`):
    from the oldest request or step open at since_ns, at most the lookback before it, with the carried requests'
    own rows. One plan covers the chosen partitions' files (a request id that several instances use gets the
    union of their spans: a few more rows, never fewer). `check(rows)`: called with at most how many rows the read
    holds, before it reads them (a memory check). The trace is None when none of `instances` is in the trace; it
    is marked as starting mid-run where it does, and the TimeWindow says where it ends (`window_end`)."""
    pieces = open_window_pieces(path, instances, since_ns, until_ns, config, with_links, plan, check)
    if pieces is None:
        return None, None
    (window, read), = pieces
    return read(), window


def open_window_pieces(path: str | os.PathLike[str], instances: Sequence[str], since_ns: int | None,
                       until_ns: int | None, config: AnalysisConfig, with_links: bool = False,
                       plan: PartitionPlan | None = None, check: Callable[[int], None] | None = None,
                       piece_events: int = 0) -> list[tuple[TimeWindow, Callable[[], Trace]]] | None:
    """`open_window`'s window planned in pieces of about `piece_events` events (one piece where 0), each with a
    call that reads its rows (`windows.read_time_window`), so that a caller holds one piece at a time. `check`
    gets the largest piece's rows. None when none of `instances` is in the trace."""
    plan = plan_partitions(path) if plan is None else plan
    wanted = instance_partitions(plan, instances, with_links) if instances else plan.partitions
    if not wanted:
        return None
    files = sorted({f for p in wanted for f in p.files})
    chosen = [p.instance for p in wanted] if len(wanted) < len(plan.partitions) and any(
        p.shared for p in wanted) else None
    source = PathSource(str(path), chosen, files, config)
    windows = plan_time_windows(source, since_ns, until_ns, config, piece_events)
    if check is not None:
        check(max(w.rows for w in windows))
    names = footer_names(plan.footers)
    return [(w, lambda w=w: _noted(read_time_window(source, w), source.warnings, names)) for w in windows]


def _noted(trace: Trace, notes: list[str], names: dict[str, str] | None = None) -> Trace:
    """The trace with `notes` (its source's: files the plan could not decode, which no window reads) first among
    its warnings, and the whole trace's instance names (`names`, where given)."""
    trace.warnings = [*notes, *(w for w in trace.warnings if w not in notes)]
    if names is not None:
        trace.instance_names = names
    return trace


# ----------------------------------------------------------------------------------------------------- phase 1

@dataclass
class LinkSummary:
    """What phase 2 needs from one partition (see the module docstring): per rule with a cross-instance part that
    ran on it, what that part's `CrossInstance.summarize` returned (none: nothing of it can link)."""

    instances: tuple[str, ...]
    #: rule id -> its CrossInstance summary of this partition
    parts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PartitionTask:
    """One unit of work: the rows of `instances` (from `files`, or a whole in-memory `trace`), the rules to run."""

    path: str | None
    instances: tuple[str, ...]
    files: tuple[str, ...] | None
    filter_instances: bool
    rules: tuple[str | Rule, ...]
    config: AnalysisConfig
    span_ns: tuple[int, int]
    summaries: bool = True
    #: whether other partitions are analysed with it: with none, nothing links and its LinkSummary is left empty
    #: (the summary parses every req_add's detail: ~0.4 s a 5M-event window of bench/long_trace.py)
    links: bool = True
    #: rows of its files per the footers: the runners start the largest tasks first (shorter makespan)
    rows: int = 0
    #: an in-memory trace (LocalRunner only): the partition is its rows of `instances`
    trace: Trace | None = field(default=None, compare=False)
    #: called per analysed window of a windowed partition, in the process that runs it (LocalRunner only)
    progress: Any = field(default=None, compare=False)
    #: events per window (`pdtrace.analysis.windows`), 0 to analyse the partition whole: decided once by the plan
    #: (`pdtrace.analysis.plan`); None (a task made by hand): from its rows (`task_window_events`)
    window_events: int | None = None

    @property
    def name(self) -> str:
        return "+".join(self.instances)


@dataclass
class PartitionResult:
    instances: tuple[str, ...]
    events: int
    #: per rule of the task, its checked findings
    frames: list[pd.DataFrame]
    warnings: list[str]
    summary: LinkSummary | None
    seconds: float
    #: windows the partition was analysed in (`pdtrace.analysis.windows`; 1: whole), and requests carried alone
    windows: int = 1
    carried: int = 0


def _resolve(rules: Iterable[str | Rule]) -> list[Rule]:
    """A task's rules as Rule objects (ids travel to workers: `_portable`): `registry.select_rules`."""
    return select_rules(list(rules))


def _load_partition(task: PartitionTask) -> Trace:
    if task.trace is not None:

        return window(task.trace, replace(task.config, instances=task.instances))
    return open_trace(task.path, instances=list(task.instances) if task.filter_instances else None,  # type: ignore
                      since_ns=task.config.since_ns, until_ns=task.config.until_ns, warn=False,
                      only_files=task.files, keep_config=True)


def run_partition(task: PartitionTask) -> PartitionResult:
    """Phase 1 (or a phase-2 group): the task's rows analysed as one slice (`engine.analyze_slice`), or window by
    window where its plan says so (`PartitionTask.window_events`), and summarised."""
    start = time.perf_counter()
    rules = _resolve(task.rules)
    every = task_window_events(task)
    if every:
        return _run_windowed(task, rules, every)
    trace = _load_partition(task)
    ctx = AnalysisContext(trace=trace, config=task.config, span_ns=task.span_ns)
    # engine's, looked up at each call (tests/test_plan.py counts the calls through it)
    result = engine.analyze_slice(ctx, rules, max(1, int(task.config.jobs)),
                           summarize=_summary(task, rules) if task.summaries else None)
    return PartitionResult(task.instances, len(trace), result.frames, list(trace.warnings), result.summary,
                           time.perf_counter() - start)


def task_window_events(task: PartitionTask) -> int:
    """Events per window of the task's partition, 0 to analyse it whole: the plan's (`PartitionTask.
    window_events`); for a task made without one, `window_size` of its rows (the footers' of its files, or an
    in-memory trace's rows of its instances). Linked groups (phase 2) are analysed whole."""
    if not task.summaries:
        return 0
    if task.window_events is not None:
        return int(task.window_events)
    return window_size(task.config, task.rows if task.trace is None else len(_load_partition(task)))


def _run_windowed(task: PartitionTask, rules: Sequence[Rule], every: int) -> PartitionResult:
    """A partition analysed window by window (`pdtrace.analysis.windows`) in windows of `every` events: one read
    from files is never loaded whole; an in-memory trace's rows are windowed where they are."""

    start = time.perf_counter()
    source: Any = MemorySource(_load_partition(task)) if task.trace is not None else PathSource(
        str(task.path), task.instances if task.filter_instances else None, task.files, task.config)
    result = analyze_windows(source, rules, task.config, task.span_ns, "+".join(task.instances), every,
                             progress=task.progress,
                             summarize=_summary(task, rules))
    return PartitionResult(task.instances, result.events, frames=result.frames, warnings=result.warnings,
                           summary=merged_summaries(result.summaries, task.instances, rules),
                           seconds=time.perf_counter() - start, windows=result.windows, carried=result.carried)


def _summary(task: PartitionTask, rules: Sequence[Rule]) -> Callable[[AnalysisContext, Sequence[pd.DataFrame]],
                                                                      LinkSummary]:
    """How the task's partition (or window) is summarised: `link_summary`, or, with no other partition to link to,
    an empty summary."""
    if task.links:
        return lambda ctx, frames: link_summary(ctx, rules, frames, task.instances)
    return lambda ctx, frames: _no_links(task.instances)


def _no_links(instances: Sequence[str]) -> LinkSummary:
    return LinkSummary(tuple(instances), {})


def merged_summaries(summaries: Sequence[LinkSummary], instances: Sequence[str], rules: Sequence[Rule] = ()
                     ) -> LinkSummary:
    """One partition's LinkSummary from its windows': per rule, its windows' summaries merged by its
    `CrossInstance.merge` (in window order)."""
    by_id = {rule.id: rule for rule in rules if rule.cross_instance is not None}
    parts: dict[str, Any] = {}
    for rule_id in dict.fromkeys(k for s in summaries for k in s.parts):
        mine = [s.parts[rule_id] for s in summaries if rule_id in s.parts]
        rule = by_id.get(rule_id) or _resolve([rule_id])[0]
        parts[rule_id] = rule.cross_instance.merge(mine)  # type: ignore[union-attr]
    return LinkSummary(tuple(instances), parts)


def link_summary(ctx: AnalysisContext, rules: Sequence[Rule], frames: Sequence[pd.DataFrame],
                 instances: Sequence[str]) -> LinkSummary:
    """The partition's `LinkSummary`: each rule's `CrossInstance.summarize` of its own findings (`frames`, one per
    rule of `rules`)."""
    mine = frozenset(instances)
    parts = {rule.id: rule.cross_instance.summarize(ctx, frame, mine)
             for rule, frame in zip(rules, frames) if rule.cross_instance is not None}
    return LinkSummary(tuple(instances), parts)


# ----------------------------------------------------------------------------------------------------- phase 2

def link_groups(summaries: Sequence[LinkSummary], rules: Sequence[Rule] | None = None
                ) -> dict[str, list[tuple[str, ...]]]:
    """Per rule with a cross-instance part, the groups of partitions whose findings of that rule depend on each
    other (connected components of the pairs its `CrossInstance.links` returns; only groups of two or more). See
    the module docstring. `rules`: those that ran (None: the registered ones); a partition without a rule's
    summary is handed to its `links` as None."""
    chosen = [rule for rule in (load_rules_quietly().values() if rules is None else rules)
              if rule.cross_instance is not None]
    links: dict[str, set[tuple[int, int]]] = {}
    for rule in chosen:
        parts = [(s.instances, s.parts.get(rule.id)) for s in summaries]
        links[rule.id] = set() if all(part is None for _, part in parts) else \
            {(int(a), int(b)) for a, b in rule.cross_instance.links(parts)}  # type: ignore[union-attr]
    out: dict[str, list[tuple[str, ...]]] = {}
    for rule, pairs in links.items():
        parent = list(range(len(summaries)))

        def root(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a, b in pairs:
            parent[root(a)] = root(b)
        members: dict[int, list[int]] = {}
        for a, b in pairs:
            for x in (a, b):
                members.setdefault(root(x), [])
                if x not in members[root(x)]:
                    members[root(x)].append(x)
        groups = [tuple(inst for x in sorted(m) for inst in summaries[x].instances) for m in members.values()
                  if len(m) > 1]
        if groups:
            out[rule] = sorted(groups)
    return out


def combine(rule_ids: Sequence[str], results: Sequence[PartitionResult],
            reruns: Sequence[tuple[str, tuple[str, ...], PartitionResult]]) -> list[pd.DataFrame]:
    """Per rule, the partitions' findings in partition order; a linked group's findings of the rule are those of
    its re-run (the whole-trace computation for the group's instances), in the group's place."""
    out = []
    for index, rule in enumerate(rule_ids):
        frames = [r.frames[index] for r in results]
        for rerun_rule, group, result in reruns:
            if rerun_rule != rule:
                continue
            members = set(group)
            at = next(i for i, r in enumerate(results) if set(r.instances) & members)
            frames = [f[~f["instance"].isin(members)] for f in frames]
            frames.insert(at, result.frames[0])
        frames = [f for f in frames if len(f)]
        out.append(pd.concat(frames, ignore_index=True) if frames else _empty())
    return out


def _empty() -> pd.DataFrame:
    return empty_findings()


# ----------------------------------------------------------------------------------------------------- runners

Progress = Callable[[PartitionTask, PartitionResult], None]


class LocalRunner:
    """Tasks one after the other in this process: memory bounded by the largest partition. Each runs its rules on
    `AnalysisConfig.jobs` threads (`pdtrace.analysis.parallel`)."""

    threads_per_task = None

    def run(self, tasks: Sequence[PartitionTask]) -> Iterator[tuple[int, PartitionResult]]:
        for index, task in enumerate(tasks):
            yield index, run_partition(task)


class ProcessRunner:
    """Tasks in a pool of `workers` processes (forkserver: a clean interpreter, not a copy of this one); at most
    `workers` partitions in flight, so memory is bounded by the largest `workers` of them."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, int(workers))
        #: the CPUs shared out between the workers (threads for each one's rules)
        self.threads_per_task = max(1, default_workers() // self.workers)

    def run(self, tasks: Sequence[PartitionTask]) -> Iterator[tuple[int, PartitionResult]]:
        # The initializer is pdtrace.malloc's own (standard library only): a worker unpickles it, and so imports its
        # module, before it runs it, and this module would bring numpy and pyarrow, whose threads take arenas of
        # their own first (see pdtrace.malloc). Under `python -m pdtrace` nothing else is imported before it; under
        # the `pdtrace` script the worker re-imports the script, and with it pdtrace.cli, which does the same.
        from pdtrace.malloc import single_arena

        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        with ProcessPoolExecutor(max_workers=min(self.workers, len(tasks)) or 1, mp_context=context,
                                 initializer=single_arena) as pool:
            largest_first = sorted(range(len(tasks)), key=lambda i: -tasks[i].rows)
            futures: dict[Future, int] = {pool.submit(run_partition, tasks[i]): i for i in largest_first}
            try:
                pending = set(futures)
                while pending:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in sorted(finished, key=futures.__getitem__):
                        index = futures[future]
                        try:
                            yield index, future.result()
                        except BrokenProcessPool:
                            raise PdtraceError(f"a worker process died while analysing {tasks[index].name} (out "
                                               "of memory? try fewer --jobs)") from None
            finally:
                for future in futures:
                    future.cancel()


def default_workers() -> int:
    """One worker process per CPU this process may run on (`parallel.usable_cpus`)."""
    return usable_cpus()


# ----------------------------------------------------------------------------------------------------- driver

def analyze_partitioned(source: str | os.PathLike[str] | Trace, rules: Sequence[Rule], config: AnalysisConfig,
                        runner: Any, plan: PartitionPlan | None = None,
                        progress: Progress | None = None, parts: Sequence[Partition] | None = None,
                        window_events: Sequence[int] | None = None) -> tuple[list[pd.DataFrame], int, list[str], list[str],
                                                                   dict[str, dict[str, int]]]:
    """(findings per rule, events analysed, trace warnings, partitions, {instance: windows and carried requests} of
    the partitions analysed window by window) of `rules` on the trace, partition by partition on the runner (see
    the module docstring). `parts`: the partitions to analyse, as the plan (`pdtrace.analysis.plan`) chose them
    (default: those of `config.instances`); `window_events`: per partition of `parts`, the plan's events per
    window, 0 to analyse it whole (default: `windows.window_size` of its rows, what the plan decides)."""
    rule_refs: tuple[str | Rule, ...] = tuple(_portable(rule) for rule in rules)
    threads = getattr(runner, "threads_per_task", None) or int(config.jobs) or default_jobs()
    task_config = replace(config, jobs=int(threads))
    if isinstance(source, Trace):
        parts = memory_partitions(source, config) if parts is None else parts
        span = _memory_span(source, config)
        base = dict(path=source.path, files=None, filter_instances=True, trace=source)
        warnings: list[str] = list(source.warnings)
    else:
        if getattr(runner, "remote", False) and not is_url(source) and not os.path.isabs(source):
            source = os.path.abspath(source)  # the workers resolve paths in their own working directory
            plan, parts, window_events = None, None, None
        plan = plan or plan_partitions(source)
        if parts is None:
            parts = [p for p in plan.partitions if not config.instances or p.instance in config.instances]
        span = analysed_span(plan, parts, config)
        base = dict(path=str(source), trace=None)
        warnings = plan.warnings
    local = isinstance(runner, LocalRunner)  # per-window progress reaches back only from this process
    if window_events is None:
        window_events = [window_size(task_config, p.rows) for p in parts]
    tasks = [PartitionTask(instances=(p.instance,), rules=rule_refs, config=task_config, span_ns=span, rows=p.rows,
                           links=len(parts) > 1, progress=progress if local else None,
                           window_events=every, **_files_of([p], base))
             for p, every in zip(parts, window_events)]
    results: list[PartitionResult | None] = [None] * len(tasks)
    for index, result in runner.run(tasks):
        results[index] = result
        if progress is not None:
            progress(tasks[index], result)
    done = [r for r in results if r is not None]
    groups = link_groups([r.summary for r in done], rules)  # type: ignore[misc]
    by_rule = {rule.id: rule for rule in rules}
    rerun_tasks, rerun_keys = [], []
    for rule_id, rule_groups in groups.items():
        if rule_id not in by_rule:
            continue
        for group in rule_groups:
            members = [p for p in parts if p.instance in group]
            rerun_tasks.append(PartitionTask(instances=tuple(p.instance for p in members),
                                             rules=(_portable(by_rule[rule_id]),), config=task_config,
                                             span_ns=span, summaries=False, rows=sum(p.rows for p in members),
                                             **_files_of(members, base)))
            rerun_keys.append((rule_id, tuple(p.instance for p in members)))
    reruns = []
    for index, result in runner.run(rerun_tasks) if rerun_tasks else ():
        reruns.append((rerun_keys[index][0], rerun_keys[index][1], result))
        if progress is not None:
            progress(rerun_tasks[index], result)
    reruns.sort(key=lambda item: rerun_keys.index((item[0], item[1])))
    for result in done:
        warnings.extend(w for w in result.warnings if w not in warnings)
    frames = combine([rule.id for rule in rules], done, reruns)
    windows = {r.instances[0]: {"windows": r.windows, "carried": r.carried} for r in done if r.windows > 1}
    return frames, sum(r.events for r in done), warnings, [p.instance for p in parts], windows


def worth_partitioning(path: str | os.PathLike[str], config: AnalysisConfig,
                       plan: PartitionPlan | None = None) -> PartitionPlan | None:
    """The plan when the trace at `path` is worth analysing by partitions by default: an instance with more than
    `config.window_events` events (analysed window by window, `pdtrace.analysis.windows`); or several instances, at
    least PARTITION_MIN_EVENTS events, and no instance with more than three quarters of them (else the largest partition
    costs about what the whole does, and one process with threads is faster). None otherwise. `plan`: the trace's,
    when the caller has it already."""
    if not is_directory(path):
        return None
    plan = plan or plan_partitions(path)
    parts = [p for p in plan.partitions if not config.instances or p.instance in config.instances]
    events = sum(p.rows for p in parts)
    if parts and window_size(config, max(p.rows for p in parts)):
        return plan  # an instance too large to analyse whole: its partition goes window by window
    if len(parts) < 2 or events < PARTITION_MIN_EVENTS or max(p.rows for p in parts) > 0.75 * events:
        return None
    return plan


def load_rules_quietly() -> dict[str, Rule]:
    """The registered rules, a plugin that fails to load left out (as `analyze` reports it, not here)."""
    return load_rules(errors=[])


def _portable(rule: Rule) -> str | Rule:
    """A registered rule travels by id (workers load it from the registry), any other Rule object as itself."""
    return rule.id if load_rules(errors=[]).get(rule.id) is rule else rule


def _files_of(parts: Sequence[Partition], base: dict[str, Any]) -> dict[str, Any]:
    if base.get("trace") is not None:
        return dict(base)
    files = tuple(sorted({f for p in parts for f in p.files}))
    return dict(base, files=files, filter_instances=any(p.shared for p in parts))


def memory_partitions(trace: Trace, config: AnalysisConfig) -> list[Partition]:
    """An in-memory trace's partitions: its instances in order of first appearance (those of `config.instances`),
    each with its rows inside the config's time window (what its task analyses; 0 where none)."""
    column = dictionary_decoded(trace.table.column("instance"))
    names = [str(v) for v in pc.unique(column).drop_null().to_pylist()]  # in order of first appearance
    shown = dictionary_decoded(window(trace, config).table.column("instance"))
    rows = {str(c["values"]): int(c["counts"]) for c in pc.value_counts(shown).to_pylist()} if len(shown) else {}
    return [Partition(name, (), rows.get(name, 0), True) for name in names
            if not config.instances or name in config.instances]


def _memory_span(trace: Trace, config: AnalysisConfig) -> tuple[int, int]:
    return trace_span(AnalysisContext(trace=window(trace, config)))


def __getattr__(name: str) -> Any:
    """`CROSS_SUBRULES` ({rule id: its cross-instance subrule}), the table the rules with a cross-instance part were
    listed in before each declared it on its `Rule` (`Rule.cross_instance`), built from the registered rules. Kept
    for one release for code written against it; read `Rule.cross_instance`."""
    if name == "CROSS_SUBRULES":
        return {r.id: r.cross_instance.subrule for r in load_rules_quietly().values() if r.cross_instance is not None}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
