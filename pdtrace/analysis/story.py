"""The chronological story of one request or one step: what `pdtrace show` prints, and where a finding's evidence
points.

`request_story(trace, req, instance=None)`  every event of the request on every instance (of every lifetime of a
    reused id: then a `lifetime` column, 1-based, says which request each row belongs to). Algorithm: start from the
    (instance, req) pairs that name `req` (only `instance` when given); follow the P/D links in `req_add` details
    (a decode-side request names its prefill side in `remote_instance` / `remote_req`; a prefill-side request is
    named by the decode-side adds that point at it) until no new pair appears; take every row of those pairs (one
    numpy mask over dictionary codes), plus the deferred drains that returned the request's blocks to the pool
    (`blocks_pool_free` rows with no req, on the same instance, at or after the request's deferred free, sharing a
    block with it). Sorted by (ts_ns, pid, seq).
`step_story(trace, step, instance=None)`  every event of step K (scheduler, engine and worker rows), same order.
`step_ranks(trace, step, instance=None)`  per rank lane (instance, dp_rank, pp_rank, tp_rank) and RPC: when its
    `exec_end` for the step came relative to the step's `step_output` (`before`, `after`, `never`; `no_output` when
    the step has none; `empty_run` when the step is one of a run of empty steps the recorder coalesced into one
    `sched` row, whose later steps keep no step_output of their own): whether vLLM's update_from_output for step K
    waited for every PP rank, read off the trace. The lanes expected are every lane that executed anything on that
    instance, plus engine_config's pp x tp grid.
`folded_steps(trace, step, instance=None)`  per scheduler whose coalesced `sched` row (detail `empty_run` = k,
    at step K0) covers `step` (K0 < step < K0 + k): instance, dp_rank, first_step K0, last_step K0 + k - 1.
`collapse_runs(story)`  consecutive `req_sched` rows of one request as one row (for reading long decodes).

Read from a trace directory, a story needs its own rows, not the trace's: `request_rows(path, req, instance)` and
`step_rows(path, step)` read just the rows the functions above read about one request or step (row filters on the
files, which hold only the kept rows in memory), so `pdtrace show` on a six-hour trace costs a few scans of the
files instead of a load of every event (`bench/long_trace.py --show`, 60M events: 4-7 s at 1.1 GiB against
40 s at 9.1-9.6 GiB). The stories they give are the whole trace's (tests/test_show.py compares them on every
sample and on built traces with renamed P/D ids, deferred drains, empty-step runs and a rank missing a step).
- request_rows: (1) the `req_add` rows (one a request) and the rows naming `req`: `related_requests` on them gives
  the (instance, req) pairs, since every P/D link is a `req_add` row; (2) every row of the pairs' ids, where they
  are not all `req` (P and D often share the id); (3) where the story has deferred frees, the request-less
  `blocks_pool_free` rows of their instances from the first of them.
- step_rows: the rows of the step, the `engine_config` rows, the `sched` rows before the step that head a run of
  empty steps (detail `empty_run`), and the rank lanes (`rank_lanes`) of the whole trace's exec rows, which
  `step_ranks` takes instead of the lanes of the rows it is given.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from pdtrace.analysis.columns import columns
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.steps import (BUBBLE_CAUSES, WAIT_CAUSES, detail_number, detail_text, exec_spans, instances,
                                    step_table, wait_frame)
from pdtrace.analysis.windows import GIVES, TAKES
from pdtrace.trace.model import Trace, dictionary_decoded
from pdtrace.trace.reader import open_trace, unified

INT64_MAX = np.iinfo(np.int64).max
STORY_COLUMNS = ("ts_ns", "instance", "role", "dp_rank", "pid", "component", "pp_rank", "tp_rank", "kind", "step",
                 "req", "blocks", "n", "reason", "status", "delay_free", "deferred", "detail", "seq")
RANK_COLUMNS = ("instance", "dp_rank", "pp_rank", "tp_rank", "rpc", "exec_begin_ts", "exec_end_ts", "output_ts",
                "relation", "wait_ns", "wait_for")


def _frame(trace: Trace, rows: np.ndarray, extra: dict[str, Any] | None = None) -> pd.DataFrame:
    names = [c for c in STORY_COLUMNS if c in trace.table.column_names]
    if len(rows) == 0:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in names})
    sub = trace.table.select(names).take(pa.array(np.asarray(rows, dtype=np.int64)))
    frame = sub.to_pandas(types_mapper={pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(),
                                        pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}.get)
    for name, values in (extra or {}).items():  # per-row columns computed by the caller, in `rows` order
        frame[name] = values
    for col in ("instance", "role", "component", "kind", "reason", "status"):
        if col in frame and isinstance(frame[col].dtype, pd.CategoricalDtype):
            frame[col] = frame[col].astype(object)
    frame["blocks"] = [list(b) if b is not None else None for b in sub.column("blocks").to_pylist()] \
        if "blocks" in names else None
    frame = frame.sort_values(["ts_ns", "pid", "seq"], kind="stable").reset_index(drop=True)
    start = int(frame["ts_ns"].iloc[0])
    frame.insert(1, "t_ns", frame["ts_ns"].astype("int64") - start)
    return frame


def related_requests(trace: Trace, req: str, instance: str | None = None) -> list[tuple[str, str]]:
    """The (instance, req) pairs of one request across P and D, following req_add's remote links."""
    ctx = AnalysisContext(trace)
    cols = columns(ctx)
    inst_codes, inst_names = cols.codes("instance")
    req_codes, req_names = cols.codes("req")
    if req not in req_names:
        return []
    rc = req_names.index(req)
    seed = np.flatnonzero(req_codes == rc)
    pairs = {(inst_names[i], req) for i in np.unique(inst_codes[seed]).tolist()}
    if instance is not None:
        pairs = {p for p in pairs if p[0] == instance}
    adds = cols.rows_of("req_add")
    if len(adds) == 0 or not pairs:
        return sorted(pairs)
    add_inst = np.asarray(inst_names, dtype=object)[inst_codes[adds]]
    add_req = np.asarray(req_names + [None], dtype=object)[req_codes[adds]]
    remote_inst = detail_text(ctx, adds, "remote_instance")
    remote_req = detail_text(ctx, adds, "remote_req")
    linked = ~pd.isna(remote_inst)
    links = pd.DataFrame({"inst": add_inst[linked], "req": add_req[linked], "r_inst": remote_inst[linked],
                          "r_req": np.where(pd.isna(remote_req[linked]), add_req[linked], remote_req[linked])})
    for _ in range(4):  # P <-> D chains are one link long; a few rounds reach a fixed point
        before = len(pairs)
        keys = pd.Series([f"{i}\x00{r}" for i, r in pairs])
        here = (links["inst"] + "\x00" + links["req"]).isin(keys)
        there = (links["r_inst"] + "\x00" + links["r_req"]).isin(keys)
        pairs |= set(zip(links.loc[here, "r_inst"], links.loc[here, "r_req"], strict=True))
        pairs |= set(zip(links.loc[there, "inst"], links.loc[there, "req"], strict=True))
        if len(pairs) == before:
            break
    return sorted((str(i), str(r)) for i, r in pairs)


