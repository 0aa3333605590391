"""`pdtrace info TRACE`: what a trace holds (instances, processes, ranks, time span, kinds, steps, requests).

The numbers come from `pdtrace.trace.summary.summarize`; this module only loads the trace and renders them.
`--format json` prints summarize()'s dict, whose keys are stable (documented in full in pdtrace/trace/summary.py):
trace, events, files, skipped_files [{path, reason}], dropped_events, sources, schema_versions, pdtrace_versions,
time {start_ns, end_ns, duration_ns, start, end}, instances [{instance, name, roles, pids, dp_ranks, pp_ranks,
tp_ranks, events, requests}], schedulers [{instance, name, dp_rank, steps, sched_events, first_step, last_step}]
(`instance` is vLLM's id, `name` the readable name every other verb prints, `pdtrace.trace.names`), kinds {kind: rows},
requests, manifest {command, vllm_version, vllm_table, created} or null, warnings.

Which rows are read: a trace under PARTITION_MIN_EVENTS events (or one file) is loaded whole, as always. A larger
trace is summarised from its Parquet footers alone (`summarize_footers`: row counts, statistics, metadata;
`rows_read` false): `kinds`, `requests`, `schedulers` and per-instance `requests` are then null, and the table
says "-" for them and how to get them. `--rows` reads the rows, one instance at a time and an instance's files in
groups of at most a window's events (`analysis.windows.DEFAULT_WINDOW_EVENTS`; the summaries merged, requests
counted over the groups: the memory of a group, not of an instance of hours). `--instance NAME` (repeatable)
summarises only those instances (by readable name or vLLM's id), reading only their part files, in the same groups.

Warnings found while loading (skipped part files, unknown kinds, a bad manifest) go to stderr, one line each;
unreadable input is a one-line error and exit status 2.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import typer
from rich.table import Table

from pdtrace.cli.app import (InstanceOption, TraceArgument, app, err_console, load_trace, no_such_instances,
                             out_console)
from pdtrace.format import COLUMNS
from pdtrace.trace.names import resolve_instances
from pdtrace.trace.reader import footer_names, read_footers


class InfoFormat(str, Enum):
    table = "table"
    json = "json"


def _ns_duration(ns: int | None) -> str:
    if ns is None:
        return "-"
    if ns >= 1_000_000_000:
        return f"{ns / 1e9:.3f} s"
    if ns >= 1_000_000:
        return f"{ns / 1e6:.3f} ms"
    return f"{ns / 1e3:.3f} µs"


def _join(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values) if values else "-"


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _render(summary: dict[str, Any]) -> None:
    span = summary["time"]
    overview = Table(title=f"pdtrace trace {summary['trace'] or '<memory>'}", show_header=False, box=None)
    overview.add_column("key", style="bold")
    overview.add_column("value")
    overview.add_row("events", f"{summary['events']:,}")
    overview.add_row("files", f"{summary['files']} loaded, {len(summary['skipped_files'])} skipped")
    overview.add_row("dropped events", f"{summary['dropped_events']:,}")
    overview.add_row("requests", _count(summary["requests"]))
    overview.add_row("start", _dash(span["start"]))
    overview.add_row("end", _dash(span["end"]))
    overview.add_row("duration", _ns_duration(span["duration_ns"]))
    overview.add_row("sources", _join(summary["sources"]))
    overview.add_row("schema versions", _join(summary["schema_versions"]))
    overview.add_row("pdtrace versions", _join(summary["pdtrace_versions"]))
    manifest = summary["manifest"]
    if manifest is not None:
        overview.add_row("command", _dash(manifest["command"]))
        overview.add_row("vLLM version", _dash(manifest["vllm_version"]))
        overview.add_row("vLLM hook table", _dash(manifest["vllm_table"]))
    out_console.print(overview)

    instances = Table(title="instances")
    # the readable name, and vLLM's id where it is another (how vLLM's logs call the instance)
    ids = any(row.get("name", row["instance"]) != row["instance"] for row in summary["instances"])
    longest = max((len(row.get("name", row["instance"])) for row in summary["instances"]), default=8)
    instances.add_column("instance", min_width=min(longest, 40))
    if ids:
        instances.add_column("vLLM id", min_width=min(max(len(row["instance"]) for row in summary["instances"]), 40))
    for name in ("role", "pids", "dp", "pp", "tp"):
        instances.add_column(name)
    instances.add_column("events", justify="right")
    instances.add_column("requests", justify="right")
    for row in summary["instances"]:
        instances.add_row(row.get("name", row["instance"]), *([row["instance"]] if ids else []),
                          *(_join(row[k]) if row[k] is not None else "?" for k in
                            ("roles", "pids", "dp_ranks", "pp_ranks", "tp_ranks")),
                          _count(row["events"]), _count(row["requests"]))
    out_console.print(instances)

    if summary["schedulers"]:
        schedulers = Table(title="schedulers")
        for name in ("instance", "dp rank", "steps", "sched events", "first step", "last step"):
            schedulers.add_column(name, justify="left" if name == "instance" else "right")
        for row in summary["schedulers"]:
            schedulers.add_row(row.get("name", row["instance"]), _dash(row["dp_rank"]), f"{row['steps']:,}",
                               f"{row['sched_events']:,}", _dash(row["first_step"]), _dash(row["last_step"]))
        out_console.print(schedulers)

    if summary["kinds"] is not None:
        kinds = Table(title="events per kind")
        kinds.add_column("kind")
        kinds.add_column("events", justify="right")
        for kind, count in summary["kinds"].items():
            kinds.add_row(kind, f"{count:,}")
        out_console.print(kinds)
    if not summary.get("rows_read", True):
        out_console.print("from the Parquet footers only: events per kind, requests and scheduler steps need the "
                          "rows (--rows reads them, one instance at a time)", markup=False)

    if summary["skipped_files"]:
        skipped = Table(title="skipped files")
        skipped.add_column("file")
        skipped.add_column("reason")
        for row in summary["skipped_files"]:
            skipped.add_row(row["path"], row["reason"])
        out_console.print(skipped)


def _read_summary(trace: Any, partitions: list[Any], footers: Any, columns: list[str]) -> dict[str, Any]:
    """The summary of the partitions' rows, read one partition at a time and a partition's files in groups of at
    most a window's events (an instance of hours does not fit in memory), merged."""
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.windows import DEFAULT_WINDOW_EVENTS
    # lazy: pdtrace --help loads no summary code (CLI start-up)
    from pdtrace.trace.summary import file_groups, merge_summaries, request_names, summarize

    parts, names = [], {}  # type: ignore[var-annotated]
    rows_of = {f.path: f.rows for f in footers.files}
    for part in partitions:
        for group in file_groups(list(part.files), rows_of, DEFAULT_WINDOW_EVENTS):
            loaded = load_trace(trace, columns=columns, instances=[part.instance] if part.shared else None,
                                only_files=group)
            parts.append(summarize(loaded))
            for name, seen in request_names(loaded).items():
                names.setdefault(name, set()).update(seen)
            del loaded
    return merge_summaries(parts, footers, names)


