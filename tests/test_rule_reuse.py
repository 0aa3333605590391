"""Blocks reused under work that still references them (issue 22 items 6 and 7): `use_after_free/
transfer_after_reuse` (a late transfer's per-rank reports after the request's blocks went to another request,
vllm#53049) and `preemption_race/finished_while_preempted` (a P/D request preempted while its only step is in
flight, then finished by that step's output with nothing left to send), each with its healthy look-alikes
(tests/scenarios_reuse.py)."""

from __future__ import annotations

import pytest

import scenarios_reuse as sr
from pdtrace.analysis import analyze
from pdtrace.analysis.registry import load_rules


def _triples(f) -> set[tuple[str, str, str]]:
    return set(zip(f["rule"], f["subrule"], f["severity"]))


def test_the_new_subrules_are_registered() -> None:
    rules = load_rules()
    assert "transfer_after_reuse" in rules["use_after_free"].subrules
    assert "finished_while_preempted" in rules["preemption_race"].subrules


@pytest.mark.parametrize("name", sorted(sr.FAULTY))
def test_each_incident_gives_its_finding(name: str) -> None:
    f = analyze(sr.FAULTY[name]())
    assert sr.EXPECTED[name] in _triples(f), f[["rule", "subrule", "message"]].to_string()


@pytest.mark.parametrize("name", sorted(sr.HEALTHY))
def test_look_alikes_give_only_their_own_defect(name: str) -> None:
    f = analyze(sr.HEALTHY[name]())
    assert _triples(f[f["severity"] != "info"]) <= sr.NEGATIVE_ONLY.get(name, set()), \
        f[["rule", "subrule", "message"]].to_string()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_late_load_into_reused_blocks_names_the_new_owner(tp: int) -> None:
    """vllm#53049 (MultiConnector broadcasts start_load_kv: two loads for r1; the late NIXL one lands in r2's
    blocks). Before: only double_free/completion_after_free for the second kv_recv_done."""
    f = analyze(sr.double_load(tp=tp))
    uaf = f[f["subrule"] == "transfer_after_reuse"]
    assert len(uaf) == 1
    row = uaf.iloc[0]
    assert (row["rule"], row["req"], list(row["blocks"])) == ("use_after_free", "r1", [1, 2])
    assert row["extra"]["new_owner"] == "r2" and row["extra"]["direction"] == "recv"
    assert row["extra"]["ranks"] == list(range(tp)) and row["extra"]["reports"] == tp
    assert "r2" in row["message"]
    kinds = [(e["kind"], e.get("req")) for e in row["evidence"]]
    assert kinds[:3] == [("kv_recv_rank", "r1"), ("blocks_free", "r1"), ("blocks_alloc", "r2")]
    # the second completion stays the double free it is
    assert ("double_free", "completion_after_free", "error") in _triples(f)


def test_rank_reports_before_the_reuse_are_not_a_write_into_it() -> None:
    """Negative: the late load's ranks report after r1's final free but before r2 gets the blocks."""
    f = analyze(sr.double_load(reuse=False))
    assert "transfer_after_reuse" not in set(f["subrule"])
    assert _triples(f[f["severity"] != "info"]) == {("double_free", "completion_after_free", "error")}


def test_a_preempted_request_finished_by_its_older_step() -> None:
    """Issue 22 item 7. Before: no finding at all."""
    f = analyze(sr.preempted_then_finished())
    hit = f[f["subrule"] == "finished_while_preempted"]
    assert len(hit) == 1 and set(f["severity"]) == {"error"} and len(f) == 1
    row = hit.iloc[0]
    assert (row["rule"], row["req"], list(row["blocks"])) == ("preemption_race", "r1", [1, 2])
    assert row["extra"]["new_owner"] == "r2" and row["extra"]["victim_step"] == 0
    assert row["extra"]["delay_free"] is False and row["extra"]["finish_step"] == 0
    kinds = [(e["kind"], e.get("req"), e.get("step")) for e in row["evidence"]]
    assert ("req_preempt", "r1", 1) in kinds  # the preemption
    assert ("req_sched", "r1", 0) in kinds  # the step that used the blocks and then finished r1
    assert ("blocks_alloc", "r2", 1) in kinds  # the new owner
    assert ("step_output", None, 0) in kinds and ("req_finish", "r1", 0) in kinds


@pytest.mark.parametrize("how", ["resumed", "no_preemption"])
def test_a_resume_or_no_preemption_is_not_a_stale_finish(how: str) -> None:
    """Negatives: preempted, resumed and finished by its own later step; finished by an in-flight step with no
    preemption (its blocks kept for the peer)."""
    assert len(analyze(sr.preempted_then_finished(how))) == 0


def test_a_plain_request_finished_by_its_older_step_is_not_reported() -> None:
    """No peer reads a plain request's KV, and its token was computed before the hand-over."""
    assert "finished_while_preempted" not in set(analyze(sr.preempted_then_finished(peer=False))["subrule"])
