"""`pdtrace dump TRACE [--instance NAME] [--timeout S]`: ask every live process of a flight recording to dump.

A flight recording (`pdtrace record --flight SECONDS -o TRACE -- CMD`, or `PDTRACE_FLIGHT` with
`PDTRACE_TRACE_DIR=TRACE`) keeps each process's last SECONDS of events in memory; each process registers itself
under `TRACE/_flight/procs/`. This verb asks the live ones (`--instance`: those of these instances) for their
windows (`pdtrace.recording.flight.request_dump`: the next `TRACE/dump-NNNN/`, a request naming them, and the dump
signal to each), waits until each has written its part or `--timeout` passes, and prints the dump's folder on
stdout, a summary on stderr. Exit 0 when every process wrote its part (or had nothing in its window), 1 when some
did not answer in time or failed, 2 when TRACE is not a flight recording or has no live process.

TRACE may also be a folder holding several flight recordings (a P/D pair recorded as `TRACE/prefill` and
`TRACE/decode`): each is asked, into `TRACE/dump-NNNN/<recording>/`, one trace of them all
(`request_dump(into=...)`; a recording whose processes are gone joins with its own recent dump, or its part of
TRACE's newest pair dump, `join_recent_dump`). One side's engine error writes such a dump by itself
(`pdtrace.recording.flight.request_pair_dump`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from pdtrace.cli.app import InstanceOption, app, err_console, out_console
from pdtrace.errors import EXIT_FINDINGS, UsageError
from pdtrace.format import FLIGHT_REGISTRY, MANIFEST_NAME, flight_recordings


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
    trace: Path = typer.Argument(..., help="The flight recording's trace directory (pdtrace record --flight -o), or "
                                           "a folder of several (a P/D pair's prefill/ and decode/).",
                                 show_default=False),
    instance: InstanceOption = None,
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for every process's part."),
) -> None:
    """Ask every live process of the flight recording TRACE to write its window into TRACE/dump-NNNN/ (of every
    flight recording under TRACE, into TRACE/dump-NNNN/<recording>/: one trace of them all)."""
    # lazy: the flight recorder's module loads only for the verbs that record or dump
    from pdtrace.recording.flight import (join_recent_dump, live_processes, newest_dump, newest_window_start_ns,
                                          next_dump_folder, request_dump, write_joint_manifest)

    recordings = flight_recordings(trace) if trace.is_dir() else []
    if not recordings:
        raise UsageError(f"{trace} is not a flight recording (no {FLIGHT_REGISTRY}/ registry here or below: record "
                         "with pdtrace record --flight SECONDS, or PDTRACE_FLIGHT with PDTRACE_TRACE_DIR)")
    targets = {recording: _targets(live_processes(recording), instance) for recording in recordings}
    # where the windows of the dump begin, which a recording's own dump must reach to join it: the live processes'
    seconds = [float(t.get("seconds") or 0) for live in targets.values() for t in live]
    since = time.time_ns() - int(max(seconds, default=0) * 1e9)
    if not seconds:  # none live: its recordings' newest dumps, joined where they meet
        since = newest_window_start_ns(recordings, trace) if not instance else None
        if since is None:
            which = f" of instance {', '.join(instance)}" if instance else ""
            dumped = sum(newest_dump(r, trace) is not None for r in recordings) if len(recordings) > 1 else 0
            raise UsageError(f"no live process{which} in the flight recording {trace} (the run has ended?)"
                             + ("" if len(recordings) < 2 or instance else
                                "; the newest dumps of its recordings do not overlap to join" if dumped > 1 else
                                "; fewer than two of its recordings have a dump of their own to join"))
    if recordings == [trace]:
        number, folder = request_dump(trace, "pdtrace dump", targets[trace])
        parts = {folder: trace}
    else:  # one dump of every recording that has a live process, each in a folder of its own
        number, folder = next_dump_folder(trace)
        parts = {}
        for recording, live in targets.items():
            if live:
                _, part = request_dump(recording, "pdtrace dump", live,
                                       into=(number, folder / recording.relative_to(trace)))
                parts[part] = recording
            else:
                part = folder / recording.relative_to(trace)
                done = join_recent_dump(recording, part, since, trace)
                if part.is_dir():
                    parts[part] = recording
                err_console.print(f"pdtrace: {recording}: no live process{' of that instance' if instance else ''}; "
                                  f"{done}", markup=False)
    deadline = time.monotonic() + max(timeout, 0.0)
    manifests = {part: _read_manifest(part) for part in parts}
    while any(_pending(m) for m in manifests.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        manifests = {part: _read_manifest(part) for part in parts}
    if folder not in parts:
        write_joint_manifest(folder, number, manifests)
    processes = {f"{part.relative_to(folder)}/{pid}" if part != folder else pid: entry or {}
                 for part, manifest in manifests.items()
                 for pid, entry in ((manifest or {}).get("processes") or {}).items()}
    pending = sorted(name for name, entry in processes.items() if entry.get("status") == "pending")
    failed = sorted(name for name, entry in processes.items() if entry.get("status") == "error")
    events = sum(int(entry.get("events") or 0) for entry in processes.values())
    out_console.print(str(folder), markup=False)
    err_console.print(f"pdtrace: {folder.name}: {len(processes) - len(pending) - len(failed)} of {len(processes)} "
                      f"processes wrote their window ({events} events)"
                      + (f" in {len(parts)} flight recordings" if folder not in parts else ""), markup=False)
    if pending:
        err_console.print(f"pdtrace: warning: no answer within {timeout:g} s from pid {', '.join(pending)} (they may "
                          "still write their part)", markup=False)
    for name in failed:
        err_console.print(f"pdtrace: warning: pid {name} could not write its window: "
                          f"{processes[name].get('error')}", markup=False)
    if not pending and not failed:
        err_console.print(f"pdtrace: analyze it with: pdtrace analyze {folder}", markup=False)
    raise typer.Exit(EXIT_FINDINGS if pending or failed else 0)


def _targets(live: list[dict[str, Any]], instances: list[str] | None) -> list[dict[str, Any]]:
    """The live processes asked: all, or those recording one of `instances`."""
    if not instances:
        return live
    return [t for t in live if set(instances) & set(t.get("instances", []))]
