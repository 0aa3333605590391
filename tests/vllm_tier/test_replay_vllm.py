"""`pdtrace replay` on a real vLLM release: a run recorded on it replays with the same decisions, and a recording
the release would not produce (a faulty peer's report killed the engine) is where the replay parts from it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

from pdtrace.dryrun import DryRunConfig, run_dry_run  # noqa: E402
from pdtrace.replay import replay  # noqa: E402
from pdtrace.trace.reader import open_trace  # noqa: E402

pytestmark = pytest.mark.vllm

RUNS = {
    "pd_pp1": dict(requests=24, rate=400.0, seed=21),
    "pd_pp2": dict(requests=24, rate=400.0, seed=22, pp=2),
    "single_preempting": dict(instances="single", requests=24, rate=0.0, seed=23, num_blocks=96,
                              output_len="uniform:16:64"),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_recorded_dry_run_replays_with_its_decisions(tmp_path: Path, name: str) -> None:
    run_dry_run(DryRunConfig(**RUNS[name]), tmp_path / "recorded")
    result = replay(open_trace(tmp_path / "recorded"), tmp_path / "replayed")
    assert result.error is None
    assert all(s.recorded >= 5 for s in result.sides) and sum(s.recorded for s in result.sides) > 100
    assert result.share >= 0.95, [(s.role, s.share, s.first_divergence) for s in result.sides]


def test_a_recording_the_release_would_not_make_is_where_the_replay_parts(tmp_path: Path) -> None:
    """A faulty peer reports a send done before the request finished: the recorded engine died there; the replay
    (which replays no faulty report) goes on, and names the first decision the recording lacks."""
    config = DryRunConfig(requests=6, rate=0.0, seed=3, prompt_len="200", max_num_batched_tokens=64,
                          perturbations=[{"kind": "early_report", "req": 1}])
    recorded = run_dry_run(config, tmp_path / "recorded")
    assert recorded.error  # vLLM asserted
    result = replay(open_trace(tmp_path / "recorded"))
    prefill = next(s for s in result.sides if s.role == "prefill")
    assert prefill.replayed > prefill.recorded and prefill.share < 1.0
    assert prefill.first_divergence["what"] == "the replay made more decisions"
    assert result.error is None
