"""History before the window: analysing a trace that starts mid-run.

A flight-recorder dump, a `pdtrace analyze --since` cut of a long trace, or a recording that started late holds a
*window* of the run: it begins with requests already running, blocks already owned, steps in flight and
completions due to requests added before it. The rules replay the window as they replay a whole run; this module
says what of a finding lies before the window, and one pass over every rule's findings (`window_findings`, called
by `analyze` on the whole-trace and the partitioned path alike, for plugins too) turns what the cut made into what
the window can tell.

How the analysis knows it has a window (`trace_window`), first match:
1. the trace says so: `Trace.window_start_ns`, which the reader sets from the files' `pdtrace.window_start_ns`
   metadata, a flight dump's `_manifest.json` (`window_start_ns`), or a `since_ns` that left earlier rows out
   (`open_trace(since_ns=...)`, `analysis.window`, `Trace.cut`); the latest of them;
2. inferred: a scheduler's first `sched` row has a step id above 0. The recorder numbers each scheduler's steps
   from 0 at its first `schedule()` call, so such a trace lacks the run's beginning (a lost first part file, a
   recording that started late). Nothing weaker is taken as a window: a completion for an id the trace never saw,
   or a free of blocks it never allocated, is exactly what the rules must still report on a whole trace.

What lies before the window (`History`, built once per analysis from the window's rows, vectorised):
- a request whose lifetime began before it: an id with rows but no `req_add` (columns.py's request keys: a key
  without `req_add`), until the id's first `req_add` in the window (a reused id's next request);
- a block owned before it: per scheduler, a block whose first row in the window (`blocks_alloc`, `req_wait_kv`,
  `blocks_free`, `blocks_pool_free`, `kv_recv_fail`) is not an allocation, until its first allocation;
- a step begun before it: per scheduler, a step id below the first `sched` step in the window.

A finding touches the window's start when its request, one of its blocks or its step (or those of a row its
evidence cites) lies before the window. What happens to it its rule declares (`Rule.window_policy`, per subrule
and per kind of history: request, blocks, step; `pdtrace.analysis.registry`):
- `drop`: the finding claims that something did not happen before it (no allocation of the freed blocks, no
  finish before the free, no rank report before the completion, no allocation before the use), and that may
  simply lie before the window: the cut made it, it is not reported;
- `downgrade` (the default, also for rules this module does not know): one severity lower (`rulekit.DOWNGRADE`),
  its message starts "history before the window unknown (...)", `extra.window` = {`start_ns`, `source`,
  `before`: what of it lies before the window} and `extra.downgraded` = "window" (unless another reason is set);
- `keep`: the window's own rows prove it: unchanged but for `extra.window`; so is a finding of a subrule in
  `Rule.status_proves` that cites a completion carrying its recorded `status` (the scheduler's own word: RUNNING
  for a completion before the finish, `unknown` for an id it does not know);
- `drop_unless_started` / `drop_unless_finished_later`: left out unless the window holds the request's transfer
  start (its req_finish or req_wait_kv) before the finding, or its req_finish after it; then one lower.
Findings that touch nothing before the window are left as they are: their evidence lies inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.columns import NO, _kind_mask, columns, first_per_key, order_by_key
from pdtrace.analysis.registry import HISTORY_KINDS, Rule, load_rules
from pdtrace.analysis.rulekit import DOWNGRADE

_BIG = np.iinfo(np.int64).max
#: kinds whose `blocks` allocate them to the row's request (a block first seen in one of these is not pre-window)
_ALLOC_KINDS = ("blocks_alloc", "req_wait_kv")
#: kinds whose `blocks` are this scheduler's pool (remote_read's are the peer's)
_BLOCK_KINDS = ("blocks_alloc", "req_wait_kv", "blocks_free", "blocks_pool_free", "kv_recv_fail", "kv_recv_dest")

REQUEST, BLOCKS, STEP = HISTORY_KINDS
#: the completions whose recorded `status` proves a finding of a subrule in `Rule.status_proves`
_COMPLETIONS = ("kv_send_done", "kv_recv_done")


@dataclass(frozen=True)
class Window:
    """Where a trace that starts mid-run begins, and how the analysis knows."""

    start_ns: int
    source: str  # "metadata", "manifest", "since" or "inferred"

    def describe(self) -> str:
        how = {"metadata": "the files' pdtrace.window_start_ns (a flight-recorder dump)",
               "manifest": "the manifest's window_start_ns (a flight-recorder dump)",
               "since": "a --since cut of a longer trace",
               "inferred": "a scheduler's first step id is above 0: the recording started late"}.get(self.source,
                                                                                                     self.source)
        return f"the trace starts mid-run at ts_ns {self.start_ns} ({how})"


#: What a window means for the rules, said once in every report of one (`summarize_findings` -> reporters).
WINDOW_MEANING = (
    "requests, blocks and steps begun before it are history this trace does not hold. Findings that rest on that "
    "history are left out (a free of blocks allocated before the window is no double free, a completion for a "
    "request added before it is no unknown id) or reported one severity lower with the reason. Rules that report "
    "something missing (leaks, never-scheduled, starved or stuck requests, completions that never came, unfreed "
    "blocks) see only the window: what was due before it is not checked, and a wait open at its end is measured "
    "from the window's own events.")


def window_summary(window: Window | None) -> dict[str, Any] | None:
    """The report's `window` entry: start_ns, source, how the analysis knows (`how`) and what it means."""
    if window is None:
        return None
    return {"start_ns": window.start_ns, "source": window.source, "how": window.describe(),
            "meaning": WINDOW_MEANING}


