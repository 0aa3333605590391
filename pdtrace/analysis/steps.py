"""Per-step and per-rank tables of the engine loop: what each step was, when each rank executed it, and where the
ranks sat idle.

`step_table(ctx)`  one row per scheduler step (instance, dp_rank, step). Algorithm: take the `sched`, `step_submit`
    and `step_output` rows (a kind filter on dictionary codes, no per-event Python), pull the numbers the format
    keeps in `detail` (`running`, `waiting`, `waiting_kv`, `free_blocks`, `dur_ns`, `empty_run` on `sched`;
    `wait_ns` on `step_output`) with one vectorised regular-expression extraction per key over those rows only, keep
    the first row of each kind per (instance, dp_rank, step), and outer-join the three on that key.

`exec_spans(ctx)`  one row per RPC a rank ran for a step (instance, dp_rank, pp_rank, tp_rank, step, rpc).
    Algorithm: sort the `exec_begin` / `exec_end` rows by writer lane (instance, dp_rank, pp_rank, tp_rank, pid) and
    `seq` (its exact order); a worker runs its RPCs strictly in order, so an `exec_begin` pairs with the row right after it when
    that row is an `exec_end` of the same lane and step. Unpaired rows keep their one timestamp (NA for the other).
    `rpc` comes from the `exec_end` detail where the recorder gave it, else from the RPC's position in the step
    (first `execute_model`, second `sample_tokens`). `gpu_begin_ns` / `gpu_end_ns` likewise from the detail.

`bubbles(ctx)`  one row per idle interval of at least `config.bubble_min_ns` on a (instance, dp_rank, pp_rank,
    tp_rank) lane, between two busy spans (`gap_frame` holds every gap, however short, for the idle sums). Busy spans are the spans of steps that carried tokens (an empty step's
    no-forward RPC is not work), on GPU time where the recorder gave it (CPU spans of non-last PP ranks do not show
    GPU time), merged where they overlap (running maximum of the end per lane). The lead before a lane's first span
    and the trail after its last are not intervals. Each interval gets one cause, decided in this order:
      1. `idle_no_requests`  the scheduler had no unfinished request for at least half the interval;
      2. `kv_transfer`       it had requests, but every one waited for remote KV, for at least half the interval;
      3. `scheduler_cpu`     (stage 0, and later stages that never saw the step upstream) the step that ends the
                             interval was submitted during it, and the engine's own time before that submit
                             (from the later of the interval start and the previous step_submit, minus the time
                             blocked on a step's future, step_output `wait_ns`) is at least half the interval:
                             update_from_output and schedule() on the critical path;
      4. `queue_not_full`    fewer than p steps carrying tokens were in flight at the interval start (p = the PP
                             size: vLLM needs p disjoint micro-batches to keep p stages busy);
      5. `stage_imbalance`   otherwise (p steps in flight, yet this stage had nothing: another stage held them).
    A later stage (pp_rank > 0) inherits the cause of its upstream stage's gap before the same step when that gap
    is at least half as long as its own (a late start travels down the pipeline, stage by stage); when the upstream
    stage ran the step without such a gap, this stage waited on a slower upstream stage: `stage_imbalance`.
    Extra columns: `runnable` (requests unfinished and not waiting for KV at the interval start) and `in_flight`
    (steps carrying tokens in flight at the interval start). The request counts are step functions built from the
    request lifecycles (req_add, req_wait_kv, kv_recv_done / kv_recv_fail, req_finish) and read with searchsorted.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.analysis.columns import columns
from pdtrace.analysis.context import AnalysisContext

BUBBLE_CAUSES = ("queue_not_full", "scheduler_cpu", "kv_transfer", "stage_imbalance", "idle_no_requests")

STEP_COLUMNS = ("instance", "dp_rank", "step", "sched_ts", "tokens", "running", "waiting", "waiting_kv",
                "free_blocks", "dur_ns", "empty_run", "submit_ts", "in_flight", "output_ts", "wait_ns")
SPAN_COLUMNS = ("instance", "dp_rank", "pp_rank", "tp_rank", "step", "rpc", "begin_ts", "end_ts", "n",
                "gpu_begin_ns", "gpu_end_ns")
BUBBLE_COLUMNS = ("instance", "dp_rank", "pp_rank", "tp_rank", "start_ns", "end_ns", "dur_ns", "cause",
                  "step_before", "step_after", "runnable", "in_flight")

_NULL = -1  # fill for null ranks / steps in the internal integer columns


# --------------------------------------------------------------------------------------------------- column access

def dict_codes(ctx: AnalysisContext, column: str) -> tuple[np.ndarray, list[str]]:
    """A dictionary (or string) column as integer codes (-1 for null) plus the values: the shared
    `pdtrace.analysis.columns` arrays, computed once per analysis for every rule."""
    return columns(ctx).codes(column)


def kind_rows(ctx: AnalysisContext, kinds: Iterable[str]) -> np.ndarray:
    """Row indices (load order) of the events of the given kinds."""
    return columns(ctx).rows_of(*kinds)


def _int_col(table: pa.Table, name: str, fill: int = _NULL) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy().astype(np.int64, copy=False)


def select_rows(ctx: AnalysisContext, kinds: Iterable[str], with_req: bool = False) -> pd.DataFrame:
    """The scalar fields of the events of the given kinds, as a DataFrame with integer codes.

    Columns: row (index into the trace), ts_ns, seq, pid, inst (code into `instances(ctx)`), dp, pp, tp, step
    (null ranks / steps as -1), n (float, NaN where null), kind (str categorical); with `with_req`, `req` (string).
    """
    rows = kind_rows(ctx, kinds)
    table = ctx.trace.table
    sub = table.select(["ts_ns", "seq", "pid", "dp_rank", "pp_rank", "tp_rank", "step", "n"]).take(pa.array(rows))
    inst_codes, _ = dict_codes(ctx, "instance")
    kind_codes, kind_values = dict_codes(ctx, "kind")
    n = sub.column("n")
    frame = pd.DataFrame({
        "row": rows,
        "ts_ns": sub.column("ts_ns").to_numpy(),
        "seq": sub.column("seq").to_numpy(),
        "pid": sub.column("pid").to_numpy(),
        "inst": inst_codes[rows],
        "dp": _int_col(sub, "dp_rank"),
        "pp": _int_col(sub, "pp_rank"),
        "tp": _int_col(sub, "tp_rank"),
        "step": _int_col(sub, "step"),
        "n": pc.cast(n, pa.float64()).to_numpy(zero_copy_only=False) if len(n) else np.empty(0),
        "kind": pd.Categorical.from_codes(kind_codes[rows], categories=kind_values) if len(kind_values)
        else pd.Categorical([]),
    })
    if with_req:
        req = table.column("req").take(pa.array(rows))
        if pa.types.is_dictionary(req.type):
            req = req.cast(req.type.value_type)
        frame["req"] = req.to_pandas()
    return frame


def instances(ctx: AnalysisContext) -> list[str]:
    """The instance names, indexed by the codes `select_rows` gives."""
    return dict_codes(ctx, "instance")[1]


def detail_number(ctx: AnalysisContext, rows: np.ndarray, key: str) -> np.ndarray:
    """The numeric `detail` value `key` of the given rows (float, NaN where absent), vectorised in Arrow.

    One regular-expression extraction over the JSON text of those rows only; booleans read as 1/0.
    """
    if len(rows) == 0:
        return np.empty(0)
    text = ctx.trace.table.column("detail").take(pa.array(rows))
    text = pc.fill_null(text, "")
    found = pc.extract_regex(text, rf'"{key}"\s*:\s*(?P<v>-?[0-9.eE+]+|true|false)')
    raw = pc.struct_field(found, [0])
    raw = pc.replace_substring_regex(pc.replace_substring_regex(raw, "^true$", "1"), "^false$", "0")
    return pc.cast(raw, pa.float64()).to_numpy(zero_copy_only=False)


def detail_int(ctx: AnalysisContext, rows: np.ndarray, key: str, fill: int = _NULL) -> np.ndarray:
    """The integer `detail` value `key` of the given rows (int64, `fill` where absent): exact for ns timestamps."""
    if len(rows) == 0:
        return np.empty(0, np.int64)
    text = pc.fill_null(ctx.trace.table.column("detail").take(pa.array(rows)), "")
    found = pc.extract_regex(text, rf'"{key}"\s*:\s*(?P<v>-?[0-9]+)\s*[,}}]')
    raw = pc.struct_field(found, [0])
    return pc.fill_null(pc.cast(raw, pa.int64()), fill).to_numpy(zero_copy_only=False)


def detail_text(ctx: AnalysisContext, rows: np.ndarray, key: str) -> np.ndarray:
    """The string `detail` value `key` of the given rows (None where absent), vectorised in Arrow."""
    if len(rows) == 0:
        return np.empty(0, dtype=object)
    text = pc.fill_null(ctx.trace.table.column("detail").take(pa.array(rows)), "")
    found = pc.extract_regex(text, rf'"{key}"\s*:\s*"(?P<v>[^"]*)"')
    return pc.struct_field(found, [0]).to_numpy(zero_copy_only=False)


# ------------------------------------------------------------------------------------------------------ engine config

def engine_configs(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per scheduler (inst, dp) that wrote `engine_config`: n_blocks, pp, tp, batch_queue_size, block_size,
    max_num_seqs, max_num_batched_tokens, runner (NaN / None where the recorder did not know)."""

    def build() -> pd.DataFrame:
        sel = select_rows(ctx, ["engine_config"])
        out = sel[["inst", "dp", "ts_ns"]].copy()
        out["n_blocks"] = sel["n"].to_numpy()
        rows = sel["row"].to_numpy()
        for key in ("pp", "tp", "batch_queue_size", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            out[key] = detail_number(ctx, rows, key)
        out["runner"] = detail_text(ctx, rows, "runner")
        return out.sort_values("ts_ns").drop_duplicates(["inst", "dp"], keep="first").reset_index(drop=True)

    return ctx.cached("steps:engine_configs", build)


# -------------------------------------------------------------------------------------------------------- step table

def _step_frame(ctx: AnalysisContext) -> pd.DataFrame:
    """step_table with integer `inst` codes (internal form)."""

    def build() -> pd.DataFrame:
        key = ["inst", "dp", "step"]
        sched = select_rows(ctx, ["sched"])
        sched = sched[sched["step"] >= 0]
        rows = sched["row"].to_numpy()
        s = pd.DataFrame({"inst": sched["inst"].to_numpy(), "dp": sched["dp"].to_numpy(),
                          "step": sched["step"].to_numpy(), "sched_ts": sched["ts_ns"].to_numpy(),
                          "tokens": sched["n"].to_numpy()})
        for col in ("running", "waiting", "waiting_kv", "free_blocks", "dur_ns", "empty_run"):
            s[col] = detail_number(ctx, rows, col)
        s["empty_run"] = s["empty_run"].fillna(1.0)
        s = s.sort_values("sched_ts", kind="stable").drop_duplicates(key, keep="first")

        eng = select_rows(ctx, ["step_submit", "step_output"])
        eng = eng[eng["step"] >= 0]
        sub = eng[eng["kind"] == "step_submit"]
        sub = pd.DataFrame({"inst": sub["inst"].to_numpy(), "dp": sub["dp"].to_numpy(),
                            "step": sub["step"].to_numpy(), "submit_ts": sub["ts_ns"].to_numpy(),
                            "in_flight": sub["n"].to_numpy()})
        sub = sub.sort_values("submit_ts", kind="stable").drop_duplicates(key, keep="first")
        out = eng[eng["kind"] == "step_output"]
        out = pd.DataFrame({"inst": out["inst"].to_numpy(), "dp": out["dp"].to_numpy(),
                            "step": out["step"].to_numpy(), "output_ts": out["ts_ns"].to_numpy(),
                            "wait_ns": detail_number(ctx, out["row"].to_numpy(), "wait_ns")})
        out = out.sort_values("output_ts", kind="stable").drop_duplicates(key, keep="first")

        # nullable Int64 before the outer joins: a float64 NaN column would round ns timestamps
        s["sched_ts"] = s["sched_ts"].astype("Int64")
        sub["submit_ts"] = sub["submit_ts"].astype("Int64")
        out["output_ts"] = out["output_ts"].astype("Int64")
        table = s.merge(sub, on=key, how="outer").merge(out, on=key, how="outer")
        return table.sort_values(key, kind="stable").reset_index(drop=True)

    return ctx.cached("steps:step_frame", build)


def step_table(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per scheduler step (instance, dp_rank, step): sched_ts, tokens, running, waiting, waiting_kv,
    free_blocks, dur_ns, empty_run, submit_ts, in_flight, output_ts, wait_ns (NA where the event or key is absent).
    See the module docstring for the algorithm."""

    def build() -> pd.DataFrame:
        frame = _step_frame(ctx)
        names = instances(ctx)
        out = frame.rename(columns={"dp": "dp_rank"})
        out.insert(0, "instance", pd.Categorical.from_codes(frame["inst"].to_numpy(), categories=names)
                   if names else pd.Categorical([]))
        out = out.drop(columns=["inst"])
        out["dp_rank"] = out["dp_rank"].astype("Int64").where(out["dp_rank"] >= 0)
        return out[list(STEP_COLUMNS)]

    return ctx.cached("steps:step_table", build)


# -------------------------------------------------------------------------------------------------------- exec spans

def _span_frame(ctx: AnalysisContext) -> pd.DataFrame:
    """exec_spans with integer codes (internal form): inst, dp, pp, tp, step, rpc, begin_ts, end_ts, n, gpu_*."""

    def build() -> pd.DataFrame:
        ev = select_rows(ctx, ["exec_begin", "exec_end"])
        ev = ev.sort_values(["inst", "dp", "pp", "tp", "pid", "seq"], kind="stable").reset_index(drop=True)
        is_begin = (ev["kind"] == "exec_begin").to_numpy()
        lane = ev[["inst", "dp", "pp", "tp", "pid"]].to_numpy()
        step = ev["step"].to_numpy()
        same_next = np.zeros(len(ev), dtype=bool)
        if len(ev) > 1:
            same_next[:-1] = (lane[1:] == lane[:-1]).all(axis=1) & (step[1:] == step[:-1])
        nxt_is_end = np.zeros(len(ev), dtype=bool)
        nxt_is_end[:-1] = ~is_begin[1:]
        paired_begin = is_begin & same_next & nxt_is_end
        paired_end = np.zeros(len(ev), dtype=bool)
        paired_end[1:] = paired_begin[:-1]
        lone_begin = is_begin & ~paired_begin
        lone_end = ~is_begin & ~paired_end

        ts = ev["ts_ns"].to_numpy()
        n = ev["n"].to_numpy()
        b_idx = np.flatnonzero(paired_begin)
        e_idx = b_idx + 1
        lb = np.flatnonzero(lone_begin)
        le = np.flatnonzero(lone_end)
        head = np.concatenate([b_idx, lb, le])  # the row whose lane/step describes the span
        end_row = np.concatenate([e_idx, np.full(len(lb), -1), le])
        begin_ts = np.concatenate([ts[b_idx], ts[lb], np.full(len(le), -1)])
        end_ts = np.concatenate([ts[e_idx], np.full(len(lb), -1), ts[le]])
        n_tok = np.concatenate([np.where(np.isnan(n[b_idx]), n[e_idx], n[b_idx]), n[lb], n[le]])

        spans = pd.DataFrame({
            "inst": ev["inst"].to_numpy()[head], "dp": ev["dp"].to_numpy()[head], "pp": ev["pp"].to_numpy()[head],
            "tp": ev["tp"].to_numpy()[head], "step": step[head], "begin_ts": begin_ts, "end_ts": end_ts,
            "n": n_tok,
        })
        has_end = end_row >= 0
        end_trace_rows = np.full(len(spans), -1, dtype=np.int64)
        end_trace_rows[has_end] = ev["row"].to_numpy()[end_row[has_end]]
        rpc = np.full(len(spans), None, dtype=object)
        gpu_b = np.full(len(spans), _NULL, dtype=np.int64)
        gpu_e = np.full(len(spans), _NULL, dtype=np.int64)
        if has_end.any():
            er = end_trace_rows[has_end]
            rpc[has_end] = detail_text(ctx, er, "rpc")
            gpu_b[has_end] = detail_int(ctx, er, "gpu_begin_ns")
            gpu_e[has_end] = detail_int(ctx, er, "gpu_end_ns")
        spans["gpu_begin_ns"] = gpu_b
        spans["gpu_end_ns"] = gpu_e
        spans["rpc"] = rpc
        spans["_order"] = np.where(spans["begin_ts"] >= 0, spans["begin_ts"], spans["end_ts"])
        spans = spans.sort_values(["inst", "dp", "pp", "tp", "_order"], kind="stable").reset_index(drop=True)
        position = spans.groupby(["inst", "dp", "pp", "tp", "step"], sort=False).cumcount().to_numpy()
        inferred = np.where(position == 0, "execute_model", np.where(position == 1, "sample_tokens", "rpc"))
        known = spans["rpc"].to_numpy()
        spans["rpc"] = np.where(pd.isna(known), inferred, known).astype(object)
        return spans.drop(columns=["_order"])

    return ctx.cached("steps:span_frame", build)


def exec_spans(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per RPC a rank ran for a step (instance, dp_rank, pp_rank, tp_rank, step, rpc): begin_ts, end_ts
    (NA where unpaired), n (tokens), gpu_begin_ns, gpu_end_ns. See the module docstring for the algorithm."""

    def build() -> pd.DataFrame:
        frame = _span_frame(ctx)
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


def request_lifetimes(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per (inst, dp, req) seen on a scheduler: start_ts (req_add, else its first event), wait_kv_ts,
    recv_ts (first kv_recv_done / kv_recv_fail), finish_ts (first req_finish); int64 ns, NEVER where absent."""

    def build() -> pd.DataFrame:
        ev = select_rows(ctx, ["req_add", "req_wait_kv", "kv_recv_done", "kv_recv_fail", "req_finish"],
                         with_req=True)
        ev = ev[ev["req"].notna()]
        ts = ev["ts_ns"].to_numpy()
        kinds = ev["kind"].astype(str).to_numpy()

        def only(mask: np.ndarray) -> np.ndarray:
            return np.where(mask, ts, NEVER)

        frame = pd.DataFrame({"inst": ev["inst"].to_numpy(), "dp": ev["dp"].to_numpy(), "req": ev["req"].to_numpy(),
                              "any": ts, "add": only(kinds == "req_add"),
                              "wait_kv_ts": only(kinds == "req_wait_kv"),
                              "recv_ts": only((kinds == "kv_recv_done") | (kinds == "kv_recv_fail")),
                              "finish_ts": only(kinds == "req_finish")})
        out = frame.groupby(["inst", "dp", "req"], sort=False).min().reset_index()
        out["start_ts"] = np.where(out["add"] == NEVER, out["any"], out["add"])
        return out[["inst", "dp", "req", "start_ts", "wait_kv_ts", "recv_ts", "finish_ts"]]

    return ctx.cached("steps:request_lifetimes", build)


def _int64(series: pd.Series, fill: int = _NULL) -> np.ndarray:
    return series.astype("Int64").fillna(fill).to_numpy(dtype=np.int64)


def _count_functions(ctx: AnalysisContext) -> dict[tuple[int, int], tuple[StepCount, StepCount, StepCount]]:
    """Per scheduler (inst, dp): (live requests, runnable requests, token-carrying steps in flight)."""

    def build() -> dict[tuple[int, int], tuple[StepCount, StepCount, StepCount]]:
        life = request_lifetimes(ctx)
        start = life["start_ts"].to_numpy()
        finish = life["finish_ts"].to_numpy()
        wait = life["wait_kv_ts"].to_numpy()
        recv = life["recv_ts"].to_numpy()
        has_wait = wait != NEVER
        # runnable: [start, finish) without a KV wait; [start, wait) and [recv, finish) with one
        r1_end = np.where(has_wait, wait, finish)
        r2_start = np.where(has_wait & (recv != NEVER) & (recv < finish), recv, NEVER)
        steps = _step_frame(ctx)
        submit = _int64(steps["submit_ts"].fillna(steps["sched_ts"]))
        output = _int64(steps["output_ts"])
        carries = ~(steps["tokens"].to_numpy() <= 0)  # NaN tokens count as work
        life_keys = life.groupby(["inst", "dp"], sort=False).indices
        step_keys = steps.groupby(["inst", "dp"], sort=False).indices
        out = {}
        for key in set(life_keys) | set(step_keys):
            m = life_keys.get(key, np.empty(0, np.int64))

            def counter(pairs: list[tuple[np.ndarray, int]]) -> StepCount:
                times = [t[(t != NEVER) & (t != _NULL)] for t, _ in pairs]
                deltas = [np.full(len(t), d) for t, (_, d) in zip(times, pairs)]
                return StepCount(np.concatenate(times), np.concatenate(deltas))

            live = counter([(start[m], 1), (finish[m], -1)])
            r2 = r2_start[m]
            runnable = counter([(start[m], 1), (r1_end[m], -1), (r2, 1),
                                (np.where(r2 != NEVER, finish[m], NEVER), -1)])
            sm = step_keys.get(key, np.empty(0, np.int64))
            sm = sm[carries[sm] & (submit[sm] != _NULL)]
            in_flight = counter([(submit[sm], 1), (output[sm], -1)])
            out[key] = (live, runnable, in_flight)
        return out

    return ctx.cached("steps:count_functions", build)


def pipeline_sizes(ctx: AnalysisContext) -> dict[tuple[int, int], int]:
    """p per scheduler (inst, dp): engine_config's `pp`, else the number of PP ranks seen executing."""
    spans = _span_frame(ctx)
    seen = spans.groupby(["inst", "dp"])["pp"].max().to_dict() if len(spans) else {}
    cfg = engine_configs(ctx)
    sizes = {key: int(v) + 1 for key, v in seen.items()}
    for inst, dp, pp in zip(cfg["inst"], cfg["dp"], cfg["pp"]):
        if not np.isnan(pp):
            sizes[(int(inst), int(dp))] = int(pp)
    return sizes


def busy_spans(ctx: AnalysisContext) -> pd.DataFrame:
    """Busy intervals per lane (inst, dp, pp, tp, step, n, b, e): spans of token-carrying steps with both ends, on
    GPU time where the recorder gave it, sorted by lane and begin."""

    def build() -> pd.DataFrame:
        spans = _span_frame(ctx)
        gpu = ((spans["gpu_begin_ns"] >= 0) & (spans["gpu_end_ns"] >= 0)).to_numpy()
        busy = spans[["inst", "dp", "pp", "tp", "step", "n"]].copy()
        busy["b"] = np.where(gpu, spans["gpu_begin_ns"], spans["begin_ts"])
        busy["e"] = np.where(gpu, spans["gpu_end_ns"], spans["end_ts"])
        busy = busy[(spans["begin_ts"].to_numpy() >= 0) & (spans["end_ts"].to_numpy() >= 0)]
        if busy["n"].isna().any():
            steps = _step_frame(ctx)
            tok = busy.merge(steps[["inst", "dp", "step", "tokens"]], on=["inst", "dp", "step"], how="left")
            busy["n"] = busy["n"].fillna(pd.Series(tok["tokens"].to_numpy(), index=busy.index))
        busy = busy[~(busy["n"] <= 0)]
        return busy.sort_values(["inst", "dp", "pp", "tp", "b"], kind="stable").reset_index(drop=True)

    return ctx.cached("steps:busy_spans", build)


def gap_frame(ctx: AnalysisContext) -> pd.DataFrame:
    """Every idle gap (> 0 ns) between busy spans of a lane, classified, with integer codes (inst, dp, pp, tp):
    the pipeline_bubble rule sums idle time from it; `bubbles` keeps the gaps of at least bubble_min_ns."""

    def build() -> pd.DataFrame:
        busy = busy_spans(ctx)
        lane_cols = ["inst", "dp", "pp", "tp"]
        empty = pd.DataFrame({c: pd.Series(dtype=np.int64) for c in
                              lane_cols + ["start_ns", "end_ns", "dur_ns", "step_before", "step_after"]})
        empty["cause"] = pd.Series(dtype=object)
        empty["runnable"] = pd.Series(dtype=np.int64)
        empty["in_flight"] = pd.Series(dtype=np.int64)
        empty["span_row"] = pd.Series(dtype=np.int64)
        if len(busy) < 2:
            return empty
        lane_id = busy.groupby(lane_cols, sort=False).ngroup().to_numpy()
        prev_end = busy.groupby(lane_id)["e"].cummax().to_numpy()
        same_lane = np.r_[False, lane_id[1:] == lane_id[:-1]]
        gap_start = np.r_[0, prev_end[:-1]]
        begin = busy["b"].to_numpy()
        idx = np.flatnonzero(same_lane & (begin > gap_start))
        if len(idx) == 0:
            return empty
        step = busy["step"].to_numpy()
        bub = busy.iloc[idx][lane_cols].reset_index(drop=True)
        bub["start_ns"] = gap_start[idx]
        bub["end_ns"] = begin[idx]
        bub["dur_ns"] = bub["end_ns"] - bub["start_ns"]
        bub["step_before"] = step[idx - 1]
        bub["step_after"] = step[idx]
        bub["span_row"] = idx  # the busy_spans row that ends the gap

        # the upstream stage's first begin of the step that ends the gap
        up = busy.groupby(["inst", "dp", "pp", "step"], sort=False)["b"].min().rename("up_begin").reset_index()
        up["pp"] = up["pp"] + 1
        bub = bub.merge(up.rename(columns={"step": "step_after"}), on=["inst", "dp", "pp", "step_after"],
                        how="left")
        steps = _step_frame(ctx)
        sub = steps[["inst", "dp", "step"]].rename(columns={"step": "step_after"})
        sub["t_sub"] = pd.array(_int64(steps["submit_ts"].fillna(steps["sched_ts"])), dtype="Int64")
        bub = bub.merge(sub, on=["inst", "dp", "step_after"], how="left")

        funcs = _count_functions(ctx)
        sizes = pipeline_sizes(ctx)
        n = len(bub)
        s = bub["start_ns"].to_numpy()
        e = bub["end_ns"].to_numpy()
        t_sub = bub["t_sub"].astype("Int64").fillna(_NULL).to_numpy(dtype=np.int64)
        no_live = np.zeros(n, np.int64)
        no_run = np.zeros(n, np.int64)
        runnable = np.zeros(n, np.int64)
        in_flight = np.zeros(n, np.int64)
        p_size = np.ones(n, np.int64)
        prev_submit = np.full(n, _NULL, np.int64)
        prev_output = np.full(n, _NULL, np.int64)
        prev_wait = np.full(n, _NULL, np.int64)
        submit_all = _int64(steps["submit_ts"])
        output_all = _int64(steps["output_ts"])
        wait_all = _int64(steps["wait_ns"].round())
        step_keys = steps.groupby(["inst", "dp"], sort=False).indices
        nothing = StepCount(np.empty(0, np.int64), np.empty(0, np.int64))
        for (inst, dp), grp in bub.groupby(["inst", "dp"], sort=False).indices.items():
            live, run, fly = funcs.get((inst, dp), (nothing, nothing, nothing))
            no_live[grp] = live.zero_between(s[grp], e[grp])
            no_run[grp] = run.zero_between(s[grp], e[grp])
            runnable[grp] = run.at(s[grp])
            in_flight[grp] = fly.at(s[grp])
            p_size[grp] = sizes.get((inst, dp), 1)
            sm = step_keys.get((inst, dp), np.empty(0, np.int64))
            q = t_sub[grp]
            subs = np.sort(submit_all[sm][submit_all[sm] != _NULL])
            if len(subs):
                k = np.searchsorted(subs, q, "left") - 1
                prev_submit[grp] = np.where(k >= 0, subs[np.maximum(k, 0)], _NULL)
            has_out = sm[output_all[sm] != _NULL]
            order = has_out[np.argsort(output_all[has_out], kind="stable")]
            if len(order):
                ot = output_all[order]
                k = np.searchsorted(ot, q, "left") - 1
                prev_output[grp] = np.where(k >= 0, ot[np.maximum(k, 0)], _NULL)
                prev_wait[grp] = np.where(k >= 0, wait_all[order][np.maximum(k, 0)], _NULL)
        dur = bub["dur_ns"].to_numpy()
        # the engine's own time in the gap before the submit: from the later of the gap start and the previous
        # submit, minus the time it sat blocked on a step's future (step_output wait_ns; everything up to that
        # output where wait_ns is unknown)
        a = np.maximum(s, prev_submit)
        out_in = (prev_output != _NULL) & (prev_output > a)
        blocked_from = np.where(prev_wait == _NULL, a, np.maximum(a, prev_output - np.maximum(prev_wait, 0)))
        blocked = np.where(out_in, prev_output - blocked_from, 0)
        host = t_sub - a - blocked
        engine_cause = np.select(
            [(t_sub != _NULL) & (t_sub > s) & (2 * host >= dur), in_flight < p_size],
            ["scheduler_cpu", "queue_not_full"], default="stage_imbalance").astype(object)
        # a later stage inherits the cause of its upstream stage's gap before the same step when that gap explains
        # at least half of its own (the delay travels down the pipeline); otherwise the upstream stage was busy
        # with the step while this one waited: stage imbalance. Stages are resolved in order, 0 first.
        pp_col = bub["pp"].to_numpy()
        has_up = ~np.isnan(bub["up_begin"].to_numpy(dtype=np.float64))
        cause = engine_cause.copy()
        keys = ["inst", "dp", "step_after"]
        for rank in np.unique(pp_col[pp_col > 0]).tolist():
            here = np.flatnonzero(pp_col == rank)
            above = np.flatnonzero(pp_col == rank - 1)
            up = pd.DataFrame({"inst": bub["inst"].to_numpy()[above], "dp": bub["dp"].to_numpy()[above],
                               "step_after": bub["step_after"].to_numpy()[above], "up_dur": dur[above],
                               "up_cause": cause[above]})
            up = up.sort_values("up_dur", kind="stable").drop_duplicates(keys, keep="last")
            mine = bub.iloc[here][keys].merge(up, on=keys, how="left")
            up_dur = mine["up_dur"].to_numpy(dtype=np.float64)
            inherit = ~np.isnan(up_dur) & (2 * up_dur >= dur[here])
            cause[here] = np.where(inherit, mine["up_cause"].to_numpy(),
                                   np.where(has_up[here], "stage_imbalance", engine_cause[here]))
        cause = np.where(2 * no_live >= dur, "idle_no_requests",
                         np.where(2 * no_run >= dur, "kv_transfer", cause)).astype(object)
        bub["cause"] = cause
        bub["runnable"] = runnable
        bub["in_flight"] = in_flight
        return bub.drop(columns=["up_begin", "t_sub"])

    return ctx.cached("steps:gap_frame", build)


def _bubble_frame(ctx: AnalysisContext) -> pd.DataFrame:
    gaps = gap_frame(ctx)
    return gaps[gaps["dur_ns"] >= max(int(ctx.config.bubble_min_ns), 1)].reset_index(drop=True)


def bubbles(ctx: AnalysisContext) -> pd.DataFrame:
    """One row per idle interval on a (instance, dp_rank, pp_rank, tp_rank) lane: start_ns, end_ns, dur_ns, cause,
    step_before, step_after, runnable, in_flight. See the module docstring for the algorithm and the causes."""

    def build() -> pd.DataFrame:
        return _public(ctx, _bubble_frame(ctx), {"dp": "dp_rank", "pp": "pp_rank", "tp": "tp_rank"}, int_na=[],
                       columns=BUBBLE_COLUMNS)

    return ctx.cached("steps:bubbles", build)