def request_story(trace: Trace, req: str, instance: str | None = None) -> pd.DataFrame:
    """Every event of one request on every instance (see the module docstring); empty if the trace lacks it."""
    pairs = related_requests(trace, req, instance)
    ctx = AnalysisContext(trace)
    cols = columns(ctx)
    if not pairs:
        return _frame(trace, np.empty(0, np.int64))
    inst_codes, inst_names = cols.codes("instance")
    req_codes, req_names = cols.codes("req")
    mask = np.zeros(cols.n, bool)
    for inst, r in pairs:  # a handful of pairs
        if inst in inst_names and r in req_names:
            mask |= (inst_codes == inst_names.index(inst)) & (req_codes == req_names.index(r))
    # deferred drains (req null) that returned this request's blocks to the pool
    frees = np.flatnonzero(mask & cols.is_kind("blocks_free"))
    value, valid = cols.bools_at("deferred", frees)
    deferred_free = frees[valid & value]
    if len(deferred_free):
        block_row, block_id = cols.block_rows
        drains = cols.is_kind("blocks_pool_free") & (req_codes < 0)
        for inst in np.unique(inst_codes[deferred_free]).tolist():
            mine = deferred_free[inst_codes[deferred_free] == inst]
            freed = block_id[np.isin(block_row, mine)]
            since = cols.ts[mine].min()
            cand = drains & (inst_codes == inst) & (cols.ts >= since)
            hit = np.unique(block_row[cand[block_row] & np.isin(block_id, freed)])
            mask[hit] = True
    rows = np.flatnonzero(mask)
    # a reused id (columns.py: a req_add after the id's finish starts a new request): each row's lifetime, 1-based,
    # as a column only when the story holds more than one
    rk = cols.rk[rows]
    life = np.where(rk >= 0, cols.request_lifetime[np.maximum(rk, 0)] if cols.n_requests else 0, -1)
    extra = {"lifetime": pd.array(np.where(life >= 0, life + 1, 0), dtype="Int64")} if (life > 0).any() else None
    if extra is not None:
        extra["lifetime"][life < 0] = pd.NA
    return _frame(trace, rows, extra)


