"""What the block and transfer rules share: step submit/output lookups, engine configs, recorder gaps, evidence refs.

Everything here is computed once per analysis (cached on the context) from small subsets of rows (engine rows,
`engine_config`, recorder rows); evidence dicts are built only for the rows a finding cites.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, Union

import numpy as np
import pandas as pd
import pyarrow as pa

from pdtrace.analysis.columns import NO, Columns, columns, lookup, positions, request_keys
from pdtrace.analysis.findings import findings_frame
from pdtrace.analysis.parallel import shared_table

DOWNGRADE = {"error": "warning", "warning": "info", "info": "info"}
#: free reasons a transfer completion causes (`_update_from_kv_xfer_finished` freeing the blocks)
COMPLETION_FREE_REASONS = ("sent", "received")


@dataclass
class StepIndex:
    """Submit and output positions per (scheduler key, step), and the tokens of each scheduled step."""

    span: int
    submit_key: np.ndarray   # sorted composite keys sk * span + step
    submit_pos: np.ndarray
    submit_row: np.ndarray
    output_key: np.ndarray
    output_pos: np.ndarray
    output_row: np.ndarray
    sched_key: np.ndarray
    sched_tokens: np.ndarray
    has_outputs: np.ndarray  # per sk: the trace has engine rows for this scheduler

    def key(self, sk: np.ndarray, step: np.ndarray) -> np.ndarray:
        return sk.astype(np.int64) * self.span + step

    @staticmethod
    def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
        return lookup(keys, values, query, NO)

    def output_pos_of(self, sk: np.ndarray, step: np.ndarray) -> np.ndarray:
        """Position of the step's step_output (NO if none or step unknown)."""
        out = self._lookup(self.output_key, self.output_pos, self.key(sk, step))
        return np.where(step >= 0, out, NO)

    def output_row_of(self, sk: np.ndarray, step: np.ndarray) -> np.ndarray:
        out = self._lookup(self.output_key, self.output_row, self.key(sk, step))
        return np.where(step >= 0, out, NO)

    def tokens_of(self, sk: np.ndarray, step: np.ndarray) -> np.ndarray:
        return self._lookup(self.sched_key, self.sched_tokens, self.key(sk, step))

    def in_flight_rows(self, sk: int, pos: int) -> list[int]:
        """step_submit rows of this scheduler submitted before pos whose step_output comes after pos (or never)."""
        lo = np.searchsorted(self.submit_key, sk * self.span)
        hi = np.searchsorted(self.submit_key, (sk + 1) * self.span)
        keys = self.submit_key[lo:hi]
        before = self.submit_pos[lo:hi] < pos
        out = self._lookup(self.output_key, self.output_pos, keys)
        flying = before & ((out < 0) | (out > pos))
        return self.submit_row[lo:hi][flying].tolist()


