"""`pdtrace replay TRACE [-o OUT]`: re-drive a recorded run through the dry run on the installed vLLM and report
where the scheduler's decisions part from the recording (pdtrace.replay). Exit 0 when every decision matches, 1
when some differ, 2 on bad input or a vLLM release the dry run does not drive."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from pdtrace.cli.app import TraceLocation, app, err_console, installed_release, load_trace, out_console
from pdtrace.errors import EXIT_FINDINGS, EXIT_OK, UsageError


class ReplayFormat(str, Enum):
    text = "text"
    json = "json"


@app.command("replay", no_args_is_help=True)
def replay(
    trace: TraceLocation,
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Keep the replayed trace here (a new "
                                          "directory); default: a temporary one, removed."),
    fmt: ReplayFormat = typer.Option(ReplayFormat.text, "--format", help="text or json."),
) -> None:
    """Re-drive a recorded run (its arrivals, lengths, aborts, prefix hits, transfer completions and step times)
    through vLLM's real scheduler on the dry run, and report the first step where its decisions differ from the
    recording and the share that match. With a patched vLLM installed, this is how a fix is checked."""
    from pdtrace.replay import replay as run_replay  # lazy: pdtrace --help loads no replay code (CLI start-up)
    # lazy: pdtrace --help loads no replay code (CLI start-up)
    from pdtrace.report.replay_report import render_replay, replay_summary

    version = installed_release("pdtrace replay")
    if output is not None and output.exists() and any(output.iterdir()):
        raise UsageError(f"{output} is not empty; choose a new directory for the replayed trace")
    loaded = load_trace(trace)
    with err_console.status("replay: running the dry run"):
        result = run_replay(loaded, output)
    if fmt is ReplayFormat.json:
        out_console.print_json(json.dumps({"vllm_version": version, **replay_summary(result)}))
    else:
        render_replay(out_console, result, version)
    raise typer.Exit(EXIT_OK if result.share == 1.0 else EXIT_FINDINGS)
