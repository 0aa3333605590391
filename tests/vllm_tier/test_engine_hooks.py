"""vLLM tier: vLLM 0.33.0's REAL EngineCore (batch queue of 2, as with PP=2) on a fake executor.

EngineCore.__init__ loads the general plugins itself, exactly as in a live run: the tests only set
PDTRACE_TRACE_DIR and let vLLM call pdtrace's entry point (which then wraps the executor at the first step).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

import harness as H  # noqa: E402

pytestmark = pytest.mark.vllm


_ENGINES: list = []


@pytest.fixture(autouse=True)
def _shutdown_engines():
    yield
    while _ENGINES:
        _ENGINES.pop().scheduler.shutdown()  # EngineCore.shutdown needs an accelerator


def _engine(model_dir, kv_role, engine_id, **kwargs):
    vc = H.make_vllm_config(model_dir, kv_role=kv_role, engine_id=engine_id, pp=2, **kwargs)
    vc.scheduler_config.async_scheduling = False  # V1 runner + PP: vLLM refuses async (config/vllm.py:1665)
    engine = H.make_engine(vc, pp=2)
    _ENGINES.append(engine)
    assert H.step_fn_name(engine) == "step_with_batch_queue" and engine.batch_queue_size == 2
    return engine


def _run(engine, max_steps=200):
    for _ in range(max_steps):
        if not engine.scheduler.has_requests() and not H.engine_busy(engine):
            return
        H.engine_step(engine)
    raise AssertionError("engine did not drain")


def test_step_ids_consistent_between_scheduler_submit_and_output(live_plugin, model_dir):
    from pdtrace.recording.vllm import hooks_installed

    engine = _engine(model_dir, None, None)
    assert hooks_installed()                          # loaded by EngineCore.__init__ through the entry point
    for i in range(4):
        H.engine_add(engine, H.make_request(f"r{i}", 40, max_tokens=6))
    _run(engine)

    events = H.close_and_read(live_plugin)
    sched = [e["step"] for e in H.of_kind(events, "sched")]
    submit = [e["step"] for e in H.of_kind(events, "step_submit")]
    output = [e["step"] for e in H.of_kind(events, "step_output")]
    assert sched == list(range(len(sched))) and len(sched) > 4
    if H.release_key() >= (0, 10, 2):
        assert submit == sched                        # vLLM 0.33 submits every step, empty ones included
    else:                                             # 0.10.1.1's step_with_batch_queue skips empty schedules
        tokens = {e["step"]: e["n"] for e in H.of_kind(events, "sched")}
        assert submit == [s for s in sched if tokens[s]]
    assert output == submit                           # outputs come back in FIFO order
    order = {(e["kind"], e["step"]): i for i, e in enumerate(events)
             if e["kind"] in ("sched", "step_submit", "step_output")}
    assert all(order[("sched", s)] < order[("step_submit", s)] < order[("step_output", s)] for s in submit)
    in_flight = [e["n"] for e in H.of_kind(events, "step_submit")]
    # 0.10.2 to 0.22.x queue a second batch only while the oldest is not done (core.py step_with_batch_queue: `not
    # batch_queue[-1][0].done()`, 0.22.0 core.py:526-529); the fake executor's futures are done at once, so one
    # batch is in flight there. 0.10.1.1 fills its queue.Queue first; 0.23+ queue without looking at the oldest
    # batch (0.23.0 core.py:541-546).
    most = 1 if (0, 10, 2) <= H.release_key() < (0, 23) else 2
    assert max(in_flight) == most and set(in_flight) <= {1, 2}
    assert all("wait_ns" in e["detail"] for e in H.of_kind(events, "step_output"))
    assert {e["step"] for e in H.of_kind(events, "req_sched")} <= set(sched)
    assert len(H.of_kind(events, "req_finish")) == 4
    assert {e["component"] for e in H.of_kind(events, "step_submit", "step_output")} == {"engine"}


def test_deferred_free_on_kv_consumer_lands_at_its_fence(live_plugin, model_dir):
    if not H.behaviour().deferred_frees:
        pytest.skip(f"vLLM {H.release()} frees every block at once (no deferred frees before 0.28)")
    engine = _engine(model_dir, "kv_consumer", "decode-0")
    assert engine.scheduler.defer_block_free
    H.engine_add(engine, H.make_request("a", 40, max_tokens=20))
    H.engine_add(engine, H.make_request("b", 40, max_tokens=20))
    for _ in range(4):
        H.engine_step(engine)
    (_, newest, _), = engine.batch_queue
    victim = next(iter(newest.num_scheduled_tokens))
    engine.aborts_queue.put([victim])                 # a client abort, handled inside the next step
    H.engine_step(engine)
    _run(engine)

    events = H.close_and_read(live_plugin)
    free_at = next(i for i, e in enumerate(events) if e["kind"] == "blocks_free" and e["req"] == victim)
    free = events[free_at]
    assert (free["deferred"], free["reason"], free["step"]) == (True, "aborted", None)
    submitted = {e["step"] for e in events[:free_at] if e["kind"] == "step_submit"}
    answered = {e["step"] for e in events[:free_at] if e["kind"] == "step_output"}
    in_flight = submitted - answered
    assert len(in_flight) == 2                        # two batches in flight when vLLM freed the blocks
    pool_at = next(i for i, e in enumerate(events) if e["kind"] == "blocks_pool_free"
                   and set(e["blocks"]) & set(free["blocks"]))
    pool = events[pool_at]
    assert sorted(pool["blocks"]) == sorted(free["blocks"]) and pool["req"] is None
    assert pool["detail"]["fence"] == free["detail"]["fence"]
    assert pool["step"] == max(in_flight)             # returned in the update of the newest step in flight
    output_at = next(i for i, e in enumerate(events) if e["kind"] == "step_output" and e["step"] == max(in_flight))
    assert free_at < output_at < pool_at
    between = [e["detail"]["free_blocks"] for e in events[free_at:pool_at] if e["kind"] == "sched"]
    after = [e["detail"]["free_blocks"] for e in events[pool_at:] if e["kind"] == "sched"]
    assert between and after and max(between) + len(free["blocks"]) <= after[0]


def test_finished_sending_for_a_running_request_is_recorded_before_vllm_asserts(live_plugin, model_dir):
    import pdtrace

    engine = _engine(model_dir, "kv_producer", "prefill-0", max_num_batched_tokens=256)
    type(engine.model_executor).inject = {0: {"finished_sending": {"r2"}}}  # in chunk 1's output
    H.engine_add(engine, H.make_request("r2", 300, remote_decode=True))
    with pytest.raises(AssertionError):
        _run(engine)

    events = H.close_and_read(live_plugin)
    send = H.of_kind(events, "kv_send_done", req="r2")
    assert len(send) == 1 and send[0]["status"] == "RUNNING" and send[0]["step"] == 0
    error = H.of_kind(events, "engine_error")
    assert len(error) == 1 and error[0]["step"] == 0 and error[0]["detail"]["error"].startswith("AssertionError")
    assert events.index(send[0]) < events.index(error[0])
    assert not H.of_kind(events, "req_finish", req="r2")

    findings = pdtrace.analyze(live_plugin)
    hit = findings[(findings["rule"] == "completion_before_finish") & (findings["req"] == "r2")]
    assert len(hit) == 1 and hit.iloc[0]["subrule"] == "send"


class _TickClock:
    """A recording clock that moves by exactly TICK ns per read: durations become counts of reads."""

    TICK = 1_000

    def __init__(self) -> None:
        self.now = 1_767_225_600_000_000_000

    def __call__(self) -> int:
        self.now += self.TICK
        return self.now


def test_durations_come_from_the_sessions_clock(live_plugin, model_dir):
    """With a clock configured (as the dry run does), dur_ns and wait_ns are differences of that clock's readings,
    not of perf_counter_ns: one read before and one after, nothing recorded in between in this run."""
    from pdtrace.recording import session

    clock = _TickClock()
    session.configure(live_plugin, source="test", clock=clock)   # EngineCore's plugin load keeps this session
    vc = H.make_vllm_config(model_dir, kv_role=None)
    vc.scheduler_config.async_scheduling = False      # EngineCore.step: no batch queue
    engine = H.make_engine(vc, pp=1)
    _ENGINES.append(engine)
    assert H.step_fn_name(engine) == "step"
    for i in range(3):
        H.engine_add(engine, H.make_request(f"r{i}", 40, max_tokens=4))
    _run(engine)

    events = H.close_and_read(live_plugin)
    tick = _TickClock.TICK
    assert {e["ts_ns"] % tick for e in events} == {clock.now % tick}   # every timestamp read from the clock
    durations = [e["detail"]["dur_ns"] for e in H.of_kind(events, "sched")]
    assert len(durations) > 3 and set(durations) == {tick}
    waits = [e["detail"]["wait_ns"] for e in H.of_kind(events, "step_output")]
    tokens = [e["n"] for e in H.of_kind(events, "sched")]
    # A step that ran the model waits on execute_model's future, then on sample_tokens (two timed waits); an empty
    # one gets its output from execute_model's future alone. Before 0.11.1 execute_model also samples: one wait.
    model_waits = 2 if H.release_key() >= (0, 11, 1) else 1
    assert 0 in tokens and waits == [model_waits * tick if n else tick for n in tokens]


@pytest.fixture
def busy_loop_engine(live_plugin, model_dir):
    """A real EngineCoreProc busy loop on the fake executor (one batch in flight), pdtrace loaded by its __init__."""
    engine = H.make_engine_proc(H.make_vllm_config(model_dir, kv_role=None), pp=1)
    _ENGINES.append(engine)
    return engine


def test_client_request_error_is_recorded_and_reraised_unchanged(live_plugin, busy_loop_engine):
    """A duplicate request id from the client trips the scheduler's assert in add_request, between steps, in
    EngineCoreProc._handle_client_request: engine_error (where, error, the request), flushed, and vLLM's own
    exception goes on to kill the busy loop."""
    if H.release_key() < (0, 18):  # 0.18.0 scheduler.py:1710 asserts "duplicate request id"
        pytest.skip(f"vLLM {H.release()}'s add_request does not check for a duplicate request id")
    import pdtrace

    engine = busy_loop_engine
    H.client_add(engine, H.make_request("r0", 40, max_tokens=8))
    engine._process_input_queue()
    for _ in range(2):
        H.engine_step(engine)
    H.client_add(engine, H.make_request("r0", 40, max_tokens=8))   # same id again
    with pytest.raises(AssertionError, match="duplicate request id") as raised:
        engine.run_busy_loop()
    assert "_handle_client_request" in {f.name for f in raised.traceback}   # raised there, not in a step

    flushed = pdtrace.open_trace(str(live_plugin)).table.to_pylist()      # before any close: the flush wrote it
    assert [r["kind"] for r in flushed].count("engine_error") == 1
    events = H.close_and_read(live_plugin)
    error, = H.of_kind(events, "engine_error")
    assert error["component"] == "engine" and error["step"] is None      # between steps
    assert error["detail"] == {"error": "AssertionError: duplicate request id", "where": "_handle_client_request",
                               "request": "ADD", "req": "r0"}
    assert len(H.of_kind(events, "req_add", req="r0")) == 1
    assert events.index(error) > max(events.index(e) for e in H.of_kind(events, "step_output"))
    assert [e["step"] for e in H.of_kind(events, "sched")] == [0, 1]


def test_executor_failure_reported_to_the_busy_loop_is_recorded(live_plugin, busy_loop_engine):
    from vllm.v1.engine import EngineCoreRequestType

    engine = busy_loop_engine
    H.client_add(engine, H.make_request("r0", 40, max_tokens=8))
    engine.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, b""))  # what the executor's callback puts
    with pytest.raises(RuntimeError, match="Executor failed"):
        engine.run_busy_loop()
    events = H.close_and_read(live_plugin)
    error, = H.of_kind(events, "engine_error")
    assert error["detail"] == {"error": "RuntimeError: Executor failed.", "where": "_handle_client_request",
                               "request": "EXECUTOR_FAILED"}


def test_client_request_hook_failure_leaves_vllms_exception_alone(live_plugin, busy_loop_engine, monkeypatch):
    """pdtrace failing while it records the error: recording switches off, vLLM's exception still propagates."""
    if H.release_key() < (0, 18):  # 0.18.0 scheduler.py:1710 asserts "duplicate request id"
        pytest.skip(f"vLLM {H.release()}'s add_request does not check for a duplicate request id")
    from pdtrace.recording.vllm import v0_33
    from pdtrace.recording.vllm._runtime import RUNTIME

    engine = busy_loop_engine
    H.client_add(engine, H.make_request("r0", 40, max_tokens=8))
    engine._process_input_queue()
    H.engine_step(engine)

    class BrokenChannel:
        def emit(self, *args, **kwargs):
            raise RuntimeError("boom inside pdtrace")

    from pdtrace.recording.vllm._common import state_of

    monkeypatch.setattr(state_of(engine), "eng", BrokenChannel())   # the engine_error emit fails
    H.client_add(engine, H.make_request("r0", 40, max_tokens=8))
    with pytest.raises(AssertionError, match="duplicate request id"):
        engine.run_busy_loop()
    assert RUNTIME.errors == 1 and not RUNTIME.active
    events = H.close_and_read(live_plugin)
    assert not H.of_kind(events, "engine_error")
    off, = H.of_kind(events, "recorder_off")
    assert "_handle_client_request" in off["detail"]["error"] and "boom inside pdtrace" in off["detail"]["error"]


