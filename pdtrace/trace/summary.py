"""What a trace holds, in one dict: what `pdtrace info` prints (as a table, or as JSON with these exact keys).

`summarize(trace)` returns (keys are stable; lists are sorted; times are integers in ns since the Unix epoch):

    trace            the trace's path (null for an in-memory trace)
    events           rows loaded
    files            part files loaded;  skipped_files: [{path, reason}] of the files left out
    dropped_events   events the recorders dropped (per writer folder the largest running total of its files, summed)
    sources, schema_versions, pdtrace_versions   distinct values over the loaded files
    time             {start_ns, end_ns, duration_ns, start, end (ISO 8601 UTC)}; null values when no events
    instances        [{instance, name, roles, pids, dp_ranks, pp_ranks, tp_ranks, events, requests}]: `name` is the
                     readable name (`pdtrace.trace.names`, added), `requests` counts distinct non-null `req` values
                     of the instance; rank lists leave out nulls
    schedulers       [{instance, name, dp_rank, steps, sched_events, first_step, last_step}] per (instance, dp_rank)
                     with scheduler rows: `sched_events` counts `sched` rows, `steps` counts the steps they stand for
                     (a row with detail `empty_run` = k stands for k steps), first/last_step are the lowest and
                     highest step on a `sched` row (null without one)
    kinds            {kind: rows}, format kinds first in the format's order, then unknown kinds by name
    requests         distinct requests summed over instances
    manifest         {command, vllm_version, vllm_table, created} from _manifest.json (null values where absent),
                     or null
    warnings         the loader's warnings (skipped files, unknown kinds, a bad manifest)

`summarize_footers(footers, instances_of)` gives the same keys from the part files' footers alone (row counts,
row-group statistics, pdtrace metadata), for `pdtrace info` on a large trace: exact for trace, events, files,
skipped_files, dropped_events, sources, versions, time, manifest and the instance names; per instance, `events` when
its files hold no other instance, and roles / pids / ranks when every row group of its files holds one value of
them (the recorder writes one file per process), else null; `schedulers`, `kinds`, `requests` and per-instance
`requests` need the rows and are null. `rows_read` (added key, also in `summarize`) says which it is.
`named_summary(summary, names)` adds `name` (the readable name, `pdtrace.trace.names`) after `instance` in every
`instances` and `schedulers` row: what `pdtrace info` prints, with names from the whole trace's footers.
`merge_summaries(parts, footers, names)` folds summaries of parts of the trace into the whole trace's: of
disjoint instance partitions, or of groups of one instance's files (`file_groups`: what `info --rows` reads at a
time, so memory holds a group, not an instance of hours) with the union of each part's `request_names` (a request's
rows span its files, so its count is not a sum).

Algorithm: a few Arrow hash group-bys over the whole table (per instance; per scheduler on the `sched` rows),
`value_counts` of `kind`, `min_max` of `ts_ns`, and a regex extraction of `empty_run` from the `detail` of `sched`
rows; no Python loop over events.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.format import KINDS
from pdtrace.trace.model import SkippedFile, Trace, dropped_events
from pdtrace.trace.names import names_of
from pdtrace.trace.reader import column_stats

if TYPE_CHECKING:  # pragma: no cover
    from pdtrace.trace.reader import TraceFooters

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


def request_names(trace: Trace) -> dict[str, set[str]]:
    """Per instance, the distinct non-null `req` values of the loaded rows (for `merge_summaries`)."""
    table = trace.table.select(["instance", "req"])
    if table.num_rows == 0:
        return {}
    if any(pa.types.is_dictionary(t) for t in table.schema.types):
        table = table.unify_dictionaries()
    groups = table.group_by("instance").aggregate([("req", "distinct")]).to_pylist()
    return {g["instance"]: {r for r in g["req_distinct"] if r is not None} for g in groups}


def file_groups(files: list[str], rows_of: dict[str, int], most: int) -> list[list[str]]:
    """`files` in consecutive groups of at most `most` rows by their footers (a larger file alone)."""
    groups: list[list[str]] = []
    rows = 0
    for name in files:
        if groups and rows + rows_of.get(name, 0) <= most:
            groups[-1].append(name)
            rows += rows_of.get(name, 0)
        else:
            groups.append([name])
            rows = rows_of.get(name, 0)
    return groups


def summarize(trace: Trace) -> dict[str, Any]:
    """Summarise a trace (loaded with at least SUMMARY_COLUMNS); keys as in the module docstring."""
    missing = [c for c in SUMMARY_COLUMNS if c not in trace.table.column_names]
    if missing:
        raise ValueError(f"summarize needs the columns {', '.join(missing)}; load them with open_trace")
    table = trace.table.select(list(SUMMARY_COLUMNS))
    if any(pa.types.is_dictionary(t) for t in table.schema.types):
        table = table.unify_dictionaries()
    instances = _instances(table)
    named = named_summary({"instances": instances, "schedulers": _schedulers(table)}, names_of(trace))
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
        "instances": named["instances"],
        "schedulers": named["schedulers"],
        "kinds": _kinds(table),
        "requests": sum(i["requests"] for i in instances),
        "manifest": _manifest_summary(trace.manifest),
        "warnings": list(trace.warnings),
        "rows_read": True,
    }


def _file_keys(footers: "TraceFooters") -> dict[str, Any]:
    """The keys that come from the file list alone, as `summarize` computes them from a loaded trace's."""
    files = footers.files
    return {
        "trace": str(footers.root),
        "files": len(files),
        "skipped_files": [{"path": s.path, "reason": s.reason} for s in footers.skipped],
        "dropped_events": dropped_events(files),
        "sources": sorted({f.source for f in files}),
        "schema_versions": sorted({f.schema_version for f in files}),
        "pdtrace_versions": sorted({f.pdtrace_version for f in files}),
        "manifest": _manifest_summary(footers.manifest),
    }