def trace_window(ctx: Any) -> Window | None:
    """The window the analysed trace holds (see the module docstring), None for a whole run."""
    def build() -> Window | None:
        trace = ctx.trace
        if getattr(trace, "window_start_ns", None) is not None:
            return Window(int(trace.window_start_ns), str(trace.window_source or "metadata"))
        cols = columns(ctx)
        rows = cols.rows_of("sched")
        rows = rows[cols.step[rows] >= 0]
        if len(rows) == 0:
            return None
        first = np.full(len(cols.sk_names), _BIG, np.int64)
        np.minimum.at(first, cols.sk[rows], cols.step[rows])
        if (first[first < _BIG] > 0).any():
            return Window(int(cols.ts.min()), "inferred")
        return None
    return ctx.cached("history.window", build)


@dataclass
class History:
    """What of the window's rows belongs to history before it (see the module docstring)."""

    window: Window
    #: (instance, req) -> ts_ns until which the id is a request that began before the window
    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (instance, dp_rank or -1) -> {block: ts_ns until which it is a block owned before the window}
    blocks: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    #: (instance, req) -> ts_ns of the first req_finish / req_wait_kv in the window (where a transfer starts), of a
    #: request begun before the window
    transfer_start: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (instance, req) -> ts_ns of the first req_finish in the window of a request begun before it
    finish_at: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (instance, dp_rank or -1) -> the first step scheduled in the window
    first_step: dict[tuple[str, int], int] = field(default_factory=dict)
    #: (instance, dp_rank or -1) -> ts_ns of the last step_output of a step begun before the window: until then a
    #: step the window did not see begin is in flight
    in_flight_until: dict[tuple[str, int], int] = field(default_factory=dict)

    def before(self, finding: dict[str, Any]) -> dict[str, list[str]]:
        """What of a finding (a findings record) lies before the window, by kind (REQUEST, BLOCKS, STEP): the
        finding's own request, blocks and step, and those of the rows its evidence cites."""
        inst = str(finding.get("instance"))
        dp = _dp(finding.get("dp_rank"))
        ts = _int(finding.get("ts_ns"))
        out: dict[str, list[str]] = {}
        cited = [(inst, finding.get("req"), finding.get("blocks"), finding.get("step"), ts, None)]
        for ref in finding.get("evidence") or []:
            if isinstance(ref, dict):
                cited.append((str(ref.get("instance") or inst), ref.get("req"), ref.get("blocks"), ref.get("step"),
                              _int(ref.get("ts_ns")), ref.get("kind")))
        for where, req, blocks, step, at, kind in cited:
            at = ts if at is None else at
            if req is not None and not _missing(req):
                until = self.requests.get((where, str(req)))
                if until is not None and (at is None or at < until):
                    _add(out, REQUEST, f"request {req} began before the window")
            if where == inst and kind != "remote_read" and blocks is not None and len(blocks):
                owned = self.blocks.get((inst, dp), {})
                early = [int(b) for b in blocks if int(b) in owned and (at is None or at < owned[int(b)])]
                if early:
                    _add(out, BLOCKS, f"blocks {early[:8]} were owned before the window")
            first = self.first_step.get((where, dp))
            if step is not None and not _missing(step) and first is not None and int(step) < first:
                _add(out, STEP, f"step {int(step)} began before the window")
            flying = self.in_flight_until.get((where, dp))
            if flying is not None and at is not None and at < flying:
                _add(out, STEP, "a step begun before the window was still in flight")
        return out


