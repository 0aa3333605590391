"""Chrome Trace Event JSON (what ui.perfetto.dev and chrome://tracing open) from an export model.

Events: `M` metadata naming each process (instance) and thread (scheduler, rank, request), `X` complete slices,
`C` counters (blocks in use by owner state), `s`/`f` flow arrows (a P/D transfer). Timestamps are microseconds since
the trace start (`otherData.trace_start_ns` holds the start in ns since the epoch). Each line is built with Arrow's
string kernels over whole columns, so a million slices need no Python loop per event.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace import __version__
from pdtrace.export.model import ExportModel


def _text(values: object) -> pa.Array:
    """A JSON string body (without the quotes) per value."""
    arr = pa.array(np.asarray(values, dtype=object).astype(str), pa.string())
    arr = pc.replace_substring(arr, "\\", "\\\\")
    arr = pc.replace_substring(arr, '"', '\\"')
    return pc.replace_substring_regex(arr, r"[\x00-\x1f]", " ")


def _int(values: object) -> pa.Array:
    return pc.cast(pa.array(np.asarray(values, dtype=np.int64)), pa.string())


def _us(ns: object, t0_ns: int) -> pa.Array:
    """ns since the epoch -> microseconds since the trace start, to the ns."""
    rel = (np.asarray(ns, dtype=np.int64) - t0_ns) / 1000.0
    return pc.cast(pa.array(np.round(rel, 3)), pa.string())


def _join(*parts: object) -> pa.Array:
    return pc.binary_join_element_wise(*parts, "")


def _metadata(model: ExportModel) -> list[pa.Array]:
    p, t = model.processes, model.threads
    out = []
    if len(p):
        out.append(_join('{"name":"process_name","ph":"M","pid":', _int(p["pid"]), ',"args":{"name":"',
                         _text(p["name"]), '"}}'))
        out.append(_join('{"name":"process_sort_index","ph":"M","pid":', _int(p["pid"]), ',"args":{"sort_index":',
                         _int(p["sort"]), "}}"))
    if len(t):
        out.append(_join('{"name":"thread_name","ph":"M","pid":', _int(t["pid"]), ',"tid":', _int(t["tid"]),
                         ',"args":{"name":"', _text(t["name"]), '"}}'))
        out.append(_join('{"name":"thread_sort_index","ph":"M","pid":', _int(t["pid"]), ',"tid":', _int(t["tid"]),
                         ',"args":{"sort_index":', _int(t["tid"]), "}}"))
    return out


def _slices(model: ExportModel) -> pa.Array:
    s = model.slices
    value = s["arg_value"].to_numpy(np.float64)
    has = ~np.isnan(value)
    args = np.full(len(s), "", dtype=object)
    if has.any():
        keys = s["arg_key"].to_numpy(dtype=object)[has].astype(str)
        args[has] = (pd.Series(',"args":{"' + keys + '":').to_numpy(dtype=object)
                     + np.char.mod("%d", value[has]).astype(object) + "}")
    dur_us = pc.cast(pa.array(np.round(s["dur_ns"].to_numpy(np.int64) / 1000.0, 3)), pa.string())
    return _join('{"name":"', _text(s["name"]), '","cat":"', _text(s["cat"]), '","ph":"X","ts":',
                 _us(s["ts_ns"], model.t0_ns), ',"dur":', dur_us, ',"pid":', _int(s["pid"]), ',"tid":',
                 _int(s["tid"]), pa.array(args.astype(str), pa.string()), "}")


def _counters(model: ExportModel) -> pa.Array:
    c = model.counters
    parts: list[object] = ['{"name":"', _text(c["name"]), '","ph":"C","ts":', _us(c["ts_ns"], model.t0_ns),
                           ',"pid":', _int(c["pid"]), ',"args":{']
    for i, series in enumerate(model.counter_series):
        parts += [("," if i else "") + f'"{series}":', _int(c[series])]
    parts.append("}}")
    return _join(*parts)


def _flows(model: ExportModel) -> list[pa.Array]:
    f = model.flows
    if len(f) == 0:
        return []
    start = _join('{"name":"KV transfer","cat":"kv","ph":"s","id":', _int(f["id"]), ',"ts":',
                  _us(f["src_ts_ns"], model.t0_ns), ',"pid":', _int(f["src_pid"]), ',"tid":', _int(f["src_tid"]), "}")
    end = _join('{"name":"KV transfer","cat":"kv","ph":"f","bp":"e","id":', _int(f["id"]), ',"ts":',
                _us(f["dst_ts_ns"], model.t0_ns), ',"pid":', _int(f["dst_pid"]), ',"tid":', _int(f["dst_tid"]), "}")
    return [start, end]


def chrome_json(model: ExportModel, trace_name: str = "") -> str:
    """The whole Chrome Trace Event JSON document as one string."""
    arrays = _metadata(model)
    if len(model.slices):
        arrays.append(_slices(model))
    if len(model.counters):
        arrays.append(_counters(model))
    arrays += _flows(model)
    lines = pa.concat_arrays([a.cast(pa.string()) for a in arrays]) if arrays else pa.array([], pa.string())
    body = pc.binary_join(pa.ListArray.from_arrays(pa.array([0, len(lines)], pa.int32()), lines), ",\n")[0].as_py()
    other = json.dumps({"pdtrace": __version__, "trace": trace_name, "trace_start_ns": model.t0_ns,
                        "time_unit": "ts and dur in microseconds since trace_start_ns"})
    return '{"traceEvents":[\n' + (body or "") + '\n],\n"displayTimeUnit":"ms",\n"otherData":' + other + "}\n"


def write_chrome(model: ExportModel, path: str | Path, trace_name: str = "") -> None:
    Path(path).write_text(chrome_json(model, trace_name), encoding="utf-8")