def step_story(trace: Trace, step: int, instance: str | None = None) -> pd.DataFrame:
    """Every event of step `step` (scheduler, engine and worker rows); empty if no row has it."""
    cols = columns(AnalysisContext(trace))
    mask = cols.step == int(step)
    if instance is not None:
        inst_codes, inst_names = cols.codes("instance")
        mask &= inst_codes == (inst_names.index(instance) if instance in inst_names else -9)
    return _frame(trace, np.flatnonzero(mask))


def rank_lanes(trace: Trace) -> pd.DataFrame:
    """The distinct rank lanes (instance, dp_rank, pp_rank, tp_rank; a null rank -1) of the trace's exec_begin and
    exec_end rows: the lanes `step_ranks` expects, with engine_config's grid."""
    keys = ["instance", "dp_rank", "pp_rank", "tp_rank"]
    table = trace.table.select(keys + ["kind"])
    table = table.filter(pc.is_in(pc.cast(table.column("kind"), pa.string()),
                                  value_set=pa.array(["exec_begin", "exec_end"])))
    # distinct in Arrow first (a few lanes among millions of exec rows: 3M rows, 2.2 s as strings in pandas), in
    # the order of first appearance (one thread)
    table = table.select(keys).group_by(keys, use_threads=False).aggregate([])
    frame = pd.DataFrame({"instance": pc.cast(table.column("instance"), pa.string()).to_numpy(zero_copy_only=False),
                          **{name: pc.fill_null(table.column(name), -1).to_numpy().astype(np.int64)
                             for name in ("dp_rank", "pp_rank", "tp_rank")}})
    return frame.drop_duplicates().reset_index(drop=True)