def _missing(value: Any) -> bool:
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _int(value: Any) -> int | None:
    return None if value is None or _missing(value) else int(value)


def _dp(value: Any) -> int:
    return -1 if value is None or _missing(value) else int(value)


def _add(out: dict[str, list[str]], kind: str, text: str) -> None:
    if text not in out.setdefault(kind, []):
        out[kind].append(text)


def history(ctx: Any) -> History | None:
    """The window's pre-window history, cached on the context; None for a whole run."""
    def build() -> History | None:
        window = trace_window(ctx)
        if window is None:
            return None
        cols = columns(ctx)
        names = cols.sk_names
        sk_key = [(str(i), _dp(d)) for i, d in zip(names["instance"].tolist(), names["dp_rank"].tolist())]
        hist = History(window)
        if cols.n == 0:
            return hist
        _requests_before(cols, hist)
        _blocks_before(cols, hist, sk_key)
        # steps: the first sched step per scheduler
        sched = cols.rows_of("sched")
        sched = sched[cols.step[sched] >= 0]
        if len(sched):
            first = np.full(len(names), _BIG, np.int64)
            np.minimum.at(first, cols.sk[sched], cols.step[sched].astype(np.int64))  # same dtype: ufunc.at's fast path
            for sk in np.flatnonzero(first < _BIG).tolist():
                hist.first_step[sk_key[sk]] = int(first[sk])
            outputs = cols.rows_of("step_output")
            outputs = outputs[cols.step[outputs] >= 0]
            early = outputs[cols.step[outputs] < first[cols.sk[outputs]]]
            for sk in np.unique(cols.sk[early]).tolist():  # per scheduler with steps in flight at the start
                hist.in_flight_until[sk_key[sk]] = int(cols.ts[early[cols.sk[early] == sk]].max())
        return hist
    return ctx.cached("history.history", build)


