"""Per-step and per-rank tables of the engine loop: what each step was, when each rank executed it, and where the
ranks sat idle.

`step_table(ctx)`  one row per scheduler step (instance, dp_rank, step). Algorithm: take the `sched`, `step_submit`
    and `step_output` rows (a kind filter on dictionary codes, no per-event Python), pull the numbers the format
    keeps in `detail` (`running`, `waiting`, `waiting_kv`, `free_blocks`, `dur_ns`, `empty_run` on `sched`;
    `wait_ns` on `step_output`) with one vectorised regular-expression extraction per key over those rows only, keep
    the first row of each kind per (instance, dp_rank, step) and outer-join the three on that key (one int64 key,
    a sorted union and searchsorted).

`exec_spans(ctx)`  one row per RPC a rank ran for a step (instance, dp_rank, pp_rank, tp_rank, step, rpc).
    Algorithm: sort the `exec_begin` / `exec_end` rows by writer lane (instance, dp_rank, pp_rank, tp_rank, pid)
    and `seq` (the writer's exact order); a worker runs its RPCs strictly in order, so an `exec_begin` pairs with
    the row right after it when that row is an `exec_end` of the same lane and step. Unpaired rows keep their one
    timestamp (NA for the other). `rpc` comes from the `exec_end` detail where the recorder gave it, else from the
    RPC's position in the step (first `execute_model`, second `sample_tokens`); `gpu_begin_ns` / `gpu_end_ns` from
    the detail too.

`bubbles(ctx)`  one row per idle interval of at least `config.bubble_min_ns` on a (instance, dp_rank, pp_rank,
    tp_rank) lane, between two busy spans (`gap_frame` holds every gap, however short, for the idle sums). Busy
    spans are the spans of steps that carried tokens (an empty step's no-forward RPC is not work), on GPU time
    where the recorder gave it (CPU spans of non-last PP ranks do not show GPU time), merged where they overlap
    (running maximum of the end per lane). The lead before a lane's first span and the trail after its last are not
    intervals. An RPC that computes nothing on its stage (`sample_tokens` on a non-last PP rank: it waits for the
    tokens the last rank broadcasts; `_waits_for_broadcast`) is not busy: the time inside it not covered by busy
    spans is an interval of its own with cause `sampled_token_wait` (vllm-ascend#10855, vllm#42187: a stage
    blocked there cannot start its next step, however many steps are queued). A wait a rank recorded inside an RPC
    (`exec_wait_begin` / `exec_wait_end`, `wait_frame`: a later PP stage receiving the previous stage's tensors)
    cuts the RPC's CPU-time span: the pieces around it stay busy, the wait is an interval of its own with cause
    `pp_recv_wait` (`pp_send_wait` for a send). The other intervals get one cause,
    decided in this order:
      1. `idle_no_requests`  the scheduler had no unfinished request for at least half the interval;
      2. `kv_transfer`       it had requests, but every one waited for remote KV, for at least half the interval;
      3. `scheduler_cpu`     (stage 0, and later stages that never saw the step upstream) the step that ends the
                             interval was submitted during it, and the engine's own time before that submit
                             (from the later of the interval start and the previous step_submit, minus the time
                             blocked on a step's future, step_output `wait_ns`) is at least half the interval:
                             update_from_output and schedule() on the critical path;
      4. `queue_not_full`    fewer than p steps carrying tokens were in flight at the interval start (p = the PP
                             size: vLLM needs p disjoint micro-batches to keep p stages busy), or p = 1 (the one
                             stage waits for the engine's next step while its last one travels back);
      5. `stage_imbalance`   otherwise (p > 1 steps in flight, yet this stage had nothing: another stage held
                             them).
    A later stage (pp_rank > 0) inherits the cause of its upstream stage's gap before the same step when that gap
    is at least half as long as its own (a late start travels down the pipeline, stage by stage); when the upstream
    stage ran the step without such a gap, this stage waited on a slower upstream stage: `stage_imbalance`.
    Extra columns: `runnable` (requests unfinished and not waiting for KV at the interval start), `in_flight`
    (steps carrying tokens in flight at the interval start) and `in_flight_requests` (the requests of the steps in
    flight just before it, so that a last stage's gap, which starts as its step's output returns, sees them:
    their `req_sched` rows; a decode in flight has nothing to schedule until its step's sampled token is back, so
    `runnable - in_flight_requests` is what the scheduler could have put into another micro-batch; a partial
    prefill chunk in flight could be followed by its next chunk, so with chunked prefills that is a lower bound).
    The request counts are step functions built from the request lifecycles (req_add, req_wait_kv, kv_recv_done /
    kv_recv_fail, req_finish) and from the steps' submit and output times, read with searchsorted.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

# lookup: defined in columns (rulekit.StepIndex uses it too, and rulekit may not import steps); steps.lookup stays
from pdtrace.analysis.columns import columns, gather, lookup, order_by_pair, positions
from pdtrace.analysis.parallel import shared_table
from pdtrace.analysis.requests import request_state
from pdtrace.trace.model import take_rows
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.rulekit import engine_config_rows, engine_configs as configs_by_scheduler

BUBBLE_CAUSES = ("queue_not_full", "scheduler_cpu", "kv_transfer", "stage_imbalance", "idle_no_requests",
                 "sampled_token_wait", "pp_recv_wait", "pp_send_wait")  # new causes at the end: codes stay
#: The bubble cause of an `exec_wait_*` reason.
WAIT_CAUSES = {"pp_recv": "pp_recv_wait", "pp_send": "pp_send_wait"}

STEP_COLUMNS = ("instance", "dp_rank", "step", "sched_ts", "tokens", "running", "waiting", "waiting_kv",
                "free_blocks", "dur_ns", "empty_run", "submit_ts", "in_flight", "output_ts", "wait_ns")
SPAN_COLUMNS = ("instance", "dp_rank", "pp_rank", "tp_rank", "step", "rpc", "begin_ts", "end_ts", "n",
                "gpu_begin_ns", "gpu_end_ns")
BUBBLE_COLUMNS = ("instance", "dp_rank", "pp_rank", "tp_rank", "start_ns", "end_ns", "dur_ns", "cause",
                  "step_before", "step_after", "runnable", "in_flight", "in_flight_requests")

_NULL = -1  # fill for null ranks / steps in the internal integer columns


# --------------------------------------------------------------------------------------------------- column access

def dict_codes(ctx: AnalysisContext, column: str) -> tuple[np.ndarray, list[str]]:
    """A dictionary (or string) column as integer codes (-1 for null) plus the values: the shared
    `pdtrace.analysis.columns` arrays, computed once per analysis for every rule."""
    return columns(ctx).codes(column)


def kind_rows(ctx: AnalysisContext, kinds: Iterable[str]) -> np.ndarray:
    """Row indices (load order) of the events of the given kinds."""
    return columns(ctx).rows_of(*kinds)


def instances(ctx: AnalysisContext) -> list[str]:
    """The instance names, indexed by the instance codes of the internal tables (`inst`)."""
    return dict_codes(ctx, "instance")[1]


def _detail_text(ctx: AnalysisContext, rows: np.ndarray) -> pa.Array:
    """The detail strings of the rows (nulls as ""), in the order given: a take from each chunk that holds them
    (`take_rows`; no take across chunks, no 10M-row mask)."""
    return pc.fill_null(take_rows(ctx.trace.table.column("detail"), np.asarray(rows, dtype=np.int64)), "")


def _extract(text: pa.Array, pattern: str, key: str, optional: bool) -> tuple[pa.Array, np.ndarray | None]:
    """Regex-extract one value per row; for an optional key, only over the rows whose text names it (a substring
    test is several times cheaper than the regex). Returns (values of the rows searched, their indices or None
    for all rows)."""
    if optional:
        has = pc.match_substring(text, f'"{key}"').to_numpy(zero_copy_only=False)
        idx = np.flatnonzero(has)
        if len(idx) == 0:
            return pa.array([], pa.string()), idx
        if len(idx) < len(text):
            text = text.take(pa.array(idx))
        else:
            idx = None
    else:
        idx = None
    return pc.struct_field(pc.extract_regex(text, pattern), [0]), idx


#: Up to this many rows, `detail` values are read with Python's `re` per row (the same patterns): each Arrow regex
#: kernel call compiles its pattern, about 0.5 ms per key, where a handful of rows (engine_config) take microseconds.
FEW_ROWS = 32


def _number_pattern(key: str) -> str:
    return rf'"{key}"\s*:\s*(?P<v>-?[0-9.eE+]+|true|false)'


def _text_pattern(key: str) -> str:
    return rf'"{key}"\s*:\s*"(?P<v>[^"]*)"'


def _few_values(texts: list[str], pattern: str) -> list[str | None]:
    """The first match of `pattern` in each of a few (FEW_ROWS) detail texts (None where none)."""
    compiled = re.compile(pattern)
    found = [compiled.search(text) for text in texts]  # per row (few)
    return [m.group("v") if m else None for m in found]


def _as_float(value: str | None) -> float:
    if value is None:
        return float("nan")
    if value in ("true", "false"):
        return 1.0 if value == "true" else 0.0
    try:
        return float(value)
    except ValueError:  # digits and signs that make no number ("1.2.3"): as absent
        return float("nan")


def detail_numbers(ctx: AnalysisContext, rows: np.ndarray, keys: Iterable[str],
                   optional: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """Numeric `detail` values of the given rows, one float array per key (NaN where absent; booleans as 1/0).

    The detail text of the rows is taken once; one vectorised regular-expression extraction per key (Arrow,
    never Python per row), over only the rows that name the key for `optional` keys. Up to FEW_ROWS rows, the
    same patterns run through Python's `re` instead."""
    keys = list(keys)
    if len(rows) == 0:
        return {k: np.empty(0) for k in keys}
    if len(rows) <= FEW_ROWS:
        texts = _detail_text(ctx, rows).to_pylist()
        return {key: np.array([_as_float(v) for v in _few_values(texts, _number_pattern(key))], np.float64)
                for key in keys}
    text = _detail_text(ctx, rows)
    optional = set(optional)
    out = {}
    for key in keys:
        raw, idx = _extract(text, _number_pattern(key), key, key in optional)
        raw = pc.replace_substring_regex(pc.replace_substring_regex(raw, "^true$", "1"), "^false$", "0")
        values = pc.cast(raw, pa.float64()).to_numpy(zero_copy_only=False)
        if idx is None:
            out[key] = values
        else:
            full = np.full(len(rows), np.nan)
            full[idx] = values
            out[key] = full
    return out


