"""preemption_race and no_progress on real vLLM 0.33.0 under heavy preemption (the dry run with a pool of 72
blocks and 32 requests arriving at once): healthy runs, so neither rule may speak, although blocks of preempted
requests change owner hundreds of times, some while the step that used them is still in flight (async scheduling,
PP=2), which is normal for plain compute on one stream.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM 0.33.0 (build its venv with .ci/install-vllm.sh VENV)")

import harness as H  # noqa: E402

from pdtrace.analysis import analyze  # noqa: E402
from pdtrace.analysis.config import AnalysisConfig  # noqa: E402
from pdtrace.analysis.context import AnalysisContext  # noqa: E402
from pdtrace.analysis.rules.preemption_race import preempt_handovers  # noqa: E402
from pdtrace.dryrun import DryRunConfig, run_dry_run  # noqa: E402
from pdtrace.trace.reader import open_trace  # noqa: E402

pytestmark = pytest.mark.vllm

PRESSURE = dict(num_blocks=72, requests=32, rate=0.0, prompt_len="uniform:64:256", output_len="exp:96", seed=0)


@pytest.mark.parametrize("layout", [dict(instances="single", async_scheduling=True), dict(instances="pd"),
                                    dict(instances="single", pp=2)], ids=["async", "pd", "pp2"])
def test_heavy_preemption_is_silent(tmp_path: Path, layout: dict) -> None:
    run_dry_run(DryRunConfig(**PRESSURE, **layout), tmp_path / "t")
    trace = open_trace(str(tmp_path / "t"))
    handovers = preempt_handovers(AnalysisContext(trace))
    assert len(handovers) >= 50 and (handovers.write_row >= 0).all()
    kinds = trace.table.column("kind").to_pylist()
    assert kinds.count("req_preempt") >= 5
    # silent at the default threshold and at the lowest one
    for steps in (AnalysisConfig().livelock_steps, 1):
        found = analyze(trace, rules=["preemption_race", "no_progress"],
                        config=AnalysisConfig(livelock_steps=steps))
        assert len(found) == 0, found[["rule", "subrule", "message"]].to_dict("records")