def _requests_before(cols: Any, hist: History) -> None:
    """`History.requests`, `transfer_start` and `finish_at`: the request keys without a req_add in the window, each
    until the first req_add of its (instance, req) id there. Ids are compared as one int64 per key (instance code,
    req code), so only the keys and rows of the few ids begun before the window reach Python (a dict of every
    request's first req_add and a loop over every req_finish / req_wait_kv row were most of `history`'s 0.13 s per
    5M-row window, now 0.03 s with `_blocks_before`: bench/long_trace.py, one core)."""
    adds = cols.req_rows("req_add")
    add_pos = first_per_key(cols.rk[adds], cols.pos[adds], cols.n_requests)
    early = np.flatnonzero(add_pos < 0)
    if len(early) == 0:
        return
    _, key_sk, key_req, _ = cols._request_keys
    inst_names, req_names = cols.codes("instance")[1], cols.codes("req")[1]
    key_inst = cols._sched_keys[1][key_sk]
    pair = key_inst.astype(np.int64) * (len(req_names) + 1) + key_req  # the (instance, req) id of each key
    early_ids = np.unique(pair[early])

    def name(k: int) -> tuple[str, str]:
        return str(inst_names[key_inst[k]]), str(req_names[key_req[k]])

    first_add: dict[tuple[str, str], int] = {}
    added = np.flatnonzero((add_pos >= 0) & np.isin(pair, early_ids))
    add_ts = cols.ts[cols.order[add_pos[added]]]
    for k, at in zip(added.tolist(), add_ts.tolist()):  # per key of such an id with a req_add: few
        key = name(k)
        first_add[key] = min(first_add.get(key, _BIG), int(at))
    for k in early.tolist():  # per request that began before the window
        key = name(k)
        hist.requests[key] = max(hist.requests.get(key, 0), first_add.get(key, _BIG))
    finish_code = cols.code_of("kind", "req_finish")
    starts = cols.req_rows("req_finish", "req_wait_kv")
    starts = starts[np.isin(pair[cols.rk[starts]], early_ids)]
    for k, at, kind in zip(cols.rk[starts].tolist(), cols.ts[starts].tolist(),
                           cols.codes("kind")[0][starts].tolist()):  # one or two a request begun before: few
        key = name(k)
        hist.transfer_start[key] = min(hist.transfer_start.get(key, _BIG), int(at))
        if kind == finish_code:
            hist.finish_at[key] = min(hist.finish_at.get(key, _BIG), int(at))