def detail_number(ctx: AnalysisContext, rows: np.ndarray, key: str) -> np.ndarray:
    """The numeric `detail` value `key` of the given rows (float, NaN where absent), vectorised in Arrow."""
    return detail_numbers(ctx, rows, [key])[key]


def detail_int(ctx: AnalysisContext, rows: np.ndarray, key: str, fill: int = _NULL,
               text: pa.Array | None = None) -> np.ndarray:
    """The integer `detail` value `key` of the given rows (int64, `fill` where absent): exact for ns timestamps.
    Only the rows whose text names the key are searched."""
    if len(rows) == 0:
        return np.empty(0, np.int64)
    text = _detail_text(ctx, rows) if text is None else text
    raw, idx = _extract(text, rf'"{key}"\s*:\s*(?P<v>-?[0-9]+)\s*[,}}]', key, True)
    values = pc.fill_null(pc.cast(raw, pa.int64()), fill).to_numpy(zero_copy_only=False)
    if idx is None:
        return values
    full = np.full(len(rows), fill, dtype=np.int64)
    full[idx] = values
    return full


def detail_text(ctx: AnalysisContext, rows: np.ndarray, key: str) -> np.ndarray:
    """The string `detail` value `key` of the given rows (None where absent), vectorised in Arrow."""
    if len(rows) == 0:
        return np.empty(0, dtype=object)
    if len(rows) <= FEW_ROWS:
        return np.array(_few_values(_detail_text(ctx, rows).to_pylist(), _text_pattern(key)), dtype=object)
    found = pc.extract_regex(_detail_text(ctx, rows), _text_pattern(key))
    return pc.struct_field(found, [0]).to_numpy(zero_copy_only=False)


# ------------------------------------------------------------------------------------------------------ engine config

