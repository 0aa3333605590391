"""The dry run against a real vLLM release (each supported one: .ci/run --all-versions): what the simulated cluster makes vLLM's own engine do, as recorded by the
same hooks as a live run. Each test runs one small dry run (a child process, about 5 s on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

import harness as H  # noqa: E402

from pdtrace.dryrun import DryRunConfig, compat, run_dry_run  # noqa: E402
from pdtrace.errors import RecordingError, UsageError  # noqa: E402

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def events(trace: Path) -> pd.DataFrame:
    df = pd.read_parquet(trace)
    for col in ("instance", "kind", "component", "reason", "status", "role"):
        df[col] = df[col].astype(str)
    return df.sort_values(["instance", "seq"]).reset_index(drop=True)


def analyze_json(trace: Path) -> list[dict]:
    from pdtrace.analysis import analyze

    findings = analyze(str(trace))
    return findings[["rule", "subrule", "severity", "instance", "req"]].to_dict("records")


def test_pd_lifecycle_through_the_hooks(tmp_path: Path) -> None:
    """1P1D: every client request is prefilled on P (delay_free), read by D, decoded there; P frees after the read."""
    res = run_dry_run(DryRunConfig(requests=6, rate=300.0, output_len="4", seed=11), tmp_path / "t")
    assert res.error is None and res.instances == ["prefill-0", "decode-0"]
    df = events(tmp_path / "t")
    p, d = df[df.instance == "prefill-0"], df[df.instance == "decode-0"]
    p_fin = p[p.kind == "req_finish"]
    assert len(p_fin) == 6 and p_fin.delay_free.all() and set(p_fin.reason) == {"length"}
    # D learned P's blocks through the proxy: req_add names the remote instance and request.
    d_add = d[d.kind == "req_add"]
    details = [json.loads(x) for x in d_add.detail]
    assert {x["remote_instance"] for x in details} == {"prefill-0"}
    if compat.shared_request_ids():  # 0.10 to 0.12: NIXL names no remote request; D keeps P's id
        assert {x["remote_req"] for x in details} == {None} and sorted(d_add.req) == sorted(p_fin.req)
    else:
        assert sorted(x["remote_req"] for x in details) == sorted(p_fin.req)
    # Each D request waited for KV, got it, and finished after exactly 4 output tokens (1 from the promotion).
    assert set(d[d.kind == "req_wait_kv"].req) == set(d_add.req) == set(d[d.kind == "kv_recv_done"].req)
    assert len(d[(d.kind == "req_finish")]) == 6
    # P frees each request's blocks only after its send completed, and no earlier than D's read could end (the
    # read starts after D parked the request; it takes at least the setup time plus a block's latency).
    cfg = DryRunConfig()
    min_read_ns = int((cfg.transfer_setup_us + cfg.transfer_latency_us_per_block) * 1000)
    unsent = [req for req in p_fin.req if p[(p.req == req) & (p.kind == "kv_send_done")].empty]
    for req in p_fin.req:
        rows = p[p.req == req]
        d_req = H.dry_req(req.removesuffix("-p"), "d")
        if req in unsent:
            continue
        send = rows[rows.kind == "kv_send_done"].seq.min()
        assert rows[rows.kind == "req_finish"].seq.min() < send <= rows[rows.kind == "blocks_free"].seq.min()
        wait_ts = d[(d.req == d_req) & (d.kind == "req_wait_kv")].ts_ns.min()
        assert rows[rows.kind == "kv_send_rank"].ts_ns.min() >= wait_ts + min_read_ns
    assert_unsent_only_after_p_slept(p, d, unsent)
    # One writer per instance: seq strictly increasing and ts never going back in seq order.
    for _, g in df.groupby("instance"):
        assert g.seq.is_unique and g.ts_ns.is_monotonic_increasing
    assert [f for f in analyze_json(tmp_path / "t") if f["severity"] != "info"] == []


def assert_unsent_only_after_p_slept(p: pd.DataFrame, d: pd.DataFrame, unsent: list[str]) -> None:
    """P requests without a send completion (`unsent`): none where the release keeps an engine stepping for pending
    sends (0.28+); on 0.10 / 0.11 P's engine sleeps once only such requests are left, so only requests whose read
    on D ended after P's last step may still hold their blocks (the next request would wake P)."""
    if H.behaviour().steps_for_pending_sends:
        assert unsent == []
        return
    last_p_step = p[p.kind == "exec_end"].ts_ns.max()
    for req in unsent:  # a D rank reports its read at the end of a forward, after the read ended
        d_rows = d[(d.req == H.dry_req(req.removesuffix("-p"), "d")) & (d.kind == "kv_recv_rank")]
        assert d_rows.ts_ns.min() > last_p_step, req
    assert 0 < len(unsent) < p[p.kind == "req_finish"].req.nunique()  # P slept at the end, after the others
    assert p[p.req.isin(unsent) & (p.kind == "blocks_free")].empty


