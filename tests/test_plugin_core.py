"""Core tier (no vLLM needed): the plugin entry point, the recording session and the checked hook patcher."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from pdtrace.recording import plugin, session
from pdtrace.recording.vllm import _patching, hooks_installed, install_hooks, supported_versions, uninstall_hooks
from pdtrace.recording.vllm._common import instance_of, split_dp_suffix
from pdtrace.recording.vllm._runtime import RUNTIME


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    session.reset()
    uninstall_hooks()
    RUNTIME.reset()


def _run_python(code: str, env_extra: dict[str, str] | None = None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "PDTRACE_TRACE_DIR"}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_switch_off_does_nothing():
    out = _run_python("""
        import sys
        from pdtrace.recording import plugin, session
        plugin.install()
        print(session.is_configured(), 'pdtrace.recording.vllm' in sys.modules, 'pyarrow' in sys.modules)
    """)
    assert out == "False False False"


def test_recording_path_imports_only_stdlib_and_pyarrow():
    out = _run_python("""
        import sys
        from pdtrace.recording import plugin, session
        import pdtrace.recording.vllm, pdtrace.recording.vllm.v0_33, pdtrace.recording.vllm._patching
        hooks = sorted(m for m in ('pandas', 'numpy', 'typer', 'rich', 'matplotlib', 'vllm', 'torch', 'pyarrow')
                       if m in sys.modules)
        import pdtrace.recording.recorder
        recorder = sorted(m for m in ('pandas', 'typer', 'rich', 'matplotlib', 'vllm', 'torch') if m in sys.modules)
        print(hooks, recorder)
    """)
    assert out == "[] []"


def test_unknown_vllm_version_warns_once_and_records_nothing(tmp_path, monkeypatch, caplog):
    import pdtrace.recording.vllm as hooks

    trace = tmp_path / "trace"
    monkeypatch.setenv("PDTRACE_TRACE_DIR", str(trace))
    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.10.1")
    with caplog.at_level(logging.WARNING, logger="pdtrace"):
        plugin.install()
        plugin.install()
        assert install_hooks() is False
    warnings = [r.getMessage() for r in caplog.records if r.name == "pdtrace"]
    assert len(warnings) == 1
    assert "0.10.1" in warnings[0] and all(v in warnings[0] for v in supported_versions())
    assert not hooks_installed() and not RUNTIME.active
    assert not trace.exists() or not any(trace.rglob("*"))


def test_without_vllm_install_hooks_returns_false(caplog):
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    with caplog.at_level(logging.WARNING, logger="pdtrace"):
        assert install_hooks() is False
    assert any("not installed" in r.getMessage() for r in caplog.records)


def test_internal_error_is_counted_logged_once_and_switches_recording_off(tmp_path, caplog):
    import pdtrace

    session.configure(tmp_path / "trace", source="test")
    rec = session.recorder("prefill-0", "prefill", 0)
    rec.channel("scheduler").emit("req_add", req="r1", n=3)
    RUNTIME.active = True
    with caplog.at_level(logging.WARNING, logger="pdtrace"):
        for _ in range(3):
            try:
                raise KeyError("no such thing")
            except KeyError as exc:
                RUNTIME.fail("unit", exc)
    assert RUNTIME.errors == 3 and not RUNTIME.active
    assert len([r for r in caplog.records if r.name == "pdtrace"]) == 1
    rec.channel("scheduler").emit("req_add", req="r2", n=3)  # after recorder_off: not recorded
    session.close_all()
    rows = pdtrace.open_trace(tmp_path / "trace").table.to_pylist()
    assert [(r["kind"], r["req"]) for r in rows] == [("req_add", "r1"), ("recorder_off", None)]
    assert "KeyError" in rows[1]["detail"]


def test_session_keeps_one_recorder_per_instance_and_dp_rank(tmp_path):
    session.configure(tmp_path, source="test")
    a = session.recorder("p", "prefill", 0)
    assert session.recorder("p", "prefill", 0) is a
    assert session.recorder("p", "prefill", 1) is not a
    assert len(session.recorders()) == 2
    session.configure(tmp_path / "other", source="test")  # a new session closes the old recorders
    assert session.recorders() == [] and a.closed


def test_hook_durations_use_the_sessions_clock_else_perf_counter(tmp_path, monkeypatch):
    import time

    from pdtrace.recording.vllm._common import SchedulerState

    ticks = iter(range(10**18, 10**18 + 100, 5))

    def clock() -> int:
        return next(ticks)

    session.configure(tmp_path / "dry", source="dryrun", clock=clock)
    assert session.duration_clock() is clock
    state = SchedulerState(None, "p", "prefill", 0)   # what schedule() and the futures' waits time with
    assert state.now is clock and state.rec.clock is clock
    session.reset()                                   # a new session forgets the old clock
    monkeypatch.setenv(session.TRACE_DIR_ENV, str(tmp_path / "live"))
    assert session.configure_from_env("vllm-0.33.0")
    assert session.duration_clock() is time.perf_counter_ns
    assert SchedulerState(None, "p", "prefill", 0).now is time.perf_counter_ns


def test_instance_ids_follow_the_format_rules():
    assert split_dp_suffix("prefill-0_dp3") == ("prefill-0", 3)
    assert split_dp_suffix("engine_dpx") == ("engine_dpx", None)
    kv = SimpleNamespace(engine_id="dec_dp1", kv_role="kv_consumer")
    cfg = SimpleNamespace(kv_transfer_config=kv, parallel_config=SimpleNamespace(data_parallel_rank=0),
                          instance_id="ignored")
    assert instance_of(cfg) == ("dec", "decode", 1)
    cfg = SimpleNamespace(kv_transfer_config=None, parallel_config=SimpleNamespace(data_parallel_rank=2),
                          instance_id="abc")
    assert instance_of(cfg) == ("abc", "none", 2)


def _config(instance_id: str, kv: object = None, dp_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=kv, parallel_config=SimpleNamespace(data_parallel_rank=dp_rank),
                           instance_id=instance_id)


def test_engine_identity_is_fixed_when_the_executor_starts_and_survives_a_recomputed_instance_id(monkeypatch):
    import os

    from pdtrace.recording.vllm import _common

    monkeypatch.delenv(_common.ENGINE_ENV, raising=False)
    cfg = _config("1764000000000000001")
    assert _common.fix_engine_identity(cfg) == ("1764000000000000001", "none", 0)
    cfg.instance_id = "1764000000000000999"  # vLLM's __post_init__ again, after the workers started
    assert instance_of(cfg) == ("1764000000000000001", "none", 0)
    assert instance_of(cfg, worker=True) == ("1764000000000000001", "none", 0)
    assert os.environ[_common.ENGINE_ENV] == f"{os.getpid()}|0|none|1764000000000000001"
    # A config whose executor never started through the hook keeps the config's own (today's) value.
    assert instance_of(_config("42")) == ("42", "none", 0)
    # Two engines of one process stay two, each with what it had.
    other = _config("1764000000000000002_dp1")
    assert _common.fix_engine_identity(other) == ("1764000000000000002", "none", 1)
    assert instance_of(cfg)[0] != instance_of(other)[0]
    # With a connector the engine_id is the identity, as before.
    kv = SimpleNamespace(engine_id="prefill-7_dp2", kv_role="kv_producer")
    assert _common.fix_engine_identity(_config("x", kv)) == ("prefill-7", "prefill", 2)


_CHILD = textwrap.dedent("""
    import json, os, sys
    from types import SimpleNamespace
    from pdtrace.recording.vllm._common import instance_of
    cfg = SimpleNamespace(kv_transfer_config=None, parallel_config=SimpleNamespace(data_parallel_rank=0),
                          instance_id="the-copy-says-otherwise")
    print(json.dumps([list(instance_of(cfg, worker=True)), list(instance_of(cfg))]))
