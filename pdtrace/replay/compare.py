"""The scheduler's decisions of a recording and of its replay, side by side (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd


@dataclass(frozen=True)
class Decision:
    """One non-empty step of one scheduler: what it scheduled, preempted and freed (requests as workload indices;
    an id the workload does not know keeps its text)."""

    step: int
    scheduled: tuple[tuple[Any, int], ...]
    preempted: tuple[Any, ...]
    freed: tuple[tuple[Any, str], ...]

    def same_as(self, other: Decision) -> bool:
        return (self.scheduled, self.preempted, self.freed) == (other.scheduled, other.preempted, other.freed)


@dataclass
class SideReport:
    """One side's comparison: the decisions each run made, how many matched, the first that did not."""

    role: str
    recorded: int
    replayed: int
    matched: int
    first_divergence: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.matched / max(self.recorded, self.replayed, 1)


def decisions(events: pd.DataFrame, index_of: dict[str, int]) -> list[Decision]:
    """A scheduler's non-empty steps in step order. Algorithm: group its `req_sched`, `req_preempt` and
    `blocks_free` rows by step; each step's entries sorted, requests named by `index_of`."""
    def key(req: Any) -> Any:
        return index_of.get(str(req), str(req))

    rows = events[events["kind"].isin(("req_sched", "req_preempt", "blocks_free")) & events["step"].notna()]
    out: list[Decision] = []
    for step, group in rows.groupby("step", sort=True):
        sched = group[group["kind"] == "req_sched"]
        if sched.empty:
            continue
        scheduled = tuple(sorted(((key(r), int(n)) for r, n in zip(sched["req"], sched["n"].fillna(0))), key=str))
        preempted = tuple(sorted((key(r) for r in group.loc[group["kind"] == "req_preempt", "req"]), key=str))
        frees = group[group["kind"] == "blocks_free"]
        freed = tuple(sorted(((key(r), str(reason)) for r, reason in zip(frees["req"], frees["reason"])), key=str))
        out.append(Decision(int(step), scheduled, preempted, freed))
    return out


def _describe(rec: Decision | None, rep: Decision | None) -> dict[str, Any]:
    """What differs between two decisions (None: that run had no such step)."""
    out: dict[str, Any] = {"recorded_step": rec.step if rec else None, "replayed_step": rep.step if rep else None}
    if rec is None or rep is None:
        out["what"] = "the replay made fewer decisions" if rep is None else "the replay made more decisions"
        return out
    parts = []
    if rec.scheduled != rep.scheduled:
        a, b = dict(rec.scheduled), dict(rep.scheduled)
        only_rec = sorted(set(a) - set(b), key=str)
        only_rep = sorted(set(b) - set(a), key=str)
        tokens = sorted((k for k in set(a) & set(b) if a[k] != b[k]), key=str)
        if only_rec:
            parts.append(f"recorded scheduled {only_rec}, the replay did not")
        if only_rep:
            parts.append(f"the replay scheduled {only_rep}, the recording did not")
        if tokens:
            parts.append("tokens differ for " + ", ".join(f"{k}: {a[k]} vs {b[k]}" for k in tokens[:5]))
    if rec.preempted != rep.preempted:
        parts.append(f"preempted {list(rec.preempted)} vs {list(rep.preempted)}")
    if rec.freed != rep.freed:
        parts.append(f"freed {list(rec.freed)} vs {list(rep.freed)}")
    out["what"] = "; ".join(parts)
    return out


def compare_decisions(role: str, recorded: list[Decision], replayed: list[Decision]) -> SideReport:
    """Position by position: a decision matches the one at the same place of the other run."""
    matched = sum(1 for a, b in zip(recorded, replayed) if a.same_as(b))
    report = SideReport(role, len(recorded), len(replayed), matched)
    for i in range(max(len(recorded), len(replayed))):
        a = recorded[i] if i < len(recorded) else None
        b = replayed[i] if i < len(replayed) else None
        if a is None or b is None or not a.same_as(b):
            report.first_divergence = {"decision": i, **_describe(a, b)}
            break
    return report