def test_same_seed_same_trace(tmp_path: Path) -> None:
    cfg = dict(requests=8, pp=2, rate=500.0, seed=5)
    frames = []
    for i in range(2):
        run_dry_run(DryRunConfig(**cfg), tmp_path / f"t{i}")
        frames.append(events(tmp_path / f"t{i}").drop(columns=["pid"]).astype(str))
    assert frames[0].equals(frames[1])
    run_dry_run(DryRunConfig(**{**cfg, "seed": 6}), tmp_path / "other")
    assert not events(tmp_path / "other").drop(columns=["pid"]).astype(str).equals(frames[0])


def test_a_dry_run_forked_from_the_tier_server_equals_a_fresh_process(tmp_path: Path, monkeypatch) -> None:
    """The tier forks its dry runs from a server that imported vLLM once (pdtrace/dryrun/zygote.py); a user's run
    is a fresh process. Same config and seed: the same events, so what the tier checks is what users get."""
    from pdtrace.dryrun import zygote as dryrun_zygote

    import pdtrace.dryrun

    cfg = DryRunConfig(requests=12, pp=2, rate=400.0, seed=11)
    assert pdtrace.dryrun._spawn_child is dryrun_zygote.spawn
    run_dry_run(cfg, tmp_path / "forked")
    monkeypatch.setattr(pdtrace.dryrun, "_spawn_child", dryrun_zygote.FRESH)
    run_dry_run(cfg, tmp_path / "fresh")
    forked, fresh = (events(tmp_path / d).drop(columns=["pid"]).astype(str) for d in ("forked", "fresh"))
    assert len(fresh) > 200 and forked.equals(fresh)


def test_pipeline_order_partial_prefill_and_persistent_batch(tmp_path: Path) -> None:
    """PP=2, one engine: stages run in pipeline order; a prompt longer than the token budget samples nothing for its
    first chunk; the V1 persistent batch drops requests that a step does not schedule."""
    res = run_dry_run(DryRunConfig(instances="single", pp=2, requests=6, rate=0.0, prompt_len="600",
                                   output_len="3", max_num_batched_tokens=512, seed=3), tmp_path / "t")
    assert res.error is None
    df = events(tmp_path / "t")
    ex = df[df.kind.isin(["exec_begin", "exec_end"])].copy()
    ex["rpc"] = ex.detail.map(lambda s: json.loads(s)["rpc"] if isinstance(s, str) else None)
    ends = ex[(ex.kind == "exec_end") & (ex.rpc == "execute_model") & (ex.n > 0)]
    begins = ex[(ex.kind == "exec_begin")].groupby(["step", "pp_rank"]).ts_ns.min()
    for step, g in ends.groupby("step"):
        stage0_end = g[g.pp_rank == 0].ts_ns.iloc[0]
        assert begins[(step, 1)] >= stage0_end  # stage 1 waits for stage 0's activations
    # 600-token prompts with a 512-token budget: k >= 2 prefill chunks each (only the last one samples a token),
    # then 2 decode steps for 3 output tokens. Sampling on a partial chunk would finish requests early.
    rs = df[df.kind == "req_sched"].sort_values("step")
    assert rs.req.nunique() == 6
    for _, g in rs.groupby("req"):
        covered = g.n.cumsum()
        chunks = int((covered.shift(fill_value=0) < 600).sum())  # rows that still had prompt to cover
        assert chunks >= 2 and covered.iloc[chunks - 1] == 600
        assert len(g) == chunks + 2 and (g.n.iloc[chunks:] == 1).all()
    fin = df[df.kind == "req_finish"]
    assert len(fin) == 6
    # At PP=2 consecutive steps hold disjoint requests: every rank drops the previous step's requests as unscheduled.
    removed = df[(df.kind == "batch_remove")]
    assert (removed.reason == "unscheduled").sum() >= 6 * 2
    # Every rank's batch: a request is added before it is removed, and removed no more often than added.
    for (_, _), g in df[df.kind.isin(["batch_add", "batch_remove"])].groupby(["pp_rank", "tp_rank"]):
        for _, r in g.groupby("req"):
            kinds = list(r.kind)
            assert kinds[0] == "batch_add" and kinds.count("batch_remove") <= kinds.count("batch_add")