def step_ranks(trace: Trace, step: int, instance: str | None = None,
               lanes: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per rank lane and RPC: exec_end of step `step` before or after its step_output, or never. `lanes`: the
    trace's `rank_lanes` where `trace` holds only some of its rows (`step_rows`); None: this trace's."""
    ctx = AnalysisContext(trace)
    cols = columns(ctx)
    inst_codes, inst_names = cols.codes("instance")
    lanes = rank_lanes(trace) if lanes is None else lanes
    code_of = {name: i for i, name in enumerate(inst_names)}
    lanes = pd.DataFrame({"inst": np.array([code_of.get(name, -9) for name in lanes["instance"]], np.int64),
                          "dp": lanes["dp_rank"].to_numpy(np.int64), "pp": lanes["pp_rank"].to_numpy(np.int64),
                          "tp": lanes["tp_rank"].to_numpy(np.int64)})
    lanes = lanes[lanes["inst"] >= 0]
    cfg_rows = cols.rows_of("engine_config")
    if len(cfg_rows):
        cfg_pp = detail_number(ctx, cfg_rows, "pp")
        cfg_tp = detail_number(ctx, cfg_rows, "tp")
        grid = [(int(inst_codes[r]), int(cols.dp[r]), p, t)
                for r, npp, ntp in zip(cfg_rows.tolist(), cfg_pp, cfg_tp, strict=True) if npp == npp and ntp == ntp
                for p in range(int(npp)) for t in range(int(ntp))]
        if grid:
            lanes = pd.concat([lanes, pd.DataFrame(grid, columns=["inst", "dp", "pp", "tp"])]).drop_duplicates()
    keep = (cols.step == int(step)) | cols.is_kind("engine_config")
    if instance is not None:
        code = inst_names.index(instance) if instance in inst_names else -9
        keep &= inst_codes == code
        lanes = lanes[lanes["inst"] == code]
    sub = trace.filter(keep)
    sctx = AnalysisContext(sub)
    steps = step_table(sctx)
    steps = steps[steps["step"] == int(step)]
    spans = exec_spans(sctx)
    spans = spans[spans["step"] == int(step)]
    steps_with = set(steps["instance"].astype(str))
    lanes = lanes.assign(instance=[inst_names[i] for i in lanes["inst"]])
    lanes = lanes[lanes["instance"].isin(steps_with | set(spans["instance"].astype(str)))]
    lanes = lanes.rename(columns={"dp": "dp_rank", "pp": "pp_rank", "tp": "tp_rank"}).drop(columns=["inst"])
    if len(lanes) == 0:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in RANK_COLUMNS})
    spans = spans.assign(instance=spans["instance"].astype(str),
                         dp_rank=spans["dp_rank"].fillna(-1).astype(np.int64),
                         pp_rank=spans["pp_rank"].fillna(-1).astype(np.int64),
                         tp_rank=spans["tp_rank"].fillna(-1).astype(np.int64))
    rpcs = spans[["rpc"]].drop_duplicates() if len(spans) else pd.DataFrame({"rpc": ["execute_model"]})
    grid = lanes.merge(rpcs, how="cross")
    out = grid.merge(spans[["instance", "dp_rank", "pp_rank", "tp_rank", "rpc", "begin_ts", "end_ts"]],
                     on=["instance", "dp_rank", "pp_rank", "tp_rank", "rpc"], how="left")
    outputs = steps.assign(instance=steps["instance"].astype(str),
                           dp_rank=steps["dp_rank"].fillna(-1).astype(np.int64))[["instance", "dp_rank",
                                                                                   "output_ts"]]
    out = out.merge(outputs, on=["instance", "dp_rank"], how="left")
    end = out["end_ts"].astype("Int64")
    output = out["output_ts"].astype("Int64")
    no_end = end.isna().to_numpy()
    no_out = output.isna().to_numpy()
    before = (end <= output).fillna(False).to_numpy(dtype=bool)
    folded = folded_steps(trace, step, instance)
    in_run = out.merge(folded.assign(dp_rank=folded["dp_rank"].fillna(-1).astype(np.int64), _run=True)
                       [["instance", "dp_rank", "_run"]], on=["instance", "dp_rank"], how="left")["_run"]
    in_run = in_run.fillna(False).to_numpy(dtype=bool)
    out["relation"] = np.select([no_out & in_run, no_end, no_out, before],
                                ["empty_run", "never", "no_output", "before"], default="after")
    out = out.rename(columns={"begin_ts": "exec_begin_ts", "end_ts": "exec_end_ts"})
    out = _rpc_waits(sctx, out, int(step))
    out = out.sort_values(["instance", "dp_rank", "rpc", "pp_rank", "tp_rank"]).reset_index(drop=True)
    return out[list(RANK_COLUMNS)]


def _rpc_waits(ctx: AnalysisContext, ranks: pd.DataFrame, step: int) -> pd.DataFrame:
    """`ranks` with `wait_ns` (the time the lane's RPC spent in the waits it recorded, `exec_wait_*`, inside its
    span) and `wait_for` (their reasons, e.g. `pp_recv`); null where the RPC recorded none."""
    waits = wait_frame(ctx)
    waits = waits[waits["step"] == step]
    wait_ns = pd.array([pd.NA] * len(ranks), dtype="Int64")
    wait_for: list[str | None] = [None] * len(ranks)
    if len(waits):
        names = instances(ctx)
        reasons = {BUBBLE_CAUSES.index(c): r for r, c in WAIT_CAUSES.items()}
        for i, lane in enumerate(ranks.itertuples(index=False)):  # one step's lanes: a handful
            if pd.isna(lane.exec_begin_ts) or pd.isna(lane.exec_end_ts):
                continue
            mine = waits[(waits["inst"] == names.index(lane.instance)) & (waits["dp"] == lane.dp_rank)
                         & (waits["pp"] == lane.pp_rank) & (waits["tp"] == lane.tp_rank)
                         & (waits["b"] >= int(lane.exec_begin_ts)) & (waits["e"] <= int(lane.exec_end_ts))]
            if len(mine):
                wait_ns[i] = int((mine["e"] - mine["b"]).sum())
                wait_for[i] = "+".join(sorted({reasons[int(c)] for c in mine["cause"]}))
    return ranks.assign(wait_ns=wait_ns, wait_for=wait_for)


def folded_steps(trace: Trace, step: int, instance: str | None = None) -> pd.DataFrame:
    """The runs of coalesced empty steps that hold `step` without being headed by it (see the module docstring)."""
    steps = step_table(AnalysisContext(trace))
    run = steps["empty_run"].to_numpy(dtype=np.float64)
    first = steps["step"].to_numpy(dtype=np.int64)
    hit = (run > 1) & (first < int(step)) & (int(step) < first + np.nan_to_num(run))
    if instance is not None:
        hit &= (steps["instance"].astype(str) == instance).to_numpy()
    out = steps.loc[hit, ["instance", "dp_rank", "step"]].rename(columns={"step": "first_step"})
    out = out.assign(instance=out["instance"].astype(str), last_step=first[hit] + run[hit].astype(np.int64) - 1)
    return out.reset_index(drop=True)


def collapse_runs(story: pd.DataFrame, kinds: Iterable[str] = ("req_sched",)) -> pd.DataFrame:
    """Consecutive rows of the given kinds for one (instance, req) as one row: kind gets the count
    (`req_sched x12`), step the range (`first_step`, `last_step` columns), n the sum."""
    if len(story) == 0:
        return story.assign(last_step=pd.Series(dtype="Int64"), count=pd.Series(dtype=np.int64))
    kinds = tuple(kinds)
    k = story["kind"].astype(str).to_numpy()
    inst = story["instance"].astype(str).to_numpy()
    req = story["req"].astype(object).to_numpy()
    foldable = np.isin(k, kinds)
    same = np.r_[False, (k[1:] == k[:-1]) & (inst[1:] == inst[:-1]) & (req[1:] == req[:-1])]
    run_id = np.cumsum(~(foldable & same))
    story = story.assign(_run=run_id)
    agg: dict[str, object] = {c: "first" for c in story.columns if c not in ("_run",)}
    agg["n"] = lambda values: values.sum(min_count=1)
    out = story.groupby("_run", sort=True).agg(agg)
    out["last_step"] = pd.array(story.groupby("_run", sort=True)["step"].last().to_numpy(), dtype="Int64")
    out["count"] = story.groupby("_run", sort=True).size().to_numpy()
    return out.reset_index(drop=True)


def _read(path: str | os.PathLike[str], rows: ds.Expression, columns: list[str] | None = None) -> Trace:
    return open_trace(path, columns=columns, rows=rows, warn=False)


def _joined(first: Trace, more: Trace) -> Trace:
    """`first` with the rows of `more` (another filtered read of the same trace) appended."""
    if len(more) == 0:
        return first
    table = unified(pa.concat_tables([first.table, more.table]))
    warnings = first.warnings + [w for w in more.warnings if w not in first.warnings]
    return Trace(table=table, path=first.path, manifest=first.manifest, files=first.files, skipped=first.skipped,
                 warnings=warnings, window_start_ns=first.window_start_ns, window_source=first.window_source,
                 instance_names=first.instance_names)


def request_rows(path: str | os.PathLike[str], req: str, instance: str | None = None) -> Trace:
    """The rows of the trace at `path` that `request_story` and `related_requests` read about `req` (module
    docstring): the same story, holding the request's rows and one row a request rather than the trace."""
    kind = ds.field("kind")
    adds = _read(path, (ds.field("req") == req) | (kind == "req_add"))
    pairs = related_requests(adds, req, instance)
    if not pairs:
        return adds
    names = sorted({r for _, r in pairs})
    # the first read holds every row of `req` already; the other ids' need a second (a P/D pair renamed across sides)
    rows = adds if names == [req] else _read(path, ds.field("req").isin(names))
    story = request_story(rows, req, instance)
    deferred = story[(story["kind"] == "blocks_free") & story["deferred"].fillna(False).astype(bool)]
    if len(deferred) == 0:
        return rows
    drains = _read(path, (kind == "blocks_pool_free") & ds.field("req").is_null()
                   & ds.field("instance").isin(sorted(set(deferred["instance"].astype(str))))
                   & (ds.field("ts_ns") >= int(deferred["ts_ns"].min())))
    return _joined(rows, drains)


def requests_span(path: str | os.PathLike[str], requests: Sequence[str],
                  instance: str | None = None) -> tuple[int, int | None] | None:
    """(first, last) ts_ns of the named requests' rows and their P/D peers' (`request_rows`, `related_requests`):
    the time a window of them must read; last None where one of them never finishes or never gives up every block
    it took (it lives to the end of the trace); None when the trace has none of them."""
    lo, hi, open_ended = None, None, False
    for req in requests:  # few: the ones a user names
        rows = request_rows(path, req, instance)
        pairs = related_requests(rows, req, instance)
        if not pairs or len(rows) == 0:
            continue
        table = rows.table
        named = pc.is_in(dictionary_decoded(table.column("req")), value_set=pa.array(sorted({r for _, r in pairs})))
        mine = table.filter(pc.fill_null(named, False))
        ts = pc.min_max(mine.column("ts_ns")).as_py()
        if ts["min"] is None:
            continue
        lo = ts["min"] if lo is None else min(lo, ts["min"])
        hi = ts["max"] if hi is None else max(hi, ts["max"])
        # a request lives to the end of the trace unless it finishes and gives up every block it took (a figure
        # draws its waiting, or its holding after the finish, to the end)
        frame = mine.select(["instance", "req", "kind", "blocks"]).to_pandas()
        frame["instance"], frame["req"] = frame["instance"].astype(str), frame["req"].astype(str)
        taken = frame["blocks"].map(lambda b: 0 if b is None else len(b))  # few rows: one request's
        kind = frame["kind"].astype(str)
        sign = np.where(kind.isin(TAKES), 1, np.where(kind.isin(GIVES), -1, 0))  # as the windows' plan counts
        held = (taken * sign).groupby([frame["instance"], frame["req"]]).sum()
        finished = set(zip(frame.loc[kind == "req_finish", "instance"], frame.loc[kind == "req_finish", "req"]))
        open_ended |= any(pair not in finished or held.get(pair, 0) > 0 for pair in pairs)
    if lo is None or hi is None:
        return None
    return int(lo), None if open_ended else int(hi)


def step_rows(path: str | os.PathLike[str], step: int) -> tuple[Trace, pd.DataFrame]:
    """(the rows of the trace at `path` that `step_story`, `step_ranks` and `folded_steps` read about step
    `step`, the trace's `rank_lanes`) (module docstring): the same story, holding the step's rows."""
    kind, number = ds.field("kind"), ds.field("step")
    step = max(min(int(step), INT64_MAX), -INT64_MAX)  # beyond int64 no row has it (and the filter cannot say it)
    rows = _read(path, (number == step) | (kind == "engine_config")
                 | ((kind == "sched") & (number < step) & pc.match_substring(ds.field("detail"), "empty_run")))
    lanes = _read(path, kind.isin(["exec_begin", "exec_end"]),
                  columns=["instance", "dp_rank", "pp_rank", "tp_rank", "kind"])
    return rows, rank_lanes(lanes)