def _blocks_before(cols: Any, hist: History, sk_key: list[tuple[str, int]]) -> None:
    """`History.blocks`: per (scheduler, block), pre-window when its first row of _BLOCK_KINDS is no allocation,
    until its first allocation. The first row and the first allocation per (scheduler, block) are minima of the
    rows' positions, one `np.minimum.at` each over the dense (scheduler, block) key space (a stable sort of every
    (key, position) where the block ids are sparse), not a stable sort of every flattened block."""
    rows, blocks = cols.block_rows
    kinds = cols.codes("kind")[0][rows]  # the kinds of the rows that hold blocks only, not a mask of every row
    keep = _kind_mask(kinds, [cols.code_of("kind", k) for k in _BLOCK_KINDS if cols.code_of("kind", k) >= 0],
                      len(cols.codes("kind")[1]))
    rows, blocks, kinds = rows[keep], blocks[keep], kinds[keep]
    if len(rows) == 0:
        return
    width = int(blocks.max()) + 1
    key = cols.sk[rows].astype(np.int64) * width + blocks
    is_alloc = _kind_mask(kinds, [cols.code_of("kind", k) for k in _ALLOC_KINDS if cols.code_of("kind", k) >= 0],
                          len(cols.codes("kind")[1]))
    pos = cols.pos[rows]
    space = len(cols.sk_names) * width
    if int(blocks.min()) >= 0 and space <= 4 * len(rows) + (1 << 16):
        first = first_per_key(key, pos, space, _BIG)
        first_alloc = first_per_key(key[is_alloc], pos[is_alloc], space, _BIG)
        early = np.flatnonzero(first < first_alloc)  # first row no allocation (none at all: _BIG)
        alloc = first_alloc[early]
    else:
        order = order_by_key(key, pos)
        key, pos, is_alloc = key[order], pos[order], is_alloc[order]
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        ends = np.r_[starts[1:], len(key)]
        alloc_idx = np.where(is_alloc, np.arange(len(key)), len(key))
        next_alloc = np.minimum.accumulate(alloc_idx[::-1])[::-1]
        firsts = starts[~is_alloc[starts]]
        found = next_alloc[firsts]
        found_end = ends[np.searchsorted(starts, firsts, side="right") - 1]
        alloc = np.where(found < found_end, pos[np.minimum(found, len(key) - 1)], _BIG)
        early = key[firsts]
    until = np.where(alloc < _BIG, cols.ts[cols.order[np.minimum(alloc, cols.n - 1)]], _BIG)
    for k, at in zip(early.tolist(), until.tolist()):  # per block owned before the window
        hist.blocks.setdefault(sk_key[k // width], {})[k % width] = at


def _action(hist: History, rule: Rule | None, rec: dict[str, Any], before: dict[str, list[str]]) -> str:
    subrule, evidence = str(rec["subrule"]), rec.get("evidence") or []
    if rule is not None and subrule in rule.status_proves and any(
            isinstance(ref, dict) and ref.get("kind") in _COMPLETIONS and ref.get("status") not in (None, "")
            for ref in evidence):
        return "keep"
    actions = [rule.window_action(subrule, kind) if rule is not None else "downgrade" for kind in before]
    key, ts = (str(rec.get("instance")), str(rec.get("req"))), _int(rec.get("ts_ns"))
    if "drop_unless_started" in actions:  # the transfer began inside the window: its reports are all in it
        started = hist.transfer_start.get(key, _BIG)
        actions = [("downgrade" if ts is not None and started <= ts else "drop") if a == "drop_unless_started"
                   else a for a in actions]
    if "drop_unless_finished_later" in actions:  # the window holds the finish after the finding: unfinished then
        later = hist.finish_at.get(key)
        actions = [("downgrade" if ts is not None and later is not None and later > ts else "drop")
                   if a == "drop_unless_finished_later" else a for a in actions]
    if "drop" in actions:
        return "drop"
    if "downgrade" in actions:
        return "downgrade"
    return "keep"


def window_findings(ctx: Any, findings: pd.DataFrame, rule: Rule | None = None) -> pd.DataFrame:
    """One rule's findings on a trace that starts mid-run, with what the cut made dropped or downgraded as `rule`
    declares (`Rule.window_policy`, `Rule.status_proves`; the module docstring); the findings themselves on a whole
    run. `rule`: the rule that made them; None looks it up among the registered rules by the findings' `rule` id
    (a rule found nowhere declares nothing: its findings touching the window's start are downgraded)."""
    if len(findings) == 0:
        return findings
    hist = history(ctx)
    if hist is None:
        return findings
    if rule is None:
        from pdtrace.analysis.registry import load_rules  # the registry loads every rule module: only when asked

        ids = {str(r) for r in findings["rule"].unique()}
        registered = load_rules(errors=[])
        rules = {i: registered.get(i) for i in ids}
    else:
        rules = {}
    out = []
    for rec in findings.to_dict("records"):  # few: findings
        before = hist.before(rec)
        if not before:
            out.append(rec)
            continue
        action = _action(hist, rule if rule is not None else rules.get(str(rec["rule"])), rec, before)
        if action == "drop":
            continue
        what = "; ".join(text for texts in before.values() for text in texts)
        extra = dict(rec.get("extra") or {})
        extra["window"] = {"start_ns": hist.window.start_ns, "source": hist.window.source,
                           "before": [t for texts in before.values() for t in texts]}
        if action == "downgrade":
            rec["severity"] = DOWNGRADE.get(str(rec["severity"]), rec["severity"])
            rec["message"] = (f"history before the window unknown ({what}; {hist.window.describe()}): "
                              f"{rec['message']}")
            extra.setdefault("downgraded", "window")
        rec["extra"] = extra
        out.append(rec)
    frame = pd.DataFrame({c: pd.Series([r[c] for r in out], dtype=object) for c in findings.columns}) if out else \
        findings.iloc[:0]
    frame.attrs = dict(findings.attrs)
    return frame


def __getattr__(name: str) -> Any:
    """`WINDOW_POLICY` and `STATUS_PROVES`, the tables these declarations lived in before they moved onto each
    `Rule` ((rule id, subrule) -> {kind: action}, and a set of (rule id, subrule)), built from the registered rules.
    Kept for one release for code written against them; read `Rule.window_policy` / `Rule.status_proves`."""
    if name == "WINDOW_POLICY":
        return {(r.id, sub): dict(policy) for r in load_rules(errors=[]).values()
                for sub, policy in r.window_policy.items()}
    if name == "STATUS_PROVES":
        return {(r.id, sub) for r in load_rules(errors=[]).values() for sub in r.status_proves}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