def engine_configs(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per scheduler (inst, dp) that wrote `engine_config`: n_blocks, pp, tp, batch_queue_size, block_size,
    max_num_seqs, max_num_batched_tokens, runner (NaN / None where the recorder did not know). The table form of
    `rulekit.engine_configs` (the one reading of engine_config: the first per scheduler, in time order)."""
    def build() -> pd.DataFrame:
        cols = columns(ctx)
        configs = configs_by_scheduler(ctx)
        where = engine_config_rows(ctx)
        sks = np.array(sorted(configs, key=lambda k: int(cols.pos[where[k]])), np.int64)
        inst_of = {name: code for code, name in enumerate(dict_codes(ctx, "instance")[1])}
        names = cols.sk_names
        keys = ("pp", "tp", "batch_queue_size", "block_size", "max_num_seqs", "max_num_batched_tokens")

        def number(value: object) -> float:
            try:
                return float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return np.nan

        rows = [configs[int(k)] for k in sks]
        return pd.DataFrame({
            "inst": np.array([inst_of[str(names["instance"].iloc[k])] for k in sks], np.int64),
            "dp": np.array([-1 if pd.isna(names["dp_rank"].iloc[k]) else int(names["dp_rank"].iloc[k])
                            for k in sks], np.int64),
            "ts_ns": np.array([int(cols.ts[where[int(k)]]) for k in sks], np.int64),
            "n_blocks": np.array([number(c.get("num_blocks")) for c in rows], np.float64),
            **{key: np.array([number(c.get(key)) for c in rows], np.float64) for key in keys},
            "runner": np.array([c.get("runner") if isinstance(c.get("runner"), str) else None for c in rows],
                               dtype=object)})

    return ctx.cached("steps:engine_configs", build)


# -------------------------------------------------------------------------------------------------------- step table

def _first_per_key(key: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Indices of the earliest row of each distinct key, sorted by key."""
    order = np.lexsort((ts, key))
    k = key[order]
    first = np.r_[True, k[1:] != k[:-1]] if len(k) else np.empty(0, bool)
    return order[first]


def _requests_per_key(cols: Any, rows: np.ndarray, all_keys: np.ndarray, dp_span: int,
                      step_span: int) -> np.ndarray:
    """How many of `rows` (the req_sched rows) each step key of `all_keys` (sorted, distinct) holds: the keys of
    `step_frame` (instance, dp_rank, step), built per row as its scheduler's base key (a small table indexed by
    `Columns.sk`) plus its step, then counted with one bincount over
    the keys' range (a row whose key lies outside it, or whose step is null, falls in a bin no key reads). Where
    that range is sparse (more than 4 bins a row), a searchsorted of every row among the keys instead. req_sched
    is most of a trace's rows: on a 5M-row window (4M req_sched rows) `step_frame` took CPU 0.09 s against
    0.23 s with three gathers, int64 arithmetic and a searchsorted per row (bench/long_trace.py, one core)."""
    n = len(all_keys)
    if n == 0 or len(rows) == 0:
        return np.zeros(n, np.int64)
    _, sk_inst, sk_dp = cols._sched_keys
    base = (sk_inst.astype(np.int64) * dp_span + sk_dp + 1) * step_span  # per scheduler key, in key order
    # a null step (-1) gives base - 1: the previous scheduler's step_span - 1, never a step
    key = cols.step[rows].astype(np.int64)
    key += base[0] if len(base) == 1 else base[cols.sk[rows]]  # one scheduler (a partition's): no gather
    low, span = int(all_keys[0]), int(all_keys[-1]) - int(all_keys[0]) + 1
    if span <= 4 * len(rows) + (1 << 16):
        key -= low - 1
        np.clip(key, 0, span + 1, out=key)  # 0: below the keys, span + 1: above them
        return np.bincount(key, minlength=span + 2)[all_keys - (low - 1)].astype(np.int64, copy=False)
    at = np.searchsorted(all_keys, key)
    at = at[(at < n) & (all_keys[np.minimum(at, n - 1)] == key)]
    return np.bincount(at, minlength=n).astype(np.int64)


@shared_table(cost=0.09)
def step_frame(ctx: AnalysisContext) -> pd.DataFrame:
    """step_table with integer `inst` codes and the sched row index `row` (the rules' form, one row per step and
    scheduler; `pdtrace.analysis.ruleapi` exports it).

    The three kinds are keyed by one int64 (instance, dp_rank, step) and outer-joined with a sorted union and
    searchsorted on numpy arrays."""

    def build() -> pd.DataFrame:
        cols = columns(ctx)
        inst_codes, _ = dict_codes(ctx, "instance")
        dp_span = int(cols.dp.max()) + 2 if cols.n else 2
        step_span = int(cols.step.max()) + 2 if cols.n else 2

        def key_of(rows: np.ndarray) -> np.ndarray:  # (instance, dp_rank, step) as one int64
            return (inst_codes[rows].astype(np.int64) * dp_span + cols.dp[rows] + 1) * step_span + cols.step[rows]

        def keyed(kinds: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
            rows = kind_rows(ctx, kinds)
            rows = rows[cols.step[rows] >= 0]
            key = key_of(rows)
            first = _first_per_key(key, cols.ts[rows])
            return rows[first], key[first]

        s_rows, s_key = keyed(("sched",))
        u_rows, u_key = keyed(("step_submit",))
        o_rows, o_key = keyed(("step_output",))
        # sorted distinct keys (a sort, not np.union1d: numpy's hash-based unique is slower on these)
        all_keys = np.sort(np.concatenate([s_key, u_key, o_key]))
        if len(all_keys):
            all_keys = all_keys[np.r_[True, all_keys[1:] != all_keys[:-1]]]
        n = len(all_keys)

        # where each kind's keys sit among all_keys: one searchsorted per kind, shared by its columns
        at = {id(key): np.searchsorted(all_keys, key) for key in (s_key, u_key, o_key)}

        def spread(key: np.ndarray, values: np.ndarray, fill: float | int, dtype: object) -> np.ndarray:
            out = np.full(n, fill, dtype=dtype)
            out[at[id(key)]] = values
            return out

        def number(rows: np.ndarray) -> np.ndarray:
            return cols.numbers_at("n", rows)

        # only what the rules read; step_table() adds waiting, waiting_kv and dur_ns for plots and notebooks
        sched_detail = detail_numbers(ctx, s_rows, ("running", "free_blocks", "empty_run"), optional=("empty_run",))
        frame = pd.DataFrame({
            "inst": (all_keys // step_span // dp_span).astype(np.int64),
            "dp": (all_keys // step_span % dp_span - 1).astype(np.int64),
            "step": (all_keys % step_span).astype(np.int64),
            "row": spread(s_key, s_rows, _NULL, np.int64),
            "sched_ts": pd.array(spread(s_key, cols.ts[s_rows], _NULL, np.int64), dtype="Int64"),
            "tokens": spread(s_key, number(s_rows), np.nan, np.float64),
        })
        for name, values in sched_detail.items():
            frame[name] = spread(s_key, values, np.nan, np.float64)
        frame["empty_run"] = np.where(frame["row"] >= 0, frame["empty_run"].fillna(1.0), np.nan)
        frame["requests"] = _requests_per_key(cols, kind_rows(ctx, ("req_sched",)), all_keys, dp_span, step_span)
        frame["submit_ts"] = pd.array(spread(u_key, cols.ts[u_rows], _NULL, np.int64), dtype="Int64")
        frame["in_flight"] = spread(u_key, number(u_rows), np.nan, np.float64)
        frame["output_ts"] = pd.array(spread(o_key, cols.ts[o_rows], _NULL, np.int64), dtype="Int64")
        frame["wait_ns"] = spread(o_key, detail_numbers(ctx, o_rows, ["wait_ns"], optional=["wait_ns"])["wait_ns"],
                                  np.nan, np.float64)
        for col in ("sched_ts", "submit_ts", "output_ts"):
            frame[col] = frame[col].mask(frame[col] == _NULL)
        return frame

    return ctx.cached("steps:step_frame", build)


#: The name step_frame had while it was private; kept so that a rule written against it still imports.
_step_frame = step_frame


@shared_table(step_frame, cost=0.05)
def step_table(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per scheduler step (instance, dp_rank, step): sched_ts, tokens, running, waiting, waiting_kv,
    free_blocks, dur_ns, empty_run, submit_ts, in_flight, output_ts, wait_ns (NA where the event or key is absent).
    See the module docstring for the algorithm."""

    def build() -> pd.DataFrame:
        frame = step_frame(ctx)
        names = instances(ctx)
        has = np.flatnonzero(frame["row"].to_numpy() >= 0)
        extra = detail_numbers(ctx, frame["row"].to_numpy()[has], ("waiting", "waiting_kv", "dur_ns"),
                               optional=("waiting_kv",))
        out = frame.rename(columns={"dp": "dp_rank"})
        for key, values in extra.items():
            column = np.full(len(frame), np.nan)
            column[has] = values
            out[key] = column
        out.insert(0, "instance", pd.Categorical.from_codes(frame["inst"].to_numpy(), categories=names)
                   if names else pd.Categorical([]))
        out = out.drop(columns=["inst", "row"])
        out["dp_rank"] = out["dp_rank"].astype("Int64").where(out["dp_rank"] >= 0)
        return out[list(STEP_COLUMNS)]

    return ctx.cached("steps:step_table", build)


# -------------------------------------------------------------------------------------------------------- exec spans

def rows_columns(ctx: AnalysisContext, rows: np.ndarray, names: Iterable[str]) -> dict[str, np.ndarray]:
    """Numeric columns at the given rows (ascending, distinct), nulls as -1, each in its column's own dtype: read
    straight from each chunk's buffers (`columns.gather`: no 10M-row mask, no Arrow allocation)."""
    table = ctx.trace.table
    out = {}
    for name in names:
        values, valid = gather(table.column(name), rows)
        out[name] = values if valid.all() else np.where(valid, values, _NULL)
    return out


def _ints_from_text(text: pa.Array, key: str) -> np.ndarray:
    found = pc.struct_field(pc.extract_regex(text, rf'"{key}"\s*:\s*(?P<v>-?[0-9]+)\s*[,}}]'), [0])
    return pc.fill_null(pc.cast(found, pa.int64()), _NULL).to_numpy(zero_copy_only=False)


@shared_table(cost=0.07)
def _span_frame(ctx: AnalysisContext) -> pd.DataFrame:
    """exec_spans with integer codes (internal form): inst, dp, pp, tp, step, rpc, begin_ts, end_ts, n, gpu_*.
    Numpy throughout: the exec rows' details read in row order (substring tests, a regex only where `gpu_`
    appears), then an order by (writer lane, seq) (a lexsort, skipped when the rows are in it already, as each
    writer's are) and pairing by position."""

    def build() -> pd.DataFrame:
        cols = columns(ctx)
        rows = kind_rows(ctx, ["exec_begin", "exec_end"])
        inst_codes, _ = dict_codes(ctx, "instance")
        kind_codes, kind_names = dict_codes(ctx, "kind")
        begin_code = kind_names.index("exec_begin") if "exec_begin" in kind_names else -9
        fields = rows_columns(ctx, rows, ["pp_rank", "tp_rank", "pid", "seq"])
        is_begin = kind_codes[rows] == begin_code
        # exec_end GPU times, in row order: a substring test, the regex only where `gpu_` appears; the RPC names
        # (0 execute_model, 1 sample_tokens, -1 not named) by two substring tests over the same text
        ends = np.flatnonzero(~is_begin)
        gpu_b = np.full(len(rows), _NULL, np.int64)
        gpu_e = np.full(len(rows), _NULL, np.int64)
        named = np.full(len(rows), -1, np.int8)
        if len(ends):
            text = _detail_text(ctx, rows[ends])
            ex = pc.match_substring(text, '"rpc":"execute_model"').to_numpy(zero_copy_only=False)
            sa = pc.match_substring(text, '"rpc":"sample_tokens"').to_numpy(zero_copy_only=False)
            named[ends] = np.where(ex, 0, np.where(sa, 1, -1))
            has_gpu = np.flatnonzero(pc.match_substring(text, '"gpu_').to_numpy(zero_copy_only=False))
            if len(has_gpu):
                sub = text.take(pa.array(has_gpu))
                gpu_b[ends[has_gpu]] = _ints_from_text(sub, "gpu_begin_ns")
                gpu_e[ends[has_gpu]] = _ints_from_text(sub, "gpu_end_ns")
        inst = inst_codes[rows].astype(np.int64)
        dp = cols.dp[rows].astype(np.int64)
        pp = fields["pp_rank"].astype(np.int64)
        tp = fields["tp_rank"].astype(np.int64)
        pid = fields["pid"].astype(np.int64)
        # one int64 per writer lane (instance, dp, pp, tp, pid) so that the sort has two keys, not six
        lane_code = (((inst * (dp.max(initial=0) + 2) + dp + 1) * (pp.max(initial=0) + 2) + pp + 1)
                     * (tp.max(initial=0) + 2) + tp + 1) * (pid.max(initial=0) + 1) + pid
        order = order_by_pair(lane_code, fields["seq"])
        if order is not None:
            rows, inst, dp, pp, tp, lane_code = (a[order] for a in (rows, inst, dp, pp, tp, lane_code))
            is_begin, gpu_b, gpu_e, named = is_begin[order], gpu_b[order], gpu_e[order], named[order]
        step = cols.step[rows].astype(np.int64)
        ts = cols.ts[rows]
        n = cols.numbers_at("n", rows)
        same_next = np.zeros(len(rows), dtype=bool)
        if len(rows) > 1:
            same_next[:-1] = (lane_code[1:] == lane_code[:-1]) & (step[1:] == step[:-1]) & ~is_begin[1:]
        paired_begin = is_begin & same_next
        paired_end = np.r_[False, paired_begin[:-1]] if len(rows) else paired_begin
        b_idx = np.flatnonzero(paired_begin)
        lb = np.flatnonzero(is_begin & ~paired_begin)
        le = np.flatnonzero(~is_begin & ~paired_end)
        head = np.concatenate([b_idx, lb, le])
        end_idx = np.concatenate([b_idx + 1, np.full(len(lb), _NULL), le])
        begin_ts = np.concatenate([ts[b_idx], ts[lb], np.full(len(le), _NULL)])
        end_ts = np.concatenate([ts[b_idx + 1], np.full(len(lb), _NULL), ts[le]])
        n_tok = np.concatenate([np.where(np.isnan(n[b_idx]), n[b_idx + 1], n[b_idx]), n[lb], n[le]])
        # spans in lane order (instance, dp, pp, tp), then time
        order_ts = np.where(begin_ts >= 0, begin_ts, end_ts)
        sort = order_by_pair(lane_code[head] // (pid.max(initial=0) + 1), order_ts)
        if sort is not None:
            head, end_idx, begin_ts, end_ts, n_tok = (a[sort] for a in (head, end_idx, begin_ts, end_ts, n_tok))
        m = len(head)
        has_end = end_idx >= 0
        span_gb = np.full(m, _NULL, np.int64)
        span_ge = np.full(m, _NULL, np.int64)
        span_gb[has_end] = gpu_b[end_idx[has_end]]
        span_ge[has_end] = gpu_e[end_idx[has_end]]
        end_row = np.full(m, _NULL, np.int64)
        end_row[has_end] = rows[end_idx[has_end]]
        rpc_named = np.full(m, -1, np.int8)
        rpc_named[has_end] = named[end_idx[has_end]]
        return pd.DataFrame({"inst": inst[head], "dp": dp[head], "pp": pp[head], "tp": tp[head],
                             "step": step[head], "begin_ts": begin_ts, "end_ts": end_ts, "n": n_tok,
                             "gpu_begin_ns": span_gb, "gpu_end_ns": span_ge, "end_row": end_row,
                             "rpc_named": rpc_named}, copy=False)

    return ctx.cached("steps:span_frame", build)


def span_rpcs(ctx: AnalysisContext, frame: pd.DataFrame) -> pd.Categorical:
    """The RPC of each span of `_span_frame` (or a subset of whole (lane, step) groups): `execute_model` /
    `sample_tokens` as the exec_end detail names it (`rpc_named`, read with the frame), else the span's position
    within its step on the lane (first execute_model, second sample_tokens, later ones `rpc`)."""
    names = ["execute_model", "sample_tokens", "rpc"]
    m = len(frame)
    code = frame["rpc_named"].to_numpy()
    lane = frame[["inst", "dp", "pp", "tp", "step"]].to_numpy()
    new_group = np.r_[True, (lane[1:] != lane[:-1]).any(axis=1)] if m else np.empty(0, bool)
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(m), 0)) if m else np.empty(0, np.int64)
    position = np.minimum(np.arange(m) - group_start, 2).astype(np.int8)
    return pd.Categorical.from_codes(np.where(code >= 0, code, position), categories=names)


@shared_table(_span_frame, cost=0.1)
def exec_spans(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per RPC a rank ran for a step (instance, dp_rank, pp_rank, tp_rank, step, rpc): begin_ts, end_ts
    (NA where unpaired), n (tokens), gpu_begin_ns, gpu_end_ns. See the module docstring for the algorithm."""

    def build() -> pd.DataFrame:
        frame = _span_frame(ctx)
        frame = frame.assign(rpc=span_rpcs(ctx, frame))
        return _public(ctx, frame, {"dp": "dp_rank", "pp": "pp_rank", "tp": "tp_rank"},
                       int_na=["begin_ts", "end_ts", "gpu_begin_ns", "gpu_end_ns"], columns=SPAN_COLUMNS)

    return ctx.cached("steps:exec_spans", build)


def _public(ctx: AnalysisContext, frame: pd.DataFrame, rename: dict[str, str], int_na: list[str],
            columns: tuple[str, ...]) -> pd.DataFrame:
    names = instances(ctx)
    out = frame.rename(columns=rename)
    out.insert(0, "instance", pd.Categorical.from_codes(frame["inst"].to_numpy(), categories=names)
               if names else pd.Categorical([]))
    out = out.drop(columns=["inst"])
    for col in ("dp_rank", "pp_rank", "tp_rank", "step", "step_before", "step_after"):
        if col in out:
            out[col] = out[col].astype("Int64").where(out[col] >= 0)
    for col in int_na:
        out[col] = out[col].astype("Int64").where(out[col] >= 0)
    return out[list(columns)]


# --------------------------------------------------------------------------------------------------------- bubbles

NEVER = np.iinfo(np.int64).max  # "did not happen (yet)" in the int64 timestamp arrays below
NO_POS = -1


class StepCount:
    """A per-scheduler step function of a count over time (requests alive, steps in flight), built from +1/-1
    events at int64 ns. `at(t)` is the count after every event at or before t; `zero_between(s, e)` the time in
    [s, e] during which the count was 0 (0 before the first event). Both are searchsorted lookups."""

    def __init__(self, times: np.ndarray, deltas: np.ndarray) -> None:
        times = np.asarray(times, dtype=np.int64)
        order = np.argsort(times, kind="stable")
        t = times[order]
        c = np.cumsum(np.asarray(deltas, dtype=np.int64)[order])
        if len(t):
            last = np.r_[t[1:] != t[:-1], True]
            t, c = t[last], np.maximum(c[last], 0)
        self.t = t
        self.c = c
        seg = np.diff(t)
        self.z = np.r_[0, np.cumsum(np.where(c[:-1] == 0, seg, 0))].astype(np.int64) if len(t) else t

    def at(self, q: np.ndarray) -> np.ndarray:
        if len(self.t) == 0:
            return np.zeros(len(q), dtype=np.int64)
        i = np.searchsorted(self.t, q, "right") - 1
        return np.where(i >= 0, self.c[np.maximum(i, 0)], 0)

    def _zero_until(self, q: np.ndarray, origin: int) -> np.ndarray:
        q = np.asarray(q, dtype=np.int64)
        if len(self.t) == 0:
            return q - origin
        i = np.searchsorted(self.t, q, "right") - 1
        j = np.maximum(i, 0)
        inside = (self.t[0] - origin) + self.z[j] + np.where(self.c[j] == 0, q - self.t[j], 0)
        return np.where(i >= 0, inside, q - origin)

    def zero_between(self, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        if len(s) == 0:
            return np.empty(0, np.int64)
        origin = int(min(np.min(s), self.t[0])) if len(self.t) else int(np.min(s))
        return self._zero_until(e, origin) - self._zero_until(s, origin)


@shared_table(positions, request_state, cost=0.01)
def request_lifetimes(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per request key (instance, dp_rank, req) of `pdtrace.analysis.requests.request_state`: inst (code),
    dp, start_ts (req_add, else its first scheduling, KV wait or finish), wait_kv_ts, recv_ts (the receive's close:
    kv_recv_done / kv_recv_fail after req_wait_kv), finish_ts (first req_finish); int64 ns, NEVER where absent.
    Read off the shared per-request positions: O(requests), no pass over the events."""

    def build() -> pd.DataFrame:
        cols = columns(ctx)
        st = request_state(ctx)

        def ts_of(pos: np.ndarray) -> np.ndarray:
            return np.where(pos >= 0, cols.ts[cols.order[np.maximum(pos, 0)]], NEVER) if cols.n else pos

        firsts = [p for p in (st.first_sched_pos, st.wait_kv_pos, st.finish_pos, st.recv_close_pos)]
        big = np.iinfo(np.int64).max
        first_other = np.min(np.stack([np.where(p >= 0, p, big) for p in firsts]), axis=0) if st.n else st.add_pos
        start_pos = np.where(st.add_pos >= 0, st.add_pos, np.where(first_other == big, NO_POS, first_other))
        names = cols.sk_names
        inst_names = instances(ctx)
        sk_inst = np.array([inst_names.index(str(i)) for i in names["instance"]], dtype=np.int64)  # per scheduler
        sk_dp = names["dp_rank"].fillna(-1).to_numpy(dtype=np.int64)
        out = pd.DataFrame({"inst": sk_inst[st.sk] if st.n else np.empty(0, np.int64),
                            "dp": sk_dp[st.sk] if st.n else np.empty(0, np.int64),
                            "start_ts": ts_of(start_pos), "wait_kv_ts": ts_of(st.wait_kv_pos),
                            "recv_ts": ts_of(st.recv_close_pos), "finish_ts": ts_of(st.finish_pos)})
        return out[out["start_ts"] != NEVER].reset_index(drop=True)

    return ctx.cached("steps:request_lifetimes", build)


def _int64(series: pd.Series, fill: int = _NULL) -> np.ndarray:
    return series.astype("Int64").fillna(fill).to_numpy(dtype=np.int64)


@shared_table(request_lifetimes, step_frame, cost=0.01)
def _count_functions(ctx: AnalysisContext) -> dict[tuple[int, int], tuple[StepCount, ...]]:
    """Per scheduler (inst, dp): (live requests, runnable requests, token-carrying steps in flight, the requests
    of those steps: each step's req_sched rows from its submit to its output)."""

    def build() -> dict[tuple[int, int], tuple[StepCount, ...]]:
        life = request_lifetimes(ctx)
        start = life["start_ts"].to_numpy()
        finish = life["finish_ts"].to_numpy()
        wait = life["wait_kv_ts"].to_numpy()
        recv = life["recv_ts"].to_numpy()
        has_wait = wait != NEVER
        # runnable: [start, finish) without a KV wait; [start, wait) and [recv, finish) with one
        r1_end = np.where(has_wait, wait, finish)
        r2_start = np.where(has_wait & (recv != NEVER) & (recv < finish), recv, NEVER)
        steps = step_frame(ctx)
        submit = _int64(steps["submit_ts"].fillna(steps["sched_ts"]))
        output = _int64(steps["output_ts"])
        carries = ~(steps["tokens"].to_numpy() <= 0)  # NaN tokens count as work
        step_requests = steps["requests"].to_numpy(dtype=np.int64)
        life_keys = life.groupby(["inst", "dp"], sort=False).indices
        step_keys = steps.groupby(["inst", "dp"], sort=False).indices
        out = {}
        for key in set(life_keys) | set(step_keys):
            m = life_keys.get(key, np.empty(0, np.int64))

            def counter(pairs: list[tuple[np.ndarray, int]]) -> StepCount:
                times = [t[(t != NEVER) & (t != _NULL)] for t, _ in pairs]
                deltas = [np.full(len(t), d) for t, (_, d) in zip(times, pairs, strict=True)]
                return StepCount(np.concatenate(times), np.concatenate(deltas))

            live = counter([(start[m], 1), (finish[m], -1)])
            r2 = r2_start[m]
            runnable = counter([(start[m], 1), (r1_end[m], -1), (r2, 1),
                                (np.where(r2 != NEVER, finish[m], NEVER), -1)])
            sm = step_keys.get(key, np.empty(0, np.int64))
            sm = sm[carries[sm] & (submit[sm] != _NULL)]
            in_flight = counter([(submit[sm], 1), (output[sm], -1)])
            ends = output[sm] != _NULL
            requests_in_flight = StepCount(np.r_[submit[sm], output[sm][ends]],
                                           np.r_[step_requests[sm], -step_requests[sm][ends]])
            out[key] = (live, runnable, in_flight, requests_in_flight)
        return out

    return ctx.cached("steps:count_functions", build)


def pipeline_sizes(ctx: AnalysisContext) -> dict[tuple[int, int], int]:
    """p per scheduler (inst, dp): engine_config's `pp`, else the number of PP ranks seen executing."""
    spans = _span_frame(ctx)
    inst, dp, pp = (spans[c].to_numpy() for c in ("inst", "dp", "pp"))
    # spans come in lane order (instance, dp, pp, tp): the last span of each (inst, dp) has its highest pp
    last = np.flatnonzero(np.r_[(inst[1:] != inst[:-1]) | (dp[1:] != dp[:-1]), True]) if len(inst) else inst
    sizes = {(i, d): p + 1 for i, d, p in zip(inst[last].tolist(), dp[last].tolist(), pp[last].tolist())}
    sizes.update(config_numbers(ctx, "pp"))
    return sizes


def config_numbers(ctx: AnalysisContext, name: str) -> dict[tuple[int, int], int]:
    """One engine_config number (a column of `engine_configs`: pp, max_num_seqs, ...) per scheduler (inst, dp)
    that recorded it, for `sizes_of`."""
    cfg = engine_configs(ctx)
    return {(int(i), int(d)): int(v) for i, d, v in zip(cfg["inst"], cfg["dp"], cfg[name], strict=True)
            if not np.isnan(v)}


def sizes_of(sizes: dict[tuple[int, int], int], inst: np.ndarray, dp: np.ndarray, fill: int = 1) -> np.ndarray:
    """p (or another per-scheduler number) for each (inst, dp) pair of two arrays (`fill` where unknown): a
    searchsorted over the few schedulers."""
    inst = np.asarray(inst, dtype=np.int64)
    dp = np.asarray(dp, dtype=np.int64)
    if not sizes or len(inst) == 0:
        return np.full(len(inst), fill, np.int64)
    width = max(int(dp.max(initial=0)), max(d for _, d in sizes)) + 2
    keys = np.array([i * width + d + 1 for i, d in sizes], dtype=np.int64)
    values = np.array(list(sizes.values()), dtype=np.int64)
    order = np.argsort(keys)
    keys, values = keys[order], values[order]
    query = inst * width + dp + 1
    idx = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    return np.where(keys[idx] == query, values[idx], fill)


def distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values (a sort: numpy 2's hash-based np.unique is slower on large int arrays)."""
    v = np.sort(values)
    return v[np.r_[True, v[1:] != v[:-1]]] if len(v) else v


class _Keys:
    """Small int64 codes for schedulers (inst, dp), stages (inst, dp, pp), lanes (inst, dp, pp, tp) and keys of a
    step on them, with spans taken from the data so that lexicographic order is kept and nothing overflows."""

    def __init__(self, inst: np.ndarray, dp: np.ndarray, pp: np.ndarray, tp: np.ndarray, step: np.ndarray) -> None:
        self.dp_span = int(dp.max(initial=0)) + 2
        self.pp_span = int(pp.max(initial=0)) + 2
        self.tp_span = int(tp.max(initial=0)) + 2
        self.step_span = int(step.max(initial=0)) + 2

    def sched(self, inst: np.ndarray, dp: np.ndarray) -> np.ndarray:
        return inst.astype(np.int64) * self.dp_span + dp + 1

    def stage(self, inst: np.ndarray, dp: np.ndarray, pp: np.ndarray) -> np.ndarray:
        return self.sched(inst, dp) * self.pp_span + pp + 1

    def lane(self, inst: np.ndarray, dp: np.ndarray, pp: np.ndarray, tp: np.ndarray) -> np.ndarray:
        return self.stage(inst, dp, pp) * self.tp_span + tp + 1

    def at_step(self, code: np.ndarray, step: np.ndarray) -> np.ndarray:
        return code * self.step_span + step + 1


@shared_table(cost=0.01)
def wait_frame(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per wait a rank recorded inside an RPC (`exec_wait_begin` / `exec_wait_end`): inst, dp, pp, tp, step,
    b, e, cause (a BUBBLE_CAUSES code). Paired as exec spans are: sorted by writer lane (instance, dp, pp, tp, pid)
    and seq, a begin pairs with the row right after it when that is an end of the same lane, step and reason; an
    unpaired row is dropped (a wait cut by the trace's end or a recorder gap is not measured)."""

    def build() -> pd.DataFrame:
        rows = kind_rows(ctx, ["exec_wait_begin", "exec_wait_end"])
        names = ["inst", "dp", "pp", "tp", "step", "b", "e", "cause"]
        if len(rows) == 0:
            return pd.DataFrame({c: np.empty(0, np.int64) for c in names})
        cols = columns(ctx)
        inst = dict_codes(ctx, "instance")[0][rows].astype(np.int64)
        kind_codes, kind_names = dict_codes(ctx, "kind")
        reason_codes, reason_names = dict_codes(ctx, "reason")
        is_begin = kind_codes[rows] == kind_names.index("exec_wait_begin") if "exec_wait_begin" in kind_names \
            else np.zeros(len(rows), bool)
        cause_of = np.array([BUBBLE_CAUSES.index(WAIT_CAUSES[r]) if r in WAIT_CAUSES else -1 for r in reason_names]
                            + [-1], np.int64)  # a null reason (code -1) reads the last entry
        cause = cause_of[reason_codes[rows]]
        fields = rows_columns(ctx, rows, ["pp_rank", "tp_rank", "pid", "seq"])
        dp = cols.dp[rows].astype(np.int64)
        pp, tp, pid = (fields[c].astype(np.int64) for c in ("pp_rank", "tp_rank", "pid"))
        lane = _Keys(inst, dp, pp, tp, np.zeros(1, np.int64)).lane(inst, dp, pp, tp) * (pid.max(initial=0) + 1) + pid
        order = order_by_pair(lane, fields["seq"])
        if order is None:
            order = np.arange(len(rows))
        step = cols.step[rows].astype(np.int64)[order]
        ts = cols.ts[rows][order]
        lane, is_begin, cause = lane[order], is_begin[order], cause[order]
        pair = np.zeros(len(rows), bool)
        pair[:-1] = (is_begin[:-1] & ~is_begin[1:] & (lane[1:] == lane[:-1]) & (step[1:] == step[:-1])
                     & (cause[1:] == cause[:-1]) & (cause[:-1] >= 0))
        i = np.flatnonzero(pair)
        first = order[i]
        return pd.DataFrame({"inst": inst[first], "dp": dp[first], "pp": pp[first], "tp": tp[first],
                             "step": step[i], "b": ts[i], "e": ts[i + 1], "cause": cause[i]}, copy=False)

    return ctx.cached("steps:wait_frame", build)


def _split_at_waits(frame: pd.DataFrame, on_cpu: np.ndarray, waits: pd.DataFrame) -> pd.DataFrame:
    """busy_spans' frame with each CPU-time span cut at the waits recorded inside it: the pieces around the waits
    stay busy, each wait becomes a row of its own (`wait` True, `cause` its BUBBLE_CAUSES code). A wait belongs to
    the span of the same lane and step that begins at or before it (clipped to that span; overlapping waits of
    one span clipped to each other). Spans on GPU time are left whole: the device's own times already leave the
    wait out. Sorted again by lane code and begin."""
    inst = np.r_[frame["inst"].to_numpy(), waits["inst"].to_numpy()]
    dp = np.r_[frame["dp"].to_numpy(), waits["dp"].to_numpy()]
    pp = np.r_[frame["pp"].to_numpy(), waits["pp"].to_numpy()]
    tp = np.r_[frame["tp"].to_numpy(), waits["tp"].to_numpy()]
    step = np.r_[frame["step"].to_numpy(), waits["step"].to_numpy()]
    keys = _Keys(inst, dp, pp, tp, step)
    lane_all = keys.lane(inst, dp, pp, tp)
    ns = len(frame)
    s_lane, w_lane = lane_all[:ns], lane_all[ns:]
    s_b, s_e = frame["b"].to_numpy(), frame["e"].to_numpy()
    s_step = frame["step"].to_numpy()
    w_b, w_e, w_step = waits["b"].to_numpy(), waits["e"].to_numpy(), waits["step"].to_numpy()
    # the latest span at or before each wait on its lane: one sort of spans and waits together
    tag = np.r_[np.zeros(ns, np.int8), np.ones(len(waits), np.int8)]
    o = np.lexsort((tag, np.r_[s_b, w_b], lane_all))
    latest = np.maximum.accumulate(np.where(o < ns, o, -1))
    host = np.empty(len(waits), np.int64)
    host[o[o >= ns] - ns] = latest[o >= ns]
    hc = np.maximum(host, 0)
    ok = ((host >= 0) & (s_lane[hc] == w_lane) & (s_step[hc] == w_step) & on_cpu[hc] & (w_b < s_e[hc]))
    host, w_b, w_e, w_cause = host[ok], w_b[ok], np.minimum(w_e[ok], s_e[hc[ok]]), waits["cause"].to_numpy()[ok]
    if len(host) == 0:
        return frame
    srt = np.lexsort((w_b, host))
    host, w_b, w_e, w_cause = host[srt], w_b[srt], w_e[srt], w_cause[srt]
    same = np.r_[False, host[1:] == host[:-1]]
    prev_e = np.r_[np.iinfo(np.int64).min, _lane_cummax(host, w_e)[:-1]]  # the latest end before, in this span
    w_b = np.where(same, np.maximum(w_b, prev_e), w_b)  # waits of one span in order, never overlapping
    keep = w_e > w_b
    host, w_b, w_e, w_cause = host[keep], w_b[keep], w_e[keep], w_cause[keep]
    hosts = distinct(host)
    # pieces of each cut span: [b, first wait), [each wait's end, the next wait's begin), [last wait's end, e)
    p_host = np.r_[hosts, host]
    p_b = np.r_[s_b[hosts], w_e]
    p_e = np.r_[w_b, s_e[hosts]]
    ob = np.lexsort((p_b, p_host))
    oe = np.lexsort((p_e, np.r_[host, hosts]))
    p_host, p_b, p_e = p_host[ob], p_b[ob], p_e[oe]
    piece = p_e > p_b
    p_host, p_b, p_e = p_host[piece], p_b[piece], p_e[piece]
    whole = np.ones(ns, bool)
    whole[hosts] = False
    src = np.r_[np.flatnonzero(whole), p_host, host]
    out = frame.iloc[src].reset_index(drop=True)
    kept = int(whole.sum())
    b = np.r_[s_b[whole], p_b, w_b]
    e = np.r_[s_e[whole], p_e, w_e]
    wait = np.r_[frame["wait"].to_numpy()[whole], np.zeros(len(p_host), bool), np.ones(len(host), bool)]
    cause = np.r_[frame["cause"].to_numpy()[whole], np.full(len(p_host), -1, np.int8), w_cause.astype(np.int8)]
    out = out.assign(b=b, e=e, wait=wait, cause=cause)
    assert kept + len(p_host) + len(host) == len(out)
    order = order_by_pair(out["lane"].to_numpy(), b)
    return out if order is None else out.iloc[order].reset_index(drop=True)


@shared_table(_span_frame, wait_frame, cost=0.01)
def busy_spans(ctx: AnalysisContext) -> pd.DataFrame:
    """Spans per lane (inst, dp, pp, tp, step, n, b, e, lane, wait, cause): spans of token-carrying steps with both
    ends, sorted by lane code and begin (numpy; a lexsort unless the spans are in that order already). Busy spans
    (`wait` False, `cause` -1) are on GPU time where the recorder gave it. `wait` marks a span that computes nothing
    on its stage (`_waits_for_broadcast`, cause `sampled_token_wait`), kept on CPU time: the time the stage sat
    blocked in it is idle time; and a wait a rank recorded inside an RPC (`wait_frame`: the RPC's span is cut
    around it, `_split_at_waits`), with its own cause (`pp_recv_wait`, `pp_send_wait`)."""

    def build() -> pd.DataFrame:
        spans = _span_frame(ctx)
        inst = spans["inst"].to_numpy()
        dp = spans["dp"].to_numpy()
        pp = spans["pp"].to_numpy()
        tp = spans["tp"].to_numpy()
        step = spans["step"].to_numpy()
        begin = spans["begin_ts"].to_numpy()
        end = spans["end_ts"].to_numpy()
        gb = spans["gpu_begin_ns"].to_numpy()
        ge = spans["gpu_end_ns"].to_numpy()
        n = spans["n"].to_numpy(dtype=np.float64)
        wait = _waits_for_broadcast(ctx, spans)
        gpu = (gb >= 0) & (ge >= 0) & ~wait
        b = np.where(gpu, gb, begin)
        e = np.where(gpu, ge, end)
        if np.isnan(n).any():
            steps = step_frame(ctx)
            k = _Keys(np.r_[inst, steps["inst"].to_numpy()], np.r_[dp, steps["dp"].to_numpy()], pp, tp,
                      np.r_[step, steps["step"].to_numpy()])
            skeys = k.at_step(k.sched(steps["inst"].to_numpy(), steps["dp"].to_numpy()), steps["step"].to_numpy())
            tokens = lookup(skeys, steps["tokens"].to_numpy(dtype=np.float64),
                            k.at_step(k.sched(inst, dp), step), np.nan)
            n = np.where(np.isnan(n), tokens, n)
        keep = np.flatnonzero((begin >= 0) & (end >= 0) & ~(n <= 0))
        keys = _Keys(inst, dp, pp, tp, step)
        lane = keys.lane(inst[keep], dp[keep], pp[keep], tp[keep])
        by_lane = order_by_pair(lane, b[keep])
        order = keep if by_lane is None else keep[by_lane]
        frame = pd.DataFrame({"inst": inst[order], "dp": dp[order], "pp": pp[order], "tp": tp[order],
                              "step": step[order], "n": n[order], "b": b[order], "e": e[order],
                              "lane": keys.lane(inst[order], dp[order], pp[order], tp[order]),
                              "wait": wait[order],
                              "cause": np.where(wait[order], CAUSE_BROADCAST, -1).astype(np.int8)}, copy=False)
        waits = wait_frame(ctx)
        if len(waits) == 0 or len(frame) == 0:
            return frame
        return _split_at_waits(frame, ~gpu[order] & ~wait[order], waits)

    return ctx.cached("steps:busy_spans", build)


def _waits_for_broadcast(ctx: AnalysisContext, spans: pd.DataFrame) -> np.ndarray:
    """Per `_span_frame` row: an RPC that computes nothing on its stage, the stage only waiting inside it.

    From vLLM's worker code (0.11.1 added `Worker.sample_tokens`, the step's second RPC; checked on 0.33.0):
    `sample_tokens` on a non-last PP rank samples nothing. The V1 runner (`gpu_model_runner.py`
    `sample_tokens`: `_pp_receive_prev_sampled_token_ids_to_input_batch`) and the V2 runner
    (`v1/worker/gpu/model_runner.py` `sample_tokens`: `pp_handler.receive`) receive the tokens the last rank
    sampled and broadcast, then pass the connector's output through; vllm-ascend's runner blocks there the same
    way. The last rank's `sample_tokens` samples (and broadcasts): compute. `execute_model` computes on every
    rank. So: rpc `sample_tokens` (named by the exec_end detail, else the step's second RPC on the lane) on a
    stage with pp_rank < p - 1 of a scheduler with p > 1. The RPC names are read only on such stages."""
    wait = np.zeros(len(spans), bool)
    if len(spans) == 0:
        return wait
    p = sizes_of(pipeline_sizes(ctx), spans["inst"].to_numpy(), spans["dp"].to_numpy())
    upstream = np.flatnonzero((p > 1) & (spans["pp"].to_numpy() < p - 1))
    if len(upstream):  # whole (lane, step) groups: the position fallback of span_rpcs still holds
        rpc = span_rpcs(ctx, spans.iloc[upstream])
        wait[upstream[np.asarray(rpc.codes) == list(rpc.categories).index("sample_tokens")]] = True
    return wait


def _lane_cummax(lane: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Running maximum of e within each lane (rows sorted by lane): one maximum.accumulate over values offset
    per lane, or pandas' grouped cummax where the offsets would overflow int64."""
    if len(e) == 0:
        return e
    new_lane = np.r_[True, lane[1:] != lane[:-1]]
    lane_idx = np.cumsum(new_lane) - 1
    base = int(e.min())
    rel = e - base
    span = int(rel.max()) + 1
    if int(lane_idx[-1]) * span < 2 ** 62:
        offset = lane_idx * span
        return np.maximum.accumulate(rel + offset) - offset + base
    return pd.Series(e).groupby(lane_idx).cummax().to_numpy()


def _latest_before(times: np.ndarray, values: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each query: (the latest time strictly before it, that row's value); _NULL where none. times sorted."""
    if len(times) == 0:
        return np.full(len(query), _NULL, np.int64), np.full(len(query), _NULL, np.int64)
    k = np.searchsorted(times, query, "left") - 1
    ok = k >= 0
    kc = np.maximum(k, 0)
    return np.where(ok, times[kc], _NULL), np.where(ok, values[kc], _NULL)


CAUSE_NO_REQUESTS, CAUSE_KV, CAUSE_IMBALANCE, CAUSE_CPU, CAUSE_QUEUE, CAUSE_BROADCAST = (
    BUBBLE_CAUSES.index("idle_no_requests"), BUBBLE_CAUSES.index("kv_transfer"),
    BUBBLE_CAUSES.index("stage_imbalance"), BUBBLE_CAUSES.index("scheduler_cpu"),
    BUBBLE_CAUSES.index("queue_not_full"), BUBBLE_CAUSES.index("sampled_token_wait"))


@shared_table(busy_spans, _count_functions, step_frame, cost=0.08)
def gap_frame(ctx: AnalysisContext) -> pd.DataFrame:
    """Every idle gap (> 0 ns) between busy spans of a lane, classified, with integer codes (inst, dp, pp, tp):
    the pipeline_bubble rule sums idle time from it; `bubbles` keeps the gaps of at least bubble_min_ns. `cause` is
    a categorical over BUBBLE_CAUSES; `span_row` the busy_spans row that ends the gap. Numpy throughout: keys are
    int64 codes looked up with searchsorted, one pass per scheduler for the request counts."""

    def build() -> pd.DataFrame:
        busy = busy_spans(ctx)
        cols_out = ["inst", "dp", "pp", "tp", "start_ns", "end_ns", "dur_ns", "step_before", "step_after",
                    "runnable", "in_flight", "in_flight_requests", "span_row"]
        if len(busy) < 2:
            empty = pd.DataFrame({c: pd.Series(dtype=np.int64) for c in cols_out})
            empty["cause"] = pd.Categorical([], categories=list(BUBBLE_CAUSES))
            return empty
        lane = busy["lane"].to_numpy()
        begin = busy["b"].to_numpy()
        end = busy["e"].to_numpy()
        step = busy["step"].to_numpy()
        waiting = busy["wait"].to_numpy()
        wait_cause = busy["cause"].to_numpy()
        prev_end = _lane_cummax(lane, end)
        same_lane = np.r_[False, lane[1:] == lane[:-1]]
        gap_start = np.r_[0, prev_end[:-1]]
        gap_idx = np.flatnonzero(same_lane & (begin > gap_start))
        # the time a stage sat blocked in an RPC that computes nothing on it: from the later of the RPC's begin and
        # the end of everything before it on the lane to the earlier of its end and the next busy span's begin
        w_idx = np.flatnonzero(waiting)
        computing = np.flatnonzero(~waiting)
        nxt = np.minimum(np.searchsorted(computing, w_idx, "right"), max(len(computing) - 1, 0))
        nxt_row = computing[nxt] if len(computing) else w_idx
        has_nxt = (nxt_row > w_idx) & (lane[nxt_row] == lane[w_idx])
        w_start = np.where(same_lane[w_idx], np.maximum(begin[w_idx], gap_start[w_idx]), begin[w_idx])
        w_end = np.where(has_nxt, np.minimum(end[w_idx], begin[nxt_row]), end[w_idx])
        w_keep = w_end > w_start
        w_idx, w_start, w_end = w_idx[w_keep], w_start[w_keep], w_end[w_keep]
        idx = np.r_[gap_idx, w_idx]
        is_wait = np.r_[np.zeros(len(gap_idx), bool), np.ones(len(w_idx), bool)]
        inst = busy["inst"].to_numpy()[idx]
        dp = busy["dp"].to_numpy()[idx]
        pp = busy["pp"].to_numpy()[idx]
        tp = busy["tp"].to_numpy()[idx]
        s = np.r_[gap_start[gap_idx], w_start]
        e = np.r_[begin[gap_idx], w_end]
        dur = e - s
        step_after = step[idx]
        step_before = np.r_[step[gap_idx - 1], step[w_idx]]
        n = len(idx)

        steps = step_frame(ctx)
        st_inst = steps["inst"].to_numpy()
        st_dp = steps["dp"].to_numpy()
        keys = _Keys(np.r_[busy["inst"].to_numpy(), st_inst], np.r_[busy["dp"].to_numpy(), st_dp],
                     busy["pp"].to_numpy(), busy["tp"].to_numpy(), np.r_[step, steps["step"].to_numpy()])
        # the upstream stage's first begin of the step that ends the gap
        stage_step = keys.at_step(keys.stage(busy["inst"].to_numpy(), busy["dp"].to_numpy(), busy["pp"].to_numpy()),
                                  step)
        order = np.lexsort((begin, stage_step))
        order = order[~waiting[order]]  # the stage's compute spans: a wait comes after the step's compute
        first = np.r_[True, stage_step[order][1:] != stage_step[order][:-1]]
        up_keys, up_begin_all = stage_step[order][first], begin[order][first]
        has_up = (pp > 0) & (lookup(up_keys, up_begin_all, keys.at_step(keys.stage(inst, dp, pp - 1), step_after),
                                    _NULL) != _NULL)
        # submit time of that step (its sched time without engine rows)
        st_key = keys.at_step(keys.sched(st_inst, st_dp), steps["step"].to_numpy())  # sorted: the frame is
        submit_all = _int64(steps["submit_ts"])
        output_all = _int64(steps["output_ts"])
        sub_or_sched = np.where(submit_all != _NULL, submit_all, _int64(steps["sched_ts"]))
        sched_code = keys.sched(inst, dp)
        t_sub = lookup(st_key, sub_or_sched, keys.at_step(sched_code, step_after), _NULL)

        funcs = _count_functions(ctx)
        sizes = pipeline_sizes(ctx)
        no_live = np.zeros(n, np.int64)
        no_run = np.zeros(n, np.int64)
        runnable = np.zeros(n, np.int64)
        in_flight = np.zeros(n, np.int64)
        in_flight_requests = np.zeros(n, np.int64)
        p_size = sizes_of(sizes, inst, dp)
        prev_submit = np.full(n, _NULL, np.int64)
        prev_output = np.full(n, _NULL, np.int64)
        prev_wait = np.full(n, _NULL, np.int64)
        wait_all = np.where(np.isnan(steps["wait_ns"].to_numpy(dtype=np.float64)), _NULL,
                            np.nan_to_num(steps["wait_ns"].to_numpy(dtype=np.float64))).astype(np.int64)
        st_sched_code = keys.sched(st_inst, st_dp)
        nothing = StepCount(np.empty(0, np.int64), np.empty(0, np.int64))
        for code in distinct(sched_code).tolist():  # per scheduler
            grp = np.flatnonzero(sched_code == code)
            gi, gd = int(inst[grp[0]]), int(dp[grp[0]])
            live, run, fly, fly_requests = funcs.get((gi, gd), (nothing,) * 4)
            no_live[grp] = live.zero_between(s[grp], e[grp])
            no_run[grp] = run.zero_between(s[grp], e[grp])
            runnable[grp] = run.at(s[grp])
            in_flight[grp] = fly.at(s[grp])
            # just before the start: at the last stage a gap starts when the step's output is back, and its
            # requests had nothing to schedule until then
            in_flight_requests[grp] = fly_requests.at(s[grp] - 1)
            mine = np.flatnonzero(st_sched_code == code)
            q = t_sub[grp]
            subs = np.sort(submit_all[mine][submit_all[mine] != _NULL])
            prev_submit[grp] = _latest_before(subs, subs, q)[0]
            outs = mine[output_all[mine] != _NULL]
            outs = outs[np.argsort(output_all[outs], kind="stable")]
            prev_output[grp], prev_wait[grp] = _latest_before(output_all[outs], wait_all[outs], q)
        # the engine's own time in the gap before the submit: from the later of the gap start and the previous
        # submit, minus the time it sat blocked on a step's future (step_output wait_ns; everything up to that
        # output where wait_ns is unknown)
        a = np.maximum(s, prev_submit)
        out_in = (prev_output != _NULL) & (prev_output > a)
        blocked_from = np.where(prev_wait == _NULL, a, np.maximum(a, prev_output - np.maximum(prev_wait, 0)))
        blocked = np.where(out_in, prev_output - blocked_from, 0)
        host = t_sub - a - blocked
        # one stage (p = 1): no other stage can hold a step, so the step "in flight" is the one this stage has
        # finished, on its way back to the engine: the stage waits for the engine's next step (queue_not_full)
        engine_cause = np.where((t_sub != _NULL) & (t_sub > s) & (2 * host >= dur), CAUSE_CPU,
                                np.where((in_flight < p_size) | (p_size <= 1), CAUSE_QUEUE,
                                         CAUSE_IMBALANCE)).astype(np.int8)
        # a later stage inherits the cause of its upstream stage's gap before the same step when that gap explains
        # at least half of its own (the delay travels down the pipeline); otherwise the upstream stage was busy
        # with the step while this one waited: stage imbalance. Stages are resolved in order, 0 first.
        cause = engine_cause.copy()
        gap_key = keys.at_step(keys.stage(inst, dp, pp), step_after)
        for rank in distinct(pp[pp > 0]).tolist():  # per PP rank
            here = np.flatnonzero(pp == rank)
            above = np.flatnonzero((pp == rank - 1) & ~is_wait)  # a wait comes after the step left the stage
            up_key, up_gap, up_code = gap_key[above], dur[above], cause[above]
            o = order_by_pair(up_key, up_gap)  # per upstream stage and step, its longest gap (over TP ranks) last
            if o is not None:
                up_key, up_gap, up_code = up_key[o], up_gap[o], up_code[o]
            last = np.r_[up_key[1:] != up_key[:-1], True] if len(up_key) else np.empty(0, bool)
            k_sorted, dur_sorted, cause_sorted = up_key[last], up_gap[last], up_code[last]
            want = keys.at_step(keys.stage(inst[here], dp[here], pp[here] - 1), step_after[here])
            up_dur = lookup(k_sorted, dur_sorted, want, _NULL)
            up_cause = lookup(k_sorted, cause_sorted.astype(np.int64), want, _NULL)
            inherit = (up_dur != _NULL) & (2 * up_dur >= dur[here])
            cause[here] = np.where(inherit, up_cause, np.where(has_up[here], CAUSE_IMBALANCE, engine_cause[here]))
        cause = np.where(2 * no_live >= dur, CAUSE_NO_REQUESTS, np.where(2 * no_run >= dur, CAUSE_KV, cause))
        cause = np.where(is_wait, wait_cause[idx], cause)
        out = np.lexsort((s, idx))  # in lane order, then time
        return pd.DataFrame({
            "inst": inst[out], "dp": dp[out], "pp": pp[out], "tp": tp[out], "start_ns": s[out], "end_ns": e[out],
            "dur_ns": dur[out], "step_before": step_before[out], "step_after": step_after[out],
            "cause": pd.Categorical.from_codes(cause[out].astype(np.int8), categories=list(BUBBLE_CAUSES)),
            "runnable": runnable[out], "in_flight": in_flight[out],
            "in_flight_requests": in_flight_requests[out], "span_row": idx[out]}, copy=False)

    return ctx.cached("steps:gap_frame", build)


def _bubble_frame(ctx: AnalysisContext) -> pd.DataFrame:
    gaps = gap_frame(ctx)
    return gaps[gaps["dur_ns"] >= max(int(ctx.config.bubble_min_ns), 1)].reset_index(drop=True)


@shared_table(gap_frame)
def bubbles(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per idle interval on a (instance, dp_rank, pp_rank, tp_rank) lane: start_ns, end_ns, dur_ns, cause,
    step_before, step_after, runnable, in_flight, in_flight_requests. See the module docstring for the algorithm and
    the causes."""

    def build() -> pd.DataFrame:
        return _public(ctx, _bubble_frame(ctx), {"dp": "dp_rank", "pp": "pp_rank", "tp": "tp_rank"}, int_na=[],
                       columns=BUBBLE_COLUMNS)

    return ctx.cached("steps:bubbles", build)
