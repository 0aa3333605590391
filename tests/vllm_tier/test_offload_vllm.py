"""The dry run's offload layout (`--instances offload`) on a real vLLM release: vLLM's own OffloadingConnector
scheduler side, with simulated workers that store and load; a healthy run is clean, a lost load completion is
reported, and the first offload bug `pdtrace chaos --workload offload` rediscovered (vLLM #49118) is found on the
release before its fix and not after."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

from pdtrace.analysis import analyze  # noqa: E402
from pdtrace.chaos import run_trial  # noqa: E402
from pdtrace.dryrun import DryRunConfig, run_dry_run  # noqa: E402
from pdtrace.dryrun.perturb import LEGAL  # noqa: E402
from pdtrace.errors import UsageError  # noqa: E402
from pdtrace.recording.vllm import installed_vllm_version  # noqa: E402
from pdtrace.trace.reader import open_trace  # noqa: E402

pytestmark = pytest.mark.vllm


def _release() -> tuple[int, ...]:
    return tuple(int(p) for p in (installed_vllm_version() or "0").split(".")[:3] if p.isdigit())


needs_offload = pytest.mark.skipif(_release() < (0, 23, 0), reason="the dry run's offload layout needs vLLM 0.23+")

#: Requests that share prefixes on a pool that evicts them: the CPU holds what the GPU lost, so some load from it.
HEALTHY = dict(instances="offload", requests=24, shared_prefix=0.7, num_blocks=48, end_hold_s=600.0,
               drain_timeout_ms=2000.0)


@needs_offload
def test_a_healthy_offload_run_stores_and_loads_and_gives_no_finding(tmp_path: Path) -> None:
    result = run_dry_run(DryRunConfig(**HEALTHY), tmp_path / "trace")
    assert result.error is None
    assert result.offload_jobs["stores"] > 0 and result.offload_jobs["loads"] > 0, result.offload_jobs
    events = open_trace(tmp_path / "trace").events
    loaded = set(events[events.kind == "kv_recv_done"].req)
    assert loaded and loaded <= set(events[events.kind == "req_wait_kv"].req)  # each load was awaited
    findings = analyze(tmp_path / "trace")
    assert not len(findings[findings.severity.isin(["warning", "error"])]), findings[["rule", "subrule", "req"]]


@needs_offload
def test_a_lost_load_completion_is_reported_and_legal_offload_timing_is_not(tmp_path: Path) -> None:
    """The twin of the test above: the same run with one rank never reporting a load of r00006 (faulty peer)
    leaves that request waiting for its KV, with its blocks; a slow or late load (legal) does not."""
    first = run_dry_run(DryRunConfig(**HEALTHY), tmp_path / "plain")
    events = open_trace(tmp_path / "plain").events
    target = sorted(set(events[events.kind == "kv_recv_done"].req))[0]
    req = int(target[1:])
    lost = run_trial(DryRunConfig(**HEALTHY, perturbations=[{"kind": "drop_job", "req": req, "what": "load"}]),
                     tmp_path / "lost")
    assert first.error is None and lost.failed, lost
    got = {(f["rule"], f["subrule"]) for f in lost.findings if f["req"] == target}
    assert ("unscheduled_request", "stuck_waiting_kv") in got, lost.findings
    for legal in ({"kind": "slow_load", "req": req, "factor": 300.0},
                  {"kind": "delay_job", "req": req, "what": "load", "steps": 5, "rank": -1},
                  {"kind": "slow_store", "req": 0, "factor": 300.0},
                  {"kind": "delay_job", "req": 0, "what": "store", "steps": 5, "rank": -1}):
        out = tmp_path / legal["kind"] / str(legal["req"])
        outcome = run_trial(DryRunConfig(**HEALTHY, perturbations=[legal]), out)
        assert outcome.label == LEGAL and not outcome.failed, (legal, outcome.signature, outcome.findings)


#: vLLM #49118 (fixed by #49285, first in 0.27.0): a request aborted while it waits in the queue (never scheduled,
#: no blocks) reaches `_build_store_jobs` through `finished_req_ids`; 0.26.0 counts its whole prompt as offloadable
#: (`num_tokens`), so its offload keys outnumber its (empty) block ids and `assert len(offload_keys) ==
#: len(offload_block_ids)` kills the engine. 0.27.0 counts an aborted request's `num_computed_tokens` instead.
#: Before 0.26.0 `_build_store_jobs` stored only scheduled requests (finished ones from #48596, in 0.26.0): 0.23.0
#: and 0.25.1 are clean of it.
ABORT_QUEUED = dict(instances="offload", requests=12, rate=0.0, max_num_seqs=4, end_hold_s=600.0,
                    drain_timeout_ms=2000.0, perturbations=[{"kind": "abort", "req": 9, "side": "p", "after_us": 50.0}])


#: What `pdtrace chaos -o DIR --workload offload` (seed 0) found on 0.26.0 after 259 s, minimised to one request
#: (a 400-token prompt in chunks of 64) aborted 1.46 ms after it arrived, mid-prefill: the same assert and the same
#: fix, with some of the prompt's blocks allocated instead of none (`num_tokens` counts the whole prompt).
ABORT_MID_PREFILL = dict(
    instances="offload", num_blocks=48, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True,
    requests=1, rate=0.0, prompt_len="uniform:8:400", output_len="exp:4", seed=262357606, shared_prefix=0.9,
    end_hold_s=600.0, drain_timeout_ms=2000.0,
    perturbations=[{"kind": "abort", "req": 0, "side": "p", "after_us": 1464.3}])


@needs_offload
@pytest.mark.parametrize("schedule", [ABORT_MID_PREFILL, ABORT_QUEUED], ids=["chaos_found", "issue_49118"])
def test_an_abort_before_the_prompt_is_computed_kills_0_26_in_build_store_jobs_and_no_other_release(
        tmp_path: Path, schedule: dict) -> None:
    outcome = run_trial(DryRunConfig(**schedule), tmp_path / "trace")
    assert outcome.harness_error is None and outcome.label == LEGAL
    if (0, 26, 0) <= _release() < (0, 27, 0):
        assert outcome.signature == ("AssertionError at vllm/distributed/kv_transfer/kv_connector/v1/offloading/"
                                     "scheduler.py:_build_store_jobs"), outcome.signature
    else:
        assert not outcome.failed, (outcome.signature, outcome.findings)


@pytest.mark.skipif(_release() >= (0, 23, 0), reason="the release has the offloading connector the dry run drives")
def test_the_offload_layout_before_0_23_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="needs vLLM 0.23 or later"):
        run_dry_run(DryRunConfig(instances="offload", requests=2), tmp_path / "trace")
