"""`pdtrace show TRACE --req ID | --step K [--instance X] [--format text|json]`: the story of one request across
every instance (P and D joined through req_add's remote links), or of one step across the scheduler, the engine
and every rank, with, for the step, which ranks' exec_end came before its step_output and which after (or never).

The computation is `pdtrace.analysis.story`, on the rows it reads about the request or step (`request_rows`,
`step_rows`: not the whole trace); this module renders. An unknown request or step is a one-line error and exit
status 2.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Mapping, Optional

import pandas as pd
import typer

from pdtrace.cli.app import TraceLocation, app, out_console, warned
from pdtrace.errors import UsageError
from pdtrace.trace.names import names_of, resolve_instance, shown
from pdtrace.trace.reader import footer_names, read_footers


class ShowFormat(str, Enum):
    text = "text"
    json = "json"


def _ms(ns: Any) -> str:
    return "-" if ns is None or pd.isna(ns) else f"+{int(ns) / 1e6:.3f} ms"


def _plain(value: Any) -> Any:
    if value is None or (not isinstance(value, (list, dict)) and pd.isna(value)):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for rec in frame.to_dict("records"):  # a story: one request or one step, small
        clean = {k: _plain(v) for k, v in rec.items() if not k.startswith("_")}
        detail = clean.get("detail")
        if isinstance(detail, str):
            try:
                clean["detail"] = json.loads(detail)
            except ValueError:
                pass
        out.append(clean)
    return out


def _story_names(story: pd.DataFrame, names: Mapping[str, str]) -> dict[str, str]:
    """{vLLM's id: readable name} of the story's instances (added key of the JSON; records keep the ids)."""
    return {str(i): shown(names, i) for i in sorted(set(story["instance"].astype(str)))}


def _event_line(rec: dict[str, Any], names: Mapping[str, str]) -> str:
    where = shown(names, rec["instance"])
    if rec.get("dp_rank") is not None:
        where += f"/dp{rec['dp_rank']}"
    if rec.get("pp_rank") is not None:
        where += f" pp{rec['pp_rank']}"
    if rec.get("tp_rank") is not None:
        where += f"/tp{rec['tp_rank']}"
    kind = str(rec["kind"])
    count = rec.get("count") or 1
    if count > 1:
        kind += f" x{count}"
    parts = [f"{_ms(rec['t_ns']):>13}", f"{where:<16}", f"{kind:<18}"]
    if rec.get("req") is not None:
        parts.append(str(rec["req"]))
    step = rec.get("step")
    if step is not None:
        last = rec.get("last_step")
        parts.append(f"step {step}" if last is None or last == step else f"steps {step}..{last}")
    for key in ("n", "reason", "status"):
        if rec.get(key) is not None:
            parts.append(f"{key}={rec[key]}")
    for key in ("delay_free", "deferred"):
        if rec.get(key):
            parts.append(key)
    if rec.get("blocks") is not None:
        blocks = list(rec["blocks"])
        listed = ",".join(str(b) for b in blocks[:12]) + (",..." if len(blocks) > 12 else "")
        parts.append(f"blocks=[{listed}] ({len(blocks)})")
    if rec.get("detail") is not None:
        detail = rec["detail"]
        if isinstance(detail, dict) and isinstance(detail.get("remote_instance"), str):  # the peer by its name too
            detail = {**detail, "remote_instance": shown(names, detail["remote_instance"])}
        parts.append(json.dumps(detail, separators=(",", ":")) if isinstance(detail, (dict, list)) else str(detail))
    return "  ".join(parts)


def _render_request(req: str, pairs: list[tuple[str, str]], story: pd.DataFrame, full: bool,
                    names: Mapping[str, str]) -> None:
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.story import collapse_runs

    drawn = story if full else collapse_runs(story)
    span = int(story["t_ns"].iloc[-1]) if len(story) else 0
    ids = ", ".join(f"{shown(names, inst)}:{r}" for inst, r in pairs)
    lifetimes = int(story["lifetime"].max()) if "lifetime" in story and story["lifetime"].notna().any() else 1
    reused = f"; the id was reused: {lifetimes} lifetimes" if lifetimes > 1 else ""
    out_console.print(f"request {req} ({ids}): {len(story)} events over {span / 1e6:.3f} ms{reused}",
                      markup=False)
    current: dict[str, Any] = {}
    for rec in _records(drawn):
        life = rec.get("lifetime")
        if life is not None and current.get(str(rec["instance"])) != life:  # a lifetime begins on this instance
            current[str(rec["instance"])] = life
            out_console.print(f"  -- {shown(names, rec['instance'])}:{rec['req']} lifetime {life} of {lifetimes}",
                              markup=False)
        out_console.print("  " + _event_line(rec, names), markup=False, soft_wrap=True)


def _render_step(step: int, story: pd.DataFrame, ranks: pd.DataFrame, folded: pd.DataFrame,
                 names: Mapping[str, str]) -> None:
    start = int(story["ts_ns"].iloc[0])
    out_console.print(f"step {step}: {len(story)} events", markup=False)
    for rec in _records(story):
        out_console.print("  " + _event_line(rec, names), markup=False, soft_wrap=True)
    carried = story[story["kind"].isin(["req_finish", "kv_send_done", "kv_recv_done", "kv_recv_fail"])]
    if len(carried):
        items = ", ".join(f"{k} {r}" for k, r in zip(carried["kind"], carried["req"], strict=True))
        out_console.print(f"completions in step {step}'s update: {items}", markup=False, soft_wrap=True)
    if len(ranks) == 0:
        out_console.print(f"no rank executed step {step} (no exec spans recorded)", markup=False)
        return
    for (instance, dp), grp in ranks.groupby(["instance", "dp_rank"], sort=True):
        output = grp["output_ts"].dropna()
        head = f"update_from_output({step}) on {shown(names, instance)}/dp{dp}"
        run = folded[(folded["instance"] == instance)]
        if len(output):
            head += f" at {_ms(int(output.iloc[0]) - start)}"
        elif len(run):
            first, last = int(run["first_step"].iloc[0]), int(run["last_step"].iloc[0])
            head += (f": an empty step, one of steps {first}..{last} recorded as one row (empty_run); their "
                     f"step_output is step {first}'s")
        else:
            head += ": no step_output recorded"
        out_console.print(head, markup=False)
        for rpc, lanes in grp.groupby("rpc", sort=False):
            cells = []
            for lane in lanes.itertuples(index=False):
                when = "" if pd.isna(lane.exec_end_ts) else f" {_ms(int(lane.exec_end_ts) - start)}"
                if not pd.isna(lane.wait_ns):  # the RPC's time blocked on another stage: idle, not work
                    span = int(lane.exec_end_ts) - int(lane.exec_begin_ts)
                    when += (f" (waited {int(lane.wait_ns) / 1e6:.3f} of {span / 1e6:.3f} ms for {lane.wait_for}, "
                             f"busy {(span - int(lane.wait_ns)) / 1e6:.3f} ms)")
                cells.append(f"pp{lane.pp_rank}/tp{lane.tp_rank} {lane.relation}{when}")
            out_console.print(f"  {rpc}: " + "; ".join(cells), markup=False, soft_wrap=True)
        before = (grp["relation"] == "before").sum()
        total = len(grp)
        if len(output):
            verdict = "yes" if before == total else "no"
            late = grp[grp["relation"] != "before"]
            tail = "" if before == total else " (not before: " + ", ".join(
                f"pp{x.pp_rank}/tp{x.tp_rank} {x.rpc} {x.relation}" for x in late.itertuples(index=False)) + ")"
            out_console.print(f"  waited for every rank: {verdict}, {before}/{total} exec_end before step_output"
                              + tail, markup=False, soft_wrap=True)
        elif len(run):
            out_console.print("  waited for every rank: not recorded for a step inside an empty run",
                              markup=False, soft_wrap=True)


@app.command("show")
def show(
    trace: TraceLocation,
    req: Optional[str] = typer.Option(None, "--req", help="Request id: its story on every instance."),
    step: Optional[int] = typer.Option(None, "--step", help="Step id: its story across scheduler, engine, ranks."),
    instance: Optional[str] = typer.Option(None, "--instance", help="Only this instance (the request's or step's): "
                                           "its readable name (prefill-0) or vLLM's id."),
    fmt: ShowFormat = typer.Option(ShowFormat.text, "--format", help="text or json."),
    full: bool = typer.Option(False, "--full", help="One line per req_sched row instead of runs."),
) -> None:
    """The chronological story of one request (--req) or one step (--step).

    --req follows the request across instances (P and D joined through req_add's remote_instance / remote_req).
    --step prints the step's schedule, submit, every rank's exec spans, its step_output and the completions it
    carried, then which ranks' exec_end came before the step_output and which after (or never): whether
    update_from_output waited for every PP rank.
    """
    # lazy: the CLI starts without the analysis stack (pdtrace --help stays fast)
    from pdtrace.analysis.story import (folded_steps, related_requests, request_rows, request_story, step_ranks,
                                        step_rows, step_story)

    if (req is None) == (step is None):
        raise UsageError("give exactly one of --req ID or --step K")
    where = f" on instance {instance}" if instance else ""
    if instance is not None:  # a readable name or vLLM's id: the id
        instance = resolve_instance(instance, footer_names(read_footers(trace)))
    if req is not None:
        loaded = warned(request_rows(trace, req, instance))  # the story's rows, not the trace's
        story = request_story(loaded, req, instance)
        if len(story) == 0:
            raise UsageError(f"request {req!r} not found in {trace}{where}")
        pairs = related_requests(loaded, req, instance)
        names = names_of(loaded)
        if fmt is ShowFormat.json:
            doc = {"trace": str(trace), "req": req, "requests": [{"instance": i, "req": r} for i, r in pairs],
                   "events": _records(story), "instance_names": _story_names(story, names)}
            typer.echo(json.dumps(doc, default=str))
            return
        _render_request(req, pairs, story, full, names)
        return
    loaded, lanes = step_rows(trace, int(step))  # type: ignore[arg-type]
    warned(loaded)
    story = step_story(loaded, int(step), instance)  # type: ignore[arg-type]
    if len(story) == 0:
        raise UsageError(f"step {step} not found in {trace}{where}")
    ranks = step_ranks(loaded, int(step), instance, lanes)  # type: ignore[arg-type]
    folded = folded_steps(loaded, int(step), instance)  # type: ignore[arg-type]
    names = names_of(loaded)
    if fmt is ShowFormat.json:
        start = int(story["ts_ns"].iloc[0])
        rank_records = _records(ranks)
        for rec in rank_records:
            for key in ("exec_begin_ts", "exec_end_ts", "output_ts"):
                if rec.get(key) is not None:
                    rec[key.replace("_ts", "_t_ns")] = int(rec[key]) - start
        doc = {"trace": str(trace), "step": int(step), "instance": instance,  # type: ignore[arg-type]
               "events": _records(story), "ranks": rank_records,
               # null for an empty step folded into a run: its own step_output was not recorded
               "waited_for_every_rank": {f"{i}/dp{d}": None if (g["relation"] == "empty_run").any()
                                         else bool((g["relation"] == "before").all())
                                         for (i, d), g in ranks.groupby(["instance", "dp_rank"])},
               "empty_run": _records(folded), "instance_names": _story_names(story, names)}
        typer.echo(json.dumps(doc, default=str))
        return
    _render_step(int(step), story, ranks, folded, names)  # type: ignore[arg-type]
