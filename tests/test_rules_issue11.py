"""Findings on traces pdtrace did not make (issue 11): request-id reuse, one definition of expected ranks, the
completion after the final free, blocks still held at the end, and the false alarms vLLM 0.33's own unit tests
showed (a failed load waiting for its receive, an abort of a deferred load that never started)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import scenarios
from scenarios import Engine, builder
from pdtrace.analysis import analyze, summarize_findings
from pdtrace.analysis.columns import columns
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.requests import request_table
from pdtrace.analysis.rulekit import engine_configs, expected_ranks
from pdtrace.analysis.steps import engine_configs as engine_config_table
from pdtrace.analysis.story import request_story
from pdtrace.trace.builder import write_table
from pdtrace.trace.model import Trace


def kinds(df, severity: str | None = None) -> set[tuple[str, str]]:
    if severity:
        df = df[df["severity"] == severity]
    return set(zip(df["rule"], df["subrule"]))


# -- request id reuse: a lifetime ends at the final free, a later req_add starts a new request ---------------------
def test_a_reused_id_is_two_requests():
    ctx = AnalysisContext(scenarios.id_reuse())
    rt = request_table(ctx)
    r1 = rt[rt["req"] == "r1"].sort_values("lifetime")
    assert list(r1["lifetime"]) == [0, 1]
    first, second = r1.iloc[0], r1.iloc[1]
    assert first["finish_ts"] < second["add_ts"]          # the first lifetime ended before the second began
    assert pd_na(second["finish_ts"])                      # the new r1 still runs at the end
    assert second["n_sched_steps"] == 3 and first["n_sched_steps"] == 2
    cols = columns(ctx)
    assert cols.n_requests == 4 and list(cols.rk_names["lifetime"]) == [0, 1, 0, 1]


def pd_na(value) -> bool:
    import pandas as pd

    return value is pd.NA or (isinstance(value, float) and np.isnan(value))


def test_id_reuse_is_healthy_and_the_real_leak_is_the_second_lifetimes():
    assert len(analyze(scenarios.id_reuse())) == 0          # main reported r1's new block as the old r1's leak
    df = analyze(scenarios.id_reuse_leak())
    assert kinds(df, "error") == {("leaked_blocks", "definitely")}
    assert df.iloc[0]["blocks"] == [3]                      # the second lifetime's block, not the freed [1, 2]


def test_a_repeated_req_add_without_a_finish_is_the_same_request():
    b = builder()
    e = Engine(b, instance="E", role="both")
    e.add("r1", n=32)
    e.add("r1", n=32)                                        # a duplicate add while it lives: no new lifetime
    e.step({"r1": 32}, alloc={"r1": [1, 2]})                # 32 tokens: two blocks of 16
    e.output()
    e.finish("r1", reason="stop")
    ctx = AnalysisContext(b.trace())
    assert columns(ctx).n_requests == 1
    # the one finding: the lifecycle model's duplicate add (vLLM keys requests by id: the second add replaces the
    # first in Scheduler.requests while the first stays queued), not a second lifetime's leak or never-scheduled
    found = analyze(b.trace())
    assert [(r.rule, r.subrule, r.severity, r.req) for r in found.itertuples()] == [
        ("lifecycle", "add_while_live", "warning", "r1")]


def test_show_labels_both_lifetimes(cli, tmp_path):
    path = write_table(scenarios.id_reuse().table, tmp_path / "reuse")
    result = cli("show", path, "--req", "r1")
    assert result.exit_code == 0, result.stderr
    assert "the id was reused: 2 lifetimes" in result.stdout
    lines = result.stdout.splitlines()
    first = lines.index("  -- E:r1 lifetime 1 of 2")
    second = lines.index("  -- E:r1 lifetime 2 of 2")
    assert first < second and "req_add" in lines[first + 1] and "req_add" in lines[second + 1]
    doc = json.loads(cli("show", path, "--req", "r1", "--format", "json").stdout)
    assert sorted({e["lifetime"] for e in doc["events"]}) == [1, 2]
    story = request_story(scenarios.healthy_pd(), "r1")
    assert "lifetime" not in story.columns                 # one lifetime: the story is as before


def test_plots_draw_a_reused_id(tmp_path):
    from pdtrace.plot import render

    for kind in ("requests", "blocks"):
        out = tmp_path / f"{kind}.png"
        render(AnalysisContext(scenarios.id_reuse()), kind, out)
        assert out.exists() and out.stat().st_size > 0


# -- one definition of expected ranks -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["quorum_tp2", "quorum_tp2_no_config", "quorum_tp2_declared"])
def test_quorum_is_found_with_or_without_engine_config(name):
    df = analyze(scenarios.FAULTY[name]())
    assert kinds(df, "error") == {("premature_free", "quorum")}
    f = df.iloc[0]
    assert f["req"] == "r2" and f["extra"]["ranks_reported"] == 1 and f["extra"]["ranks_expected"] == 2
    if name == "quorum_tp2_no_config":
        assert f["extra"]["ranks_source"] == "the ranks that reported for other requests"
        assert "2 expected from the ranks that reported for other requests" in f["message"]


def test_expected_ranks_fallback_chain():
    ctx = AnalysisContext(scenarios.quorum_tp2(config=False))
    assert expected_ranks(ctx, 0, "send", [4]) == (4, "expected_ranks of its completion")
    assert expected_ranks(ctx, 0, "send", []) == (2, "the ranks that reported for other requests")
    assert expected_ranks(ctx, 0, "recv", []) == (None, "")
    ctx = AnalysisContext(scenarios.quorum_tp2())
    assert expected_ranks(ctx, 0, "send", []) == (2, "engine_config tp*pp")
    ctx = AnalysisContext(scenarios.quorum_tp2(config=False, declared=True))
    assert expected_ranks(ctx, 0, "send", []) == (2, "expected_ranks of the instance's completions")


def test_engine_config_is_read_once_for_rules_and_tables():
    ctx = AnalysisContext(scenarios.pp4_pipeline())
    table = engine_config_table(ctx)
    configs = engine_configs(ctx)
    assert len(table) == len(configs) == 1
    row = table.iloc[0]
    assert row["pp"] == configs[0]["pp"] == 4 and row["n_blocks"] == configs[0]["num_blocks"] == 64


# -- a completion after the final free is a double free ------------------------------------------------------------
def test_completion_after_the_final_free_is_double_free_whatever_the_reason():
    df = analyze(scenarios.FAULTY["abort_received_then_second_completion"]())
    assert kinds(df, "error") == {("double_free", "completion_after_free")}
    assert "final free (reason received)" in " ".join(e.get("note", "") for e in df.iloc[0]["evidence"])
    for reason in ("finished", "aborted"):
        b = builder()
        e = Engine(b, instance="E", role="both")
        e.add("r1", n=32)
        e.step({"r1": 32}, alloc={"r1": [1, 2]})
        e.output()
        e.finish("r1", reason="stop" if reason == "finished" else "abort")
        e.step({})
        e.output()
        e.ev("kv_send_done", step=e._current_step(), req="r1", status=None)
        got = analyze(b.trace())
        assert ("double_free", "completion_after_free") in kinds(got, "error"), reason
        assert not any(r == "use_after_free" for r, _ in kinds(got))


# -- still held at the end of the trace (valgrind's "still reachable") ---------------------------------------------
def test_blocks_still_held_within_grace_are_listed_in_the_leak_summary():
    df = analyze(scenarios.FAULTY["send_still_held"]())
    assert list(zip(df["rule"], df["subrule"], df["severity"])) == [("leaked_blocks", "still_held", "info")]
    f = df.iloc[0]
    assert f["extra"]["awaiting"] == "kv_send_done" and f["extra"]["request_state"] == "finished"
    assert 59 < f["extra"]["held_s"] < 61 and f["blocks"] == [7, 8]
    (entry,) = summarize_findings(df)["leaks"]
    assert entry["still_held"] == 2 and entry["still_held_requests"] == 1
    assert entry["blocks"] == 0 and entry["requests"] == 0  # not counted as lost
    lost = summarize_findings(analyze(scenarios.FAULTY["send_lost"]()))["leaks"]
    assert lost[0]["indirectly"] == 2 and "still_held" not in lost[0]


def test_an_aborted_receive_still_held_is_info():
    b, _ = scenarios.abort_while_waiting_kv(receive=False)
    df = analyze(b.trace(), rules=["leaked_blocks"])
    f = df.iloc[0]
    assert (f["subrule"], f["severity"]) == ("still_held", "info")
    assert f["extra"]["awaiting"] == "kv_recv_done" and f["extra"]["request_state"] == "aborted"


def test_still_held_is_in_the_terminal_leak_summary(cli, tmp_path):
    path = write_table(scenarios.FAULTY["send_still_held"]().table, tmp_path / "held")
    result = cli("analyze", path)
    assert result.exit_code == 0
    assert "LEAK SUMMARY" in result.stdout and "still held" in result.stdout and "2 (1 req)" in result.stdout


# -- vLLM 0.33's own tests: the false alarms and their true-positive neighbours ---------------------------------------
def test_failed_load_that_waits_for_its_receive_is_clean():
    assert len(analyze(scenarios.failed_load_waits_for_receive())) == 0


def test_failed_load_freed_before_its_receive_is_recv_open():
    df = analyze(scenarios.FAULTY["failed_load_freed_before_receive"]())
    assert ("premature_free", "recv_open") in kinds(df, "error")
    assert ("premature_free", "send_open") not in kinds(df)


def test_a_failure_without_a_later_completion_closes_the_receive():
    b = builder()
    d = Engine(b, instance="D", role="decode")
    d.add("r1", n=32, remote_prefill=True)
    d.step({}, wait_kv={"r1": [11, 12]})
    d.output()
    d.ev("kv_recv_fail", step=0, req="r1")
    d.finish("r1", reason="error", status="WAITING_FOR_REMOTE_KVS")   # freed at once: nothing follows
    d.step({})
    d.output()
    assert len(analyze(b.trace())) == 0


def test_abort_of_a_deferred_load_that_never_started_is_clean():
    assert len(analyze(scenarios.abort_deferred_load()).query("severity != 'info'")) == 0


def test_abort_after_the_deferred_load_started_is_recv_open():
    df = analyze(scenarios.FAULTY["abort_started_load"]())
    assert ("premature_free", "recv_open") in kinds(df, "error")


def unit_test_abort_of_deferred_load(load_started: bool) -> Trace:
    """The events vLLM 0.33's test_deferred_block_free::test_abort_deferred_async_load_frees_after_inflight_step
    records, written by hand (the scheduler driven without an engine loop: no step_submit rows): request 0 runs
    steps 0-2 (defer_block_free), `imp`'s remote load is allocated in step 2 while steps 0 and 1 are in flight,
    the client aborts it (delay_free false: its deferred load never started), the free is deferred, and step 2's
    update drains it. `load_started`: step 0's output (non-empty) comes before the abort, so the load started."""
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="e", role="both", start_ns=scenarios.START_NS)
    b.add("engine_config", n=10000, detail={"pp": 1, "tp": 1, "defer_block_free": True, "block_size": 16})
    b.add("req_add", req="0", n=33, detail={"remote_prefill": False, "remote_decode": False})
    b.add("blocks_alloc", step=0, req="0", blocks=[1, 2, 3])
    for k, n in ((0, 33), (1, 1)):
        b.add("sched", step=k, n=n, detail={"running": 1, "waiting": 0, "free_blocks": 9996})
        b.add("req_sched", step=k, req="0", n=n)
    b.add("req_add", req="imp", n=33, detail={"remote_prefill": False, "remote_decode": False})
    b.add("blocks_alloc", step=2, req="imp", blocks=[4, 5], detail={"hit": 0, "external": 2})
    b.add("req_wait_kv", step=2, req="imp", blocks=[4, 5], n=32)
    b.add("sched", step=2, n=1, detail={"running": 1, "waiting": 1, "waiting_kv": 1, "free_blocks": 9994})
    b.add("req_sched", step=2, req="0", n=1)
    if load_started:
        b.add("step_output", component="engine", step=0)
    b.add("req_finish", req="imp", reason="abort", status="FINISHED_ABORTED", delay_free=False)
    b.add("blocks_free", req="imp", blocks=[4, 5], reason="aborted", deferred=True, detail={"fence": 3})
    for k in ((1, 2) if load_started else (0, 1, 2)):
        b.add("step_output", component="engine", step=k)
    b.add("blocks_pool_free", step=2, blocks=[4, 5], detail={"fence": 3})
    return b.trace()


def test_vllm_unit_test_abort_of_a_deferred_load_is_clean():
    assert len(analyze(unit_test_abort_of_deferred_load(load_started=False))) == 0
    df = analyze(unit_test_abort_of_deferred_load(load_started=True))
    assert ("premature_free", "recv_open") in kinds(df, "error")


def test_a_second_receive_after_preemption_is_its_own_window():
    # each req_wait_kv opens a receive window: the second kv_recv_done completes the second wait
    trace = scenarios.receive_again_after_preemption()
    assert len(analyze(trace)) == 0
    from stripped import strip

    assert len(analyze(Trace.from_table(strip(trace.table, ["status"])))) == 0
    df = analyze(scenarios.FAULTY["freed_during_second_receive"]())
    assert ("premature_free", "recv_open") in kinds(df, "error")
    f = df[df["subrule"] == "recv_open"].iloc[0]
    wait = [e for e in f["evidence"] if e.get("note") == "waiting for remote KV since"][0]
    assert wait["kind"] == "req_wait_kv" and wait["step"] == 3   # the second wait, not the first