""")


def test_workers_the_engine_starts_take_its_identity_forked_or_spawned(monkeypatch):
    import json
    import multiprocessing
    import os

    from pdtrace.recording.vllm import _common

    monkeypatch.delenv(_common.ENGINE_ENV, raising=False)
    cfg = _config("1764000000000000001")
    _common.fix_engine_identity(cfg)
    cfg.instance_id = "rebuilt"
    # Forked (vLLM's default on Linux): the plugin does not run again; same config object, same identity.
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_send_identity, args=(child, cfg))
    proc.start()
    assert parent.recv() == ("1764000000000000001", "none", 0)
    proc.join(30)
    # Spawned: a new interpreter, a copy of the config with another instance_id: the engine's exported identity.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60)
    worker, engine_side = json.loads(out.stdout.strip().splitlines()[-1])
    assert worker == ["1764000000000000001", "none", 0]
    assert engine_side == ["the-copy-says-otherwise", "none", 0]  # a scheduler never takes an inherited identity
    # A grandchild (a process the worker starts, not the engine) does not take it: only the engine's own children.
    grand = subprocess.run([sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call([sys.executable, "
                            f"'-c', {_CHILD!r}]))"], env=env, capture_output=True, text=True, timeout=60)
    assert json.loads(grand.stdout.strip().splitlines()[-1])[0] == ["the-copy-says-otherwise", "none", 0]


def _send_identity(conn, cfg) -> None:
    conn.send(instance_of(cfg, worker=True))
    conn.close()


# ------------------------------------------------------------------------------------ checked patching


_MODULE = """
class Engine:
    def step(self, batch, budget=1):
        return ("step", batch, budget)