def test_vllm_assert_is_recorded_and_the_trace_kept(tmp_path: Path) -> None:
    res = run_dry_run(DryRunConfig(requests=4, faults=["completion_before_finish"], seed=1), tmp_path / "t")
    assert res.error is not None and "AssertionError at scheduler.py:" in res.error
    # vLLM's own assert in _free_blocks (0.33.0 scheduler.py:3065; the line moves between releases).
    where = res.error.rsplit(" at ", 1)[1]
    assert "assert request.is_finished()" in H.vllm_source_line("v1/core/sched/scheduler.py", where)
    df = events(tmp_path / "t")
    p = df[(df.instance == "prefill-0") & (df.component != "worker")]
    assert p.kind.iloc[-1] == "engine_error"
    target = H.dry_req("r00001", "p")  # the fault's target: workload request 1
    sent = p[(p.kind == "kv_send_done") & (p.req == target)]
    assert list(sent.status) == ["RUNNING"]  # the completion reached vLLM while the request was still running
    assert p[(p.kind == "req_finish") & (p.req == target)].empty
    rules = {(f["rule"], f["req"]) for f in analyze_json(tmp_path / "t") if f["severity"] == "error"}
    assert ("completion_before_finish", target) in rules


def test_missing_rank_completion_leaks(tmp_path: Path) -> None:
    res = run_dry_run(DryRunConfig(requests=6, tp=2, rate=300.0, faults=["missing_rank_completion"],
                                   fault_request=2, end_hold_s=500.0, seed=2), tmp_path / "t")
    assert res.error is None
    df = events(tmp_path / "t")
    p = df[df.instance == "prefill-0"]
    target = H.dry_req("r00002", "p")
    assert sorted(p[(p.kind == "kv_send_rank") & (p.req == target)].tp_rank) == [0.0]  # rank 1 never reports
    assert p[(p.kind == "kv_send_done") & (p.req == target)].empty
    sent = set(p[p.kind == "kv_send_done"].req)
    unsent = [r for r in p[p.kind == "req_finish"].req if r != target and r not in sent]
    assert_unsent_only_after_p_slept(p, df[df.instance == "decode-0"], unsent)  # every other one completed normally
    leaks = [f for f in analyze_json(tmp_path / "t") if f["rule"] == "leaked_blocks"]
    if H.behaviour().steps_for_pending_sends:  # P kept stepping through the 500 s hold: past the grace period
        assert [(f["instance"], f["req"], f["severity"]) for f in leaks] == [("prefill-0", target, "error")]
    else:  # P slept: the trace ends within the grace period, the target and the last reads still held
        assert sorted((f["instance"], f["req"], f["subrule"]) for f in leaks) == sorted(
            ("prefill-0", r, "still_held") for r in [target, *unsent])


