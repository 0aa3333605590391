"""A recording read as a dry run's configuration: topology, workload, client, network and clock (see the package
docstring for the algorithm)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pdtrace.dryrun.config import DryRunConfig
from pdtrace.errors import UsageError
from pdtrace.trace.names import names_of

_COLUMNS = ["ts_ns", "instance", "component", "dp_rank", "pp_rank", "tp_rank", "kind", "step", "req", "blocks", "n",
            "reason", "delay_free", "detail"]
#: a transfer the recording never saw end: its report never comes in the replay either
NEVER_STEPS = 1 << 40
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


@dataclass
class Side:
    """One recorded scheduler: its instance, its role in the pair and its events (pandas, ts order)."""

    instance: str
    role: str  # "prefill", "decode" or "single"
    config: dict[str, Any]
    events: pd.DataFrame
    name: str = ""  # the instance's readable name (pdtrace.trace.names)


@dataclass
class ReplayPlan:
    """What the dry run is asked to do, and how the recording's request ids map to the replay's."""

    config: DryRunConfig
    sides: dict[str, Side]  # role -> its recorded side
    index_of: dict[str, int]  # recorded request id (either side) -> workload index
    notes: list[str] = field(default_factory=list)


def load_events(trace: Any) -> pd.DataFrame:
    """The columns the plan and the comparison read, decoded, in time order."""
    table = trace.table
    df = table.select([c for c in _COLUMNS if c in table.column_names]).to_pandas()
    for col in ("instance", "component", "kind", "reason"):
        df[col] = df[col].astype(object).where(df[col].notna(), None)
    return df.sort_values("ts_ns", kind="stable").reset_index(drop=True)


def _detail(value: Any) -> dict[str, Any]:
    if isinstance(value, str) and value:
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _sides(df: pd.DataFrame) -> dict[str, Side]:
    configs = df[df["kind"] == "engine_config"].drop_duplicates("instance")
    sched = df[df["component"] == "scheduler"]
    instances = list(dict.fromkeys(sched["instance"].tolist()))
    if not instances:
        raise UsageError("the trace holds no scheduler events: nothing to replay")
    if sched["dp_rank"].fillna(0).nunique() > 1:
        raise UsageError("pdtrace replay drives one scheduler per instance; this trace has several DP ranks")
    sides: dict[str, Side] = {}
    for instance in instances:
        row = configs[configs["instance"] == instance]
        cfg = _detail(row["detail"].iloc[0]) if len(row) else {}
        if len(row) and pd.notna(row["n"].iloc[0]):
            cfg["num_blocks"] = int(row["n"].iloc[0])
        role = _ROLES.get(cfg.get("kv_role") or "", "single") if cfg.get("connector") else "single"
        if role == "both" or role in sides:
            raise UsageError(f"pdtrace replay drives one prefill and one decode instance (or one engine); this trace "
                             f"has {', '.join(instances)}")
        sides[role] = Side(instance, role, cfg, df[(df["instance"] == instance) & (df["component"] != "worker")])
    if "single" in sides and len(sides) > 1:
        raise UsageError("pdtrace replay drives a prefill/decode pair or one engine, not both in one trace")
    if "decode" in sides and "prefill" not in sides:
        raise UsageError("pdtrace replay needs the prefill side of a pair (this trace holds only its decode side)")
    return sides


def _sampled(events: pd.DataFrame, req: str, prompt: int, block_size: int) -> int:
    """Tokens a request sampled: the steps that scheduled it up to or past its prompt's end, counting from what it
    had computed before its first step (the external tokens of its `req_wait_kv`, its prefix-cache hits)."""
    mine = events[events["req"] == req]
    n = mine.loc[mine["kind"] == "req_sched", "n"].fillna(0).to_numpy(np.int64)
    external = mine.loc[mine["kind"] == "req_wait_kv", "n"].dropna()
    allocs = mine.loc[mine["kind"] == "blocks_alloc", "detail"]
    hits = int(_detail(allocs.iloc[0]).get("hit") or 0) if len(allocs) else 0
    before = (int(external.iloc[0]) if len(external) else 0) + hits * block_size
    if not len(external) and (mine["kind"] == "req_wait_kv").any():  # 0.10 / 0.11 record no external count
        return len(n)
    return int(np.count_nonzero(np.cumsum(n) + before >= prompt))


def _fit_compute(events: pd.DataFrame, workers: pd.DataFrame, pp: int) -> tuple[float, float, list[str]]:
    """(fixed us, us per token) per PP stage, least squares over the recorded non-empty steps: the first rank's
    `execute_model` spans where the workers were recorded (one stage's own compute), else the steps' submit to
    output divided over the stages (which, with a batch queue, also holds the wait behind the steps before)."""
    first = workers[(workers["pp_rank"].fillna(0) == 0) & (workers["tp_rank"].fillna(0) == 0)]
    begins = first[first["kind"] == "exec_begin"].drop_duplicates("step").set_index("step")
    ends = first[(first["kind"] == "exec_end") & ~first["detail"].fillna("").str.contains("sample_tokens")]
    ends = ends.drop_duplicates("step").set_index("step")["ts_ns"]
    if len(begins) >= 3:
        spans = pd.concat({"tokens": begins["n"], "t0": begins["ts_ns"], "t1": ends}, axis=1).dropna()
        per_stage, source = 1, "the first rank's execute_model spans"
    else:
        sched = events[events["kind"] == "sched"].drop_duplicates("step").set_index("step")["n"]
        submit = events[events["kind"] == "step_submit"].drop_duplicates("step").set_index("step")["ts_ns"]
        output = events[events["kind"] == "step_output"].drop_duplicates("step").set_index("step")["ts_ns"]
        spans = pd.concat({"tokens": sched, "t0": submit, "t1": output}, axis=1).dropna()
        per_stage, source = pp, "the steps' submit to output"
    spans = spans[spans["tokens"] > 0]
    if len(spans) < 3:
        return 400.0, 20.0, ["fewer than 3 recorded steps: the dry run's default compute times"]
    dur_us = (spans["t1"] - spans["t0"]).to_numpy(float) / 1e3
    tokens = spans["tokens"].to_numpy(float)
    slope, fixed = np.polyfit(tokens, dur_us, 1) if np.ptp(tokens) > 0 else (0.0, float(np.median(dur_us)))
    # to the ns: the recorded times are whole ns, and a fit's float noise would shift every later event by one
    fixed, slope = round(max(float(fixed) / per_stage, 1.0), 3), round(max(float(slope) / per_stage, 0.0), 3)
    return fixed, slope, [f"compute per stage and step fitted to {len(spans)} steps ({source}): {fixed:.0f} us + "
                          f"{slope:.2f} us per token"]


def _fit_schedule(events: pd.DataFrame) -> tuple[float, float]:
    """(fixed us, us per scheduled request) of `schedule()`, least squares over the recorded `sched` rows' `dur_ns`
    against the requests each scheduled (the dry run's defaults without durations)."""
    sched = events[events["kind"] == "sched"].drop_duplicates("step")
    dur = np.array([_detail(d).get("dur_ns") or 0 for d in sched["detail"]], float) / 1e3
    counts = events[events["kind"] == "req_sched"].groupby("step").size()
    reqs = counts.reindex(sched["step"]).fillna(0).to_numpy(float)
    keep = dur > 0
    if keep.sum() < 3:
        return 150.0, 4.0
    if np.ptp(reqs[keep]) > 0:
        slope, fixed = np.polyfit(reqs[keep], dur[keep], 1)
    else:
        slope, fixed = 0.0, float(np.median(dur[keep]))
    return round(max(float(fixed), 1.0), 3), round(max(float(slope), 0.0), 3)


def plan_replay(trace: Any) -> ReplayPlan:
    """The dry run that re-drives `trace` (UsageError, one line, for a trace it cannot drive)."""
    df = load_events(trace)
    sides = _sides(df)
    names = names_of(trace)
    for side in sides.values():
        side.name = names.get(side.instance, side.instance)
    first = sides.get("prefill") or sides["single"]
    cfg = first.config
    notes: list[str] = []
    ev = first.events
    adds = ev[ev["kind"] == "req_add"].drop_duplicates("req")
    if adds.empty:
        raise UsageError("the trace holds no req_add on its first scheduler: no workload to replay")
    t0 = int(adds["ts_ns"].iloc[0])
    index_of = {str(r): i for i, r in enumerate(adds["req"].tolist())}
    decode = sides.get("decode")
    d_of: dict[str, str] = {}  # P's id -> D's id
    if decode is not None:
        d_adds = decode.events[decode.events["kind"] == "req_add"].drop_duplicates("req")
        for req, detail in zip(d_adds["req"].tolist(), d_adds["detail"].tolist()):
            peer = _detail(detail).get("remote_req") or req
            if peer in index_of:
                d_of[peer] = req
                index_of[req] = index_of[peer]
    finishes = {s: side.events[side.events["kind"] == "req_finish"].drop_duplicates("req", keep="last")
                .set_index("req") for s, side in sides.items()}
    requests: list[dict[str, Any]] = []
    perturbations: list[dict[str, Any]] = []
    owner_of_block: dict[int, int] = {}
    allocs = ev[ev["kind"] == "blocks_alloc"]
    first_alloc = allocs.drop_duplicates("req").set_index("req")
    for i, (req, prompt, ts) in enumerate(zip(adds["req"].tolist(), adds["n"].fillna(1).astype(int).tolist(),
                                              adds["ts_ns"].tolist())):
        out_side, out_req = (decode, d_of.get(req)) if decode is not None else (first, req)
        if out_req is not None and out_side is not None:
            out_prompt = int(out_side.events.loc[(out_side.events["kind"] == "req_add")
                                                 & (out_side.events["req"] == out_req), "n"].fillna(prompt).iloc[0])
            sampled = _sampled(out_side.events, out_req, out_prompt, int(cfg.get("block_size") or 16))
            fin = finishes[out_side.role]
            eos = bool(out_req in fin.index and fin.loc[out_req, "reason"] == "stop")
        else:  # a P request that never reached D (aborted, or D is not in the trace)
            sampled, eos = 1, False
        entry: dict[str, Any] = {"arrival_us": (int(ts) - t0) / 1e3, "prompt_len": max(1, prompt),
                                 "max_tokens": max(1, sampled), "eos": eos}
        if req in first_alloc.index:
            row = first_alloc.loc[req]
            hits = int(_detail(row["detail"]).get("hit") or 0)
            blocks = list(row["blocks"]) if row["blocks"] is not None else []
            sources = [owner_of_block.get(int(b)) for b in blocks[:hits]]
            if hits and sources and all(s is not None and s == sources[0] for s in sources):
                entry["prefix"] = [sources[0], hits * int(cfg.get("block_size") or 16)]
            for b in blocks:
                owner_of_block.setdefault(int(b), i)
        requests.append(entry)
    # the step each request was added before, per side: the first `sched` after its req_add
    for role, side in sides.items():
        sched = side.events[side.events["kind"] == "sched"]
        adds_side = side.events[side.events["kind"] == "req_add"].drop_duplicates("req")
        at = np.searchsorted(sched["ts_ns"].to_numpy(), adds_side["ts_ns"].to_numpy(), side="left")
        field_name = "decode_step" if role == "decode" else "first_step"
        for req, k in zip(adds_side["req"].tolist(), at.tolist()):
            if req in index_of and k < len(sched) and pd.notna(sched["step"].iloc[k]):
                requests[index_of[req]][field_name] = int(sched["step"].iloc[k])
    for role, side in sides.items():
        fin = finishes[role]
        side_adds = side.events[side.events["kind"] == "req_add"].drop_duplicates("req").set_index("req")["ts_ns"]
        for req, row in fin.iterrows():
            if row["reason"] == "abort" and req in side_adds.index and req in index_of:
                after = (int(row["ts_ns"]) - int(side_adds.loc[req])) / 1e3
                perturbations.append({"kind": "abort", "req": index_of[req], "side": "d" if role == "decode" else "p",
                                      "after_us": round(max(after, 0.0), 1)})
    proxy_us = 500.0
    if decode is not None:
        # each transfer's report in the step it was recorded in, counted from the step that started it: the
        # scheduler's decisions depend on the step a completion reaches it, not on the read's exact time
        d_ev, p_ev = decode.events, sides["prefill"].events
        waits = d_ev[d_ev["kind"] == "req_wait_kv"].drop_duplicates("req").set_index("req")["step"]
        dones = d_ev[d_ev["kind"] == "kv_recv_done"].drop_duplicates("req").set_index("req")["step"]
        for req in waits.index:  # a read the recording never saw end outlasts the replay too
            if req in index_of and pd.notna(waits.loc[req]):
                done = dones.get(req)
                steps = NEVER_STEPS if done is None or pd.isna(done) else max(int(done) - int(waits.loc[req]), 0)
                perturbations.append({"kind": "recv_at_step", "req": index_of[req], "steps": steps})
        p_sent = p_ev[p_ev["kind"] == "kv_send_done"].drop_duplicates("req").set_index("req")["step"]
        # a send is registered in the metadata of the first step scheduled after the finish (with a batch queue,
        # steps already in flight come before it): counted from that step
        p_sched = p_ev[p_ev["kind"] == "sched"]
        finish_rows = p_ev[(p_ev["kind"] == "req_finish") & (p_ev["delay_free"] == True)]  # noqa: E712
        finish_rows = finish_rows.drop_duplicates("req")
        registered = np.searchsorted(p_sched["ts_ns"].to_numpy(), finish_rows["ts_ns"].to_numpy(), side="right")
        for req, k in zip(finish_rows["req"].tolist(), registered.tolist()):
            if req not in index_of or k >= len(p_sched) or pd.isna(p_sched["step"].iloc[k]):
                continue
            sent = p_sent.get(req)
            registered_step = int(p_sched["step"].iloc[k])
            steps = NEVER_STEPS if sent is None or pd.isna(sent) else max(int(sent) - registered_step + 1, 1)
            perturbations.append({"kind": "send_at_step", "req": index_of[req], "steps": steps})
        p_fin = finishes["prefill"]["ts_ns"]
        d_add = decode.events[decode.events["kind"] == "req_add"].drop_duplicates("req").set_index("req")["ts_ns"]
        delays = [int(d_add.loc[d]) - int(p_fin.loc[p]) for p, d in d_of.items() if p in p_fin.index]
        if delays:  # the least: the others also hold the time D took to take an input between its steps
            proxy_us = max(float(np.min(delays)) / 1e3, 1.0)
    pp, tp = int(cfg.get("pp") or 1), int(cfg.get("tp") or 1)
    workers = df[(df["instance"] == first.instance) & (df["component"] == "worker")]
    fixed, per_token, fit_notes = _fit_compute(ev, workers, pp)
    notes += fit_notes
    sched_us, sched_per_req = _fit_schedule(ev)
    # the recording does not say whether prefix caching was on; vLLM's default is on, and without shared
    # prefixes in the replayed prompts (`prefix`, from the recorded hits) it finds nothing either way
    prefix_caching = True
    instances = "pd" if decode is not None else ("p" if "prefill" in sides else "single")
    config = DryRunConfig(
        pp=pp, tp=tp, instances=instances, num_blocks=int(cfg.get("num_blocks") or 2048),
        block_size=int(cfg.get("block_size") or 16), max_num_seqs=int(cfg.get("max_num_seqs") or 64),
        max_num_batched_tokens=int(cfg.get("max_num_batched_tokens") or 512),
        async_scheduling=bool(cfg.get("async_scheduling")) and pp == 1, enable_prefix_caching=prefix_caching,
        compute_us_fixed=fixed, compute_us_per_token=per_token, sched_cost_us=sched_us,
        sched_cost_us_per_req=sched_per_req,
        proxy_delay_us=proxy_us, given_requests=requests, perturbations=perturbations)
    if decode is not None and decode.config.get("num_blocks") not in (None, config.num_blocks):
        notes.append(f"D's pool ({decode.config.get('num_blocks')} blocks) differs from P's: the dry run gives both "
                     f"{config.num_blocks}")
    return ReplayPlan(config.validate(), sides, index_of, notes)
