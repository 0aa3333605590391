"""vLLM tier: an engine's instance survives vLLM's config rebuild (issue 20, problem 1).

vLLM 0.28+ sets `VllmConfig.instance_id = time.time_ns()` in `__post_init__`, and `EngineCoreProc.__init__` runs it
again once its executor has started the workers (0.32.0 v1/engine/core.py:1311, 0.33.0 :1349): without a KV
connector the scheduler and its workers read two ids, and a trace shows two instances and no worker joined to its
scheduler. Here vLLM's real EngineCore (fake executor) is built, `vllm_config.__post_init__()` is called exactly as
`EngineCoreProc` calls it, and the rows of the scheduler, of a worker in the engine process, of a forked worker and
of a spawned worker (a copy of the config whose `instance_id` differs) must all land in the one instance the engine
had when its executor started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

import harness as H  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_hook(name: str):
    from pdtrace.recording.vllm import v0_33

    return next(h.factory for h in v0_33.TABLE if (h.owner, h.name) == ("Worker", name))


def test_scheduler_and_every_worker_share_the_engine_identity_across_the_config_rebuild(recording, model_dir):
    from pdtrace.recording.vllm._common import instance_of

    vc = H.make_vllm_config(model_dir, kv_role=None)         # no KV connector: the instance comes from instance_id
    first = vc.instance_id
    engine = H.make_engine(vc, pp=2)                         # the executor (hooked) starts "the workers" here
    time.sleep(0.001)
    vc.__post_init__()                                       # what EngineCoreProc.__init__ does next
    if H.release_key() >= (0, 28):                           # 0.10 / 0.11 keep a non-empty instance_id
        assert vc.instance_id != first, "vLLM no longer recomputes instance_id: the premise of this test changed"
    assert instance_of(vc) == (first, "none", 0)

    execute_model = _worker_hook("execute_model")(lambda self, so: None)
    for i in range(3):
        H.engine_add(engine, H.make_request(f"r{i}", 20, max_tokens=2))
    so = engine.scheduler.schedule()
    in_process = SimpleNamespace(vllm_config=vc)             # a worker of an in-process executor: the same object
    execute_model(in_process, so)

    # A forked worker: the same config object, the identity inherited with the process (the plugin does not run).
    read_fork, write_fork = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_fork)
            execute_model(SimpleNamespace(vllm_config=vc), so)
            from pdtrace.recording import session

            session.close_all()
            os.write(write_fork, json.dumps(list(instance_of(vc))).encode())
        finally:
            os._exit(0)
    os.close(write_fork)
    forked = json.loads(os.read(read_fork, 4096).decode())
    os.close(read_fork)
    os.waitpid(pid, 0)

    # A spawned worker: a new interpreter whose own config copy says another instance_id (a value vLLM may recompute
    # in the copy as well); it runs the plugin and takes the identity its parent, the engine process, exported.
    code = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {os.path.join(ROOT, 'tests', 'vllm_tier')!r})
        import harness as H
        from pdtrace.recording import plugin, session
        plugin.install()
        from pdtrace.recording.vllm._common import instance_of
        vc = H.make_vllm_config({model_dir!r}, kv_role=None)
        vc.instance_id = "a-value-vllm-recomputed"
        print(json.dumps([list(instance_of(vc, worker=True)), list(instance_of(vc))]))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spawned = json.loads(proc.stdout.strip().splitlines()[-1])

    assert forked == [first, "none", 0] and spawned[0] == [first, "none", 0]
    assert spawned[1] == ["a-value-vllm-recomputed", "none", 0]  # a scheduler there would be an engine of its own
    H.engine_step(engine)
    events = H.close_and_read(recording)
    by_component = {}
    for e in events:
        by_component.setdefault(e["component"], set()).add(e["instance"])
    assert by_component["scheduler"] == {first} and by_component["worker"] == {first}
    assert {e["pid"] for e in events if e["component"] == "worker"} == {os.getpid(), pid}


def test_two_engines_in_one_process_stay_two_instances(recording, model_dir):
    # The healthy look-alike: two engines (as a dry run or a test holds them) must not be merged by the fix.
    from pdtrace.recording.vllm._common import instance_of

    a = H.make_vllm_config(model_dir, kv_role=None)
    time.sleep(0.001)
    b = H.make_vllm_config(model_dir, kv_role=None)
    H.make_engine(a, pp=1)
    H.make_engine(b, pp=1)
    assert instance_of(a)[0] != instance_of(b)[0]


def test_data_parallel_suffix_of_instance_id_goes_to_dp_rank(recording, model_dir):
    # 0.33 appends _dp{N} to instance_id for each data-parallel engine (v1/engine/utils.py
    # _apply_dp_identity_suffix) and resets data_parallel_rank to 0 for independent ranks.
    from pdtrace.recording.vllm._common import instance_of

    vc = H.make_vllm_config(model_dir, kv_role=None)
    vc.instance_id = "12345_dp3"
    H.make_engine(vc, pp=1)
    assert instance_of(vc) == ("12345", "none", 3)
