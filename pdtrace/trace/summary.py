"""What a trace holds, in one dict: what `pdtrace info` prints (as a table, or as JSON with these exact keys).

`summarize(trace)` returns (keys are stable; lists are sorted; times are integers in ns since the Unix epoch):

    trace            the trace's path (null for an in-memory trace)
    events           rows loaded
    files            part files loaded;  skipped_files: [{path, reason}] of the files left out
    dropped_events   events the recorders dropped (per writer folder the largest running total of its files, summed)
    sources, schema_versions, pdtrace_versions   distinct values over the loaded files
    time             {start_ns, end_ns, duration_ns, start, end (ISO 8601 UTC)}; null values when no events
    instances        [{instance, roles, pids, dp_ranks, pp_ranks, tp_ranks, events, requests}]: `requests` counts
                     distinct non-null `req` values of the instance; rank lists leave out nulls
    schedulers       [{instance, dp_rank, steps, sched_events, first_step, last_step}] per (instance, dp_rank) with
                     scheduler rows: `sched_events` counts `sched` rows, `steps` counts the steps they stand for
                     (a row with detail `empty_run` = k stands for k steps), first/last_step are the lowest and
                     highest step on a `sched` row (null without one)
    kinds            {kind: rows}, format kinds first in the format's order, then unknown kinds by name
    requests         distinct requests summed over instances
    manifest         {command, vllm_version, vllm_table, created} from _manifest.json (null values where absent),
                     or null
    warnings         the loader's warnings (skipped files, unknown kinds, a bad manifest)

Algorithm: a few Arrow hash group-bys over the whole table (per instance; per scheduler on the `sched` rows),
`value_counts` of `kind`, `min_max` of `ts_ns`, and a regex extraction of `empty_run` from the `detail` of `sched`
rows; no Python loop over events.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.format import KINDS
from pdtrace.trace.model import Trace

#: The columns `summarize` reads: load only these (`open_trace(path, columns=SUMMARY_COLUMNS)`) to save time.
SUMMARY_COLUMNS = ("ts_ns", "instance", "role", "pid", "component", "dp_rank", "pp_rank", "tp_rank", "kind",
                   "step", "req", "detail")


def _iso(ts_ns: int | None) -> str | None:
    if ts_ns is None:
        return None
    seconds, rest = divmod(int(ts_ns), 1_000_000_000)
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{rest:09d}Z"


def _sorted_values(values: list[Any] | None) -> list[Any]:
    return sorted(v for v in (values or []) if v is not None)


def _manifest_summary(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    if manifest is None:
        return None
    vllm = manifest.get("vllm")
    vllm_version = manifest.get("vllm_version")
    if vllm_version is None and isinstance(vllm, dict):
        vllm_version = vllm.get("version")
    elif vllm_version is None and isinstance(vllm, str):
        vllm_version = vllm
    command = manifest.get("command")
    if isinstance(command, list):
        command = " ".join(str(part) for part in command)
    created = manifest.get("created") or manifest.get("start_time") or manifest.get("started")
    return {"command": command, "vllm_version": vllm_version, "vllm_table": manifest.get("vllm_table"),
            "created": created}


def _time_span(table: pa.Table) -> dict[str, Any]:
    if table.num_rows == 0:
        return {"start_ns": None, "end_ns": None, "duration_ns": None, "start": None, "end": None}
    bounds = pc.min_max(table.column("ts_ns")).as_py()
    start, end = bounds["min"], bounds["max"]
    return {"start_ns": start, "end_ns": end, "duration_ns": end - start, "start": _iso(start), "end": _iso(end)}


def _instances(table: pa.Table) -> list[dict[str, Any]]:
    if table.num_rows == 0:
        return []
    # One hash group-by over the identity columns gives the distinct (instance, role, pid, ranks) combinations, a
    # few per writer; folding those per instance in Python is cheap. Requests need their own distinct count.
    keys = ["instance", "role", "pid", "dp_rank", "pp_rank", "tp_rank"]
    combos = table.select(keys + ["ts_ns"]).group_by(keys).aggregate([("ts_ns", "count")]).to_pylist()
    requests = {g["instance"]: g["req_count_distinct"]
                for g in table.select(["instance", "req"]).group_by("instance")
                .aggregate([("req", "count_distinct")]).to_pylist()}
    folded: dict[str, dict[str, Any]] = {}
    for combo in combos:
        row = folded.setdefault(combo["instance"], {"roles": set(), "pids": set(), "dp_ranks": set(),
                                                    "pp_ranks": set(), "tp_ranks": set(), "events": 0})
        row["roles"].add(combo["role"])
        row["pids"].add(combo["pid"])
        row["dp_ranks"].add(combo["dp_rank"])
        row["pp_ranks"].add(combo["pp_rank"])
        row["tp_ranks"].add(combo["tp_rank"])
        row["events"] += combo["ts_ns_count"]
    rows = []
    for instance in sorted(folded):
        row = folded[instance]
        rows.append({
            "instance": instance,
            **{name: _sorted_values(list(row[name])) for name in ("roles", "pids", "dp_ranks", "pp_ranks",
                                                                  "tp_ranks")},
            "events": row["events"],
            "requests": requests.get(instance, 0),
        })
    return rows


def _schedulers(table: pa.Table) -> list[dict[str, Any]]:
    if table.num_rows == 0:
        return []
    # Select before filtering: filtering copies every column it keeps.
    on_scheduler = table.select(["instance", "dp_rank"]).filter(pc.equal(table.column("component"), "scheduler"))
    keys = on_scheduler.group_by(["instance", "dp_rank"]).aggregate([]).to_pylist()
    sched = table.select(["instance", "dp_rank", "step", "detail"]).filter(pc.equal(table.column("kind"), "sched"))
    # Rows without `empty_run` give a null match: they stand for one step.
    runs = pc.struct_field(pc.extract_regex(pc.fill_null(sched.column("detail"), ""),
                                            r'"empty_run"\s*:\s*(?P<k>\d+)'), [0])
    extra_steps = pc.subtract(pc.cast(pc.fill_null(runs, "1"), pa.int64()), 1)
    sched = sched.drop_columns(["detail"]).append_column("extra", extra_steps)
    stats = {
        (g["instance"], g["dp_rank"]): g
        for g in sched.group_by(["instance", "dp_rank"]).aggregate([
            ("step", "min"), ("step", "max"), ("extra", "sum"), ("extra", "count"),
        ]).to_pylist()
    }
    rows = []
    for key in keys:  # one row per scheduler: a handful
        g = stats.get((key["instance"], key["dp_rank"]))
        rows.append({
            "instance": key["instance"],
            "dp_rank": key["dp_rank"],
            "steps": (g["extra_count"] + (g["extra_sum"] or 0)) if g else 0,
            "sched_events": g["extra_count"] if g else 0,
            "first_step": g["step_min"] if g else None,
            "last_step": g["step_max"] if g else None,
        })
    return sorted(rows, key=lambda r: (r["instance"], -1 if r["dp_rank"] is None else r["dp_rank"]))


def _kinds(table: pa.Table) -> dict[str, int]:
    if table.num_rows == 0:
        return {}
    column = table.column("kind")
    counted = {c["values"]: c["counts"] for c in pc.value_counts(column.combine_chunks()).to_pylist()}
    ordered = [k for k in KINDS if k in counted] + sorted(k for k in counted if k not in KINDS)
    return {k: counted[k] for k in ordered}


def summarize(trace: Trace) -> dict[str, Any]:
    """Summarise a trace (loaded with at least SUMMARY_COLUMNS); keys as in the module docstring."""
    missing = [c for c in SUMMARY_COLUMNS if c not in trace.table.column_names]
    if missing:
        raise ValueError(f"summarize needs the columns {', '.join(missing)}; load them with open_trace")
    table = trace.table.select(list(SUMMARY_COLUMNS))
    if any(pa.types.is_dictionary(t) for t in table.schema.types):
        table = table.unify_dictionaries()
    instances = _instances(table)
    return {
        "trace": trace.path,
        "events": table.num_rows,
        "files": len(trace.files),
        "skipped_files": [{"path": s.path, "reason": s.reason} for s in trace.skipped],
        "dropped_events": trace.dropped_events,
        "sources": trace.sources,
        "schema_versions": sorted({f.schema_version for f in trace.files}),
        "pdtrace_versions": sorted({f.pdtrace_version for f in trace.files}),
        "time": _time_span(table),
        "instances": instances,
        "schedulers": _schedulers(table),
        "kinds": _kinds(table),
        "requests": sum(i["requests"] for i in instances),
        "manifest": _manifest_summary(trace.manifest),
        "warnings": list(trace.warnings),
    }