def test_regenerated_sample_matches_its_expected_findings(tmp_path: Path) -> None:
    """The vLLM tier regenerates one shipped sample from its manifest and checks analyze still agrees."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("test_samples", REPO / "tests" / "test_samples.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    sample = REPO / "sample_traces" / "lost_send_completion"
    manifest = json.loads((sample / "trace" / "_manifest.json").read_text())
    expected = json.loads((sample / "expected.json").read_text())
    run_dry_run(DryRunConfig(**manifest["dry_run"]), tmp_path / "t")
    from pdtrace.analysis import analyze

    own_id = H.sample_req
    findings = analyze(str(tmp_path / "t")).to_dict("records")
    summary = mod.summarize_findings(findings)
    if H.behaviour().steps_for_pending_sends:
        assert summary == [{**f, "reqs": [own_id(r) for r in f["reqs"]]} for f in expected["findings"]]
    else:
        # 0.10 / 0.11: P sleeps once only requests awaiting their send are left (no 500 s of P steps to pass the
        # grace period): the lost send and the reads that ended after P's last step are still held, nothing else.
        df = events(tmp_path / "t")
        p, d = df[df.instance == "prefill-0"], df[df.instance == "decode-0"]
        target = own_id(expected["findings"][0]["reqs"][0])
        sent = set(p[p.kind == "kv_send_done"].req)
        unsent = [r for r in p[p.kind == "req_finish"].req if r != target and r not in sent]
        assert_unsent_only_after_p_slept(p, d, unsent)
        assert summary == [{"rule": "leaked_blocks", "subrule": "still_held", "severity": "info",
                            "instance": "prefill-0", "count": 1 + len(unsent), "reqs": sorted([target, *unsent])}]
    # The same workload went through: the same requests finished on both instances as in the shipped trace.
    def finishes(trace: Path, ids=lambda r: r) -> list[tuple[str, str]]:
        df = events(trace)
        return sorted(zip(df[df.kind == "req_finish"].instance, df[df.kind == "req_finish"].req.map(ids)))

    assert finishes(tmp_path / "t") == finishes(sample / "trace", own_id)


def test_config_refusals() -> None:
    with pytest.raises(UsageError, match="pipeline parallelism"):
        DryRunConfig(pp=2, async_scheduling=True).validate()
    with pytest.raises(UsageError, match="decode instance"):
        DryRunConfig(instances="p", faults=["slow_transfer"]).validate()
    with pytest.raises(UsageError, match="unknown fault"):
        DryRunConfig(faults=["nope"]).validate()
    with pytest.raises(UsageError, match="length distribution"):
        DryRunConfig(prompt_len="gauss:3").validate()


def test_existing_trace_is_not_overwritten(tmp_path: Path) -> None:
    run_dry_run(DryRunConfig(requests=1, instances="single", output_len="2"), tmp_path / "t")
    with pytest.raises(RecordingError, match="already holds a trace"):
        run_dry_run(DryRunConfig(requests=1), tmp_path / "t")


def test_abort_while_waiting_kv_frees_only_after_the_read(tmp_path: Path) -> None:
    """vLLM 0.28+ keep an aborted WAITING_FOR_REMOTE_KVS request's blocks until finished_recving (0.33
    scheduler.py:3015-3024); 0.10 / 0.11 free them at once, while the read may still write them: pdtrace reports it."""
    res = run_dry_run(DryRunConfig(requests=4, rate=200.0, faults=["abort_while_waiting_kv"], fault_request=1,
                                   seed=4), tmp_path / "t")
    d_target = H.dry_req("r00001", "d")
    assert res.error is None and any(f"abort {d_target} " in x for x in res.injected)
    df = events(tmp_path / "t")
    d = df[(df.instance == "decode-0") & (df.req == d_target)]
    fin = d[d.kind == "req_finish"]
    if H.behaviour().abort_while_receiving == "immediate":
        assert list(fin.status) == ["FINISHED_ABORTED"] and not fin.delay_free.any()
        free = d[d.kind == "blocks_free"]
        assert list(free.reason) == ["aborted"] and fin.seq.iloc[0] < free.seq.iloc[0]
        found = {(f["rule"], f["req"]) for f in analyze_json(tmp_path / "t") if f["severity"] == "error"}
        assert ("premature_free", d_target) in found
        return
    assert list(fin.reason) == ["abort"] and list(fin.status) == ["FINISHED_ABORTED"] and fin.delay_free.all()
    assert fin.step.isna().all()  # aborts arrive between steps
    recv = d[d.kind == "kv_recv_done"]
    free = d[d.kind == "blocks_free"]
    assert list(recv.status) == ["FINISHED_ABORTED"] and list(free.reason) == ["received"]
    assert fin.seq.iloc[0] < recv.seq.iloc[0] <= free.seq.iloc[0]
    assert d[d.kind == "req_sched"].empty  # never ran on D
    # P still gets its send completion (the read did happen) where its engine steps for pending sends (0.22+);
    # before, an engine left with only this pending send sleeps: then the read ended after P's last step.
    p_all = df[df.instance == "prefill-0"]
    p = p_all[p_all.req == H.dry_req("r00001", "p")]
    sent = not p[p.kind == "kv_send_done"].empty
    if H.behaviour().steps_for_pending_sends:
        assert sent
    elif not sent:
        assert d[d.kind == "kv_recv_rank"].ts_ns.min() > p_all[p_all.kind == "exec_end"].ts_ns.max()
        assert p[p.kind == "blocks_free"].empty


def test_starve_blocks_the_head_of_the_line(tmp_path: Path) -> None:
    res = run_dry_run(DryRunConfig(requests=9, rate=300.0, num_blocks=48, max_num_batched_tokens=1024,
                                   prompt_len="uniform:32:96", output_len="4", faults=["starve"], seed=9),
                      tmp_path / "t")
    assert res.error is None
    df = events(tmp_path / "t")
    p = df[df.instance == "prefill-0"]
    added = set(p[p.kind == "req_add"].req)
    scheduled = set(p[p.kind == "req_sched"].req)
    target = H.dry_req("r00003", "p")  # requests // 3
    prompt = int(p[(p.kind == "req_add") & (p.req == target)].n.iloc[0])
    assert prompt == (48 - 1) * 16 - 1  # the whole usable pool
    assert target in added and target not in scheduled
    assert {H.dry_req(f"r{i:05d}", "p") for i in range(3)} <= scheduled  # ahead of it: served
    assert not ({H.dry_req(f"r{i:05d}", "p") for i in range(4, 9)} & scheduled)  # behind it: stuck (FCFS)
    assert p[(p.kind == "kv_send_done") & (p.req == H.dry_req("r00000", "p"))].empty  # the pinned blocks


def test_prefill_only_with_a_phantom_decoder(tmp_path: Path) -> None:
    """--instances p: one recorded instance; every delayed free completes when the unrecorded decoder has read."""
    res = run_dry_run(DryRunConfig(instances="p", requests=5, rate=0.0, seed=12), tmp_path / "t")
    assert res.error is None and res.instances == ["prefill-0"]
    df = events(tmp_path / "t")
    assert set(df.instance) == {"prefill-0"} and set(df.role) == {"prefill"}
    fin = df[df.kind == "req_finish"]
    assert len(fin) == 5 and fin.delay_free.all()
    sent = df[df.kind == "kv_send_done"]
    assert set(sent.status) == {"FINISHED_LENGTH_CAPPED"} and set(sent.req) <= set(fin.req)
    unsent = sorted(set(fin.req) - set(sent.req))
    if H.behaviour().steps_for_pending_sends:
        assert unsent == []
    else:  # 0.10 / 0.11: P sleeps once only requests awaiting their send are left
        cfg = DryRunConfig()
        last_p_step = df[df.kind == "exec_end"].ts_ns.max()
        earliest_read_end = (cfg.proxy_delay_us + cfg.transfer_setup_us) * 1000
        assert 0 < len(unsent) < len(fin)
        assert (fin[fin.req.isin(unsent)].ts_ns + earliest_read_end > last_p_step).all()
        assert df[df.req.isin(unsent) & (df.kind == "blocks_free")].empty
    for req in sent.req:  # the blocks go back only after the send completed
        rows = df[df.req == req]
        assert rows[rows.kind == "kv_send_done"].seq.iloc[0] < rows[rows.kind == "blocks_free"].seq.iloc[0]
