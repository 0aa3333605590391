"""`pdtrace chaos` without vLLM: the perturbations, the minimisation, the verdicts and the command's refusals.
(The campaign on a real vLLM release is in tests/vllm_tier/test_chaos_vllm.py.)"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pandas as pd
import pytest
from typer.testing import CliRunner

from pdtrace.chaos.campaign import minimise
from pdtrace.chaos.trials import draw_trial, judge, raise_signature
from pdtrace.cli import app
from pdtrace.dryrun.config import DryRunConfig
from pdtrace.dryrun.perturb import FAULTY, LEGAL, PERTURBATIONS, Perturber, apply_to_workload, check, draw, label_of
from pdtrace.dryrun.workload import WorkloadRequest
from pdtrace.errors import UsageError

TRACEBACK = '''Traceback (most recent call last):
  File "/x/site-packages/pdtrace/dryrun/sim.py", line 640, in run
    outputs, executed = engine_step(e.core)
  File "/x/site-packages/vllm/v1/engine/core.py", line 400, in step
    engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
  File "/x/site-packages/vllm/v1/core/sched/scheduler.py", line 3581, in _update_from_kv_xfer_finished
    assert req_id in self.requests
AssertionError
'''


def test_every_kind_is_labelled_and_drawn_only_where_it_applies():
    assert {k.label for k in PERTURBATIONS.values()} == {LEGAL, FAULTY}
    single = draw(random.Random(3), 10, 1, 1, pair=False, count=200)
    assert {p["kind"] for p in single} <= {k for k, v in PERTURBATIONS.items() if not v.needs_pair}
    paired = draw(random.Random(3), 10, 2, 2, pair=True, count=400)
    assert {p["kind"] for p in paired} == {k for k, v in PERTURBATIONS.items() if v.drawn and not v.needs_offload}
    offload = draw(random.Random(3), 10, 1, 1, pair=False, count=400, offload=True)
    assert {p["kind"] for p in offload} == {k for k, v in PERTURBATIONS.items() if v.drawn and not v.needs_pair}
    assert not {p["kind"] for p in single} & {k for k, v in PERTURBATIONS.items() if v.needs_offload}
    assert "read_time" not in {p["kind"] for p in paired}  # replay's, not chaos's
    assert all(0 <= p["req"] < 10 for p in paired)


def test_the_same_seed_draws_the_same_trials(monkeypatch):
    import pdtrace.dryrun.config as dryrun_config

    monkeypatch.setattr(dryrun_config, "_offload_protocol_in_files", lambda: True)  # whatever vLLM is installed
    a = [draw_trial(random.Random(7), w).to_dict() for w in ("pd", "pp", "single", "offload")]
    b = [draw_trial(random.Random(7), w).to_dict() for w in ("pd", "pp", "single", "offload")]
    assert a == b
    assert a != [draw_trial(random.Random(8), w).to_dict() for w in ("pd", "pp", "single", "offload")]
    for trial in a:
        DryRunConfig(**trial).validate()  # every drawn trial is a valid dry run
        # a trial outlasts its slowest read before it is judged stuck, and a leak outlasts the leak grace
        assert trial["drain_timeout_ms"] >= 2000 and trial["end_hold_s"] >= 600


def test_the_other_workloads_draw_what_they_drew_before_offload_existed():
    """The offload workload's own draws (shared prefixes, pool) come after the others': a pd/pp/single campaign of
    a seed still runs the trials it ran (the seeds of docs/chaos.md's table)."""
    for workload in ("pd", "pp", "single"):
        trial = draw_trial(random.Random(11), workload)
        assert trial.shared_prefix == 0.0 and trial.num_blocks == 512
        assert not any(PERTURBATIONS[p["kind"]].needs_offload for p in trial.perturbations)
    offload = [draw_trial(random.Random(s), "offload") for s in range(30)]
    assert {t.instances for t in offload} == {"offload"} and all(t.shared_prefix > 0 for t in offload)
    assert {t.num_blocks for t in offload} > {512}  # small pools too: the GPU evicts what the CPU holds


def test_offload_perturbations_need_the_offload_layout_in_one_line():
    with pytest.raises(UsageError, match="needs the offloading connector"):
        DryRunConfig(instances="single", perturbations=[{"kind": "drop_job", "req": 0, "what": "load"}]).validate()
    with pytest.raises(UsageError, match="needs a prefill/decode pair"):
        DryRunConfig(instances="offload", perturbations=[{"kind": "slow_read", "req": 0}]).validate()
    DryRunConfig(instances="offload", perturbations=[{"kind": "slow_store", "req": 0, "factor": 3}]).validate()
    assert label_of([{"kind": "delay_job", "req": 0}, {"kind": "slow_load", "req": 0}]) == LEGAL
    assert label_of([{"kind": "drop_job", "req": 0}]) == FAULTY


def test_shared_prefixes_copy_half_an_earlier_prompt_and_change_nothing_without_them():
    from pdtrace.dryrun.workload import make_workload

    plain = make_workload(DryRunConfig(requests=12, seed=4))
    shared = make_workload(DryRunConfig(requests=12, seed=4, shared_prefix=1.0))
    assert [w.arrival_ns for w in plain] == [w.arrival_ns for w in shared]
    assert [len(w.prompt_token_ids) for w in plain] == [len(w.prompt_token_ids) for w in shared]
    assert plain[0].prompt_token_ids == shared[0].prompt_token_ids
    for w in shared[1:]:  # each starts with the first half of some earlier prompt
        assert any(w.prompt_token_ids[:max(1, len(e.prompt_token_ids) // 2)] ==
                   e.prompt_token_ids[:max(1, len(e.prompt_token_ids) // 2)][:len(w.prompt_token_ids)]
                   for e in shared[:w.index])
    assert sum(w.prompt_token_ids != p.prompt_token_ids for w, p in zip(shared, plain)) >= 8
    with pytest.raises(UsageError, match="--shared-prefix"):
        DryRunConfig(shared_prefix=1.5).validate()


def test_the_chunk_cap_is_drawn_on_async_trials_only_and_leaves_the_campaigns_draws_as_they_were():
    """The chunk cap (vLLM #50297's shape) comes from each trial's own seed: seed 0's trials draw the same seeds
    as before it existed (the numbers below are main's before this change); only async trials without an abort get
    a cap, all of them, with KV pressure."""
    rng = random.Random(0)
    trials = [draw_trial(rng, w) for w in ("pd", "pp", "single") * 4]
    assert [t.seed for t in trials] == [2046968324, 878225224, 1924014660, 872745308, 559309739, 1534881946,
                                        1597986360, 514088150, 1680518472, 1076693935, 1077747587, 568414356]
    many = [draw_trial(rng, "pd") for _ in range(300)]
    assert all(t.long_prefill_token_threshold == 0 for t in many + trials if not t.async_scheduling)
    capped = [t for t in many if t.long_prefill_token_threshold]
    assert capped and all(t.async_scheduling for t in capped)  # the twin: the cap is drawn
    # seed 0's async pd trial that found vLLM #32255 aborts: drawn as it was before the cap existed (main's values)
    found = [draw_trial(r, "pd") for r in [random.Random(0)] for _ in range(3)][2]
    assert found.async_scheduling and found.long_prefill_token_threshold == 0 and found.seed == 1924014660
    assert (found.requests, found.prompt_len, found.perturbations) == (
        14, "uniform:8:48", [{"kind": "abort", "req": 5, "side": "d", "after_us": 29.4}])

    def aborts(t: DryRunConfig) -> bool:
        return any(p["kind"] in ("abort", "abort_in_read") for p in t.perturbations)

    assert not any(aborts(t) for t in capped)
    assert all(t.long_prefill_token_threshold for t in many if t.async_scheduling and not aborts(t))
    assert all(t.long_prefill_token_threshold < t.max_num_batched_tokens for t in capped)
    assert all(t.requests >= 12 and any(p["kind"] == "small_pool" for p in t.perturbations) for t in capped)
    assert {t.long_prefill_token_threshold for t in capped} <= {16, 32, 64}
    for t in capped[:3]:
        DryRunConfig(**t.to_dict()).validate()
    with pytest.raises(UsageError, match="long-prefill-token-threshold"):
        DryRunConfig(long_prefill_token_threshold=-1).validate()


def test_a_schedule_is_faulty_if_one_perturbation_is():
    assert label_of([{"kind": "abort", "req": 0}, {"kind": "slow_read", "req": 1}]) == LEGAL
    assert label_of([{"kind": "abort", "req": 0}, {"kind": "dup_report", "req": 1}]) == FAULTY
    assert label_of([]) == LEGAL


def test_bad_perturbations_are_refused_in_one_line():
    assert "unknown perturbation" in check([{"kind": "nope", "req": 0}], 4, pair=True)
    assert "targets request 9 of 4" in check([{"kind": "abort", "req": 9}], 4, pair=True)
    assert "needs a prefill/decode pair" in check([{"kind": "slow_read", "req": 0}], 4, pair=False)
    assert check([{"kind": "abort", "req": 3}], 4, pair=False) is None
    with pytest.raises(UsageError, match="unknown perturbation"):
        DryRunConfig(perturbations=[{"kind": "nope", "req": 0}]).validate()


def test_a_burst_makes_its_requests_arrive_together():
    wl = [WorkloadRequest(i, i * 1000, [1], 1) for i in range(6)]
    apply_to_workload([{"kind": "burst", "req": 1, "count": 3}], wl)
    assert [(w.index, w.arrival_ns) for w in wl] == [(0, 0), (1, 1000), (2, 1000), (3, 1000), (4, 4000),
                                                      (5, 5000)]


def _config(n: int) -> DryRunConfig:
    return DryRunConfig(requests=20, perturbations=[{"kind": "abort", "req": i, "side": "p", "after_us": 1.0}
                                                    for i in range(n)])


def test_minimise_finds_the_two_perturbations_that_matter_and_cuts_the_workload():
    calls = []

    def fails(candidate: DryRunConfig) -> bool:
        calls.append(candidate)
        reqs = {p["req"] for p in candidate.perturbations}
        return {2, 5} <= reqs and candidate.requests > 5

    small, runs = minimise(_config(8), "sig", fails)
    assert sorted(p["req"] for p in small.perturbations) == [2, 5]
    assert small.requests == 6  # one more than the highest request a perturbation targets
    assert runs == len(calls) <= 48


def test_minimise_drops_every_perturbation_when_the_workload_alone_fails():
    small, _ = minimise(_config(5), "sig", lambda c: True)
    assert small.perturbations == []


def test_minimise_stops_at_its_run_budget():
    small, runs = minimise(_config(16), "sig", lambda c: len(c.perturbations) >= 9, max_runs=5)
    assert runs == 5 and len(small.perturbations) >= 9


def test_a_raise_is_signed_by_its_exception_and_innermost_vllm_function():
    assert raise_signature("prefill-0: AssertionError at scheduler.py:3581", TRACEBACK) == (
        "AssertionError at vllm/v1/core/sched/scheduler.py:_update_from_kv_xfer_finished")
    key_error = TRACEBACK.replace("AssertionError\n", "KeyError: 'r00003-d'\n")
    assert raise_signature("x", key_error).startswith("KeyError at vllm/")
    assert raise_signature("decode-0: KeyError: 'r1' at core.py:9", None) == "KeyError"


def test_judge_prefers_vllm_raising_then_the_first_error_finding():
    findings = pd.DataFrame([
        {"rule": "leaked_blocks", "subrule": "indirectly", "severity": "error", "instance": "p", "req": "r1",
         "message": "leak"},
        {"rule": "double_free", "subrule": "not_owned", "severity": "error", "instance": "p", "req": "r2",
         "message": "twice"},
        {"rule": "unscheduled_request", "subrule": "starved", "severity": "warning", "instance": "p", "req": "r3",
         "message": "slow"}])
    assert judge(None, None, findings, LEGAL).signature == "double_free/not_owned"
    assert len(judge(None, None, findings, LEGAL).findings) == 2  # errors only
    raised = judge("prefill-0: AssertionError at scheduler.py:3581", TRACEBACK, findings, FAULTY)
    assert raised.signature.startswith("AssertionError at vllm/") and raised.label == FAULTY
    passed = judge(None, None, findings[findings.severity == "warning"], LEGAL)
    assert passed.signature is None and not passed.failed


# -- the perturbations inside the simulated cluster: a rank's reports --------------------------------------------

@dataclass
class _Rank:
    pp_rank: int = 0
    tp_rank: int = 0
    sends_registered: set = field(default_factory=set)


def _perturber(perturbations: list[dict]) -> tuple[Perturber, SimpleNamespace]:
    cluster = SimpleNamespace(config=SimpleNamespace(perturbations=perturbations),
                              req_id=lambda base, side: f"{base}-{side}")
    engine = SimpleNamespace(instance="prefill-0", role="prefill", rank_keys=[(0, 0), (0, 1)])
    return Perturber(cluster), engine


def _steps(perturber: Perturber, engine, rank, reports: list[set]) -> list[set]:
    rec = SimpleNamespace(forward=True, so=SimpleNamespace(num_scheduled_tokens={}), step=0)
    return [perturber.filter_reports(engine, rank, rec, sends, set())[0] for sends in reports]


def test_a_delayed_report_comes_that_many_steps_later_once():
    perturber, engine = _perturber([{"kind": "delay_report", "req": 1, "side": "p", "rank": -1, "steps": 2}])
    got = _steps(perturber, engine, _Rank(), [{"r00001-p"}, set(), set(), set()])
    assert got == [set(), set(), {"r00001-p"}, set()]


def test_a_dropped_report_never_comes_and_a_duplicated_one_comes_twice():
    perturber, engine = _perturber([{"kind": "drop_report", "req": 1, "side": "p", "rank": 1}])
    assert _steps(perturber, engine, _Rank(0, 1), [{"r00001-p"}, set()]) == [set(), set()]
    assert _steps(perturber, engine, _Rank(0, 0), [{"r00001-p"}]) == [{"r00001-p"}]  # another rank: untouched
    perturber, engine = _perturber([{"kind": "dup_report", "req": 1, "side": "p", "rank": -1, "steps": 1}])
    got = _steps(perturber, engine, _Rank(), [{"r00001-p"}, set(), set()])
    assert got == [{"r00001-p"}, {"r00001-p"}, set()]


def test_a_decode_side_perturbation_leaves_the_prefill_side_alone():
    perturber, engine = _perturber([{"kind": "drop_report", "req": 1, "side": "d", "rank": -1}])
    assert _steps(perturber, engine, _Rank(), [{"r00001-p"}]) == [{"r00001-p"}]


def test_offload_jobs_are_dropped_once_per_rank_delayed_or_slowed():
    perturber, engine = _perturber([{"kind": "drop_job", "req": 2, "what": "load", "rank": -1},
                                    {"kind": "delay_job", "req": 3, "what": "store", "rank": 1, "steps": 4},
                                    {"kind": "slow_store", "req": 3, "factor": 5.0}])
    perturber.cluster.req_id = lambda base, side: base  # one engine: the client's ids
    r0, r1 = _Rank(0, 0), _Rank(0, 1)
    assert perturber.offload_report(engine, r0, "r00002", True) is None  # the first load of r00002: never reported
    assert perturber.offload_report(engine, r0, "r00002", True) == 0  # a later one is
    assert perturber.offload_report(engine, r1, "r00002", True) is None  # each rank drops its own
    assert perturber.offload_report(engine, r0, "r00002", False) == 0  # stores are left alone
    assert perturber.offload_report(engine, r1, "r00003", False) == 4
    assert perturber.offload_report(engine, r0, "r00003", False) == 0  # another rank: untouched
    assert perturber.offload_factor("r00003", False) == 5.0 and perturber.offload_factor("r00003", True) == 1.0


def test_a_campaign_whose_dry_run_cannot_run_stops_in_one_line(tmp_path):
    from pdtrace.chaos import Campaign, run_campaign
    from pdtrace.errors import RecordingError

    calls = []

    def broken(args, env):
        calls.append(args)
        return 1, "Traceback ...\nImportError: no vllm\n"

    with pytest.raises(RecordingError, match="could not run 20 trials in a row"):
        run_campaign(Campaign(output=tmp_path / "out", budget_s=600.0), broken, "0.33.0")
    assert len(calls) <= 20  # (none at all where vLLM is not importable: refused before the spawn)
    assert not list((tmp_path / "out").glob("failure-*"))


# -- the command ------------------------------------------------------------------------------------------------

runner = CliRunner()


def test_chaos_without_a_supported_vllm_says_which_releases_in_one_line(monkeypatch, tmp_path):
    import pdtrace.recording.vllm as hooks

    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.9.0")
    result = runner.invoke(app, ["chaos", "-o", str(tmp_path / "c")], standalone_mode=False)
    assert isinstance(result.exception, UsageError) and result.exception.exit_code == 2
    assert "0.9.0" in str(result.exception) and "0.33" in str(result.exception)
    assert not (tmp_path / "c").exists()


def test_chaos_offload_before_vllm_0_23_is_refused_in_one_line_and_left_out_of_all(monkeypatch, tmp_path):
    import pdtrace.chaos as chaos_pkg
    import pdtrace.dryrun.config as dryrun_config
    import pdtrace.recording.vllm as hooks

    monkeypatch.setattr(dryrun_config, "_offload_protocol_in_files", lambda: None)  # decided by the release alone
    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.17.1")
    result = runner.invoke(app, ["chaos", "-o", str(tmp_path / "c"), "--workload", "offload"], standalone_mode=False)
    assert isinstance(result.exception, UsageError) and result.exception.exit_code == 2
    assert "needs vLLM 0.23" in str(result.exception) and "0.17.1" in str(result.exception)
    seen = []

    def fake_campaign(campaign, spawn, version, progress=None):
        seen.append(campaign.workloads)
        raise UsageError("stop here")

    monkeypatch.setattr(chaos_pkg, "run_campaign", fake_campaign)
    runner.invoke(app, ["chaos", "-o", str(tmp_path / "d")], standalone_mode=False)
    assert seen == [("pd", "pp", "single")]
    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.26.0")
    runner.invoke(app, ["chaos", "-o", str(tmp_path / "e")], standalone_mode=False)
    assert seen[-1] == ("pd", "pp", "single", "offload")


@pytest.mark.parametrize("args, message", [
    (["chaos"], "needs -o DIR"),
    (["chaos", "-o", "X", "--budget", "soon"], "--budget takes a duration"),
    (["chaos", "--repro", "NOPE"], "holds no failure.json"),
    (["chaos", "--repro", "NOPE", "-o", "X"], "takes no -o"),
])
def test_chaos_refuses_bad_usage_in_one_line(monkeypatch, tmp_path, args, message):
    import pdtrace.recording.vllm as hooks

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.33.0")
    result = runner.invoke(app, args, standalone_mode=False)
    assert isinstance(result.exception, UsageError), result.output
    assert message in str(result.exception) and result.exception.exit_code == 2


def test_a_campaign_refuses_a_directory_that_holds_failures(monkeypatch, tmp_path):
    import pdtrace.recording.vllm as hooks

    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.33.0")
    (tmp_path / "failure-0001").mkdir()
    result = runner.invoke(app, ["chaos", "-o", str(tmp_path)], standalone_mode=False)
    assert isinstance(result.exception, UsageError) and "already holds failures" in str(result.exception)


def test_a_campaign_built_in_code_runs_only_the_workloads_its_release_drives(monkeypatch, tmp_path):
    """The default workloads include offload; a campaign on a release whose OffloadingConnector reports per request
    (before 0.23) leaves it out wherever it is built (a vLLM-tier test built one in code and drew an offload trial
    on 0.11.0: a harness error), and a campaign of offload alone there is refused in one line."""
    from pdtrace.chaos import campaign as campaign_module
    from pdtrace.chaos import runnable_workloads

    monkeypatch.setattr(campaign_module, "offload_supported", lambda version: False)
    assert runnable_workloads(("pd", "pp", "offload", "single"), "0.11.0") == ("pd", "pp", "single")
    with pytest.raises(UsageError, match="offload needs vLLM 0.23"):
        campaign_module.run_campaign(campaign_module.Campaign(output=tmp_path / "out", workloads=("offload",)), None,
                                     "0.11.0")
    monkeypatch.setattr(campaign_module, "offload_supported", lambda version: True)
    assert runnable_workloads(("pd", "offload"), "0.26.0") == ("pd", "offload")