@pytest.mark.parametrize("batch_queue", [False, True], ids=["step", "batch_queue"])
def test_runs_of_empty_steps_are_coalesced(live_plugin, model_dir, batch_queue):
    """A prefill finished with a delayed free: vLLM steps with nothing to schedule until the send completes. Those
    empty steps, with nothing else recorded between them, become one sched row with empty_run = k; step ids still
    count every schedule() call, and the step that brings the completion keeps its own rows."""
    import pdtrace
    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.analysis.steps import step_table

    if batch_queue:
        engine = _engine(model_dir, "kv_producer", "prefill-0")
    else:
        vc = H.make_vllm_config(model_dir, kv_role="kv_producer", engine_id="prefill-0")
        vc.scheduler_config.async_scheduling = False
        engine = H.make_engine(vc, pp=1)
        _ENGINES.append(engine)
        assert H.step_fn_name(engine) == "step"
    executor = type(engine.model_executor)
    executor.submitted = []
    executor.inject = {30: {"finished_sending": {"r1"}}}      # in the output of the 31st step
    H.engine_add(engine, H.make_request("r1", 40, remote_decode=True))
    _run(engine)
    calls = len(executor.submitted)                           # every schedule() call was submitted
    if calls <= 30 and not H.behaviour().steps_for_pending_sends:
        pytest.skip(f"vLLM {H.release()} made {calls} steps: no run of empty steps waiting for the send")
    assert calls > 30

    events = H.close_and_read(live_plugin)
    sched = H.of_kind(events, "sched")
    weights = [e["detail"].get("empty_run", 1) for e in sched]
    assert sum(weights) == calls                              # every step counted once
    steps = [e["step"] for e in sched]
    assert [s + w for s, w in zip(steps, weights)] == steps[1:] + [calls]   # ids advance by k
    runs = [e for e in sched if "empty_run" in e["detail"]]
    assert runs and max(w for w in weights) >= 20             # the wait for the send is one row, not 20+
    assert all(e["n"] == 0 and e["detail"]["empty_run"] >= 2 for e in runs)
    covered = {s for e in runs for s in range(e["step"] + 1, e["step"] + e["detail"]["empty_run"])}
    assert not [e for e in events if e["step"] in covered]   # a coalesced step left no row at all
    for e in runs:                                            # nothing else happened inside a run
        at = events.index(e)
        end = e["step"] + e["detail"]["empty_run"]
        between = [x for x in events[at + 1:] if x["step"] is None or x["step"] < end]
        assert {x["kind"] for x in between} <= {"step_submit", "step_output"}
    send, = H.of_kind(events, "kv_send_done", req="r1")
    assert send["step"] in steps                              # the completion's step has its own sched row
    # The analyzers read the coalesced rows as k steps.
    table = step_table(AnalysisContext(pdtrace.open_trace(str(live_plugin))))
    assert table["empty_run"].fillna(0).sum() == calls
    findings = pdtrace.analyze(live_plugin)
    assert not (findings["severity"] == "error").any()
