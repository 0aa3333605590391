"""The typer application that every verb module (`pdtrace/cli/<verb>.py`) adds its command to.

Results go to stdout; progress and diagnostics go to stderr through `err_console`.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterable, Optional

import typer
from rich.console import Console

from pdtrace import __version__
from pdtrace.errors import UsageError
from pdtrace.trace.names import listing, resolve_instances
from pdtrace.trace.reader import footer_names, open_trace

if TYPE_CHECKING:  # pragma: no cover
    from pdtrace.analysis.partitions import PartitionPlan
    from pdtrace.analysis.windows import WindowEnd
    from pdtrace.plot.window import Window
    from pdtrace.trace.model import Trace

app = typer.Typer(
    name="pdtrace",
    help="memcheck for the KV cache: record, analyze and plot what a vLLM engine did with its KV blocks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# Arguments and options that several verbs share, declared once.
TraceArgument = Annotated[Path, typer.Argument(help="Trace directory (or one Parquet part file).",
                                               show_default=False)]
#: A trace that may also be a URL (`s3://bucket/trace`, `file:///data/trace`): a plain string, which Path would mangle.
TraceLocation = Annotated[str, typer.Argument(help="Trace directory, one Parquet part file, or a URL pyarrow or "
                                              "fsspec reads (s3://bucket/trace, file:///data/trace).",
                                              show_default=False)]
InstanceOption = Annotated[Optional[list[str]], typer.Option("--instance", "-i",
                                                             help="Only this instance (repeat for several): "
                                                                  "its readable name (prefill-0) or vLLM's id.")]
MemoryCheckOption = Annotated[bool, typer.Option("--memory-check/--no-memory-check",
                                                 help="Refuse a load that would need more memory than is "
                                                      "available (plot and export hold the events they show).")]
SinceSecondsOption = Annotated[Optional[float], typer.Option("--since",
                                                             help="Window start, seconds from the trace start.")]
UntilSecondsOption = Annotated[Optional[float], typer.Option("--until",
                                                             help="Window end, seconds from the trace start.")]
WindowEventsOption = Annotated[int, typer.Option(
    "--window-events",
    help="With --since/--until (or --request alone: its life): read only that window's rows, with what is open "
         "at its start up to half this many events before it, where the instances shown hold more than this many "
         "events (default: more than 15M, as analyze windows them; 0: never).")]
RequestOption = Annotated[Optional[list[str]], typer.Option(
    "--request", "-r",
    help="Only this request (repeat for several): the window narrows to its lifetime and its P/D peer's, and "
         "(without --instance) to their instances.")]


@dataclass(frozen=True)
class WindowOptions:
    """What `--instance`, `--since`, `--until`, `--request`, `--memory-check` and `--window-events` chose: the
    window options that `plot` and `export` share, declared once (`window_options`)."""

    instance: tuple[str, ...] = ()
    since: float | None = None
    until: float | None = None
    request: tuple[str, ...] = ()
    memory_check: bool = True
    window_events: int = -1

    def window(self) -> "Window":
        """The selection as `pdtrace.plot` takes it."""
        # lazy: pdtrace.plot's package loads matplotlib; the CLI starts without it
        from pdtrace.plot.window import Window

        return Window(since_s=self.since, until_s=self.until, instances=self.instance, requests=self.request)


#: The window options, in the order `--help` lists them, with their declarations and defaults.
_WINDOW_PARAMETERS = (
    ("instance", InstanceOption, None),
    ("since", SinceSecondsOption, None),
    ("until", UntilSecondsOption, None),
    ("request", RequestOption, None),
    ("memory_check", MemoryCheckOption, True),
    ("window_events", WindowEventsOption, -1),
)


def window_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """A command's window options declared once: `command` takes one parameter `shown: WindowOptions =
    WindowOptions()` (the default only keeps Python's parameter order; typer never sees it); typer sees
    the six options in its place (same names, help and defaults wherever a command uses them) and the command gets
    them gathered in a `WindowOptions`."""
    signature = inspect.signature(command, eval_str=True)
    names = [name for name, _, _ in _WINDOW_PARAMETERS]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        chosen = {name: kwargs.pop(name) for name in names}
        chosen["instance"] = tuple(chosen["instance"] or ())
        chosen["request"] = tuple(chosen["request"] or ())
        return command(*args, shown=WindowOptions(**chosen), **kwargs)

    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name == "shown":
            parameters += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation,
                                             default=default) for name, annotation, default in _WINDOW_PARAMETERS]
        else:
            parameters.append(parameter)
    if len(parameters) != len(signature.parameters) + len(names) - 1:
        raise TypeError(f"{command.__name__} takes no `shown` parameter for window_options to fill")
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    # typer reads the annotations too (typing.get_type_hints): the six options', not `shown`'s
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    if signature.return_annotation is not inspect.Signature.empty:
        wrapper.__annotations__["return"] = signature.return_annotation
    del wrapper.__wrapped__  # typer must see the six options, not the command's own signature
    return wrapper

#: Results (tables, reports) go to stdout.
def _results_width() -> int | None:
    """Piped or redirected reports keep their full table width (rich would squeeze them to 80 columns)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():
        return int(columns)
    return None if sys.stdout.isatty() else 160


out_console = Console(highlight=False, soft_wrap=True, width=_results_width())
#: Progress, warnings and errors go to stderr.
err_console = Console(stderr=True, highlight=False, soft_wrap=True)  # one error = one line, however long


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"pdtrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                 help="Print pdtrace's version and exit."),
) -> None:
    """memcheck for the KV cache of vLLM: `record` a run, `analyze` it, `show` one request or step, `plot` it."""


def load_instances(path: Path, instances: Iterable[str] | None, columns: Iterable[str] | None = None,
                   with_links: bool = False, memory_check: bool = True,
                   plan: "PartitionPlan | None" = None) -> tuple["Trace", tuple[int, int] | None]:
    """(trace, span) for a verb that shows only `instances` (--instance): only their partitions are read
    (`pdtrace.analysis.partitions.open_instances`), plus with `with_links` those of the instances linked to them,
    so that the findings a plot or export marks are the whole trace's (its selection still shows `instances`
    only); span is the whole trace's (first, last) ts, for an AnalysisContext's `span_ns`. Without instances, the
    whole trace and None. Warnings as load_trace's. `memory_check`: refuse a load that would not fit in the memory
    available (`check_memory`)."""
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.partitions import open_instances, plan_partitions

    plan = plan_partitions(path) if plan is None else plan  # footers only
    names = resolve_instances(instances or (), footer_names(plan.footers))  # a readable name or vLLM's id
    if memory_check:
        check_memory(shown_events(plan, names, with_links), path)
    if not names:
        return load_trace(path, columns=columns), None
    trace, span, plan = open_instances(path, names, columns=columns, with_links=with_links, plan=plan)
    if trace is None:
        raise no_such_instances(names, plan.instances, footer_names(plan.footers))
    return warned(trace), span


def shown_events(plan: "PartitionPlan", names: list[str], with_links: bool) -> int:
    """The events, by the footers, of the files of `names`' partitions (with `with_links` their peers' too; all
    partitions where `names` is empty): what a whole load of them reads."""
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.partitions import instance_partitions

    chosen = instance_partitions(plan, names, with_links) if names else plan.partitions
    rows_of = {f.path: f.rows for f in plan.footers.files}
    return sum(rows_of[f] for f in {f for p in chosen for f in p.files})


@dataclass
class ShownPiece:
    """A piece of what plot or export shows, its rows read when `read` is called; its own span [since, until)
    (None: from the start, to the end), the trace's span and where its read ends (`AnalysisContext`'s)."""

    read: Callable[[], "Trace"]
    span: tuple[int, int] | None
    window_end: "WindowEnd | None"
    since: int | None = None
    until: int | None = None


def load_shown(path: Path, window: "Window", window_events: int, memory_check: bool = True
               ) -> tuple["Trace", tuple[int, int] | None, "WindowEnd | None"]:
    """(trace, span, window end) for plot and export, which show `window` read whole (`shown_pieces`)."""
    (piece,) = shown_pieces(path, window, window_events, memory_check)
    return piece.read(), piece.span, piece.window_end


def shown_pieces(path: Path, window: "Window", window_events: int, memory_check: bool = True,
                 in_pieces: bool = False) -> list[ShownPiece]:
    """What plot and export show of `window`: its instances and their peers' loaded whole (`load_instances`), or,
    where they hold more events than the windowed analysis analyses whole (`window_size` of `window_events`) and
    --since/--until or --request is given (or `in_pieces`), only the rows of that time window (the named
    requests' lives, their P/D peers' included: `story.requests_span`), read as the windowed analysis reads one
    (`pdtrace.analysis.partitions.open_window_pieces`). With `in_pieces` (a figure drawn piece by piece) the
    window is read in pieces of that many events, one at a time; else in one."""
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.config import AnalysisConfig
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.partitions import analysed_span, open_window_pieces, plan_partitions
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.story import requests_span
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.windows import window_size
    from pdtrace.plot.window import no_requests  # lazy: matplotlib and the analysis stack load only to draw

    plan = plan_partitions(path)  # footers only
    readable = footer_names(plan.footers)
    names = resolve_instances(window.instances, readable)  # a readable name or vLLM's id: the id
    events = shown_events(plan, names, True)
    config = AnalysisConfig(window_events=window_events)
    timed = window.since_s is not None or window.until_s is not None
    piece_events = window_size(config, events) if events else 0
    if not (timed or window.requests or in_pieces) or not piece_events:
        trace, span = load_instances(path, names, with_links=True, memory_check=memory_check, plan=plan)
        return [ShownPiece(lambda: trace, span, None)]
    span = plan.stats_span or analysed_span(plan, plan.partitions, config)
    since: int | None = None
    until: int | None = None
    if timed:
        lo, hi = window.bounds(*span)
        since, until = lo if window.since_s is not None else None, hi + 1 if window.until_s is not None else None
    elif window.requests:  # --request alone: the requests' lives (a finding of analyze, drawn without loading)
        lives = requests_span(path, window.requests, names[0] if len(names) == 1 else None)
        if lives is None:
            raise no_requests(window.requests, names)
        since, until = lives[0], None if lives[1] is None else lives[1] + 1
    pieces = open_window_pieces(path, names, since, until, config, with_links=True, plan=plan,
                                check=(lambda rows: check_memory(rows, path)) if memory_check else None,
                                piece_events=piece_events if in_pieces else 0)
    if pieces is None:
        raise no_such_instances(names, plan.instances, readable)
    # the footers' notes and skipped files (a window reads only the readable files: its trace does not name them),
    # then the first piece's own (each piece's are the trace's: printed once)
    told = warned_once(plan.warnings, [])
    return [ShownPiece((lambda read=read, first=k == 0: warned(read(), told) if first else read()), span,
                       read_window.window_end, read_window.since, read_window.until)
            for k, (read_window, read) in enumerate(pieces)]


def available_memory() -> int | None:
    """Bytes of memory this process may still take: the least of the kernel's MemAvailable and the room under its
    cgroup's limit (a container's); None where neither is known (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as current:
            top = limit.read().strip()
            if top != "max":
                found.append(max(int(top) - int(current.read().strip()), 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


#: Peak bytes per event of `plot` and `export`, which hold every event they show with the tables they draw from:
#: 190-213 measured on bench/long_trace.py's 60M events (plot --kind blocks 11.4 GB, requests 12.8 GB, export 11.8
#: GB; `/usr/bin/time -v`, 2026-12-03).
LOAD_EVENT_BYTES = 215


def check_memory(events: int, path: Any) -> None:
    """Refuse, one line and exit 2, to load `events` events for a verb that holds them all (plot, export) when at
    `LOAD_EVENT_BYTES` each they need more memory than is available: such a load ends in the kernel's OOM killer,
    which may take another process with it (the vLLM engine on the same host)."""
    available = available_memory()
    need = events * LOAD_EVENT_BYTES
    if available is not None and need > available:
        raise UsageError(f"{path}: {events:,} events to load (~{need / 2**30:.1f} GiB), more than the "
                         f"{available / 2**30:.1f} GiB of memory available: give --since and --until for a "
                         "shorter time window, --instance for fewer instances, or --no-memory-check to load them "
                         "anyway (analyze, show and info read a trace of any length in bounded memory)")


def no_such_instances(names: Iterable[str], known: Iterable[str],
                      readable: dict[str, str] | None = None) -> Exception:
    """The one-line error (exit 2) for --instance names none of which the trace holds; `readable`: the trace's
    names (`pdtrace.trace.names`), listed with the ids."""
    from pdtrace.plot.window import EmptySelection  # lazy: matplotlib and the analysis stack load only to draw

    return EmptySelection(f"nothing to show: no instance {', '.join(names)} in the trace (instances: "
                          f"{listing(readable or {}, known)})")


def load_trace(path: Path, columns: Iterable[str] | None = None, **kwargs: Any) -> "Trace":
    """Open a trace for a CLI verb: warnings (skipped files, unknown kinds, bad manifest) go to stderr, one line
    each; errors propagate as TraceError (one line and exit 2 through pdtrace.cli.main)."""
    return warned(open_trace(path, columns=columns, warn=False, **kwargs))


def warned(trace: "Trace", told: list[str] | None = None) -> "Trace":
    """The trace, its warnings (skipped files, unknown kinds, bad manifest) printed to stderr, one line each (but
    those in `told`, already printed)."""
    warned_once(trace.warnings, [] if told is None else told)
    return trace


def warned_once(notes: Iterable[str], told: list[str]) -> list[str]:
    """Print each note not in `told` (one line each, to stderr) and add it there; `told`."""
    for note in notes:
        if note not in told:
            err_console.print(f"pdtrace: warning: {note}", markup=False, soft_wrap=True)
            told.append(note)
    return told


def installed_release(verb: str = "pdtrace chaos") -> str:
    """The installed vLLM, if the dry run drives it; else UsageError naming the supported releases (exit 2). For
    the verbs that drive the dry run (chaos, replay)."""
    # read at the call, not at the CLI's start: the other verbs never need the hook tables
    from pdtrace.recording.vllm import installed_vllm_version, supported_versions, table_for

    version = installed_vllm_version()
    if version is None or table_for(version) is None:
        what = f"vLLM {version}" if version else "no vLLM"
        raise UsageError(f"{verb} drives the vLLM releases the dry run supports "
                         f"({', '.join(supported_versions())}); this environment has {what}")
    return version
