"""`pdtrace analyze TRACE`: run the rules and report the findings (memcheck-like text, or JSON); the exit status
makes it a CI gate (0 clean, 1 findings at or above --fail-on, 2 bad usage or unreadable input).

Thresholds come from, in increasing priority: the defaults (pdtrace.analysis.config), `[tool.pdtrace]` of a
pyproject.toml (`--config PATH`, else the nearest one from the current directory upward that has the table), then
the flags. The analysis itself is `pdtrace.analysis.analyze`, the same code path as the Python API.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer

from pdtrace.cli.app import TraceLocation, app, err_console, load_trace, out_console
from pdtrace.errors import EXIT_FINDINGS, EXIT_OK, UsageError
from pdtrace.trace.names import listing, resolve_instances
from pdtrace.trace.reader import footer_names


class AnalyzeFormat(str, Enum):
    text = "text"
    json = "json"


FAIL_LEVELS = {"error": ("error",), "warning": ("error", "warning"), "info": ("error", "warning", "info"),
               "never": ()}

_TIME = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*(ns|us|µs|ms|s|m|min)?\s*$")
_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000, "m": 60_000_000_000,
            "min": 60_000_000_000}


def parse_time(value: str, start_ns: int, option: str) -> int:
    """An absolute ns timestamp from `--since` / `--until`: seconds (or with a unit: 500ms, 2min) relative to the
    trace start; a bare integer of 16 digits or more, or a value with unit `ns` of that size, is absolute ns since
    the epoch."""
    match = _TIME.match(value)
    if not match:
        raise UsageError(f"{option}: cannot read {value!r} as a time (seconds from the trace start, e.g. 1.5, "
                         "500ms, 2min; or absolute ns since the epoch)")
    number, unit = match.group(1), match.group(2)
    if unit is None and re.fullmatch(r"\d{16,}", number.strip()):
        return int(number)
    if unit == "ns" and re.fullmatch(r"\d{16,}", number.strip()):
        return int(number)
    ns = float(number) * _UNIT_NS[unit or "s"]
    return start_ns + int(round(ns))


def _label(task: Any, names: dict[str, str]) -> str:
    """A partition's or window's name in progress lines, its instances by their readable names."""
    if getattr(task, "total", None):  # a window: instance is the partition's instances joined by "+"
        joined = "+".join(names.get(i, i) for i in str(task.instance).split("+"))
        return f"{joined} window {task.index + 1}/{task.total}"
    instances = getattr(task, "instances", None)
    return "+".join(names.get(str(i), str(i)) for i in instances) if instances else str(task.name)


@contextmanager
def _partition_progress(total: int, names: dict[str, str]) -> Iterator[Callable[[Any, Any], None]]:
    """A callback for analyze(progress=...): a rich progress bar over the partitions (and one over the windows of an
    instance analysed window by window) on a terminal, else one line per finished partition or window; always on
    stderr (stdout holds the report)."""
    if not err_console.is_terminal:
        def line(task: Any, result: Any) -> None:
            if getattr(task, "total", None):  # a window of an instance analysed window by window
                err_console.print(f"pdtrace: {_label(task, names)}: {task.events:,} events in {task.seconds:.1f} s",
                                  markup=False, soft_wrap=True)
                return
            what = "linked " if not task.summaries else ""
            err_console.print(f"pdtrace: {what}{_label(task, names)}: {result.events:,} events in "
                              f"{result.seconds:.1f} s",
                              markup=False, soft_wrap=True)

        yield line
        return
    # lazy: only a partitioned run draws a progress bar (CLI start-up)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=False) as bar:
        job = bar.add_task("instances", total=total)
        events = [0]

        windows: dict[str, Any] = {}

        def advance(task: Any, result: Any) -> None:
            if getattr(task, "total", None):  # a window: a bar per windowed instance
                if task.instance not in windows:
                    shown = "+".join(names.get(i, i) for i in str(task.instance).split("+"))
                    windows[task.instance] = bar.add_task(f"{shown} windows", total=task.total)
                bar.update(windows[task.instance], advance=1,
                           description=f"{_label(task, names)} ({task.events:,} events, {task.seconds:.1f} s)")
                return
            events[0] += result.events
            if task.summaries:
                bar.advance(job)
            bar.update(job, description=f"{_label(task, names)} done ({events[0]:,} events)")

        yield advance


def _split(values: Optional[list[str]]) -> list[str]:
    out: list[str] = []
    for value in values or []:
        out.extend(v.strip() for v in value.split(",") if v.strip())
    return out


@app.command()
def analyze(
    trace: TraceLocation,
    format: AnalyzeFormat = typer.Option(AnalyzeFormat.text, "--format", "-f", help="text (default) or json."),
    rules: Optional[list[str]] = typer.Option(None, "--rules", "-r",
                                              help="Rules to run, comma-separated or repeated (default: all)."),
    instance: Optional[list[str]] = typer.Option(None, "--instance", "-i",
                                                 help="Only this instance (repeat for several): its "
                                                      "readable name (prefill-0) or vLLM's id."),
    since: Optional[str] = typer.Option(None, "--since", help="Start of the window: seconds from the trace start "
                                        "(1.5, 500ms, 2min) or absolute ns since the epoch."),
    until: Optional[str] = typer.Option(None, "--until", help="End of the window (exclusive), same forms."),
    fail_on: Optional[str] = typer.Option(None, "--fail-on",
                                          help="Exit 1 when a finding is at or above this severity: error "
                                               "(default), warning, info or never."),
    grace_s: Optional[float] = typer.Option(None, "--grace-s", help="Grace period for transfers and leaks, s "
                                            "(default: the recorded release's connector timeouts)."),
    starve_steps: Optional[int] = typer.Option(None, "--starve-steps", help="Steps before a waiting request is "
                                               "starved (default 50)."),
    zombie_steps: Optional[int] = typer.Option(None, "--zombie-steps", help="Steps before a running request that "
                                               "is neither scheduled nor finished is a zombie (default 50)."),
    bubble_min_ms: Optional[float] = typer.Option(None, "--bubble-min-ms", help="Shortest idle gap reported as a "
                                                  "bubble, ms (default 1)."),
    bubble_warn_fraction: Optional[float] = typer.Option(None, "--bubble-warn-fraction",
                                                         help="Lost fraction of a PP rank that makes a warning "
                                                              "(default 0.10)."),
    config: Optional[Path] = typer.Option(None, "--config", help="A pyproject.toml whose [tool.pdtrace] table "
                                          "holds thresholds (default: the nearest one from the current directory)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Text: show every finding of a context in full."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Worker processes for the instances of a large "
                                       "multi-instance trace (default: one per CPU; 1: one instance after the other "
                                       "in this process); for a trace analysed whole, threads for the rules. Same "
                                       "findings either way."),
    dask: Optional[str] = typer.Option(None, "--dask", help="Run the instances as tasks on this Dask cluster "
                                       "(scheduler address, e.g. tcp://dask-scheduler:8786); the workers read TRACE "
                                       "at the same path. Needs pdtrace[dask]."),
    window_events: Optional[int] = typer.Option(None, "--window-events", help="Analyse an instance with more "
                                                "events than this in time windows of at most this many, memory "
                                                "bounded by the window (default: an instance of more than 15M "
                                                "events, in windows of 5M; 0: never). Same findings; "
                                                "pipeline_bubble is measured per window."),
    partitions: Optional[bool] = typer.Option(None, "--partitions/--whole", help="Analyse instance by instance "
                                              "(default: when the trace is large and no instance dominates) or the "
                                              "whole trace in one process. Same findings either way."),
    show_plan: bool = typer.Option(False, "--plan", help="Print how the analysis would run (mode, what is read, "
                                   "the slices and their rows per the footers, the runner) and exit 0 without "
                                   "analysing; --format json gives it as JSON."),
) -> None:
    """Replay a trace and report premature frees, use after free, double frees, leaks, completions before finish,
    unscheduled requests and pipeline bubbles, with the events that prove them."""
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis import analyze as run_analysis
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis import available_rules, select_rules, summarize_findings
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.config import config_from_table, find_pyproject, load_pyproject_table

    pyproject = config if config is not None else find_pyproject()
    table = load_pyproject_table(pyproject, required=config is not None) if pyproject is not None else {}
    settings, defaults = config_from_table(table)
    overrides: dict[str, Any] = {"grace_s": grace_s, "starve_steps": starve_steps, "zombie_steps": zombie_steps,
                                 "bubble_warn_fraction": bubble_warn_fraction, "jobs": jobs,
                                 "window_events": window_events}
    if bubble_min_ms is not None:
        overrides["bubble_min_ns"] = int(bubble_min_ms * 1_000_000)
    settings = settings.with_overrides(**overrides)

    level = (fail_on or str(defaults.get("fail_on", "error"))).strip().lower()
    if level not in FAIL_LEVELS:
        raise UsageError(f"--fail-on must be one of {', '.join(FAIL_LEVELS)}, not {level!r}")
    wanted_rules = _split(rules) or None
    if wanted_rules is None and defaults.get("rules"):
        value = defaults["rules"]
        wanted_rules = _split([value] if isinstance(value, str) else [str(v) for v in value])
    registered, notes = available_rules()
    chosen = select_rules(wanted_rules, registered)  # unknown ids: exit 2 before the trace is read
    for note in notes:
        err_console.print(f"pdtrace: warning: {note}", markup=False)

    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.partitions import analysed_span, plan_partitions
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.plan import plan_analysis

    plan = plan_partitions(trace)  # footers only: bad schema, unknown version, nothing readable exit 2 here
    start_ns = plan.stats_span[0] if plan.stats_span else analysed_span(plan, plan.partitions, settings)[0]
    names = footer_names(plan.footers)
    instances = _split(instance) or None
    if instances:
        known = set(plan.instances)
        unknown = [name for name in instances if resolve_instances([name], names)[0] not in known]
        if unknown:
            raise UsageError(f"--instance {unknown[0]!r} is not in the trace (instances: "
                             f"{listing(names, known)})")
        instances = resolve_instances(instances, names)  # a readable name or vLLM's id: the id
    settings = settings.with_overrides(
        since_ns=parse_time(since, start_ns, "--since") if since is not None else None,
        until_ns=parse_time(until, start_ns, "--until") if until is not None else None,
    )
    if instances:
        settings = settings.__class__(**{**settings.__dict__, "instances": tuple(instances)})

    how = plan_analysis(str(trace), settings, dask=dask, partitioned=partitions, footers=plan)  # footers only
    if show_plan:
        if format is AnalyzeFormat.json:
            typer.echo(json.dumps(how.as_dict(), indent=2))
        else:
            for line in how.describe():
                out_console.print(line, markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_OK)
    if how.mode == "whole":
        findings = run_analysis(load_trace(trace), rules=chosen, config=settings, partitioned=False)
    else:
        with _partition_progress(len(plan.partitions), names) as progress:
            findings = run_analysis(str(trace), rules=chosen, config=settings, plan=how, progress=progress)
        for note in findings.attrs.get("trace_warnings", []):
            err_console.print(f"pdtrace: warning: {note}", markup=False, soft_wrap=True)
    summary = summarize_findings(findings)
    if format is AnalyzeFormat.json:
        # lazy: the reporters load with the analysis stack, not at CLI start
        from pdtrace.report.json_report import render_json

        typer.echo(render_json(findings, summary, str(trace)))
    else:
        # lazy: the reporters load with the analysis stack, not at CLI start
        from pdtrace.report.terminal import render_terminal

        render_terminal(findings, summary, out_console, trace=str(trace), start_ns=start_ns, verbose=verbose)
    failing = FAIL_LEVELS[level]
    hit = bool(len(findings)) and bool(findings["severity"].isin(failing).any())
    raise typer.Exit(EXIT_FINDINGS if hit else EXIT_OK)
