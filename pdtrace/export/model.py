"""What an export holds, independent of its file format: processes, threads, slices, counters and flows as
DataFrames, built from the analyses' tables (`exec_spans`, `step_table`, `request_phases`, `block_usage`,
`request_table`) for a selection. `chrome.py` and `perfetto.py` only serialise this model.

Layout: one process per instance; in it a `scheduler` thread (one slice per schedule() call), a thread per worker
rank (`dp0 PP1 TP0`: one slice per RPC of a step, a `wait pp_recv` slice nested in it per wait the rank recorded
inside the RPC), and a thread per request (`req r1`: one slice per phase, plus
zero-width `kv send` / `kv recv` marks where a P/D transfer starts and lands). A counter `KV blocks` per scheduler
carries the blocks in use by owner state. A flow joins a prefill request's `kv send` mark (its finish, when its KV
is ready) to the decode request's `kv recv` mark (its `kv_recv_done`); the pair comes from the decode request's
`req_add` detail (`remote_instance`, `remote_req`), as `request_table` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.requests import request_table
from pdtrace.analysis.steps import BUBBLE_CAUSES, WAIT_CAUSES, exec_spans, instances, step_table, wait_frame
from pdtrace.analysis.timelines import BLOCK_STATES, block_usage, request_phases, usage_held_at
from pdtrace.plot.window import Selection

#: Thread id ranges inside a process, disjoint for DP ranks < 1000, PP and TP ranks < 1000: schedulers 1 + dp,
#: worker ranks RANK_TID_BASE + (dp * 1000 + pp) * 1000 + tp, requests REQUEST_TID_BASE + their index.
SCHEDULER_TID = 1
RANK_TID_BASE = 1_000
REQUEST_TID_BASE = 2_000_000_000
MARK_NS = 1_000  # width of the kv send / kv recv marks (1 µs)


@dataclass
class ExportModel:
    """The export as tables. ts/dur in ns since the epoch; `t0_ns` is the trace start (exports count from it)."""

    t0_ns: int
    processes: pd.DataFrame  # pid, name, sort
    threads: pd.DataFrame  # pid, tid, name
    slices: pd.DataFrame  # pid, tid, name, cat, ts_ns, dur_ns, arg_key, arg_value (one numeric arg or none)
    counters: pd.DataFrame  # pid, name, ts_ns, <one column per series>
    counter_series: tuple[str, ...]
    flows: pd.DataFrame  # id, src_pid, src_tid, src_ts_ns, dst_pid, dst_tid, dst_ts_ns

    def counts(self) -> dict[str, int]:
        return {"processes": len(self.processes), "threads": len(self.threads), "slices": len(self.slices),
                "counters": len(self.counters), "flows": len(self.flows)}


def _clip(start: np.ndarray, end: np.ndarray, sel: Selection) -> tuple[np.ndarray, np.ndarray]:
    s = np.maximum(start, sel.lo_ns)
    return s, np.maximum(np.minimum(end, sel.hi_ns) - s, 0)


def _slices(pid: np.ndarray, tid: np.ndarray, name: pd.Series | np.ndarray, cat: str, ts: np.ndarray,
            dur: np.ndarray, arg_key: str = "", arg_value: np.ndarray | None = None) -> pd.DataFrame:
    return pd.DataFrame({"pid": pid.astype(np.int64), "tid": tid.astype(np.int64),
                         "name": np.asarray(name, dtype=object), "cat": cat, "ts_ns": ts.astype(np.int64),
                         "dur_ns": dur.astype(np.int64), "arg_key": arg_key,
                         "arg_value": np.full(len(pid), np.nan) if arg_value is None else arg_value.astype(float)})


def _wait_slices(ctx: AnalysisContext, sel: Selection, pid_of: dict[str, int]) -> pd.DataFrame:
    """A slice per wait a rank recorded inside an RPC (`exec_wait_*`: `wait pp_recv`, category `wait`), on the
    rank's thread, nested in its RPC's slice: the part of the RPC that is idle time, not work."""
    waits = wait_frame(ctx)
    names = np.array(instances(ctx) + [""], dtype=object)
    inst = names[waits["inst"].to_numpy()] if len(waits) else np.empty(0, dtype=object)
    pid = pd.Series(inst, dtype=object).map(pid_of).to_numpy()
    b, e = waits["b"].to_numpy(np.int64), waits["e"].to_numpy(np.int64)
    mine = np.flatnonzero(pd.notna(pid) & sel.overlaps(b, e)) if len(waits) else np.empty(0, np.int64)
    reason = {BUBBLE_CAUSES.index(c): r for r, c in WAIT_CAUSES.items()}
    dp, pp, tp = (np.maximum(waits[c].to_numpy(np.int64)[mine], 0) for c in ("dp", "pp", "tp"))
    ts, dur = _clip(b[mine], e[mine], sel)
    name = np.array(["wait " + reason[int(c)] for c in waits["cause"].to_numpy()[mine]], dtype=object)
    return _slices(pid[mine].astype(np.int64), RANK_TID_BASE + (dp * 1_000 + pp) * 1_000 + tp, name, "wait", ts,
                   dur, "step", waits["step"].to_numpy(np.int64)[mine].astype(np.float64))


def build_model(ctx: AnalysisContext, sel: Selection, findings: pd.DataFrame | None = None) -> ExportModel:
    """The export model of a selection (see the module docstring). Vectorised: merges and column arithmetic."""
    reqs = request_table(ctx)
    wanted_reqs = sel.request_pairs  # the named requests and their P/D peers, so that a transfer has both ends
    instances = sel.instances

    def keep(frame: pd.DataFrame) -> np.ndarray:
        vals = frame["instance"].astype("str")
        return np.ones(len(frame), bool) if instances is None else vals.isin(list(instances)).to_numpy()

    spans = exec_spans(ctx).dropna(subset=["begin_ts", "end_ts"])
    spans = spans[keep(spans) & sel.overlaps(spans["begin_ts"], spans["end_ts"])]
    steps = step_table(ctx).dropna(subset=["sched_ts"])
    steps = steps[keep(steps) & sel.contains(steps["sched_ts"])]
    ph = request_phases(ctx)
    lane = ph.groupby(["instance", "req"], observed=True, sort=False).ngroup().to_numpy()  # an integer per request
    ph = ph[keep(ph) & sel.current(lane, (ph["phase"] == "freed").to_numpy(), ph["start_ns"], ph["end_ns"])]
    if wanted_reqs is not None:
        ph = ph.merge(pd.DataFrame(sorted(wanted_reqs), columns=["instance", "req"]), on=["instance", "req"])
    usage = block_usage(ctx, findings=findings)
    usage = usage[keep(usage)]
    if len(usage):  # the counters' samples: those in the window, and per scheduler the value at its start
        # the last sample before the window: the value at its start, where blocks were in use then (a counter is
        # 0 until its first sample; and a window read alone, `plan_time_windows`, holds the rows of what was in use
        # at its start, not the changes that emptied the pool before it)
        before = usage_held_at(usage, sel.lo_ns) & (usage["in_use"].to_numpy(np.int64) > 0)
        usage = usage[sel.contains(usage["ts_ns"].to_numpy(np.int64)) | before]

    names = sorted({str(n) for frame in (spans, steps, ph, usage)
                    for n in frame["instance"].astype("str").unique()})  # per instance of each table (few)
    if not names:
        raise sel.empty("exec spans, steps, request phases or block usage")
    roles = reqs.drop_duplicates("instance").set_index("instance")["role"].to_dict()
    # prefill instances above decode ones, so that transfer arrows point down
    rank = {"prefill": 0, "both": 1, "decode": 2}
    names.sort(key=lambda n: (rank.get(str(roles.get(n)), 3), sel.shown(n), n))
    pid_of = {name: i + 1 for i, name in enumerate(names)}
    # a process by its readable name (`pdtrace.trace.names`), with vLLM's id where that is another
    labels = [sel.shown(n) if sel.shown(n) == n else f"{sel.shown(n)} [{n}]" for n in names]
    processes = pd.DataFrame({"pid": [pid_of[n] for n in names],
                              "name": [f"{label} ({roles[n]})" if roles.get(n) else label
                                       for n, label in zip(names, labels, strict=True)],
                              "sort": list(range(len(names)))})
    parts: list[pd.DataFrame] = []
    threads: list[pd.DataFrame] = []

    # scheduler: one slice per schedule() call
    if len(steps):
        pid = steps["instance"].astype("str").map(pid_of).to_numpy()
        dp = steps["dp_rank"].astype("Int64").fillna(0).to_numpy(np.int64)
        tid = SCHEDULER_TID + dp
        ts = steps["sched_ts"].to_numpy(np.int64)
        dur = steps["dur_ns"].astype("Float64").fillna(0).to_numpy(np.int64)
        parts.append(_slices(pid, tid, "step " + steps["step"].astype("Int64").astype("str"), "scheduler", ts, dur,
                             "tokens", steps["tokens"].astype("Float64").fillna(np.nan).to_numpy(np.float64)))
        t = pd.DataFrame({"pid": pid, "tid": tid, "dp": dp}).drop_duplicates(["pid", "tid"])
        threads.append(pd.DataFrame({"pid": t["pid"], "tid": t["tid"], "name": "scheduler dp" + t["dp"].astype(str)}))

    # workers: one thread per (dp, pp, tp) rank
    if len(spans):
        dp = spans["dp_rank"].astype("Int64").fillna(0).to_numpy(np.int64)
        pp = spans["pp_rank"].astype("Int64").fillna(0).to_numpy(np.int64)
        tp = spans["tp_rank"].astype("Int64").fillna(0).to_numpy(np.int64)
        pid = spans["instance"].astype("str").map(pid_of).to_numpy()
        tid = RANK_TID_BASE + (dp * 1_000 + pp) * 1_000 + tp
        ts, dur = _clip(spans["begin_ts"].to_numpy(np.int64), spans["end_ts"].to_numpy(np.int64), sel)
        rpc = spans["rpc"].astype("str").fillna("execute_model").to_numpy(dtype=object)
        name = "step " + spans["step"].astype("Int64").astype("str").to_numpy(dtype=object) + " " + rpc
        tokens = spans["n"].astype("Float64").to_numpy(np.float64)
        parts.append(_slices(pid, tid, name, "exec", ts, dur, "tokens", tokens))
        waits = _wait_slices(ctx, sel, pid_of)
        if len(waits):  # (a trace without wait rows exports as before they existed)
            parts.append(waits)
        t = pd.DataFrame({"pid": pid, "tid": tid, "dp": dp, "pp": pp, "tp": tp}).drop_duplicates(["pid", "tid"])
        threads.append(pd.DataFrame({"pid": t["pid"], "tid": t["tid"],
                                     "name": "dp" + t["dp"].astype(str) + " PP" + t["pp"].astype(str)
                                     + " TP" + t["tp"].astype(str)}))

    # requests: one thread each, one slice per phase
    req_tid: pd.DataFrame = pd.DataFrame({"instance": [], "req": [], "tid": []})
    if len(ph):
        first = ph.groupby(["instance", "req"], observed=True)["start_ns"].min().reset_index()
        first = first.sort_values(["instance", "start_ns", "req"]).reset_index(drop=True)
        first["tid"] = REQUEST_TID_BASE + first.groupby("instance").cumcount().to_numpy()
        req_tid = first[["instance", "req", "tid"]]
        ph = ph.merge(req_tid, on=["instance", "req"])
        ts, dur = _clip(ph["start_ns"].to_numpy(np.int64), ph["end_ns"].to_numpy(np.int64), sel)
        pid = ph["instance"].astype("str").map(pid_of).to_numpy()
        parts.append(_slices(pid, ph["tid"].to_numpy(), ph["phase"].astype("str").to_numpy(dtype=object),
                             "request", ts, dur))
        threads.append(pd.DataFrame({"pid": req_tid["instance"].map(pid_of), "tid": req_tid["tid"],
                                     "name": "req " + req_tid["req"].astype(str)}))

    # flows: P's finish (KV ready to send) -> D's kv_recv_done, both ends on drawn request threads
    flows = pd.DataFrame({"id": [], "src_pid": [], "src_tid": [], "src_ts_ns": [], "dst_pid": [], "dst_tid": [],
                          "dst_ts_ns": []}, dtype=np.int64)
    down = reqs.dropna(subset=["remote_instance", "remote_req", "recv_done_ts"])
    if len(down) and len(req_tid):
        pairs = down[["instance", "req", "remote_instance", "remote_req", "recv_done_ts"]].merge(
            reqs[["instance", "req", "finish_ts"]].dropna(subset=["finish_ts"]),
            left_on=["remote_instance", "remote_req"], right_on=["instance", "req"], suffixes=("", "_p"))
        pairs = pairs.merge(req_tid, on=["instance", "req"]).merge(
            req_tid.rename(columns={"instance": "instance_p", "req": "req_p", "tid": "tid_p"}),
            on=["instance_p", "req_p"])
        pairs = pairs[sel.contains(pairs["finish_ts"]) & sel.contains(pairs["recv_done_ts"])]
        if len(pairs):
            src_ts = pairs["finish_ts"].to_numpy(np.int64)
            dst_ts = pairs["recv_done_ts"].to_numpy(np.int64)
            flows = pd.DataFrame({
                "id": np.arange(1, len(pairs) + 1, dtype=np.int64),
                "src_pid": pairs["instance_p"].map(pid_of).to_numpy(np.int64),
                "src_tid": pairs["tid_p"].to_numpy(np.int64),
                "src_ts_ns": src_ts,
                "dst_pid": pairs["instance"].map(pid_of).to_numpy(np.int64), "dst_tid": pairs["tid"].to_numpy(np.int64),
                "dst_ts_ns": dst_ts})
            zero = np.full(len(flows), MARK_NS)
            parts.append(_slices(flows["src_pid"].to_numpy(), flows["src_tid"].to_numpy(),
                                 np.full(len(flows), "kv send", dtype=object), "kv", src_ts, zero))
            parts.append(_slices(flows["dst_pid"].to_numpy(), flows["dst_tid"].to_numpy(),
                                 np.full(len(flows), "kv recv", dtype=object), "kv", dst_ts, zero))

    # counters: blocks in use per scheduler, by owner state, over the window (the value at its start included)
    counters = pd.DataFrame({"pid": [], "name": [], "ts_ns": [], **{s: [] for s in BLOCK_STATES}})
    if len(usage):
        multi_dp = usage.groupby("instance")["dp_rank"].nunique()
        name = np.where(usage["instance"].map(multi_dp).to_numpy() > 1,
                        "KV blocks dp" + usage["dp_rank"].astype("Int64").astype("str"), "KV blocks")
        counters = pd.DataFrame({"pid": usage["instance"].astype("str").map(pid_of).to_numpy(), "name": name,
                                 "ts_ns": np.maximum(usage["ts_ns"].to_numpy(np.int64), sel.lo_ns),
                                 **{s: usage[s].to_numpy(np.int64) for s in BLOCK_STATES}})

    slices = pd.concat(parts, ignore_index=True) if parts else _slices(np.empty(0), np.empty(0), [], "",
                                                                        np.empty(0), np.empty(0))
    # per thread in time order (and the threads and counters by process and thread): the same file whatever order
    # the analyses' tables list their rows in (a window read alone lists its instances and requests as it read them)
    slices = slices.sort_values(["pid", "tid", "ts_ns"], kind="stable", ignore_index=True)
    thread_table = (pd.concat(threads, ignore_index=True) if threads
                    else pd.DataFrame({"pid": [], "tid": [], "name": []}))
    thread_table = thread_table.sort_values(["pid", "tid"], kind="stable", ignore_index=True)
    counters = counters.sort_values(["pid", "name", "ts_ns"], kind="stable", ignore_index=True)
    return ExportModel(t0_ns=sel.t0_ns, processes=processes, threads=thread_table, slices=slices,
                       counters=counters, counter_series=BLOCK_STATES, flows=flows)
