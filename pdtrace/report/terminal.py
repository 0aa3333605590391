"""The terminal report of `pdtrace analyze`, shaped like valgrind memcheck's.

Findings are grouped by context (same rule, subrule and code path), contexts ordered errors first, then by time.
For each context the first finding is shown in full: what went wrong, then its evidence in order (where the blocks
were freed, where they were allocated, what was still in flight, ...), each event with its time relative to the
start of the trace, step, seq and request; the other findings of the context follow as one line each (all of them
with `verbose`). Then the leak summary (blocks per instance, % of the pool), the bubble summary per PP rank, and the
memcheck line "ERROR SUMMARY: N errors from M contexts". Only renders: the numbers come from
`pdtrace.analysis.summarize_findings`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pdtrace import __version__

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
PREFIX = "==pdtrace== "
MORE_PER_CONTEXT = 5
TABLE_WIDTH = 110  # summary tables are not squeezed to 80 columns when stdout is a pipe


def _rel(ts: Any, start_ns: int | None) -> str:
    if ts is None or ts is pd.NA:
        return "-"
    try:
        ts = int(ts)
    except (TypeError, ValueError):
        return "-"
    if start_ns is None:
        return str(ts)
    return f"{(ts - start_ns) / 1e9:+.6f} s"  # signed: a flight dump's window may start before its first event


def _blocks(blocks: Any, limit: int = 12) -> str:
    blocks = list(blocks or [])
    if len(blocks) <= limit:
        return "[" + ", ".join(str(b) for b in blocks) + "]"
    return "[" + ", ".join(str(b) for b in blocks[:limit]) + f", ... +{len(blocks) - limit}]"


def _named(text: str, names: Mapping[str, str]) -> str:
    """A rule's message with the instances vLLM gave an id (`1796642343414415538`) called by their readable names,
    as everywhere else in this report (the JSON keeps the message as the rule wrote it)."""
    renamed = {inst: name for inst, name in names.items() if inst != name and inst in text}
    if not renamed:
        return text
    pattern = re.compile(r"(?<![\w-])(" + "|".join(re.escape(i) for i in sorted(renamed, key=len, reverse=True))
                         + r")(?![\w-])")
    return pattern.sub(lambda m: renamed[m.group(1)], text)


def _event_line(ev: dict[str, Any], start_ns: int | None, names: Mapping[str, str]) -> str:
    parts = [f"{ev.get('kind', '?'):<16}", f"{_rel(ev.get('ts_ns'), start_ns):>16}"]
    if ev.get("instance") is not None:
        where = names.get(str(ev["instance"]), str(ev["instance"]))
        if ev.get("pp_rank") is not None:
            where += f" pp{ev['pp_rank']}"
        if ev.get("tp_rank") is not None:
            where += f" tp{ev['tp_rank']}"
        parts.append(where)
    if ev.get("step") is not None:
        parts.append(f"step {ev['step']}")
    if ev.get("seq") is not None:
        parts.append(f"seq {ev['seq']}")
    if ev.get("req") is not None:
        parts.append(f"req {ev['req']}")
    if ev.get("blocks"):
        parts.append(f"blocks {_blocks(ev['blocks'])}")
    if ev.get("reason") is not None:
        parts.append(f"reason {ev['reason']}")
    if ev.get("status") is not None:
        parts.append(f"status {ev['status']}")
    return "  ".join(parts)


def _where(rec: dict[str, Any]) -> str:
    name = rec.get("instance_name")
    inst = str(name) if isinstance(name, str) else str(rec.get("instance"))
    dp = rec.get("dp_rank")
    if dp is not None and dp is not pd.NA and str(dp) != "nan":
        inst += f" dp{int(dp)}"
    return inst


def _finding(console: Console, rec: dict[str, Any], start_ns: int | None, count: int,
             names: Mapping[str, str]) -> None:
    sev = str(rec.get("severity"))
    head = Text(PREFIX)
    head.append(sev.upper(), style=SEVERITY_STYLE.get(sev, ""))
    head.append(f" {rec.get('rule')}/{rec.get('subrule')}  [{_where(rec)}]", style="bold")
    if rec.get("req") is not None:
        head.append(f"  req {rec['req']}")
    others = _others(rec)
    if others:
        head.append(f"  (and {others})")
    if rec.get("step") is not None and str(rec.get("step")) not in ("nan", "<NA>"):
        head.append(f"  step {rec['step']}")
    head.append(f"  at {_rel(rec.get('ts_ns'), start_ns)}")
    if count > 1:
        head.append(f"   ({count} in this context)", style="dim")
    console.print(head)
    console.print(Text(PREFIX + "   " + _named(str(rec.get("message")), names)))
    evidence = rec.get("evidence") or []
    width = max((len(str(ev.get("note") or ev.get("kind"))) for ev in evidence), default=0)
    for ev in evidence:
        label = str(ev.get("note") or ev.get("kind"))
        console.print(Text(f"{PREFIX}     {label:>{width}}: " + _event_line(ev, start_ns, names)), soft_wrap=True)


def _others(rec: dict[str, Any], limit: int = 8) -> str:
    """The finding's other requests (`requests`), listed after its main one."""
    names = [str(r) for r in (rec.get("requests") if isinstance(rec.get("requests"), (list, tuple)) else [])]
    if not names:
        return ""
    shown = ", ".join(names[:limit]) + (f", ... +{len(names) - limit}" if len(names) > limit else "")
    return f"req {shown}" if len(names) == 1 else f"reqs {shown}"