@app.command()
def info(
    trace: TraceArgument,
    output_format: InfoFormat = typer.Option(InfoFormat.table, "--format", "-f", help="table (default) or json."),
    instance: InstanceOption = None,
    rows: bool = typer.Option(False, "--rows", help="Read every row, one instance at a time, also on a large trace "
                              "(default there: the Parquet footers only)."),
) -> None:
    """Summarise a trace: instances, roles, processes, ranks, time span, events per kind, steps, requests."""
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.partitions import PARTITION_MIN_EVENTS, is_directory, plan_partitions
    # lazy: pdtrace --help loads no summary code (CLI start-up)
    from pdtrace.trace.summary import named_summary, summarize, summarize_footers

    # Everything but the heavy `blocks` lists: the summary needs few columns, but `info` is also how a user checks
    # a trace, so every value the validator knows how to check is loaded and checked.
    columns = [c for c in COLUMNS if c != "blocks"]
    plan = plan_partitions(trace)  # footers only
    names = footer_names(plan.footers)
    if instance:
        instance = resolve_instances(instance, names)  # a readable name or vLLM's id: the id
        chosen = [p for p in plan.partitions if p.instance in set(instance)]
        if not chosen:
            raise no_such_instances(instance, plan.instances, names)
        # the footers of their files alone, as a load of only those files reads them
        footers = read_footers(trace, only_files=sorted({f for p in chosen for f in p.files}))
        summary = _read_summary(trace, chosen, footers, columns)
    elif plan.events < PARTITION_MIN_EVENTS or not is_directory(trace):
        summary = summarize(load_trace(trace, columns=columns))
    elif rows:
        summary = _read_summary(trace, plan.partitions, plan.footers, columns)
    else:
        for note in plan.warnings:
            err_console.print(f"pdtrace: warning: {note}", markup=False, soft_wrap=True)
        summary = summarize_footers(plan.footers, {p.instance: list(p.files) for p in plan.partitions})
    summary = named_summary(summary, names)
    if output_format is InfoFormat.json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        _render(summary)
