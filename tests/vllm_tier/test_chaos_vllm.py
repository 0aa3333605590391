"""`pdtrace chaos` on a real vLLM release: a campaign runs every trial it draws, a failure reproduces, and the
first known bug it rediscovered (docs/chaos.md) is found on the release before its fix and not after."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

from pdtrace.chaos import Campaign, repro, run_campaign, run_trial  # noqa: E402
from pdtrace.chaos.campaign import save_failure  # noqa: E402
from pdtrace.dryrun import DryRunConfig  # noqa: E402
from pdtrace.dryrun.perturb import FAULTY, LEGAL  # noqa: E402
from pdtrace.recording.vllm import installed_vllm_version  # noqa: E402

pytestmark = pytest.mark.vllm


def _release() -> tuple[int, ...]:
    return tuple(int(p) for p in (installed_vllm_version() or "0").split(".")[:3] if p.isdigit())


#: What `pdtrace chaos -o DIR --workload pd` (seed 0) found on vLLM 0.15.1 after 71 s, minimised to one request
#: abort: D's request r00005-d aborted 29.4 us after it reached D, while its KV read is in flight. 0.15.1's
#: `finish_requests` frees a WAITING_FOR_REMOTE_KVS request's blocks at once (scheduler.py, the abort path), so
#: the read writes into freed blocks and its completion arrives for a freed request; vLLM #32255 (in 0.16.0)
#: defers that free until the read ends.
ABORT_DURING_READ = dict(
    instances="pd", pp=1, tp=1, num_blocks=512, max_num_seqs=64, max_num_batched_tokens=64, async_scheduling=True,
    enable_prefix_caching=False, requests=6, rate=2000.0, prompt_len="uniform:8:48", output_len="exp:4",
    seed=1924014660, end_hold_s=600.0, perturbations=[{"kind": "abort", "req": 5, "side": "d", "after_us": 29.4}])


def test_an_abort_during_the_read_is_a_premature_free_before_0_16_and_clean_after(tmp_path: Path) -> None:
    """Measured on 0.10.2, 0.11.1 and 0.15.1 (found) and 0.16.0 and 0.33.0 (clean); the tier's other releases lie
    on either side of the fix."""
    release = _release()
    outcome = run_trial(DryRunConfig(**ABORT_DURING_READ), tmp_path / "trace")
    assert outcome.harness_error is None and outcome.label == LEGAL
    # one request id on both sides before 0.13 (pdtrace.dryrun.compat.shared_request_ids), r00005-d after
    found = {f"{f['rule']}/{f['subrule']}" for f in outcome.findings if f["req"] in ("r00005-d", "r00005")}
    if release < (0, 16, 0):
        assert outcome.signature == "double_free/completion_after_free"
        assert "premature_free/recv_open" in found
    else:
        assert not outcome.failed, outcome.findings


def test_a_faulty_peer_completion_fails_and_its_saved_failure_reproduces(tmp_path: Path) -> None:
    """P's ranks report a send done in the first step that schedules the request (the first of its four prefill
    chunks): vLLM asserts; the failure is saved with its trace and re-runs to the same signature (the runs are
    deterministic)."""
    config = DryRunConfig(requests=3, rate=0.0, seed=3, prompt_len="200", max_num_batched_tokens=64, end_hold_s=600.0,
                          perturbations=[{"kind": "early_report", "req": 1},
                                         {"kind": "slow_read", "req": 0, "factor": 3.0}])
    outcome = run_trial(config, tmp_path / "first")
    assert outcome.failed and outcome.label == FAULTY
    assert outcome.signature.startswith("AssertionError at vllm/v1/core/sched/scheduler.py:"), outcome.signature
    campaign = Campaign(output=tmp_path / "out", budget_s=120.0)
    failure = save_failure(campaign, config, outcome, 1, 1.0, tmp_path, None, 3600.0, installed_vllm_version() or "")
    assert failure.signature == outcome.signature and failure.perturbations_after == 1  # slow_read did not matter
    assert (failure.path / "trace").is_dir() and (failure.path / "failure.json").is_file()
    record, again = repro(failure.path)
    assert again.signature == record["signature"] == outcome.signature


def test_a_short_campaign_runs_every_trial_it_draws(tmp_path: Path) -> None:
    """Every drawn trial (each workload, every kind of perturbation the draws give) is one the release runs. The
    run count decides the end, not the clock (the budget is far beyond six runs on any machine)."""
    result = run_campaign(Campaign(output=tmp_path / "out", budget_s=3600.0, seed=5, max_runs=6,
                                          minimise_runs=2), None,
                          installed_vllm_version() or "")
    assert result.runs == 6 and result.harness_errors == 0, result.first_harness_error
    for failure in result.failures:
        assert (failure.path / "failure.json").is_file()


#: vLLM #50297 (fix in 0.27.0): P under async scheduling and KV pressure, prefill chunks capped at 32 tokens
#: (long_prefill_token_threshold), so a short request finishes its whole prompt in a step where an older prefill
#: still runs; the next step, scheduled while that one is in flight, preempts it (the last running request) for the
#: older prefill's blocks. 0.26.0 then delivers the in-flight output: the request finishes holding no block, NIXL
#: hands D an empty block list, and its blocks are another request's. 0.27.0 drops the stale output
#: (requires_kv_delivery) and recomputes the prefill.
PREEMPTED_IN_ITS_LAST_STEP = dict(
    instances="pd", pp=1, tp=1, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=128,
    long_prefill_token_threshold=32, async_scheduling=True, enable_prefix_caching=False, requests=12, rate=2000.0,
    prompt_len="uniform:8:400", output_len="exp:4", seed=3, end_hold_s=600.0, drain_timeout_ms=2000.0,
    perturbations=[{"kind": "small_pool", "req": 0, "blocks": 24}])


def test_a_prefill_preempted_in_its_last_step_finishes_without_blocks_before_0_27_and_is_recomputed_after(
        tmp_path: Path) -> None:
    """Measured on 0.26.0 (found) and 0.27.0 and 0.33.0 (clean: every request finishes; before the dry run took a
    resumed request's output count from the scheduler, 0.27+ left the recomputed prefill a zombie)."""
    release = _release()
    if release < (0, 26, 0):
        pytest.skip("not measured before 0.26.0 (the in-flight output of a preempted request is delivered there too)")
    outcome = run_trial(DryRunConfig(**PREEMPTED_IN_ITS_LAST_STEP), tmp_path / "trace")
    assert outcome.harness_error is None and outcome.label == LEGAL
    if release < (0, 27, 0):
        assert outcome.signature == "preemption_race/finished_while_preempted", outcome.findings
    else:
        assert not outcome.failed, outcome.findings
