"""`pdtrace analyze --format json`: the findings document of docs/trace-format.md ("Findings").

    {"pdtrace": "<version>", "trace": "<path>", "summary": {...}, "findings": [{rule, subrule, severity, instance,
     instance_name, dp_rank, req, blocks, step, ts_ns, message, evidence: [{kind, ts_ns, seq, req, step, ...}],
     context, extra, requests}]}

`summary` is `pdtrace.analysis.summarize_findings`. Only renders: numpy and pandas scalars become JSON numbers,
missing values null.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from pdtrace import __version__
from pdtrace.analysis.findings import FINDING_COLUMNS, NAME_COLUMN


def _plain(value: Any) -> Any:
    """A JSON-safe copy: numpy/pandas scalars to Python, NA/NaN to None, containers recursively."""
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _plain(value.tolist())
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "item"):
        return _plain(value.item())
    return str(value)


def findings_document(findings: pd.DataFrame, summary: dict[str, Any], trace: str | None) -> dict[str, Any]:
    """The findings JSON document as a dict."""
    records = []
    for rec in findings.to_dict("records"):  # one per finding
        item = {}
        for c in FINDING_COLUMNS:
            item[c] = _plain(rec.get(c))
            if c == "instance" and NAME_COLUMN in rec:  # added: the readable name after vLLM's id
                item[NAME_COLUMN] = _plain(rec[NAME_COLUMN])
        item["blocks"] = item["blocks"] or []
        item["evidence"] = item["evidence"] or []
        item["extra"] = item["extra"] or {}
        item["requests"] = item["requests"] or []
        records.append(item)
    return {"pdtrace": __version__, "trace": trace, "summary": _plain(summary), "findings": records}


def render_json(findings: pd.DataFrame, summary: dict[str, Any], trace: str | None, indent: int | None = 2) -> str:
    return json.dumps(findings_document(findings, summary, trace), indent=indent)
