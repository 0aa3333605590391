"""no_progress: the livelocks of tests/scenarios_preemption.py, their thresholds and degraded inputs, and silence on
busy-but-progressing controls, the healthy scenarios, random healthy runs and the shipped samples."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from pdtrace.analysis import analyze
from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.registry import load_rules
from pdtrace.analysis.rules.no_progress import RULE, run
from pdtrace.trace.model import Trace
from scenarios import random_healthy
from scenarios_preemption import (EXPECTED, LIVELOCKS, RACES, deferred_free_cascade, never_fits_self_preemption,
                                  preempt_and_resume_under_pressure, quiet_scenarios, recompute_thrash, retable,
                                  set_queue, slow_progress_under_preemption, without)


def findings(trace, **config):
    return run(AnalysisContext(trace, AnalysisConfig().with_overrides(**config)))


def without_sched_key(trace: Trace, key: str) -> Trace:
    table = trace.table
    kinds = [str(k) for k in table.column("kind").to_pylist()]
    details = table.column("detail").to_pylist()
    for i, (kind, detail) in enumerate(zip(kinds, details)):
        if kind == "sched" and detail:
            d = json.loads(detail)
            d.pop(key, None)
            details[i] = json.dumps(d)
    at = table.schema.get_field_index("detail")
    return retable(table.set_column(at, "detail", pa.array(details, pa.string())))


def test_rule_object_is_registered():
    assert RULE.id == "no_progress" and RULE.subrules == ("livelock",)
    assert load_rules()["no_progress"] is RULE


@pytest.mark.parametrize("name", sorted(LIVELOCKS))
def test_each_livelock_is_one_warning(name):
    rule, subrule, severity = EXPECTED[name]
    f = findings(LIVELOCKS[name]())
    assert list(zip(f["rule"], f["subrule"], f["severity"])) == [(rule, subrule, severity)]
    extra = f.iloc[0]["extra"]
    assert extra["tokens_produced"] == 0 and extra["open_at_end"] is True
    assert extra["preemptions"] >= 2 and extra["queue"] >= 1
    kinds = [e["kind"] for e in f.iloc[0]["evidence"]]
    assert kinds[0] == "sched" and kinds[-1] == "sched" and "req_preempt" in kinds


def test_the_cascade_reports_its_fenced_frees_and_counts():
    f = findings(deferred_free_cascade(cycles=20))
    extra = f.iloc[0]["extra"]
    assert (extra["steps"], extra["preemptions"], extra["deferred_frees"], extra["queue"]) == (20, 19, 19, 2)
    assert extra["requests"] == 3 and extra["min_free_blocks"] == 0
    assert "19 of their frees deferred" in f.iloc[0]["message"]


def test_the_thrash_has_no_deferred_free():
    extra = findings(recompute_thrash(cycles=16)).iloc[0]["extra"]
    assert (extra["steps"], extra["preemptions"], extra["deferred_frees"]) == (16, 15, 0)


def test_the_window_closes_at_the_first_token():
    f = findings(deferred_free_cascade(cycles=20, recover=True))
    assert len(f) == 1
    extra = f.iloc[0]["extra"]
    assert extra["open_at_end"] is False and extra["last_step"] == 19


def test_threshold_livelock_steps():
    assert len(findings(recompute_thrash(cycles=3))) == 0
    assert len(findings(recompute_thrash(cycles=3), livelock_steps=2)) == 1


def test_without_step_outputs_the_steps_in_flight_come_from_engine_config():
    for make in (deferred_free_cascade, recompute_thrash):
        bare = without(make(), ("step_output", "step_submit"))
        assert list(findings(bare)["subrule"]) == ["livelock"]


def test_without_the_waiting_detail_the_victims_are_the_queue():
    f = findings(without_sched_key(deferred_free_cascade(), "waiting"))
    assert list(f["subrule"]) == ["livelock"] and f.iloc[0]["extra"]["queue"] == 3


def test_a_recorder_gap_over_the_window_lowers_it_to_info():
    trace = deferred_free_cascade()
    table = trace.table
    gap = table.slice(table.num_rows // 2, 1).to_pylist()[0]
    gap.update(kind="recorder_gap", req=None, blocks=None, n=5, reason=None, deferred=None, detail=None)
    from pdtrace.trace.builder import rows_to_table
    f = findings(retable(pa.concat_tables([table, rows_to_table([gap])])))
    assert list(f["severity"]) == ["info"] and f.iloc[0]["extra"]["downgraded"] == "recorder_gap"


@pytest.mark.parametrize("name", sorted(quiet_scenarios()))
def test_controls_and_healthy_runs_give_nothing(name):
    assert len(findings(quiet_scenarios()[name]())) == 0


@pytest.mark.parametrize("name", sorted(RACES))
def test_races_are_not_livelocks(name):
    assert len(findings(RACES[name]())) == 0


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("pp", [1, 2])
def test_random_healthy_runs_give_nothing(seed, pp):
    """Random runs preempt 10% of the steps and recompute: busy, never stuck."""
    assert len(findings(random_healthy(seed, pp=pp), livelock_steps=2)) == 0


@pytest.mark.parametrize("name", sorted(LIVELOCKS))
def test_livelocks_have_no_error_from_any_rule(name):
    assert "error" not in set(analyze(LIVELOCKS[name]())["severity"])


def test_a_resumed_long_prefill_keeps_its_work_and_is_silent():
    """The prefill's own request was preempted once before, so its schedules are not kept work by default: the
    thrown-away share decides, and its chunks are not thrown away."""
    from scenarios import Engine, builder

    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=64)
    e.add("d1", n=16)
    e.add("d2", n=16)
    e.add("big", n=384)
    e.step({"d1": 16, "d2": 16, "big": 32}, alloc={"d1": [1], "d2": [2], "big": [3, 4]})
    e.output()
    e.step({"d1": 1, "d2": 1}, preempt={"big": [3, 4]})
    e.output()
    for i in range(12):
        preempt = {"d1": [1], "d2": [2]} if i == 0 else None
        k = e.step({"big": 32}, alloc={"big": [5 + 2 * i, 6 + 2 * i]}, preempt=preempt)
        set_queue(e, k, waiting=2, free_blocks=2)
        e.output()
    trace = b.trace()
    assert len(findings(trace)) == 0
    # the same stretch with the prefill thrown away at every step is a livelock
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=64)
    e.add("big", n=384)
    e.add("d1", n=16)
    for i in range(12):
        cur, victim = ("big", "d1") if i % 2 == 0 else ("d1", "big")
        k = e.step({cur: 32 if cur == "big" else 8}, alloc={cur: [1, 2]}, preempt={victim: [1, 2]} if i else None)
        set_queue(e, k, waiting=1, free_blocks=0)
        e.output()
    assert list(findings(b.trace())["subrule"]) == ["livelock"]


@pytest.mark.parametrize("name", sorted(LIVELOCKS))
def test_a_trace_without_sched_rows_counts_the_steps_of_its_request_rows(name):
    f = findings(without(LIVELOCKS[name](), ("sched",)))
    assert list(f["subrule"]) == ["livelock"]
    extra = f.iloc[0]["extra"]
    victims = {f.iloc[0]["req"], *f.iloc[0]["requests"]}  # without the waiting detail the victims are the queue
    assert extra["steps"] >= 15 and extra["queue"] == len(victims) >= 1 and extra["min_free_blocks"] is None


@pytest.mark.parametrize("name", sorted(quiet_scenarios()))
def test_controls_without_sched_rows_stay_silent(name):
    assert len(findings(without(quiet_scenarios()[name](), ("sched",)))) == 0


def test_a_request_that_never_fits_loses_every_chunk_it_prefilled():
    """vllm#52520: four chunks per cycle, then the request preempts itself and restarts from token 0. Counting only
    the schedule right before each preemption (one of four) stayed under the threshold; every schedule since the
    request's admission is thrown away."""
    f = findings(never_fits_self_preemption(cycles=6))
    assert list(zip(f["subrule"], f["severity"])) == [("livelock", "warning")]
    extra = f.iloc[0]["extra"]
    assert (extra["schedules"], extra["schedules_thrown_away"], extra["preemptions"]) == (24, 24, 6)
    assert f.iloc[0]["req"] == "long" and list(f.iloc[0]["requests"]) == []
    assert "of 1 request (long)" in f.iloc[0]["message"]


def test_work_kept_by_a_token_is_not_thrown_away():
    """The healthy look-alike: a long prefill preempted mid-way (its chunks lost) and resumed while a decoder
    produces every step, and a request that produced tokens before its preemption: nothing reported."""
    assert len(findings(preempt_and_resume_under_pressure())) == 0
    assert len(findings(slow_progress_under_preemption())) == 0


def test_a_livelock_names_its_requests():
    """Every request the finding's evidence lies in is named: the most preempted in `req`, the others in
    `requests`, in the message too (a user can `pdtrace show --req` each)."""
    f = findings(deferred_free_cascade(cycles=20))
    row = f.iloc[0]
    assert row["req"] == "a" and list(row["requests"]) == ["b", "c"]
    assert "3 requests (a, b, c)" in row["message"]
    thrash = findings(recompute_thrash()).iloc[0]
    assert {thrash["req"], *thrash["requests"]} == {"a", "b"}