def _one_line(rec: dict[str, Any], start_ns: int | None, names: Mapping[str, str]) -> str:
    bits = [f"{_rel(rec.get('ts_ns'), start_ns)}", _where(rec)]
    if rec.get("req") is not None:
        bits.append(f"req {rec['req']}")
    others = _others(rec, 3)
    if others:
        bits.append(f"(and {others})")
    extra = rec.get("extra") or {}
    if isinstance(extra, dict) and extra.get("pp_rank") is not None:
        bits.append(f"pp{extra['pp_rank']}")
    if rec.get("blocks"):
        bits.append(f"blocks {_blocks(rec['blocks'], 6)}")
    message = _named(str(rec.get("message") or ""), names)
    bits.append(message if len(message) <= 110 else message[:107] + "...")
    return "  ".join(bits)


def _leak_table(leaks: list[dict[str, Any]], names: Mapping[str, str]) -> Table:
    held = any("still_held" in row for row in leaks)  # the column only where some blocks are still held
    table = Table(title="LEAK SUMMARY (KV blocks)", title_justify="left")
    # the instance column as wide as its longest name: a name cut to "prefill…" on a narrow console says nothing
    longest = min(max([len(names.get(str(r["instance"]), str(r["instance"]))) for r in leaks] + [8]), 40)
    for name in ("instance", "dp", "definitely", "indirectly", "possibly", "total", "requests", "% of pool") + \
            (("still held",) if held else ()):
        table.add_column(name, justify="left" if name == "instance" else "right", no_wrap=True,
                         min_width=longest if name == "instance" else len(name))
    for row in leaks:
        pct = row.get("pool_percent")
        cells = [names.get(str(row["instance"]), str(row["instance"])),
                 "-" if row.get("dp_rank") is None else str(row["dp_rank"]),
                 str(row["definitely"]), str(row["indirectly"]), str(row["possibly"]), str(row["blocks"]),
                 str(row["requests"]), "-" if pct is None else f"{pct:.1f}%"]
        if held:
            n = row.get("still_held")
            cells.append("-" if not n else f"{n} ({row.get('still_held_requests', 0)} req)")
        table.add_row(*cells)
    return table


def _bubble_table(bubbles: list[dict[str, Any]], names: Mapping[str, str]) -> Table:
    table = Table(title="BUBBLE SUMMARY (per PP rank)", title_justify="left")
    longest = min(max([len(names.get(str(r.get("instance")), str(r.get("instance")))) for r in bubbles] + [8]), 40)
    for name in ("instance", "dp", "pp rank", "idle", "lost", "avoidable", "main cause", "severity"):
        table.add_column(name, justify="left" if name in ("instance", "main cause", "severity") else "right",
                         no_wrap=True, min_width=longest if name == "instance" else max(len(name), 5))

    def pct(value: Any) -> str:
        return "-" if value is None else f"{100.0 * float(value):.1f}%"

    def shown(row: dict[str, Any]) -> str:
        return names.get(str(row.get("instance")), str(row.get("instance")))

    for row in sorted(bubbles, key=lambda r: (shown(r), r.get("pp_rank") or 0)):
        rank = row.get("pp_rank")
        p = row.get("p")
        table.add_row(shown(row), "-" if row.get("dp_rank") is None else str(row["dp_rank"]),
                      "-" if rank is None else (f"{rank}/{p}" if p else str(rank)), pct(row.get("idle_fraction")),
                      pct(row.get("lost_fraction")), pct(row.get("avoidable_fraction")), str(row.get("cause") or "-"),
                      str(row.get("severity")))
    return table


