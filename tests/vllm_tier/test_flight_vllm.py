"""vLLM tier: flight mode on vLLM's REAL EngineCore (fake executor): vLLM raising out of a step or a client request
dumps the window, through the same hook that records `engine_error`; a healthy run writes nothing.

pdtrace is loaded by EngineCore.__init__ itself (the general plugins), with PDTRACE_FLIGHT set as users set it.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

import harness as H  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def flight_plugin(live_plugin, monkeypatch):
    """The recording switch on in flight mode (60 s) and vLLM's "plugins loaded" flag cleared (`live_plugin`)."""
    monkeypatch.setenv("PDTRACE_FLIGHT", "60")
    return live_plugin


_ENGINES: list = []


@pytest.fixture(autouse=True)
def _shutdown_engines():
    yield
    while _ENGINES:
        _ENGINES.pop().scheduler.shutdown()


def _wait_for_dump() -> None:
    from pdtrace.recording import flight

    ctl = flight.controller()
    assert ctl is not None and ctl.wait_idle(60.0) and ctl.errors == 0, ctl and ctl.last_error


def _only_the_dump_written(trace) -> None:
    outside = [p for p in trace.rglob("*.parquet") if not p.relative_to(trace).parts[0].startswith("dump-")]
    assert outside == []


def test_step_assert_dumps_the_window_and_analyze_finds_the_fault(flight_plugin, model_dir):
    import pdtrace

    vc = H.make_vllm_config(model_dir, kv_role="kv_producer", engine_id="prefill-0", pp=2,
                            max_num_batched_tokens=256)
    vc.scheduler_config.async_scheduling = False
    engine = H.make_engine(vc, pp=2)
    _ENGINES.append(engine)
    from pdtrace.recording import session

    assert session.flight() is not None and session.flight().seconds == 60.0
    type(engine.model_executor).inject = {0: {"finished_sending": {"r2"}}}
    H.engine_add(engine, H.make_request("r1", 40, max_tokens=4))
    H.engine_add(engine, H.make_request("r2", 300, remote_decode=True))
    with pytest.raises(AssertionError):
        for _ in range(200):
            H.engine_step(engine)
    _wait_for_dump()
    dump = flight_plugin / "dump-0001"
    manifest = json.loads((dump / "_manifest.json").read_text())
    assert manifest["flight"] is True and manifest["reason"] == "engine_error"
    # an engine younger than its 60 s window: the dump is its whole recording, judged as a whole trace
    assert manifest["window_start_ns"] is None and all(p["whole"] for p in manifest["processes"].values())
    _only_the_dump_written(flight_plugin)
    events = pdtrace.open_trace(str(dump)).table.to_pylist()
    error = [e for e in events if e["kind"] == "engine_error"]
    assert len(error) == 1 and json.loads(error[0]["detail"])["error"].startswith("AssertionError")
    assert [e for e in events if e["kind"] == "kv_send_done" and e["req"] == "r2"]
    findings = pdtrace.analyze(dump)
    hit = findings[(findings["rule"] == "completion_before_finish") & (findings["req"] == "r2")]
    assert list(hit["severity"]) == ["error"] and not findings.attrs.get("window")


def test_client_request_error_dumps(flight_plugin, model_dir):
    if H.release_key() < (0, 28):
        pytest.skip(f"vLLM {H.release()}'s add_request does not check for a duplicate request id")
    import pdtrace

    engine = H.make_engine_proc(H.make_vllm_config(model_dir, kv_role=None), pp=1)
    _ENGINES.append(engine)
    H.client_add(engine, H.make_request("r0", 40, max_tokens=8))
    engine._process_input_queue()
    for _ in range(2):
        H.engine_step(engine)
    H.client_add(engine, H.make_request("r0", 40, max_tokens=8))
    with pytest.raises(AssertionError, match="duplicate request id"):
        engine.run_busy_loop()
    _wait_for_dump()
    dump = flight_plugin / "dump-0001"
    events = pdtrace.open_trace(str(dump)).table.to_pylist()
    error, = [e for e in events if e["kind"] == "engine_error"]
    assert json.loads(error["detail"])["where"] == "_handle_client_request"
    assert [e["step"] for e in events if e["kind"] == "sched"] == [0, 1]


def test_healthy_run_writes_nothing(flight_plugin, model_dir):
    engine = H.make_engine_proc(H.make_vllm_config(model_dir, kv_role=None), pp=1)
    _ENGINES.append(engine)
    for i in range(3):
        H.engine_add(engine, H.make_request(f"r{i}", 40, max_tokens=4))
    for _ in range(30):
        H.engine_step(engine)
    from pdtrace.recording import flight, session

    rec, = session.recorders()
    assert isinstance(rec, flight.FlightRecorder) and rec.buffered_events > 0
    session.close_all()
    assert not list(flight_plugin.rglob("*.parquet")) and not list(flight_plugin.glob("dump-*"))
