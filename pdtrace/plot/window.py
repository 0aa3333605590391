"""What part of a trace a plot or an export shows: a time window (seconds from the trace start), instances and
requests. Shared by `pdtrace plot` and `pdtrace export`; no matplotlib here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

from pdtrace.analysis import analyze, available_rules
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.findings import empty_findings
from pdtrace.analysis.parallel import shared_table
from pdtrace.analysis.requests import request_table
from pdtrace.analysis.timelines import request_phases, trace_span
from pdtrace.errors import PdtraceError, UsageError
from pdtrace.trace.names import names_of, resolve_instances
from pdtrace.trace.names import shown as shown_name


class EmptySelection(PdtraceError):
    """The selection (window, instance, request) holds nothing to draw or export: exit 2 with one line."""


def no_requests(requests: Iterable[str], instances: Iterable[str]) -> EmptySelection:
    """The one-line error (exit 2) for --request names none of which the trace (or --instance) holds."""
    names = sorted(instances)
    return EmptySelection(f"nothing to show: no request {', '.join(sorted(requests))} in the trace"
                          + (f" on instance {', '.join(names)}" if names else ""))


@dataclass(frozen=True)
class Window:
    """A selection as the user gives it: seconds from the trace start, instance names, request ids."""

    since_s: float | None = None
    until_s: float | None = None
    instances: tuple[str, ...] = ()
    requests: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.instances:
            parts.append("instance " + ", ".join(self.instances))
        if self.requests:
            parts.append("request " + ", ".join(self.requests))
        if self.since_s is not None or self.until_s is not None:
            lo = f"{self.since_s:g}" if self.since_s is not None else "start"
            hi = f"{self.until_s:g}" if self.until_s is not None else "end"
            parts.append(f"{lo} s to {hi} s")
        return "; ".join(parts) if parts else "the whole trace"

    def bounds(self, t0: int, t1: int) -> tuple[int, int]:
        """[lo_ns, hi_ns] of --since and --until on a trace spanning [t0, t1] (the trace's own where not given);
        UsageError for negative or reversed bounds, EmptySelection for a window outside the trace."""
        if self.since_s is not None and self.since_s < 0 or self.until_s is not None and self.until_s < 0:
            raise UsageError("--since and --until are seconds from the trace start and must not be negative")
        if self.since_s is not None and self.until_s is not None and self.until_s <= self.since_s:
            raise UsageError(f"--until ({self.until_s:g}) must be after --since ({self.since_s:g})")
        lo = t0 + int(round(self.since_s * 1e9)) if self.since_s is not None else t0
        hi = t0 + int(round(self.until_s * 1e9)) if self.until_s is not None else t1
        if hi < lo:
            raise self.outside(t0, t1)
        return lo, hi

    def outside(self, t0: int, t1: int) -> "EmptySelection":
        return EmptySelection(f"nothing to show: the window ({self.describe()}) is outside the trace, which lasts "
                              f"{(t1 - t0) / 1e9:g} s")


@dataclass(frozen=True)
class Selection:
    """A window resolved against a trace: absolute ns bounds [lo_ns, hi_ns], the trace start, and filters."""

    t0_ns: int
    lo_ns: int
    hi_ns: int
    instances: frozenset[str] | None
    requests: frozenset[str] | None
    window: Window
    #: (instance, req) of the named requests and their P/D peers (None without --request).
    request_pairs: frozenset[tuple[str, str]] | None = None
    #: instance -> readable name (`pdtrace.trace.names`): what labels and titles print
    names: Mapping[str, str] | None = None

    def shown(self, instance: object) -> str:
        """How a figure or export labels an instance: its readable name."""
        return shown_name(self.names or {}, instance)

    def empty(self, what: str) -> EmptySelection:
        return EmptySelection(f"nothing to show: no {what} in the selection ({self.window.describe()})")

    def keep_instance(self, values: pd.Series | np.ndarray) -> np.ndarray:
        if self.instances is None:
            return np.ones(len(values), dtype=bool)
        return pd.Series(values).isin(list(self.instances)).to_numpy(dtype=bool)

    def overlaps(self, start: pd.Series | np.ndarray, end: pd.Series | np.ndarray) -> np.ndarray:
        """Intervals [start, end] that meet the window."""
        return (np.asarray(end, dtype=np.int64) >= self.lo_ns) & (np.asarray(start, dtype=np.int64) <= self.hi_ns)

    def current(self, lane: np.ndarray, freed: np.ndarray, start: pd.Series | np.ndarray,
                end: pd.Series | np.ndarray) -> np.ndarray:
        """Of request phases (`lane`: an integer per request; `freed`: the phase is `freed`), those that meet the
        window, of the requests that do more in it than stay freed: a request freed before the window (its freed
        phase runs to the end of the trace) is left out, or on a long trace every request ever served would crowd
        out the window's own."""
        lane = np.asarray(lane, dtype=np.int64)
        meet = self.overlaps(start, end)
        live = meet & ~(np.asarray(freed, dtype=bool) & (np.asarray(start, dtype=np.int64) < self.lo_ns))
        alive = np.zeros(int(lane.max()) + 1 if len(lane) else 0, dtype=bool)
        alive[lane[live]] = True
        return meet & alive[lane]

    def contains(self, ts: pd.Series | np.ndarray) -> np.ndarray:
        ts = np.asarray(ts, dtype=np.int64)
        return (ts >= self.lo_ns) & (ts <= self.hi_ns)


def resolve(ctx: AnalysisContext, window: Window) -> Selection:
    """Turn the user's window into absolute bounds. `--request` narrows the window to the requests' lifetimes
    (their first to last phase) and, without `--instance`, the instances to theirs and their remote peers'."""
    t0, t1 = trace_span(ctx)
    lo, hi = window.bounds(t0, t1)
    names = names_of(ctx.trace)
    # a readable name or vLLM's id: the id
    instances = frozenset(resolve_instances(window.instances, names)) if window.instances else None
    requests = frozenset(window.requests) if window.requests else None
    pairs: frozenset[tuple[str, str]] | None = None
    if requests is not None:
        pairs = _request_pairs(ctx, requests, instances)
        ph = request_phases(ctx)
        wanted = pd.DataFrame(sorted(pairs), columns=["instance", "req"])
        mine = ph.merge(wanted, on=["instance", "req"]) if len(wanted) else ph.iloc[:0]
        if len(mine) == 0:
            raise no_requests(requests, instances or ())
        # The requests' lives (their P/D peers' included), not the freed tails that run to the end of the trace.
        live = mine[mine["phase"] != "freed"]
        span_from = live if len(live) else mine
        lo = max(lo, int(span_from["start_ns"].min()))
        hi = min(hi, int(span_from["end_ns"].max()))
        if instances is None:
            instances = frozenset(mine["instance"].astype("str"))
    if hi < lo:
        raise window.outside(t0, t1)
    return Selection(t0_ns=t0, lo_ns=lo, hi_ns=max(hi, lo + 1), instances=instances, requests=requests,
                     window=window, request_pairs=pairs, names=names)


def _request_pairs(ctx: AnalysisContext, requests: frozenset[str],
                   instances: frozenset[str] | None) -> frozenset[tuple[str, str]]:
    """(instance, req) of the named requests and, without --instance, of their P/D peers: the prefill request a
    decode request received from (its remote_instance / remote_req) and the decode requests that received from
    a named prefill request."""
    rt = request_table(ctx)
    mine = rt[rt["req"].isin(list(requests))]
    if instances is not None:
        mine = mine[mine["instance"].isin(list(instances))]
        return frozenset(zip(mine["instance"].astype("str"), mine["req"].astype("str"), strict=True))
    up = mine.dropna(subset=["remote_instance", "remote_req"])
    down = rt.dropna(subset=["remote_instance", "remote_req"]).merge(
        mine[["instance", "req"]].rename(columns={"instance": "remote_instance", "req": "remote_req"}))
    return frozenset(zip(mine["instance"].astype("str"), mine["req"].astype("str"), strict=True)) \
        | frozenset(zip(up["remote_instance"].astype("str"), up["remote_req"].astype("str"), strict=True)) \
        | frozenset(zip(down["instance"].astype("str"), down["req"].astype("str"), strict=True))


def findings_of(ctx: AnalysisContext, without: tuple[str, ...] = ()) -> pd.DataFrame:
    """The findings `pdtrace analyze` reports for this trace and configuration: plots and exports mark exactly
    these (one code path with analyze), computed once per context. `without`: rule ids a figure has no use for
    (their findings are left out, and their analysis is not run)."""
    def build() -> pd.DataFrame:
        rules = [rule for rule_id, rule in available_rules()[0].items() if rule_id not in without]
        return analyze(ctx, rules=rules) if rules else empty_findings()

    return ctx.cached("plot.findings" + "".join(f"-{r}" for r in sorted(without)), build)


@shared_table(cost=1.0)
def request_findings(ctx: AnalysisContext) -> pd.DataFrame:
    """The findings a requests figure marks: every rule's but pipeline_bubble's (per rank, never on a request)."""
    return findings_of(ctx, without=("pipeline_bubble",))
