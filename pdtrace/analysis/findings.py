"""Findings: what every rule returns and every reporter renders. One row per finding; few rows, so the list-valued
columns (`blocks`, `evidence`) hold Python objects."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import pandas as pd

from pdtrace.errors import UsageError

if TYPE_CHECKING:
    from pdtrace.analysis.registry import Rule

#: Columns of a findings DataFrame, in order. `evidence` is a list of dicts with keys kind, ts_ns, seq, req, step
#: (plus optional instance, pid, pp_rank, tp_rank, blocks, note). `context` groups findings the way memcheck's
#: "N errors from M contexts" does (same rule, subrule and code path). `extra` is a dict of rule-specific values
#: (e.g. a leak's class, a bubble's duration).
#: `req` names the finding's main request; `requests` (added in pdtrace 0.1, after `extra`) the other requests its
#: evidence lies in (a list of ids of the same instance, empty when none), so that each can be looked up with
#: `pdtrace show --req`. A rule may set `requests` itself (to name a request its evidence does not cite); where it
#: leaves it out, `named_requests` derives it from the evidence.
FINDING_COLUMNS: tuple[str, ...] = (
    "rule", "subrule", "severity", "instance", "dp_rank", "req", "blocks", "step", "ts_ns", "message",
    "evidence", "context", "extra", "requests",
)
#: Columns a rule (a plugin written before they existed) may leave out: filled with None.
OPTIONAL_FINDING_COLUMNS: tuple[str, ...] = ("requests",)

SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2}

#: Added by `named_findings` once the rules' findings are joined (not a rule's to fill): the instance's readable
#: name (`pdtrace.trace.names`), beside `instance`, which stays vLLM's id. The JSON puts it after `instance`.
NAME_COLUMN = "instance_name"


def named_findings(findings: pd.DataFrame, names: dict[str, str]) -> pd.DataFrame:
    """The findings with `instance_name` (NAME_COLUMN), and `attrs["instance_names"]` = every instance's name of
    the trace (the text report names the instances of evidence and summaries by it). Order and attrs kept."""
    out = findings.assign(**{NAME_COLUMN: pd.Series([names.get(str(i), str(i)) for i in findings["instance"]],
                                                    index=findings.index, dtype=object)})
    out.attrs = {**findings.attrs, "instance_names": dict(names)}
    return out


_EMPTY: list[pd.DataFrame] = []


def empty_findings() -> pd.DataFrame:
    """A findings DataFrame without rows: a copy of one built once (building it costs ~1 ms, and every rule without
    findings returns one, per window of a long trace)."""
    if not _EMPTY:
        _EMPTY.append(pd.DataFrame({c: pd.Series(dtype=object) for c in FINDING_COLUMNS}))
    return _EMPTY[0].copy()


def findings_frame(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Build a findings DataFrame from dicts (missing keys become None)."""
    rows = [{c: rec.get(c) for c in FINDING_COLUMNS} for rec in records]
    if not rows:
        return empty_findings()
    # object columns: a column of ints with a None would become float64 (ts_ns 1.7e18 loses its last digits)
    return pd.DataFrame({c: pd.Series([row[c] for row in rows], dtype=object) for c in FINDING_COLUMNS})


def named_requests(frame: pd.DataFrame) -> pd.DataFrame:
    """`requests` filled where the rule left it None: the distinct requests of the finding's evidence on the
    finding's instance (evidence rows without an instance count as its own), in evidence order, less `req`. One
    pass over the findings (few rows), no trace access."""
    if len(frame) == 0 or "requests" not in frame.columns or frame["requests"].notna().all():
        return frame
    filled = []
    for req, instance, evidence, given in zip(frame["req"], frame["instance"], frame["evidence"], frame["requests"]):
        if isinstance(given, (list, tuple)):
            filled.append(list(given))
            continue
        names: list[str] = []
        for ev in evidence if isinstance(evidence, (list, tuple)) else []:
            other = ev.get("req") if isinstance(ev, dict) else None
            if other is None or str(other) == str(req) or str(other) in names:
                continue
            if ev.get("instance", instance) == instance:
                names.append(str(other))
        filled.append(names)
    frame = frame.copy()
    frame["requests"] = pd.Series(filled, index=frame.index, dtype=object)
    return frame


def explained_once(findings: pd.DataFrame, fallback: Iterable[str]) -> pd.DataFrame:
    """The findings less those of a fallback rule (`Rule.fallback`) that another rule explains: a finding of
    another rule at warning or error on the same (instance, dp_rank) naming the same request (its `req`, or one of
    its `requests`), or citing in its evidence the event the fallback finding is about (its first evidence row:
    kind, ts_ns, seq). Order is kept; `attrs` too."""
    fallback = set(fallback)
    if len(findings) == 0 or not fallback:
        return findings
    is_fallback = findings["rule"].isin(fallback).to_numpy()
    if not is_fallback.any():
        return findings
    claimed: set[tuple[str, str, str]] = set()
    cited: set[tuple[str, Any, Any, Any]] = set()
    strong = ~is_fallback & findings["severity"].isin(("warning", "error")).to_numpy()
    for instance, dp, req, others, evidence in zip(findings["instance"][strong], findings["dp_rank"][strong],
                                                   findings["req"][strong], findings["requests"][strong],
                                                   findings["evidence"][strong]):
        for name in [req, *(others if isinstance(others, (list, tuple)) else [])]:
            if name is not None:
                claimed.add((str(instance), str(dp), str(name)))
        for ev in evidence if isinstance(evidence, (list, tuple)) else []:
            if isinstance(ev, dict):
                cited.add((str(ev.get("instance", instance)), ev.get("kind"), ev.get("ts_ns"), ev.get("seq")))

    def explained(instance: Any, dp: Any, req: Any, evidence: Any) -> bool:
        if req is not None and (str(instance), str(dp), str(req)) in claimed:
            return True
        event = evidence[0] if isinstance(evidence, (list, tuple)) and evidence else None
        return isinstance(event, dict) and (str(event.get("instance", instance)), event.get("kind"),
                                            event.get("ts_ns"), event.get("seq")) in cited

    keep = [not fb or not explained(instance, dp, req, evidence)
            for fb, instance, dp, req, evidence in zip(is_fallback, findings["instance"], findings["dp_rank"],
                                                       findings["req"], findings["evidence"])]
    if all(keep):
        return findings
    out = findings[keep].reset_index(drop=True)
    out.attrs = findings.attrs
    return out


def checked_findings(frame: pd.DataFrame, rule: "Rule") -> pd.DataFrame:
    """A rule's findings with exactly the finding columns (none: an empty frame); missing columns: UsageError."""
    if frame is None or len(frame) == 0:
        return empty_findings()
    missing = [c for c in FINDING_COLUMNS if c not in frame.columns and c not in OPTIONAL_FINDING_COLUMNS]
    if missing:
        raise UsageError(f"rule {rule.id!r} returned findings without the columns {missing}")
    absent = [c for c in OPTIONAL_FINDING_COLUMNS if c not in frame.columns]
    if absent:
        frame = frame.assign(**{c: pd.Series([None] * len(frame), index=frame.index, dtype=object) for c in absent})
    return named_requests(frame[list(FINDING_COLUMNS)])
