"""`pdtrace replay` without vLLM: what the plan reads off a recording, the comparison of decisions, and the
command's refusals. (Replays on a real vLLM release: tests/vllm_tier/test_replay_vllm.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdtrace.cli import app
from pdtrace.errors import UsageError
from pdtrace.replay import Decision, compare_decisions, decisions, plan_replay
from pdtrace.replay.plan import NEVER_STEPS, load_events
from pdtrace.trace.reader import open_trace

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def test_the_plan_reads_the_pair_its_workload_and_its_transfers_off_the_recording():
    trace = open_trace(SAMPLES / "healthy_pd_pp1" / "trace")
    plan = plan_replay(trace)
    cfg = plan.config
    assert (cfg.instances, cfg.pp, cfg.tp, cfg.num_blocks, cfg.block_size) == ("pd", 1, 1, 2048, 16)
    assert cfg.requests == len(cfg.given_requests) == 24
    events = load_events(trace)
    adds = events[(events.kind == "req_add") & (events.instance == "prefill-0")]
    assert [r["prompt_len"] for r in cfg.given_requests] == adds["n"].astype(int).tolist()
    assert cfg.given_requests[0]["arrival_us"] == 0 and cfg.given_requests[1]["arrival_us"] > 0
    # each request's output length is what D sampled: r00000-d was scheduled 27 times, one token each
    assert cfg.given_requests[0]["max_tokens"] == 27
    kinds = {p["kind"] for p in cfg.perturbations}
    assert kinds == {"recv_at_step", "send_at_step"}
    assert plan.index_of["r00003-p"] == plan.index_of["r00003-d"] == 3
    assert all(r["decode_step"] >= 0 and r["first_step"] >= 0 for r in cfg.given_requests)


def test_a_transfer_the_recording_never_saw_end_never_ends_in_the_replay():
    plan = plan_replay(open_trace(SAMPLES / "slow_transfer" / "trace"))
    never = [p for p in plan.config.perturbations if p["steps"] == NEVER_STEPS]
    assert {p["kind"] for p in never} == {"recv_at_step", "send_at_step"}  # the slow read, and P's send of it


def test_a_recorded_abort_is_replayed_at_the_same_time_after_the_request_arrived():
    plan = plan_replay(open_trace(SAMPLES / "abort_while_waiting_kv" / "trace"))
    aborts = [p for p in plan.config.perturbations if p["kind"] == "abort"]
    assert len(aborts) == 1 and aborts[0]["side"] == "d" and aborts[0]["after_us"] > 0


def test_the_same_decisions_match_and_the_first_difference_is_named():
    events = load_events(open_trace(SAMPLES / "healthy_pd_pp1" / "trace"))
    plan = plan_replay(open_trace(SAMPLES / "healthy_pd_pp1" / "trace"))
    d = decisions(events[events.instance == "decode-0"], plan.index_of)
    assert len(d) > 100 and compare_decisions("decode", d, list(d)).share == 1.0
    changed = list(d)
    k = changed[40]
    req, tokens = k.scheduled[0]
    changed[40] = Decision(k.step, ((req, tokens + 1),) + k.scheduled[1:], k.preempted, k.freed)
    report = compare_decisions("decode", d, changed)
    assert report.matched == len(d) - 1 and report.first_divergence["decision"] == 40
    assert f"tokens differ for {req}: {tokens} vs {tokens + 1}" in report.first_divergence["what"]
    shorter = compare_decisions("decode", d, d[:-5])
    assert shorter.first_divergence["what"] == "the replay made fewer decisions" and shorter.share < 1


runner = CliRunner()


def test_replay_without_a_supported_vllm_is_one_line_and_exit_2(monkeypatch):
    import pdtrace.recording.vllm as hooks

    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: None)
    result = runner.invoke(app, ["replay", str(SAMPLES / "healthy_pd_pp1" / "trace")], standalone_mode=False)
    assert isinstance(result.exception, UsageError) and result.exception.exit_code == 2
    assert "pdtrace replay drives the vLLM releases" in str(result.exception)


def test_replay_refuses_a_non_empty_output_and_a_trace_without_a_scheduler(monkeypatch, tmp_path):
    import pdtrace.recording.vllm as hooks

    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.33.0")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    result = runner.invoke(app, ["replay", str(SAMPLES / "healthy_pd_pp1" / "trace"), "-o", str(tmp_path / "out")],
                           standalone_mode=False)
    assert isinstance(result.exception, UsageError) and "is not empty" in str(result.exception)
    trace = open_trace(SAMPLES / "healthy_pd_pp1" / "trace")
    import pyarrow.compute as pc

    workers_only = trace.table.filter(pc.equal(trace.table.column("component").cast("string"), "worker"))
    with pytest.raises(UsageError, match="no scheduler events"):
        plan_replay(type("T", (), {"table": workers_only})())


def test_the_plan_names_each_side_as_every_verb_does(tmp_path):
    """A real engine's sides carry vLLM's ids; the replay's report names them as analyze and show do, and keeps
    the id (text `prefill-0 = <id>`, JSON `instance` and `instance_name`)."""
    from renamed import ID_D, UUID, renamed

    from pdtrace.replay.run import ReplayResult
    from pdtrace.report.replay_report import replay_summary

    path = renamed(SAMPLES / "healthy_pd_pp1" / "trace", tmp_path / "t", {"prefill-0": UUID, "decode-0": ID_D})
    plan = plan_replay(open_trace(path))
    assert {(s.role, s.instance, s.name) for s in plan.sides.values()} == {
        ("prefill", UUID, "prefill-0"), ("decode", ID_D, "decode-0")}
    report = compare_decisions("prefill", [], [])
    summary = replay_summary(ReplayResult(plan, [report]))
    assert (summary["sides"][0]["instance"], summary["sides"][0]["instance_name"]) == (UUID, "prefill-0")