"""


def _counting(orig):
    def wrapper(self, *args, **kwargs):
        wrapper.calls += 1
        return orig(self, *args, **kwargs)

    wrapper.calls = 0
    return wrapper


def _module(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_patcher_wraps_checked_methods_and_reverts(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "pdt_fake_eager")
    import pdt_fake_eager

    original = pdt_fake_eager.Engine.step
    patcher = _patching.Patcher([_patching.Hook("pdt_fake_eager", "Engine", "step", _counting, ("batch",))],
                                on_lazy_mismatch=pytest.fail)
    patcher.apply()
    assert pdt_fake_eager.Engine().step(7) == ("step", 7, 1)
    assert pdt_fake_eager.Engine.step.calls == 1
    assert getattr(pdt_fake_eager.Engine.step, _patching.ORIGINAL_ATTR) is original
    patcher.revert()
    assert pdt_fake_eager.Engine.step is original


def test_patcher_never_guesses_a_name_or_parameter(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "pdt_fake_strict")
    import pdt_fake_strict

    original = pdt_fake_strict.Engine.step
    for hooks in ([_patching.Hook("pdt_fake_strict", "Engine", "step", _counting, ("batch",)),
                   _patching.Hook("pdt_fake_strict", "Engine", "stpe", _counting)],
                  [_patching.Hook("pdt_fake_strict", "Engine", "step", _counting, ("scheduler_output",))],
                  [_patching.Hook("pdt_fake_strict", "Engnie", "step", _counting)]):
        with pytest.raises(_patching.TableMismatch):
            _patching.Patcher(hooks, on_lazy_mismatch=pytest.fail).apply()
        assert pdt_fake_strict.Engine.step is original  # nothing of the table was applied


def test_lazy_hooks_apply_when_the_module_is_imported(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "pdt_fake_lazy")
    patcher = _patching.Patcher([_patching.Hook("pdt_fake_lazy", "Engine", "step", _counting, ("batch",),
                                                lazy=True)], on_lazy_mismatch=pytest.fail)
    patcher.apply()
    try:
        assert "pdt_fake_lazy" not in sys.modules      # pdtrace did not import it
        import pdt_fake_lazy

        assert pdt_fake_lazy.Engine().step(1, budget=2) == ("step", 1, 2)
        assert pdt_fake_lazy.Engine.step.calls == 1
    finally:
        patcher.revert()
    assert not hasattr(pdt_fake_lazy.Engine.step, _patching.ORIGINAL_ATTR)


def test_forked_child_records_under_its_own_pid(tmp_path):
    import os

    import pdtrace

    session.configure(tmp_path / "trace", source="test")
    parent = session.recorder("engine", "both", 0)
    parent.channel("scheduler").emit("req_add", req="before-fork", n=1)
    pid = os.fork()
    if pid == 0:  # child: the session is inherited, its recorder is opened anew under the child's pid
        code = 1
        try:
            child = session.recorder("engine", "both", 0)
            if child is not parent:
                child.channel("scheduler").emit("req_add", req="in-child", n=2)
                session.close_all()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    parent.channel("scheduler").emit("req_add", req="after-fork", n=3)
    session.close_all()
    rows = pdtrace.open_trace(tmp_path / "trace").table.to_pylist()
    by_req = {r["req"]: r["pid"] for r in rows}
    assert sorted(by_req) == ["after-fork", "before-fork", "in-child"]  # nothing written twice
    assert len(rows) == 3
    assert by_req["before-fork"] == by_req["after-fork"] == os.getpid() and by_req["in-child"] == pid


def _empty_step(state, step, free_blocks=10):
    """The rows one empty step leaves in a synchronous engine loop: sched (0 tokens), step_submit, step_output."""
    state.ch.emit("sched", step, None, None, 0, None, None, None, None,
                  {"running": 0, "waiting": 0, "waiting_kv": 0, "free_blocks": free_blocks, "dur_ns": 100})
    state.eng.emit("step_submit", step=step, n=1)
    state.eng.emit("step_output", step=step, detail={"wait_ns": 5})


def test_empty_steps_fold_only_while_nothing_else_is_recorded(tmp_path):
    """The vLLM hook's fold (v0_33._coalesce_empty_step, run after the update of an empty step) on hand-made rows:
    consecutive empty steps join the run's sched row; any other event, a change of the row's counters or a write
    of the buffer ends the run, and a folded step leaves no row."""
    import pdtrace
    from pdtrace.recording.vllm import v0_33
    from pdtrace.recording.vllm._common import SchedulerState

    session.configure(tmp_path / "t", source="test")
    st = SchedulerState(None, "p", "prefill", 0)
    for step in range(0, 4):                       # steps 0-3: one run
        _empty_step(st, step)
        v0_33._coalesce_empty_step(st, step)
    st.ch.emit("req_add", req="r1", n=16)          # another event: step 4 starts a new run
    for step in range(4, 6):
        _empty_step(st, step)
        v0_33._coalesce_empty_step(st, step)
    _empty_step(st, 6, free_blocks=9)              # the pool changed: its own row, heading the next run
    v0_33._coalesce_empty_step(st, 6)
    _empty_step(st, 7, free_blocks=9)
    v0_33._coalesce_empty_step(st, 7)
    st.rec.flush()                                 # written: step 8 cannot join step 6's row any more
    _empty_step(st, 8, free_blocks=9)
    v0_33._coalesce_empty_step(st, 8)
    _empty_step(st, 9, free_blocks=9)
    v0_33._coalesce_empty_step(st, 9)
    session.close_all()

    import json

    rows = sorted(pdtrace.open_trace(tmp_path / "t").table.to_pylist(), key=lambda r: r["seq"])
    brief = [(r["kind"], r["step"], json.loads(r["detail"]).get("empty_run") if r["detail"] else None)
             for r in rows if r["kind"] != "engine_config"]
    assert brief == [
        ("sched", 0, 4), ("step_submit", 0, None), ("step_output", 0, None),
        ("req_add", None, None),
        ("sched", 4, 2), ("step_submit", 4, None), ("step_output", 4, None),
        ("sched", 6, 2), ("step_submit", 6, None), ("step_output", 6, None),
        ("sched", 8, 2), ("step_submit", 8, None), ("step_output", 8, None),
    ]
    first = json.loads(next(r["detail"] for r in rows if r["kind"] == "sched"))
    assert first["dur_ns"] == 400 and first["free_blocks"] == 10   # the run's schedule() time, summed


def test_a_run_of_empty_steps_stands_for_at_most_its_span_cap(tmp_path):
    """An engine stepping idly until it is stopped: the run is cut every RUN_MAX_SPAN_NS, so the trace's last row
    is within that of the last step (the leak rules measure "held until the end of the trace" from it)."""
    import json

    import pdtrace
    from pdtrace.recording.vllm import v0_33
    from pdtrace.recording.vllm._common import SchedulerState

    now = [1_000_000_000]
    session.configure(tmp_path / "t", source="test", clock=lambda: now[0])
    st = SchedulerState(None, "p", "prefill", 0)
    step_ns = 1_000_000  # vLLM's ~1 kHz of empty steps
    for step in range(1000):  # one second of them
        _empty_step(st, step)
        v0_33._coalesce_empty_step(st, step)
        now[0] += step_ns
    session.close_all()

    rows = pdtrace.open_trace(tmp_path / "t").table.to_pylist()
    sched = sorted((r for r in rows if r["kind"] == "sched"), key=lambda r: r["step"])
    runs = [json.loads(r["detail"]).get("empty_run", 1) for r in sched]
    assert sum(runs) == 1000                                   # every step counted once
    per_run = v0_33.RUN_MAX_SPAN_NS // step_ns
    assert runs == [per_run] * (1000 // per_run)               # cut at the cap, not later
    last_step_ts = 1_000_000_000 + 999 * step_ns
    assert 0 <= last_step_ts - max(r["ts_ns"] for r in rows) < v0_33.RUN_MAX_SPAN_NS


def test_hook_state_is_kept_beside_vllm_objects_never_on_them():
    import gc

    from pdtrace.recording.vllm._common import _REFS, _STATES, attach_state, state_of

    class Scheduler:  # a plain class: its instances keep their attributes inline until __dict__ is read
        def __init__(self) -> None:
            self.requests: dict = {}

    class Pool:
        pass

    sched, pool, other = Scheduler(), Pool(), Scheduler()
    state, pool_state = object(), object()
    attach_state(sched, state, owner=True)
    attach_state(pool, state)
    assert state_of(sched) is state and state_of(pool) is state and state_of(other) is None
    assert not hasattr(sched, "_pdtrace") and set(vars(sched)) == {"requests"}  # nothing added to the object
    # The owner's death forgets its state everywhere; another object's only its own entry.
    entries = len(_STATES)
    del sched
    gc.collect()
    assert state_of(pool) is None and len(_STATES) == entries - 2 and len(_REFS) == len(_STATES)
    attach_state(pool, pool_state)
    attach_state(other, state)
    del pool
    gc.collect()
    assert state_of(other) is state and pool_state not in _STATES.values()
    # A new object that reuses a dead one's id starts without state.
    del other
    gc.collect()
    assert all(state_of(Pool()) is None for _ in range(100))


def test_takes_exactly_matches_names_defaults_and_kinds_only():
    class Coordinator:
        def trim(self, request_id, processed_computed_tokens, num_prompt_tokens=None): ...
        def older(self, request_id, num_computed_tokens): ...
        def general(self, request_id, *args, **kwargs): ...
        def keyword_only(self, request_id, processed_computed_tokens, *, num_prompt_tokens=None): ...

    expected = (("request_id", _patching.REQUIRED), ("processed_computed_tokens", _patching.REQUIRED),
                ("num_prompt_tokens", None))
    assert _patching.takes_exactly(Coordinator.trim, expected)
    assert _patching.takes_exactly(Coordinator().trim, expected)  # bound: self already taken
    assert not _patching.takes_exactly(Coordinator.trim, expected[:2])  # one parameter more than expected
    assert not _patching.takes_exactly(Coordinator.trim, expected[:2] + (("num_prompt_tokens", 0),))  # default
    for other in (Coordinator.older, Coordinator.general, Coordinator.keyword_only, len):
        assert not _patching.takes_exactly(other, expected)