def render_terminal(findings: pd.DataFrame, summary: dict[str, Any], console: Console, trace: str | None = None,
                    start_ns: int | None = None, verbose: bool = False) -> None:
    """Print the memcheck-shaped report of a findings DataFrame (as returned by pdtrace.analysis.analyze). Instances
    are printed by their readable names (`attrs["instance_names"]`, `pdtrace.trace.names`)."""
    names: Mapping[str, str] = findings.attrs.get("instance_names") or {}
    console.print(Text(f"{PREFIX}pdtrace {__version__}: memcheck for the KV cache"))
    rules = ", ".join(summary.get("rules") or []) or "-"
    events = summary.get("events")
    console.print(Text(f"{PREFIX}trace {trace or '<memory>'}"
                       + (f" ({events:,} events)" if isinstance(events, int) else "") + f"; rules: {rules}"),
                  soft_wrap=True)
    renamed = {inst: name for inst, name in names.items() if name != inst}
    if renamed:  # how vLLM's logs call the instances this report names
        console.print(Text(f"{PREFIX}instances: " + ", ".join(f"{name} = {inst}" for inst, name in
                                                              sorted(renamed.items(), key=lambda x: x[1]))),
                      soft_wrap=True)
    window = summary.get("window")
    if window:
        console.print(Text(f"{PREFIX}WINDOW: {window['how']}, {_rel(window['start_ns'], start_ns)} from the "
                           f"trace's start: {window['meaning']}"), soft_wrap=True)
    for name, split in (summary.get("windows") or {}).items():
        console.print(Text(f"{PREFIX}{names.get(name, name)}: analysed in {split['windows']} time windows "
                           "(pdtrace.analysis.windows)"
                           + (f"; {split['carried']} requests began more than a window before a cut and were "
                              "carried alone (their findings say so)" if split.get("carried") else "")),
                      soft_wrap=True)
    console.print(Text(PREFIX))
    if len(findings):
        records = findings.to_dict("records")  # one per finding
        contexts: dict[str, list[dict[str, Any]]] = {}
        for rec in records:  # findings arrive sorted: errors first, then by time
            contexts.setdefault(str(rec.get("context") or f"{rec.get('rule')}:{rec.get('subrule')}"), []).append(rec)
        for members in contexts.values():
            first = members[0]
            _finding(console, first, start_ns, len(members), names)
            rest = members[1:] if verbose else members[1:1 + MORE_PER_CONTEXT]
            if verbose:
                for rec in rest:
                    console.print(Text(PREFIX))
                    _finding(console, rec, start_ns, 1, names)
            else:
                for rec in rest:
                    console.print(Text(f"{PREFIX}   also: {_one_line(rec, start_ns, names)}"), soft_wrap=True)
                hidden = len(members) - 1 - len(rest)
                if hidden > 0:
                    console.print(Text(f"{PREFIX}   ... and {hidden} more in this context (--verbose shows all)"))
            console.print(Text(PREFIX))
    if summary.get("leaks"):
        console.print(_leak_table(summary["leaks"], names), width=max(console.width, TABLE_WIDTH))
    if summary.get("bubbles"):
        console.print(_bubble_table(summary["bubbles"], names), width=max(console.width, TABLE_WIDTH))
    sev = summary.get("by_severity", {})
    line = Text(f"{PREFIX}ERROR SUMMARY: ")
    line.append(f"{summary.get('errors', 0)} errors from {summary.get('error_contexts', 0)} contexts",
                style="bold red" if summary.get("errors") else "bold green")
    line.append(f" (warnings: {sev.get('warning', 0)}, info: {sev.get('info', 0)})")
    console.print(line)
