"""vLLM tier: worker-side hooks (Worker.execute_model / sample_tokens, V1 GPUModelRunner._update_states).

No real vLLM worker runs on this CPU box (`vllm._C` is absent, no GPU, no distributed groups), so these tests
check (1) that the hook table really wraps vLLM 0.33.0's Worker and GPUModelRunner when a process imports them,
and (2) the wrappers installed there, driven with real SchedulerOutputs (from vLLM's real scheduler) and
hand-built ModelRunnerOutput / KVConnectorOutput objects around stand-in originals. What is NOT exercised here:
the real worker bodies, reading PP/TP ranks from initialised process groups, pickling through vLLM's message
queue to a worker process, AsyncModelRunnerOutput from a real GPU runner, and the V1 runner's real
persistent-batch bookkeeping.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

import harness as H  # noqa: E402

pytestmark = pytest.mark.vllm


def _factory(owner: str, name: str):
    from pdtrace.recording.vllm import v0_33

    return next(h.factory for h in v0_33.TABLE if (h.owner, h.name) == (owner, name))


def test_worker_modules_are_wrapped_when_a_process_imports_them(tmp_path):
    code = textwrap.dedent(f"""
        import json, os, sys
        os.environ["PDTRACE_TRACE_DIR"] = {str(tmp_path / "trace")!r}
        from pdtrace.recording import plugin
        plugin.install()
        before = "vllm.v1.worker.gpu_model_runner" in sys.modules
        from vllm.v1.worker.gpu_worker import Worker
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        attr = "__pdtrace_original__"
        sample = getattr(Worker, "sample_tokens", None)  # 0.11.1+
        print(json.dumps([before, hasattr(Worker.execute_model, attr),
                          None if sample is None else hasattr(sample, attr),
                          hasattr(GPUModelRunner._update_states, attr)]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, *wrapped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert before is False                            # pdtrace did not import the GPU model runner itself
    split = H.release_key() >= (0, 11, 1)            # Worker.sample_tokens exists (and is wrapped) from 0.11.1
    assert wrapped == [True, True if split else None, True]


def _wraps_the_receive(table, called: set[str]) -> bool:
    """Whether a hook table wraps every PP receive in `called` (and the handles' wait after an asynchronous one)."""
    wrapped = {(h.owner, h.name) for h in table}
    receive = called & {"recv_tensor_dict", "irecv_tensor_dict"}
    return bool(receive) and all(("GroupCoordinator", name) in wrapped for name in receive) and (
        "irecv_tensor_dict" not in receive or ("AsyncIntermediateTensors", "wait_for_comm") in wrapped)


def test_the_pp_calls_the_installed_worker_makes_are_the_ones_its_table_wraps():
    """The PP wait is recorded by wrapping the GroupCoordinator method the worker's `execute_model` calls to receive
    the previous stage's tensors (and, after an asynchronous receive, `AsyncIntermediateTensors.wait_for_comm`). A
    table that wraps a receive the installed worker no longer calls records no wait and raises nothing (0.17-0.25
    under the synchronous hooks until 2026-12-07), so this reads the installed worker's own source. Twin: the table
    of the other kind of receive (v0_16's synchronous one, v0_17's asynchronous one) fails the same check."""
    import importlib
    import inspect
    import re

    from vllm.v1.worker import gpu_worker

    from pdtrace.recording.vllm import table_for, v0_16, v0_17

    source = inspect.getsource(gpu_worker.Worker.execute_model)
    called = set(re.findall(r"get_pp_group\(\)\s*\.\s*(i?recv_tensor_dict)", source))
    assert called, "execute_model receives no PP tensors through get_pp_group(): re-read it"
    table = importlib.import_module(table_for(H.release()).module).TABLE
    assert _wraps_the_receive(table, called), sorted(called)
    if "irecv_tensor_dict" in called:
        assert hasattr(gpu_worker.AsyncIntermediateTensors, "wait_for_comm")
    other = v0_16 if "irecv_tensor_dict" in called else v0_17
    assert not _wraps_the_receive(other.TABLE, called)


def test_exec_spans_and_per_rank_completions(recording, model_dir, monkeypatch):
    from vllm.v1.outputs import KVConnectorOutput

    from pdtrace.dryrun.compat import model_runner_output, split_sampling

    if not split_sampling():
        pytest.skip(f"vLLM {H.release()} has no sample_tokens RPC (this test drives both RPCs; 0.11.1+)")

    from pdtrace.recording.vllm import v0_33

    assert v0_33._worker_ranks() == (None, None)      # no process groups here: ranks stay null
    monkeypatch.setattr(v0_33, "_worker_ranks", lambda: (1, 0))  # as a PP rank 1, TP rank 0 would read them
    vc = H.make_vllm_config(model_dir, kv_role="kv_producer", engine_id="prefill-0_dp2")
    s = H.make_scheduler(vc)
    s.add_request(H.make_request("r0", 20))
    s.schedule()                                       # step 0
    s.add_request(H.make_request("r1", 30))
    so = s.schedule()                                  # step 1: r1's prompt (r0 waits for its token)
    step = so._pdtrace_step
    assert step == 1 and so.total_num_scheduled_tokens == 30

    done = KVConnectorOutput(finished_sending={"r7"}, finished_recving={"r8"})
    calls = []

    def execute_model(self, scheduler_output):
        calls.append("execute_model")
        return None                                    # a non-last PP rank returns nothing here

    def sample_tokens(self, grammar_output):
        calls.append("sample_tokens")
        return model_runner_output([], [], done)

    class AsyncOutput:                                 # must not be waited on by pdtrace
        def get_output(self):
            raise AssertionError("pdtrace blocked on the async output")

        def get_kv_connector_output(self):
            return KVConnectorOutput(finished_sending={"r9"})

    worker = SimpleNamespace(vllm_config=vc)
    assert _factory("Worker", "execute_model")(execute_model)(worker, so) is None
    assert _factory("Worker", "sample_tokens")(sample_tokens)(worker, None).kv_connector_output is done
    async_out = AsyncOutput()
    assert _factory("Worker", "sample_tokens")(lambda self, g: async_out)(worker, None) is async_out
    assert calls == ["execute_model", "sample_tokens"]

    events = H.close_and_read(recording)
    rows = [e for e in events if e["component"] in ("worker", "connector")]
    assert {(e["instance"], e["dp_rank"], e["pp_rank"], e["tp_rank"]) for e in rows} == {("prefill-0", 2, 1, 0)}
    assert [(e["component"], e["kind"], e["step"], e["req"], e["n"], e["detail"].get("rpc")) for e in rows] == [
        ("worker", "exec_begin", step, None, 30, None),
        ("worker", "exec_end", step, None, 30, "execute_model"),
        ("worker", "exec_begin", step, None, 30, None),
        ("worker", "exec_end", step, None, 30, "sample_tokens"),
        ("connector", "kv_send_rank", step, "r7", None, None),
        ("connector", "kv_recv_rank", step, "r8", None, None),
        ("worker", "exec_begin", step, None, 30, None),
        ("worker", "exec_end", step, None, 30, "sample_tokens"),
        ("connector", "kv_send_rank", step, "r9", None, None),
    ]


def test_persistent_batch_add_and_remove_with_reasons(recording, model_dir):
    vc = H.make_vllm_config(model_dir, kv_role=None)
    s = H.make_scheduler(vc)
    for r in ("a", "b", "c"):
        s.add_request(H.make_request(r, 16))
    so0 = s.schedule()
    assert set(so0.num_scheduled_tokens) == {"a", "b", "c"}

    def v1_update_states(self, scheduler_output):
        # What vLLM 0.33's V1 GPUModelRunner._update_states does to the persistent batch's rows.
        rows = self.input_batch.req_id_to_index
        for req_id in scheduler_output.finished_req_ids:
            rows.pop(req_id, None)
        for req_id in list(rows):
            if req_id not in scheduler_output.num_scheduled_tokens:
                rows.pop(req_id)
        for req_id in scheduler_output.num_scheduled_tokens:
            rows.setdefault(req_id, len(rows))

    update = _factory("GPUModelRunner", "_update_states")(v1_update_states)
    runner = SimpleNamespace(vllm_config=vc, input_batch=SimpleNamespace(req_id_to_index={}))
    update(runner, so0)
    # Next step: a finished, b preempted, c not scheduled; d new. Then c comes back: it was only left out of one
    # step, so its row is `rescheduled`, not `resumed` (nothing preempted it); b comes back `resumed`.
    # 0.10 / 0.11.0 do not say which requests were preempted: b's removal is then `unscheduled`.
    has_preempted = "preempted_req_ids" in {f.name for f in dataclasses.fields(so0)}
    preempted = {"preempted_req_ids": {"b"}} if has_preempted else {}
    so1 = dataclasses.replace(so0, num_scheduled_tokens={"d": 16}, finished_req_ids={"a"}, scheduled_new_reqs=[
                                  dataclasses.replace(so0.scheduled_new_reqs[0], req_id="d")], **preempted)
    so1._pdtrace_step = 1
    update(runner, so1)
    so2 = dataclasses.replace(so0, num_scheduled_tokens={"c": 1, "d": 1}, finished_req_ids=set(),
                              scheduled_new_reqs=[], **({"preempted_req_ids": set()} if has_preempted else {}))
    so2._pdtrace_step = 2
    update(runner, so2)
    assert set(runner.input_batch.req_id_to_index) == {"c", "d"}
    cached = so0.scheduled_cached_reqs
    if hasattr(cached, "resumed_req_ids"):  # 0.11.1+
        back = dataclasses.replace(cached, req_ids=["b"], resumed_req_ids={"b"})
    else:
        back = dataclasses.replace(cached, req_ids=["b"], resumed_from_preemption=[True])
    so3 = dataclasses.replace(so2, num_scheduled_tokens={"b": 16, "c": 1, "d": 1}, scheduled_cached_reqs=back)
    so3._pdtrace_step = 3
    update(runner, so3)

    events = [e for e in H.close_and_read(recording) if e["kind"] in ("batch_add", "batch_remove")]
    got = sorted((e["step"], e["kind"], e["req"], e["reason"]) for e in events)
    assert got == [
        (0, "batch_add", "a", "new"), (0, "batch_add", "b", "new"), (0, "batch_add", "c", "new"),
        (1, "batch_add", "d", "new"),
        (1, "batch_remove", "a", "finished"), (1, "batch_remove", "b", "preempted" if has_preempted else "unscheduled"),
        (1, "batch_remove", "c", "unscheduled"),
        (2, "batch_add", "c", "rescheduled"),
        (3, "batch_add", "b", "resumed"),
    ]
    assert {e["component"] for e in events} == {"worker"}


def test_pp_receive_inside_execute_model_is_a_recorded_wait(recording, model_dir, monkeypatch):
    """The receive of the previous PP stage's tensors inside execute_model (0.26+: irecv_tensor_dict, then the
    handles' wait on first use of `.tensors`; before: recv_tensor_dict) is recorded as exec_wait_begin /
    exec_wait_end reason pp_recv at the RPC's step, on the rank's worker channel. Twin: the same calls outside an
    RPC, and a wait already done, record nothing; a nested receive is timed once; vLLM's exception passes through
    with the wait still closed."""
    from pdtrace.recording.vllm import v0_33

    monkeypatch.setattr(v0_33, "_worker_ranks", lambda: (1, 0))
    vc = H.make_vllm_config(model_dir, kv_role=None)
    s = H.make_scheduler(vc)
    s.add_request(H.make_request("r0", 20))
    so = s.schedule()
    step = so._pdtrace_step

    class Group:                                       # stand-ins for GroupCoordinator's receives
        def irecv_tensor_dict(self, all_gather_group=None):
            return {"hidden_states": None}, [], []

        def recv_tensor_dict(self, all_gather_group=None):  # 0.26+'s calls irecv_tensor_dict
            return irecv(self)[0]

    class Tensors:                                     # AsyncIntermediateTensors' wait, once
        _comm_waited = False

        def wait_for_comm(self):
            self._comm_waited = True

    irecv = _factory("GroupCoordinator", "irecv_tensor_dict")(Group.irecv_tensor_dict)
    recv = next(h.factory for h in v0_33.PP_SYNC_HOOKS if h.name == "recv_tensor_dict")(Group.recv_tensor_dict)
    wait = _factory("AsyncIntermediateTensors", "wait_for_comm")(Tensors.wait_for_comm)
    group, tensors = Group(), Tensors()

    def execute_model(self, scheduler_output):
        irecv(group)                                   # blocks on the previous stage's metadata
        wait(tensors)                                  # the forward's first use of .tensors
        wait(tensors)                                  # already waited: nothing to record
        recv(group)                                    # nested: timed once, by the outer call
        return None

    def failing(self, scheduler_output):
        irecv(group)
        raise RuntimeError("vLLM's own error")

    worker = SimpleNamespace(vllm_config=vc)
    irecv(group)                                       # outside any RPC: not recorded
    assert _factory("Worker", "execute_model")(execute_model)(worker, so) is None
    with pytest.raises(RuntimeError, match="vLLM's own error"):
        _factory("Worker", "execute_model")(failing)(worker, so)
    irecv(group)                                       # after the RPC: not recorded
    assert v0_33._RPC_OPEN is None

    rows = [e for e in H.close_and_read(recording) if e["component"] == "worker"]
    assert {(e["pp_rank"], e["tp_rank"]) for e in rows} == {(1, 0)}
    wait_rows = [("exec_wait_begin", step, "pp_recv"), ("exec_wait_end", step, "pp_recv")]
    assert [(e["kind"], e["step"], e["reason"]) for e in rows] == [
        ("exec_begin", step, None), *wait_rows * 3, ("exec_end", step, None),
        ("exec_begin", step, None), *wait_rows]       # the failed RPC: its wait closed, no exec_end
    assert all(b["ts_ns"] <= e["ts_ns"] for b, e in zip(rows[1:7:2], rows[2:7:2]))
