"""`pdtrace dump TRACE [--instance NAME] [--timeout S]`: ask every live process of a flight recording to dump.

A flight recording (`pdtrace record --flight SECONDS -o TRACE -- CMD`, or `PDTRACE_FLIGHT` with
`PDTRACE_TRACE_DIR=TRACE`) keeps each process's last SECONDS of events in memory; each process registers itself
under `TRACE/_flight/procs/`. This verb asks the live ones (`--instance`: those of these instances) for their
windows (`pdtrace.recording.flight.request_dump`: the next `TRACE/dump-NNNN/`, a request naming them, and the dump
signal to each), waits until each has written its part or `--timeout` passes, and prints the dump's folder on
stdout, a summary on stderr. Exit 0 when every process wrote its part (or had nothing in its window), 1 when some
did not answer in time or failed, 2 when TRACE is not a flight recording or has no live process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from pdtrace.cli.app import InstanceOption, app, err_console, out_console
from pdtrace.errors import EXIT_FINDINGS, UsageError
from pdtrace.format import MANIFEST_NAME


def _pending(manifest: dict[str, Any] | None) -> list[str]:
    processes = (manifest or {}).get("processes") or {}
    return sorted(pid for pid, entry in processes.items() if (entry or {}).get("status") == "pending")


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


@app.command("dump", no_args_is_help=True)
def dump(
    trace: Path = typer.Argument(..., help="The flight recording's trace directory (pdtrace record --flight -o).",
                                 show_default=False),
    instance: InstanceOption = None,
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for every process's part."),
) -> None:
    """Ask every live process of the flight recording TRACE to write its window into TRACE/dump-NNNN/."""
    from pdtrace.recording.flight import REGISTRY, live_processes, request_dump

    if not (trace / REGISTRY / "procs").is_dir():
        raise UsageError(f"{trace} is not a flight recording (no {REGISTRY}/ registry: record with "
                         "pdtrace record --flight SECONDS, or PDTRACE_FLIGHT with PDTRACE_TRACE_DIR)")
    targets = live_processes(trace)
    if instance:
        wanted = set(instance)
        targets = [t for t in targets if wanted & set(t.get("instances", []))]
    if not targets:
        which = f" of instance {', '.join(instance)}" if instance else ""
        raise UsageError(f"no live process{which} in the flight recording {trace} (the run has ended?)")
    number, folder = request_dump(trace, "pdtrace dump", targets)
    deadline = time.monotonic() + max(timeout, 0.0)
    manifest = _read_manifest(folder)
    while _pending(manifest) and time.monotonic() < deadline:
        time.sleep(0.1)
        manifest = _read_manifest(folder)
    processes = (manifest or {}).get("processes") or {}
    pending = _pending(manifest)
    failed = sorted(pid for pid, entry in processes.items() if (entry or {}).get("status") == "error")
    events = sum(int((entry or {}).get("events") or 0) for entry in processes.values())
    out_console.print(str(folder), markup=False)
    err_console.print(f"pdtrace: {folder.name}: {len(processes) - len(pending) - len(failed)} of {len(processes)} "
                      f"processes wrote their window ({events} events)", markup=False)
    if pending:
        err_console.print(f"pdtrace: warning: no answer within {timeout:g} s from pid {', '.join(pending)} (they may "
                          "still write their part)", markup=False)
    for pid in failed:
        err_console.print(f"pdtrace: warning: pid {pid} could not write its window: "
                          f"{processes[pid].get('error')}", markup=False)
    if not pending and not failed:
        err_console.print(f"pdtrace: analyze it with: pdtrace analyze {folder}", markup=False)
    raise typer.Exit(EXIT_FINDINGS if pending or failed else 0)
