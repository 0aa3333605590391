"""preemption_race: each subrule on the tracker incident it follows (tests/scenarios_preemption.py), its variants,
and silence on the negative controls, the healthy scenarios, random healthy runs and every shipped sample."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdtrace.analysis import analyze
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.registry import load_rules
from pdtrace.analysis.rules.preemption_race import RULE, preempt_handovers, run
from scenarios import Engine, builder, random_healthy
from scenarios_preemption import (CONTROLS, EXPECTED, LIVELOCKS, RACES, _finish_all, _pressure, hand_over,
                                  late_report, quiet_scenarios, rank_report, store_engine, store_outlives_preemption,
                                  without)

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def findings(trace):
    return run(AnalysisContext(trace))


def test_rule_object_is_registered():
    assert RULE.id == "preemption_race"
    assert set(RULE.subrules) == {"late_rank_report", "async_store", "async_load", "step_in_flight",
                                  "finished_while_preempted"}
    assert load_rules()["preemption_race"] is RULE


@pytest.mark.parametrize("name", sorted(RACES))
def test_each_incident_gives_its_subrule(name):
    rule, subrule, severity = EXPECTED[name]
    f = findings(RACES[name]())
    assert list(zip(f["rule"], f["subrule"], f["severity"])) == [(rule, subrule, severity)]
    row = f.iloc[0]
    assert row["req"] == "b" and row["blocks"] == [3, 4] and row["instance"] == "E"
    assert row["extra"]["new_owner"] == "c"
    kinds = [e["kind"] for e in row["evidence"]]
    assert kinds[:3] == ["req_preempt", "blocks_free", "req_sched"]
    assert "blocks_alloc" in kinds
    if subrule != "step_in_flight":
        assert kinds[-1] == "kv_send_rank"
    else:
        assert kinds[-1] == "step_output"


def test_the_straggler_rank_is_named_with_the_rank_that_reported_first():
    row = findings(RACES["straggler_rank_after_preemption"]()).iloc[0]
    ranks = [(e["kind"], e.get("tp_rank")) for e in row["evidence"] if e["kind"] == "kv_send_rank"]
    assert ranks == [("kv_send_rank", 0), ("kv_send_rank", 1)]


@pytest.mark.parametrize("name", sorted(quiet_scenarios()))
def test_controls_and_healthy_runs_give_nothing(name):
    assert len(findings(quiet_scenarios()[name]())) == 0


@pytest.mark.parametrize("name", ["store_done_before_preemption", "store_done_before_reuse", "fenced_preemption",
                                  "in_flight_plain_compute"])
def test_race_controls_do_hand_preempted_blocks_over(name):
    """The controls are not silent for want of a hand-over: each gives b's blocks to c."""
    h = preempt_handovers(AnalysisContext(CONTROLS[name]()))
    assert len(h) == 2 and (h.write_row >= 0).all()


def test_a_completion_in_the_step_of_the_first_write_is_a_warning():
    f = findings(store_outlives_preemption(report_step=2))
    assert list(zip(f["subrule"], f["severity"])) == [("async_store", "warning")]
    assert f.iloc[0]["extra"]["same_step"] is True
    assert "may have flushed" in f.iloc[0]["message"]


def test_prefix_hits_are_reads_not_a_change_of_writer():
    assert len(findings(store_outlives_preemption(hits=2))) == 0
    # one of the two blocks a hit: only the other is reported
    assert [list(b) for b in findings(store_outlives_preemption(hits=1))["blocks"]] == [[4]]


def test_a_completion_after_the_victim_resumed_belongs_to_its_new_blocks():
    b = builder()
    e = store_engine(b, "MooncakeStoreConnector")
    _pressure(e)
    e.output()
    hand_over(e)
    e.output()
    e.step({"b": 34}, alloc={"b": [6, 7, 8]})
    rank_report(e, "kv_send_rank", "b", step=3)
    e.output()
    assert len(findings(b.trace())) == 0


def test_a_load_completing_into_reused_blocks_is_async_load():
    f = findings(late_report("OffloadingConnector", kind="kv_recv_rank"))
    assert list(zip(f["subrule"], f["severity"])) == [("async_load", "error")]


def test_the_same_rank_reporting_twice_is_not_a_straggler():
    assert list(findings(late_report("OffloadingConnector", early_rank=0, late_rank=0))["subrule"]) == ["async_store"]