def _exact_values(metadatas: list[Any], name: str) -> list[Any] | None:
    """The distinct values of a column over the files' row groups when each row group holds one value (min ==
    max), sorted; None when a row group holds several or has no statistics."""
    values = set()
    for metadata in metadatas:
        stats = column_stats(metadata, name)
        if stats is None:
            return None
        for low, high in stats:
            if low != high:
                return None
            values.add(low.decode() if isinstance(low, bytes) else low)
    return sorted(values)


def summarize_footers(footers: "TraceFooters", instances_of: dict[str, list[str]]) -> dict[str, Any]:
    """The summary from the footers only (see the module docstring); `instances_of`: instance -> its files."""
    files = footers.files
    lows, highs = [], []
    for f in files:
        for low, high in column_stats(footers.metadata[f.path], "ts_ns") or []:
            lows.append(low)
            highs.append(high)
    start, end = (min(lows), max(highs)) if lows else (None, None)
    time_span = {"start_ns": start, "end_ns": end, "duration_ns": None if start is None else end - start,
                 "start": _iso(start), "end": _iso(end)}
    owners: dict[str, int] = {}
    for paths in instances_of.values():
        for path in paths:
            owners[path] = owners.get(path, 0) + 1
    rows_of = {f.path: f.rows for f in files}
    instances = []
    for name in sorted(instances_of):
        paths = instances_of[name]
        metadatas = [footers.metadata[p] for p in paths]
        own = all(owners[p] == 1 for p in paths)
        instances.append({
            "instance": name,
            "roles": _exact_values(metadatas, "role"),
            "pids": _exact_values(metadatas, "pid"),
            "dp_ranks": _exact_values(metadatas, "dp_rank"),
            "pp_ranks": _exact_values(metadatas, "pp_rank"),
            "tp_ranks": _exact_values(metadatas, "tp_rank"),
            "events": sum(rows_of[p] for p in paths) if own else None,
            "requests": None,
        })
    return {**_file_keys(footers), "events": sum(f.rows for f in files), "time": time_span,
            "instances": instances, "schedulers": None, "kinds": None, "requests": None,
            "warnings": list(footers.notes) + [f"{s.path}: skipped: {s.reason}" for s in footers.skipped],
            "rows_read": False}