def _index(cols: Columns) -> StepIndex:
    sub = cols.rows_of("step_submit")
    outp = cols.rows_of("step_output")
    sch = cols.rows_of("sched")
    steps = cols.step
    span = int(steps.max()) + 2 if cols.n else 2

    def sorted_by_key(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = rows[steps[rows] >= 0]
        key = cols.sk[rows].astype(np.int64) * span + steps[rows]
        order = np.argsort(key, kind="stable")
        return key[order], cols.pos[rows[order]], rows[order]

    sk_, sp, sr = sorted_by_key(sub)
    ok, op, orow = sorted_by_key(outp)
    ck, _, crow = sorted_by_key(sch)
    has = np.zeros(int(cols.sk.max()) + 1 if cols.n else 0, bool)
    has[cols.sk[outp]] = True
    return StepIndex(span, sk_, sp, sr, ok, op, orow, ck, cols.ints_at("n", crow), has)


@shared_table(positions, request_keys, cost=0.02)
def step_index(ctx: Any) -> StepIndex:
    return ctx.cached("rulekit.step_index", lambda: _index(columns(ctx)))


def engine_configs(ctx: Any) -> dict[int, dict[str, Any]]:
    """engine_config detail (plus `num_blocks` from n) per scheduler key: the scheduler's first `engine_config` in
    time order. The one reading of engine_config: `steps.engine_configs` (the table of the scheduling analyses)
    and `timelines.pool_sizes` are built from it."""
    return _engine_config_rows(ctx)[0]


def engine_config_rows(ctx: Any) -> dict[int, int]:
    """The row of the engine_config `engine_configs` read, per scheduler key."""
    return _engine_config_rows(ctx)[1]


def _engine_config_rows(ctx: Any) -> tuple[dict[int, dict[str, Any]], dict[int, int]]:
    def build() -> tuple[dict[int, dict[str, Any]], dict[int, int]]:
        cols = columns(ctx)
        rows = cols.rows_of("engine_config")
        rows = rows[np.argsort(cols.pos[rows], kind="stable")]
        out: dict[int, dict[str, Any]] = {}
        where: dict[int, int] = {}
        for row, detail, n in zip(rows.tolist(), cols.details(rows), cols.ints_at("n", rows).tolist()):
            cfg = dict(detail)
            if n >= 0:
                cfg["num_blocks"] = int(n)
            sk = int(cols.sk[row])
            if sk not in out:
                out[sk], where[sk] = cfg, row
        return out, where
    return ctx.cached("rulekit.engine_configs", build)


def defer_block_free(ctx: Any) -> np.ndarray:
    """Per scheduler key: the scheduler defers frees (vLLM's `defer_block_free`): engine_config says so, or, where
    the scheduler has no engine_config with the key, one of its `blocks_free` rows is `deferred=true` (only such a
    scheduler parks frees)."""
    def build() -> np.ndarray:
        cols = columns(ctx)
        out = np.zeros(len(cols.sk_names), bool)
        said = np.zeros(len(out), bool)
        for sk, cfg in engine_configs(ctx).items():
            if "defer_block_free" in cfg:
                out[sk] = bool(cfg.get("defer_block_free"))
                said[sk] = True
        frees = cols.rows_of("blocks_free")
        value, valid = cols.bools_at("deferred", frees)
        seen = np.zeros(len(out), bool)
        seen[cols.sk[frees[value & valid]]] = True
        return np.where(said, out, seen)
    return ctx.cached("rulekit.defer_block_free", build)


@dataclass
class Gaps:
    """recorder_gap / recorder_off positions per instance code. A `recorder_off` holds from its position to the
    end, and so does a gap of unknown size (n null: the writer process marked where a killed process's loss
    begins; everything it emitted after may be missing); a counted gap (buffer full, a lost batch) sits where its
    loss was."""

    inst_codes: list[int]
    gap_pos: dict[int, np.ndarray]
    off_pos: dict[int, int]
    open_gap_pos: dict[int, int] = field(default_factory=dict)

    def covers(self, inst: int, start_pos: int, end_pos: int) -> str | None:
        """'recorder_off' or 'recorder_gap' if one covers [start_pos, end_pos] on this instance, else None."""
        off = self.off_pos.get(inst)
        if off is not None and off <= end_pos:
            return "recorder_off"
        open_gap = self.open_gap_pos.get(inst)
        if open_gap is not None and open_gap <= end_pos:
            return "recorder_gap"
        gaps = self.gap_pos.get(inst)
        if gaps is not None and len(gaps):
            i = np.searchsorted(gaps, start_pos)
            if i < len(gaps) and gaps[i] <= end_pos:
                return "recorder_gap"
        return None


def gaps(ctx: Any) -> Gaps:
    def build() -> Gaps:
        cols = columns(ctx)
        inst, _ = cols.codes("instance")
        gap_rows = cols.rows_of("recorder_gap")
        off_rows = cols.rows_of("recorder_off")
        gap_pos: dict[int, np.ndarray] = {}
        for code in np.unique(inst[gap_rows]).tolist():
            gap_pos[code] = np.sort(cols.pos[gap_rows[inst[gap_rows] == code]])
        off_pos: dict[int, int] = {}
        for code in np.unique(inst[off_rows]).tolist():
            off_pos[code] = int(cols.pos[off_rows[inst[off_rows] == code]].min())
        open_rows = gap_rows[int_column_at(cols, "n", gap_rows) < 0]
        open_gap_pos = {code: int(cols.pos[open_rows[inst[open_rows] == code]].min())
                        for code in np.unique(inst[open_rows]).tolist()}
        return Gaps(sorted(set(gap_pos) | set(off_pos)), gap_pos, off_pos, open_gap_pos)
    return ctx.cached("rulekit.gaps", build)


_REF_COLUMNS = ("kind", "ts_ns", "seq", "req", "step", "instance", "pid", "pp_rank", "tp_rank", "blocks",
                "reason", "status")


class Evidence:
    """Collects the rows findings cite, then turns them into event refs in one take()."""

    def __init__(self, cols: Columns) -> None:
        self.cols = cols
        self._refs: dict[int, dict[str, Any]] = {}

    def refs(self, rows: Iterable[int]) -> None:
        """Pre-fetch refs for many rows at once."""
        need = sorted({int(r) for r in rows if r is not None and r >= 0} - set(self._refs))
        if not need:
            return
        # the cited columns, selected once per analysis (a select of a many-chunk table costs ~0.2 ms a call)
        table = self.cols.once("evidence_table", lambda: self.cols.table.select(
            [c for c in _REF_COLUMNS if c in self.cols.table.column_names]))
        # one-row slices: take() over a many-chunk 10M-row table would concatenate the chunks first
        records = [table.slice(row, 1).to_pylist()[0] for row in need] if len(need) < 2000 else \
            table.take(pa.array(need, pa.int64())).to_pylist()
        for row, rec in zip(need, records):
            clean = {k: v for k, v in rec.items() if v is not None}
            if "blocks" in clean and len(clean["blocks"]) > 16:
                clean["n_blocks"] = len(clean["blocks"])
                clean["blocks"] = clean["blocks"][:16]
            clean.setdefault("req", None)
            clean.setdefault("step", None)
            self._refs[row] = clean

    def ref(self, row: int, note: str | None = None) -> dict[str, Any]:
        if row not in self._refs:
            self.refs([row])
        out = dict(self._refs[row])
        if note:
            out["note"] = note
        return out


def sk_instance(cols: Columns, sk: int) -> tuple[str, int | None]:
    """(instance, dp_rank or None) of a scheduler key; the list of them is built once per analysis (a pandas
    lookup per finding cost ~0.3 ms)."""
    def build() -> list[tuple[str, int | None]]:
        names = cols.sk_names
        return [(str(i), None if d is None or d is np.nan or str(d) == "<NA>" else int(d))
                for i, d in zip(names["instance"].tolist(), names["dp_rank"].tolist())]

    return cols.once("sk_instance", build)[sk]


def inst_code_of_sk(cols: Columns, sk: int) -> int:
    return cols.code_of("instance", sk_instance(cols, sk)[0])


def groups(keys: np.ndarray) -> list[np.ndarray]:
    """Indices grouped by key (keys sorted stably); one array per distinct key."""
    if len(keys) == 0:
        return []
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    cuts = np.flatnonzero(k[1:] != k[:-1]) + 1
    return np.split(order, cuts)


def fmt_blocks(blocks: list[int], limit: int = 12) -> str:
    if len(blocks) <= limit:
        return "[" + ", ".join(str(b) for b in blocks) + "]"
    return "[" + ", ".join(str(b) for b in blocks[:limit]) + f", ... ({len(blocks)} blocks)]"


#: What a finding cites: a row index, a (row, note) pair, or an event ref already made (`Evidence.ref`, or a dict
#: of the same keys for an event that is no row, e.g. a measured idle interval).
Cited = Union[int, "tuple[int, str | None]", "dict[str, Any]"]


class _FromRows:
    """The default of `FindingsBuilder.add`'s fields: taken from the rows the finding cites."""

    def __repr__(self) -> str:
        return "FROM_ROWS"


#: `FindingsBuilder.add`'s default for instance, dp_rank, req, step and ts_ns: filled from the cited rows.
FROM_ROWS: Any = _FromRows()


class FindingsBuilder:
    """A rule's findings, built from the rows they cite (so no rule writes the finding columns by hand).

    `add` fills a finding's where and when from its rows: `at` (default: the first row it cites) gives `ts_ns` and
    `step`; `about` (default: `at`) gives `instance` and `dp_rank` (its scheduler) and `req`. Any of them can be
    given instead (`sk=` for the scheduler; a value for the others, None included). `evidence` keeps the order the
    rule gives and becomes event refs in `frame()`, all rows fetched in one take; until then a record's
    "evidence" is that list, so a rule may still append to it (e.g. the engine failure's row). `context` defaults
    to "rule:subrule", `blocks` to [], `extra` to {}."""

    def __init__(self, ctx: Any, rule: str, evidence: Evidence | None = None) -> None:
        self.ctx = ctx
        self.rule = rule
        self.cols = columns(ctx)
        self.evidence = evidence if evidence is not None else Evidence(self.cols)
        self.records: list[dict[str, Any]] = []

    def ref(self, row: int, note: str | None = None) -> dict[str, Any]:
        """The event ref of a row (its kind, ts_ns, seq, req, step, ... and the note), e.g. to read its req."""
        return self.evidence.ref(int(row), note)

    def refs(self, rows: Iterable[int]) -> None:
        """Fetch the refs of many rows at once (a speed hint: `ref` and `frame` fetch what is missing)."""
        self.evidence.refs(rows)

    def add(self, subrule: str | None, severity: str, message: str, evidence: Sequence[Cited] = (), *,
            at: int | None = None, about: int | None = None, sk: int | None = None,
            instance: Any = FROM_ROWS, dp_rank: Any = FROM_ROWS, req: Any = FROM_ROWS, step: Any = FROM_ROWS,
            ts_ns: Any = FROM_ROWS, blocks: Sequence[int] | None = None, context: str | None = None,
            extra: dict[str, Any] | None = None, requests: list[str] | None = None) -> dict[str, Any]:
        """Add one finding and return its record (a dict of the finding columns; change it before `frame()` if
        need be, e.g. `EngineFailure.mark`)."""
        evidence = list(evidence)
        if at is None:
            at = next((int(c if isinstance(c, (int, np.integer)) else c[0]) for c in evidence
                       if not isinstance(c, dict)), None)
        about = at if about is None else about
        if sk is None and about is not None and (instance is FROM_ROWS or dp_rank is FROM_ROWS):
            sk = int(self.cols.sk[about])
        if sk is not None:
            where = sk_instance(self.cols, int(sk))
            instance = where[0] if instance is FROM_ROWS else instance
            dp_rank = where[1] if dp_rank is FROM_ROWS else dp_rank
        if req is FROM_ROWS:
            req = self.ref(about).get("req") if about is not None else None
        if step is FROM_ROWS:
            step = self.ref(at).get("step") if at is not None else None
        if ts_ns is FROM_ROWS:
            ts_ns = int(self.cols.ts[at]) if at is not None else None
        if instance is FROM_ROWS or dp_rank is FROM_ROWS:
            raise ValueError(f"{self.rule}: a finding that cites no row needs sk=, or instance= and dp_rank=")
        record = {
            "rule": self.rule, "subrule": subrule, "severity": severity, "instance": instance, "dp_rank": dp_rank,
            "req": req, "blocks": [] if blocks is None else blocks, "step": step, "ts_ns": ts_ns, "message": message,
            "evidence": evidence, "context": f"{self.rule}:{subrule}" if context is None else context,
            "extra": {} if extra is None else extra, "requests": requests,
        }
        self.records.append(record)
        return record

    def frame(self) -> pd.DataFrame:
        """The findings DataFrame (`pdtrace.analysis.findings.FINDING_COLUMNS`), in the order they were added."""
        self.evidence.refs(c if isinstance(c, (int, np.integer)) else c[0] for rec in self.records
                           for c in rec["evidence"] if not isinstance(c, dict))
        for rec in self.records:
            rec["evidence"] = [c if isinstance(c, dict) else self.ref(c) if isinstance(c, (int, np.integer))
                               else self.ref(c[0], c[1]) for c in rec["evidence"]]
        return findings_frame(self.records)


# --- engine failures ---------------------------------------------------------------------------------------------
#
# Crash policy, shared by every absence-based rule (leaked_blocks, unscheduled_request). Once a scheduler's engine
# logged `engine_error`, nothing it would have done afterwards can appear in the trace: a finding that reports the
# absence of such an event is a consequence of the crash, not a bug of its own. The *failure point* is the first
# event of the failing step K (the step of the first `engine_error` of that scheduler; the error row itself when the
# step is unknown): the engine never finished that step's update, so anything due from there on was cut off. A
# finding on that scheduler is a crash consequence when
#   - the event it misses became due at or after the failure point (a free due at a finish or at a send completion
#     recorded in the failing step's update), or
#   - it is a window open at the end of the trace (a wait for a transfer, an idle request, a request waiting to be
#     scheduled) that had not yet reached the rule's threshold at the failure point (time since the window began
#     <= grace_s; steps strictly before the failure point < starve_steps / zombie_steps).
# Such findings become `info`; their message starts "engine failed at step K (engine_error <error>) before <what>: ",
# their evidence ends with the engine_error row and `extra` gets `engine_failed` {step, ts_ns, error} and
# `downgraded: "engine_error"`. Findings already overdue before the failure keep their severity: the crash did not
# cause them. Only the failed scheduler's own findings are touched: a peer instance still waiting on it keeps its
# severity (it should have timed out), and its stuck_waiting_kv findings cite the failure as their root cause.

CRASH_SEVERITY = "info"
CRASH_NOTE = "the engine failed here"


@dataclass(frozen=True)
class EngineFailure:
    """The first `engine_error` of one scheduler and its failure point (first event of the failing step)."""

    row: int
    pos: int
    step: int
    ts_ns: int
    point_pos: int
    point_ts: int
    error: str

    def describe(self) -> str:
        at = f"step {self.step}" if self.step >= 0 else "an unknown step"
        return f"engine failed at {at} (engine_error {self.error})"

    def cut_off(self, due_pos: int) -> bool:
        """The event due at due_pos could not happen: it was due at or after the failure point."""
        return due_pos >= self.point_pos

    def mark(self, record: dict[str, Any], what: str) -> dict[str, Any]:
        """Rewrite a finding record as a crash consequence (severity, message, extra; evidence is the caller's:
        append the ref of `self.row` with CRASH_NOTE)."""
        record["severity"] = CRASH_SEVERITY
        record["message"] = f"{self.describe()} before {what}: {record['message']}"
        record["extra"] = dict(record.get("extra") or {}, downgraded="engine_error",
                               engine_failed={"step": self.step if self.step >= 0 else None, "ts_ns": self.ts_ns,
                                              "error": self.error})
        return record


def engine_failures(ctx: Any) -> dict[int, EngineFailure]:
    """The first engine_error per scheduler key (see the crash policy above); {} when no engine failed."""
    def build() -> dict[int, EngineFailure]:
        cols = columns(ctx)
        rows = cols.rows_of("engine_error")
        out: dict[int, EngineFailure] = {}
        if len(rows) == 0:
            return out
        rows = rows[np.argsort(cols.pos[rows], kind="stable")]
        _, first = np.unique(cols.sk[rows], return_index=True)  # each scheduler's first engine_error
        rows = rows[np.sort(first)]
        for row, detail in zip(rows.tolist(), cols.details(rows)):  # one per failed scheduler
            sk = int(cols.sk[row])
            pos = int(cols.pos[row])
            step = int(cols.step[row])
            point = pos
            if step >= 0:
                same = np.flatnonzero((cols.sk == sk) & (cols.step == step))  # one mask per failed scheduler
                if len(same):
                    point = min(pos, int(cols.pos[same].min()))
            error = " ".join(str(detail.get("error") or "").split()).rstrip(": ") or "unknown error"
            if len(error) > 80:
                error = error[:77] + "..."
            out[sk] = EngineFailure(row, pos, step, int(cols.ts[row]), point, int(cols.ts[cols.order[point]]),
                                    error)
        return out
    return ctx.cached("rulekit.engine_failures", build)


# --- per-rank transfer reports ----------------------------------------------------------------------------------

@dataclass
class RankReport:
    """Which ranks reported one request's transfer in one direction (`kv_send_rank` / `kv_recv_rank`)."""

    direction: str            # "send" or "recv"
    rows: list[int]           # the request's rank rows of that direction, in time order
    reported: list[str]       # rank labels "pp<P>/tp<T>", sorted
    missing: list[str]        # expected ranks that never reported (known labels)
    expected: int | None      # expected number of ranks (None: unknown)
    source: str               # where `expected` comes from

    @property
    def n_unseen(self) -> int:
        """Expected ranks missing beyond the ones named (never seen on the instance at all)."""
        if self.expected is None:
            return 0
        return max(0, self.expected - len(self.reported) - len(self.missing))

    def describe(self) -> str:
        names = list(self.missing) + ([f"{self.n_unseen} more"] if self.n_unseen else [])
        verb = "send" if self.direction == "send" else "receive"
        return (f"rank(s) {', '.join(names)} never reported the {verb} (kv_{self.direction}_rank from "
                f"{', '.join(self.reported)} only; {self.expected} expected, from {self.source})")


def _rank_label(pp: int, tp: int) -> str:
    return f"pp{max(pp, 0)}/tp{max(tp, 0)}"


_RANK_SPAN = 10_000  # rank code = pp * _RANK_SPAN + tp


@dataclass
class _RankIndex:
    """The rank rows of one direction sorted by (request key, position), with their rank codes; per scheduler,
    the codes seen for any request and the largest `expected_ranks` of its aggregated completions."""

    rows: np.ndarray
    rk: np.ndarray
    code: np.ndarray
    known: dict[int, set[int]]
    done_rows: np.ndarray      # kv_<direction>_done rows sorted by request key
    done_rk: np.ndarray
    instance_expected: dict[int, int]

    def of(self, rk: int) -> np.ndarray:
        """Indices (into rows / code) of request key rk's rank rows."""
        lo, hi = np.searchsorted(self.rk, [rk, rk + 1])
        return np.arange(lo, hi)

    def done_of(self, rk: int) -> np.ndarray:
        lo, hi = np.searchsorted(self.done_rk, [rk, rk + 1])
        return self.done_rows[lo:hi]


def _expected_values(cols: Columns, rows: np.ndarray) -> list[int]:
    return declared_ranks(cols.details(rows))


def _rank_index(ctx: Any, direction: str) -> _RankIndex:
    def build() -> _RankIndex:
        cols = columns(ctx)
        rows = cols.rows_of(f"kv_{direction}_rank")
        rows = rows[cols.rk[rows] >= 0]
        rk = cols.rk[rows].astype(np.int64)
        order = np.lexsort((cols.pos[rows], rk))
        rows, rk = rows[order], rk[order]
        pp = np.maximum(int_column_at(cols, "pp_rank", rows), 0)
        tp = np.maximum(int_column_at(cols, "tp_rank", rows), 0)
        code = pp * _RANK_SPAN + tp
        sk = cols.sk[rows]
        known: dict[int, set[int]] = {}
        for s in np.unique(sk).tolist():  # per scheduler
            known[int(s)] = set(np.unique(code[sk == s]).tolist())
        done = cols.rows_of(f"kv_{direction}_done")
        done = done[np.isin(cols.sk[done], list(known)) & (cols.rk[done] >= 0)] if known else done[:0]
        done_rk = cols.rk[done].astype(np.int64)
        d_order = np.argsort(done_rk, kind="stable")
        done, done_rk = done[d_order], done_rk[d_order]
        instance_expected: dict[int, int] = {}
        for s in known:  # per scheduler: the completions' declared rank counts (a sample of them)
            values = _expected_values(cols, done[cols.sk[done] == s][:256])
            if values:
                instance_expected[s] = max(values)
        return _RankIndex(rows, rk, code, known, done, done_rk, instance_expected)
    return ctx.cached(f"rulekit.rank_index.{direction}", build)


def int_column_at(cols: Columns, name: str, rows: np.ndarray) -> np.ndarray:
    """A numeric column's values at rows, nulls as -1 (all -1 where the table lacks the column)."""
    if name not in cols.table.column_names:
        return np.full(len(rows), -1, np.int64)
    return cols.ints_at(name, rows)


def declared_ranks(details: list[dict[str, Any]]) -> list[int]:
    """The `expected_ranks` values declared in these completions' details (ints only)."""
    values = [d.get("expected_ranks") for d in details]
    return [int(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _engine_grid(cfg: dict[str, Any]) -> tuple[int, int] | None:
    """(pp, tp) of an engine_config detail, None without either key or with a value that is not a number."""
    if "tp" not in cfg and "pp" not in cfg:
        return None
    try:
        return int(cfg.get("pp", 1)), int(cfg.get("tp", 1))
    except (TypeError, ValueError):
        return None


def expected_ranks(ctx: Any, sk: int, direction: str, declared: list[int]) -> tuple[int | None, str]:
    """How many ranks must report a transfer in `direction` ("send" / "recv") before its aggregated completion, on
    scheduler sk, and where that comes from: the one definition every rule uses (premature_free's `quorum`,
    leaked_blocks' missing ranks). The fallback chain:
    1. `declared`: the `expected_ranks` of the request's own aggregated completion(s) (their largest);
    2. the largest `expected_ranks` declared by the scheduler's other completions of that direction;
    3. engine_config tp * pp;
    4. the number of distinct ranks that reported that direction (`kv_<direction>_rank`) for any request of the
       scheduler.
    (None, "") only where none applies (no rank row of that direction on the scheduler at all)."""
    if declared:
        return max(declared), "expected_ranks of its completion"
    idx = _rank_index(ctx, direction)
    if sk in idx.instance_expected:
        return idx.instance_expected[sk], "expected_ranks of the instance's completions"
    grid = _engine_grid(engine_configs(ctx).get(sk, {}))
    if grid is not None:
        return grid[0] * grid[1], "engine_config tp*pp"
    if idx.known.get(sk):
        return len(idx.known[sk]), "the ranks that reported for other requests"
    return None, ""


def rank_report(ctx: Any, rk: int, direction: str) -> RankReport | None:
    """The ranks that reported request key rk's transfer in `direction`, and the expected ones that did not.

    None when the request has no rank row of that direction (nothing says ranks report here) or every expected rank
    reported. The expected count is `expected_ranks` (its fallback chain: the request's own completions, the
    scheduler's completions, engine_config tp*pp, the ranks seen); the ranks named missing are those of the
    scheduler-wide set (ranks that reported for any request, plus the engine_config pp x tp grid) absent for this
    request. The rank rows are indexed once per direction (sorted by request key); each call is a searchsorted, so
    call it per finding."""
    cols = columns(ctx)
    idx = _rank_index(ctx, direction)
    mine = idx.of(rk)
    if len(mine) == 0:
        return None
    sk = int(cols.sk[idx.rows[mine[0]]])
    reported_codes = set(idx.code[mine].tolist())
    expected, source = expected_ranks(ctx, sk, direction, _expected_values(cols, idx.done_of(rk)))
    pp_tp = _engine_grid(engine_configs(ctx).get(sk, {}))
    grid = {p * _RANK_SPAN + t for p in range(pp_tp[0]) for t in range(pp_tp[1])} if pp_tp else set()
    known = idx.known.get(sk, set()) | grid

    def labels(codes: set[int]) -> list[str]:
        return [_rank_label(c // _RANK_SPAN, c % _RANK_SPAN) for c in sorted(codes)]

    report = RankReport(direction, idx.rows[mine].tolist(), labels(reported_codes),
                        labels(known - reported_codes), expected, source)
    if not report.missing and report.n_unseen == 0:
        return None
    return report