def in_flight(store_row: bool):
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=16)
    _pressure(e)
    if store_row:  # a store completion of a running request: this connector saves KV in the background
        rank_report(e, "kv_send_rank", "a", step=1)
    hand_over(e)
    e.output()
    _finish_all(e)
    return b.trace()


def test_a_storing_connector_is_also_recognised_from_the_trace():
    assert len(findings(in_flight(False))) == 0
    f = findings(in_flight(True))
    assert list(zip(f["subrule"], f["severity"])) == [("step_in_flight", "warning")]


def test_a_hand_over_to_an_asynchronous_load_is_left_to_premature_free():
    b = builder()
    e = store_engine(b, "LMCacheConnectorV1", async_scheduling=True)
    _pressure(e)
    e.add("c", n=32)
    e.step({"a": 1}, alloc={"a": [5]}, wait_kv={"c": [3, 4]}, preempt={"b": [3, 4]})
    e.output()
    _finish_all(e)
    trace = b.trace()
    assert len(findings(trace)) == 0
    assert "async_load_reuse" in set(analyze(trace, rules=["premature_free"])["subrule"])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("pp", [1, 2])
def test_random_healthy_runs_give_nothing(seed, pp):
    assert len(findings(random_healthy(seed, pp=pp))) == 0


@pytest.mark.parametrize("sample", sorted(p.name for p in SAMPLES.iterdir() if (p / "trace").is_dir()))
def test_samples_give_nothing(sample):
    assert len(analyze(str(SAMPLES / sample / "trace"), rules=["preemption_race", "no_progress"])) == 0


@pytest.mark.parametrize("name", sorted(LIVELOCKS))
def test_livelocks_are_not_races(name):
    assert len(findings(LIVELOCKS[name]())) == 0


@pytest.mark.parametrize("name", sorted(RACES))
def test_no_other_rule_reports_the_races(name):
    """The gap this rule closes: before it, these incidents gave no finding at all."""
    assert set(analyze(RACES[name]())["rule"]) == {"preemption_race"}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_controls_have_no_error_from_any_rule(name):
    assert "error" not in set(analyze(CONTROLS[name]())["severity"])


@pytest.mark.parametrize("name", sorted(RACES))
def test_without_engine_config_only_the_connector_guess_is_lost(name):
    """Stripped of engine_config, the completion-based subrules stand as they were; step_in_flight, which needs to
    know that the connector saves in the background, goes silent (no store completion in the trace says so)."""
    trace = RACES[name]()
    bare = without(trace, ("engine_config",))
    full, stripped = findings(trace), findings(bare)
    if EXPECTED[name][1] == "step_in_flight":
        assert len(stripped) == 0
    else:
        assert list(zip(stripped["subrule"], stripped["severity"], stripped["req"])) == \
            list(zip(full["subrule"], full["severity"], full["req"]))


def test_a_hand_made_trace_without_the_new_owners_schedules_still_counts_its_allocation():
    bare = without(store_outlives_preemption(), ("req_sched",), req="c")
    f = findings(bare)
    assert list(zip(f["subrule"], f["severity"])) == [("async_store", "error")]
    notes = [e.get("note") for e in f.iloc[0]["evidence"] if e["kind"] == "blocks_alloc"]
    assert notes == ["handed to c, which writes them from here"]


@pytest.mark.parametrize("how", ["external", "remote_prefill"])
def test_an_asynchronous_load_without_its_wait_kv_row_under_a_step_in_flight_is_an_error(how):
    """vllm #45357 / vllm-ascend #14055: a KV consumer's load into the blocks is not ordered after the in-flight
    step; a trace that shows the load only by the allocation's `external` count or the request's remote_prefill."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=16)
    _pressure(e)
    e.add("c", n=32, **({"remote_prefill": True} if how == "remote_prefill" else {}))
    e.step({"a": 1}, alloc={"a": [5]}, preempt={"b": [3, 4]})
    e.ev("blocks_alloc", step=2, req="c", blocks=[3, 4], detail={"hit": 0, "external": 2} if how == "external"
         else None)
    e.output()
    _finish_all(e)
    f = findings(b.trace())
    assert list(zip(f["subrule"], f["severity"])) == [("step_in_flight", "error")]
    assert f.iloc[0]["extra"]["async_load"] is True and "asynchronous load" in f.iloc[0]["message"]