def named_summary(summary: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The summary with each instance's readable name, `name`, after `instance` in its instances and schedulers
    rows (the id stays: it is how vLLM's own logs call the instance)."""
    def named(row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in row.items():
            if key != "name":
                out[key] = value
            if key == "instance":
                out["name"] = names.get(str(value), str(value))
        return out

    return {**summary, "instances": [named(r) for r in summary["instances"]],
            "schedulers": None if summary["schedulers"] is None else [named(r) for r in summary["schedulers"]]}


def merge_summaries(parts: list[dict[str, Any]], footers: "TraceFooters",
                    names: dict[str, set[str]] | None = None) -> dict[str, Any]:
    """The whole trace's summary from `summarize` of parts of it, each read alone (module docstring): sums, unions
    and extremes of theirs, an instance or scheduler in several parts folded into one row; the file-level keys from
    the footers (every file, as one load would list them, but those a part could not decode: skipped, as one load
    skips them). `names`: per instance, the union of the parts' `request_names`, which count its requests (needed
    where one instance spans parts)."""
    unreadable = [SkippedFile(s["path"], s["reason"]) for p in parts for s in p["skipped_files"]
                  if all(s["path"] != k.path for k in footers.skipped)]
    if unreadable:
        gone = {s.path for s in unreadable}
        footers = replace(footers, files=[f for f in footers.files if f.path not in gone],
                          skipped=footers.skipped + unreadable)
    starts = [p["time"]["start_ns"] for p in parts if p["time"]["start_ns"] is not None]
    ends = [p["time"]["end_ns"] for p in parts if p["time"]["end_ns"] is not None]
    start, end = (min(starts), max(ends)) if starts else (None, None)
    counted: dict[str, int] = {}
    for part in parts:
        for kind, n in part["kinds"].items():
            counted[kind] = counted.get(kind, 0) + n
    ordered = [k for k in KINDS if k in counted] + sorted(k for k in counted if k not in KINDS)
    instances: dict[str, dict[str, Any]] = {}
    for row in (i for p in parts for i in p["instances"]):
        have = instances.setdefault(row["instance"], dict(row, events=0, requests=0))
        for key in ("roles", "pids", "dp_ranks", "pp_ranks", "tp_ranks"):
            have[key] = sorted(set(have[key]) | set(row[key]))
        have["events"] += row["events"]
        have["requests"] += row["requests"]
    for name, row in instances.items():
        if names is not None:
            row["requests"] = len(names.get(name, ()))
    schedulers: dict[tuple[Any, Any], dict[str, Any]] = {}
    for row in (r for p in parts for r in p["schedulers"]):
        have = schedulers.setdefault((row["instance"], row["dp_rank"]), dict(row, steps=0, sched_events=0))
        have["steps"] += row["steps"]
        have["sched_events"] += row["sched_events"]
        for key, pick in (("first_step", min), ("last_step", max)):
            known = [v for v in (have[key], row[key]) if v is not None]
            have[key] = pick(known) if known else None
    skipped = [f"{s.path}: skipped: {s.reason}" for s in footers.skipped]
    warnings = list(footers.notes)
    for part in parts:
        warnings.extend(w for w in part["warnings"] if w not in warnings and w not in skipped)
    rows = [instances[name] for name in sorted(instances)]
    merged = {**_file_keys(footers), "events": sum(p["events"] for p in parts),
              "time": {"start_ns": start, "end_ns": end, "duration_ns": None if start is None else end - start,
                       "start": _iso(start), "end": _iso(end)},
              "instances": rows,
              "schedulers": sorted(schedulers.values(),
                                   key=lambda r: (r["instance"], -1 if r["dp_rank"] is None else r["dp_rank"])),
              "kinds": {k: counted[k] for k in ordered},
              "requests": sum(i["requests"] for i in rows),
              "warnings": warnings + skipped, "rows_read": True}
    return {key: merged[key] for key in parts[0]} if parts else merged  # in summarize's order
