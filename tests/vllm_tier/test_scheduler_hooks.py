"""vLLM tier: pdtrace's hooks on vLLM 0.33.0's REAL Scheduler with the NixlConnector scheduler side.

The hooks are installed by the entry point function vLLM calls (fixture `recording`), events are read back with
pdtrace.open_trace.
"""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

import harness as H  # noqa: E402

pytestmark = pytest.mark.vllm


def test_entry_point_is_what_vllm_loads(tmp_path, monkeypatch):
    import vllm.plugins
    from vllm.v1.core.sched.scheduler import Scheduler

    from pdtrace.recording import session
    from pdtrace.recording.vllm import hooks_installed, uninstall_hooks
    from pdtrace.recording.vllm._patching import ORIGINAL_ATTR

    monkeypatch.setenv("PDTRACE_TRACE_DIR", str(tmp_path / "trace"))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    try:
        vllm.plugins.load_general_plugins()
        assert hooks_installed()
        assert hasattr(Scheduler.schedule, ORIGINAL_ATTR)
        assert session.directory() == str(tmp_path / "trace")
    finally:
        session.reset()
        uninstall_hooks()
    assert not hasattr(Scheduler.schedule, ORIGINAL_ATTR)


def test_prefill_side_lifecycle(recording, model_dir):
    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role="kv_producer", engine_id="prefill-0"))
    faker = H.OutputFaker()
    s.add_request(H.make_request("r1", 40, remote_decode=True))
    H.step(s, faker)                                   # step 0: prefill, finishes with length, blocks held
    assert H.num_free_blocks(s) == 96
    H.step(s, faker)                                   # step 1: nothing to do; D has not read yet
    H.step(s, faker, finished_sending={"r1"})          # step 2: the send completes, blocks freed
    assert H.num_free_blocks(s) == 99

    events = H.close_and_read(recording)
    assert {e["instance"] for e in events} == {"prefill-0"}
    assert {e["role"] for e in events} == {"prefill"}
    config = H.of_kind(events, "engine_config")
    assert len(config) == 1 and config[0]["n"] == 100
    assert config[0]["detail"]["connector"] == "NixlConnector"
    assert config[0]["detail"]["kv_role"] == "kv_producer"

    r1 = [e for e in events if e["req"] == "r1"]
    assert [(e["kind"], e["step"]) for e in r1] == [
        ("req_add", None), ("blocks_alloc", 0), ("req_sched", 0), ("req_finish", 0),
        ("kv_send_done", 2), ("blocks_free", 2), ("blocks_pool_free", 2)]
    add, alloc, sched, finish, send, free, pool = r1
    assert add["n"] == 40 and add["detail"] == {"remote_prefill": False, "remote_decode": True}
    assert alloc["blocks"] == [1, 2, 3]
    assert sched["n"] == 40
    assert (finish["reason"], finish["status"], finish["delay_free"]) == ("length", "FINISHED_LENGTH_CAPPED", True)
    assert send["status"] == "FINISHED_LENGTH_CAPPED"
    assert (free["blocks"], free["reason"], free["deferred"]) == ([1, 2, 3], "sent", False)
    assert sorted(pool["blocks"]) == [1, 2, 3]
    assert [e["step"] for e in H.of_kind(events, "sched")] == [0, 1, 2]
    assert [e["step"] for e in H.of_kind(events, "step_output")] == [0, 1, 2]


def test_partial_tail_pin_returns_to_the_pool_with_its_request(recording, model_dir):
    """0.27.0 to 0.28.0: a producer's copy-on-write tail block handed to an offloading connector is pinned outside the
    request's block table (KVCacheManager.take_partial_tail_offloads) and unpinned first thing in
    KVCacheManager.free; its return to the pool is recorded, and it is no block of the request."""
    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role="kv_producer", engine_id="prefill-0"))
    kvm = s.kv_cache_manager
    if not hasattr(kvm, "_partial_tail_pins"):
        pytest.skip(f"vLLM {H.release()} pins no partial-tail blocks (0.27.0 to 0.28.0 only)")
    faker = H.OutputFaker()
    s.add_request(H.make_request("r1", 40, remote_decode=True))
    H.step(s, faker)                                   # step 0: prefill, finishes with length, blocks held
    # What the CoW leaves pinned once its copy ran: a block off the table, held by the pin alone (0.28.0
    # single_type_kv_cache_manager.py:1629-1655 takes it with get_new_blocks; take_partial_tail_offloads pins it).
    (pin,) = kvm.block_pool.get_new_blocks(1)
    kvm._partial_tail_pins["r1"] = [pin]
    assert H.num_free_blocks(s) == 95
    H.step(s, faker, finished_sending={"r1"})          # step 1: the send completes, blocks and pin freed
    assert H.num_free_blocks(s) == 99 and pin.ref_cnt == 0

    events = H.close_and_read(recording)
    (free,) = H.of_kind(events, "blocks_free", req="r1")
    assert free["blocks"] == [1, 2, 3]
    returned = [b for e in H.of_kind(events, "blocks_pool_free", req="r1") for b in e["blocks"]]
    assert sorted(returned) == sorted([1, 2, 3, pin.block_id])

    from pdtrace.analysis import analyze

    found = analyze(str(recording))
    assert found[found.severity != "info"].empty, found[["rule", "message"]].to_dict("records")


def test_decode_side_lifecycle(recording, model_dir):
    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role="kv_consumer", engine_id="decode-0_dp1"))
    faker = H.OutputFaker()
    s.add_request(H.make_request("d1", 40, remote_prefill=True, remote_request_id="p7",
                                 remote_engine_id="prefill-0_dp3", remote_block_ids=[11, 12, 13],
                                 ignore_eos=False, max_tokens=8))
    so0, _ = H.step(s, faker)                          # step 0: blocks allocated, waiting for remote KV
    assert not so0.num_scheduled_tokens
    H.step(s, faker, finished_recving={"d1"})          # step 1: the receive completes
    H.step(s, faker)                                   # step 2: d1 runs (1 token)
    H.step(s, faker, eos={"d1"})                       # step 3: EOS, finished, freed
    assert H.num_free_blocks(s) == 99

    events = H.close_and_read(recording)
    assert {(e["instance"], e["dp_rank"]) for e in events} == {("decode-0", 1)}
    d1 = [e for e in events if e["req"] == "d1"]
    assert [(e["kind"], e["step"]) for e in d1] == [
        ("req_add", None), ("blocks_alloc", 0), ("req_wait_kv", 0), ("kv_recv_dest", 0), ("kv_recv_done", 1),
        ("req_sched", 2), ("req_sched", 3), ("req_finish", 3), ("blocks_free", 3), ("blocks_pool_free", 3)]
    add, alloc, wait, dest, recv, _, _, finish, free, pool = d1
    # the read's destination as NIXL decided it (`_reqs_need_recv`): the blocks d1 waits with
    assert dest["blocks"] == [1, 2, 3]
    assert add["detail"] == {"remote_prefill": True, "remote_decode": False, "remote_instance": "prefill-0",
                             "remote_req": "p7", "remote_blocks": [11, 12, 13]}
    assert alloc["blocks"] == [1, 2, 3] and alloc["detail"] == {"hit": 0, "external": 3}
    # Before 0.18 vLLM sets num_computed_tokens only when the read completes: the external tokens are unknown (null);
    # 0.18+ set it at the switch into WAITING_FOR_REMOTE_KVS (0.18.0 scheduler.py:781).
    assert wait["blocks"] == [1, 2, 3] and wait["n"] == (40 if H.release_key() >= (0, 18) else None)
    assert recv["status"] == "WAITING_FOR_REMOTE_KVS"
    assert (finish["reason"], finish["status"], finish["delay_free"]) == ("stop", "FINISHED_STOPPED", False)
    assert (free["blocks"], free["reason"], free["deferred"]) == ([1, 2, 3], "finished", False)
    assert sorted(pool["blocks"]) == [1, 2, 3] and pool["req"] == "d1"
    waiting_kv = [e["detail"]["waiting_kv"] for e in H.of_kind(events, "sched")]
    assert waiting_kv == [1, 1, 0, 0]


def test_preemption_and_resumption(recording, model_dir):
    # 9 usable blocks, two 48-token prompts growing by 40 tokens each: the second is preempted, then resumed.
    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role=None, max_num_batched_tokens=128), num_blocks=10)
    faker = H.OutputFaker()
    s.add_request(H.make_request("r1", 48, max_tokens=40))
    s.add_request(H.make_request("r2", 48, max_tokens=40))
    for _ in range(200):
        if not s.has_requests():
            break
        H.step(s, faker)
    assert not s.has_requests() and H.num_free_blocks(s) == 9

    events = H.close_and_read(recording)
    preempts = H.of_kind(events, "req_preempt")
    assert len(preempts) == 1
    victim, step = preempts[0]["req"], preempts[0]["step"]
    held = [b for e in H.of_kind(events, "blocks_alloc", req=victim) if e["step"] <= step for b in e["blocks"]]
    frees = H.of_kind(events, "blocks_free", req=victim)
    assert frees[0]["step"] == step and frees[0]["reason"] == "preempted" and frees[0]["deferred"] is False
    assert frees[0]["blocks"] == held
    resumed = [e for e in H.of_kind(events, "req_sched", req=victim) if e["step"] > step]
    assert resumed, "the preempted request never ran again"
    realloc = [e for e in H.of_kind(events, "blocks_alloc", req=victim) if e["step"] > step]
    assert realloc[0]["step"] == resumed[0]["step"]
    # The resumption's allocation opens a new table: its re-hits lead it (`hit`, before pdtrace 0.1's fix never
    # recorded on a resumption through the cached requests), and the tokens it counts as computed are in them.
    detail = realloc[0]["detail"] or {}
    hit, computed = detail.get("hit", 0), detail.get("computed", 0)
    assert computed <= hit * H.BLOCK_SIZE
    assert realloc[0]["blocks"][:hit] == held[:hit]
    assert resumed[0]["n"] >= 48 - computed           # it computes what its re-hits do not hold
    finish = H.of_kind(events, "req_finish", req=victim)
    assert len(finish) == 1 and finish[0]["step"] > resumed[0]["step"]
    assert frees[-1]["reason"] == "finished"
    # Every block the pool got back was freed by its owner first, and the pool ends where it began.
    pooled = sorted(b for e in H.of_kind(events, "blocks_pool_free") for b in e["blocks"])
    freed = sorted(b for e in H.of_kind(events, "blocks_free") for b in e["blocks"])
    assert pooled == freed


@pytest.mark.parametrize("kv_role", [None, "kv_both"])
def test_prefix_cache_hit(recording, model_dir, kv_role):
    """The local hit, without a connector and with one: 0.28+ `_get_local_prefix_cache_hit`; 0.27 reads it with a
    connector from `get_computed_blocks_for_connector`; 0.18-0.26 from `get_computed_blocks` either way."""
    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role=kv_role, max_num_batched_tokens=128))
    faker = H.OutputFaker()
    prompt = list(range(100, 164))                    # 4 full blocks
    s.add_request(H.make_request("a", 64, max_tokens=2, prompt=prompt))
    H.step(s, faker)
    H.step(s, faker)                                   # a finishes; its hashed blocks stay revivable
    s.add_request(H.make_request("b", 64, max_tokens=2, prompt=prompt))
    H.step(s, faker)

    events = H.close_and_read(recording)
    a_blocks = H.of_kind(events, "blocks_alloc", req="a")[0]["blocks"]
    b_alloc = H.of_kind(events, "blocks_alloc", req="b")[0]
    hit = b_alloc["detail"]["hit"]
    assert hit == 3                                    # vLLM recomputes the last prompt token: 63 tokens hit
    assert b_alloc["blocks"][:hit] == a_blocks[:hit]
    assert H.of_kind(events, "req_sched", req="b")[0]["n"] == 64 - hit * H.BLOCK_SIZE


def test_pdtrace_error_switches_recording_off_and_vllm_carries_on(recording, model_dir, monkeypatch):
    from pdtrace.recording.vllm import v0_33
    from pdtrace.recording.vllm._runtime import RUNTIME

    def broken(*args, **kwargs):
        raise RuntimeError("boom inside pdtrace")

    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role="kv_producer", engine_id="prefill-0"))
    faker = H.OutputFaker()
    s.add_request(H.make_request("r1", 40, remote_decode=True))
    H.step(s, faker)
    monkeypatch.setattr(v0_33, "_free_reason", broken)   # the next free hook fails
    H.step(s, faker, finished_sending={"r1"})
    s.add_request(H.make_request("r2", 40, remote_decode=True))
    H.step(s, faker)
    H.step(s, faker, finished_sending={"r2"})
    assert H.num_free_blocks(s) == 99 and not s.requests    # vLLM did all its work

    assert RUNTIME.errors == 1 and not RUNTIME.active
    events = H.close_and_read(recording)
    off = H.of_kind(events, "recorder_off")
    assert len(off) == 1 and "boom inside pdtrace" in off[0]["detail"]["error"]
    assert events[-1]["kind"] == "recorder_off"       # nothing recorded after it
    assert not H.of_kind(events, "req_add", req="r2")


def test_step_id_travels_with_the_scheduler_output(recording, model_dir):
    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role=None))
    s.add_request(H.make_request("r1", 20))
    so = s.schedule()
    assert pickle.loads(pickle.dumps(so))._pdtrace_step == 0   # workers receive it pickled
    assert s.schedule()._pdtrace_step == 1


def test_uninstall_restores_vllm(recording, model_dir):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from pdtrace.recording.vllm import uninstall_hooks
    from pdtrace.recording.vllm._patching import ORIGINAL_ATTR

    original = Scheduler.schedule.__pdtrace_original__
    uninstall_hooks()
    assert Scheduler.schedule is original
    assert not hasattr(KVCacheManager.free, ORIGINAL_ATTR)


def test_abort_while_receiving_keeps_blocks_until_the_receive_completes(recording, model_dir):
    from vllm.v1.request import RequestStatus

    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role="kv_consumer", engine_id="decode-0"))
    faker = H.OutputFaker()
    s.add_request(H.make_request("d1", 40, remote_prefill=True))
    H.step(s, faker)                                   # step 0: WAITING_FOR_REMOTE_KVS, blocks allocated
    s.finish_requests(["d1"], RequestStatus.FINISHED_ABORTED)  # client abort between steps
    if H.behaviour().abort_while_receiving == "immediate":  # 0.10 to 0.15 free at once: the read may still write
        assert H.num_free_blocks(s) == 99
        d1 = [e for e in H.close_and_read(recording) if e["req"] == "d1"]
        assert [(e["kind"], e["step"]) for e in d1] == [
            ("req_add", None), ("blocks_alloc", 0), ("req_wait_kv", 0), ("kv_recv_dest", 0), ("req_finish", None),
            ("blocks_free", None), ("blocks_pool_free", None)]
        assert (d1[4]["reason"], d1[4]["status"], d1[4]["delay_free"]) == ("abort", "FINISHED_ABORTED", False)
        assert (d1[5]["reason"], d1[5]["blocks"]) == ("aborted", [1, 2, 3])
        return
    assert H.num_free_blocks(s) == 96                  # vLLM keeps them: the NIXL read may still be writing
    H.step(s, faker, finished_recving={"d1"})          # step 1: the read completes, now they are freed
    assert H.num_free_blocks(s) == 99

    d1 = [e for e in H.close_and_read(recording) if e["req"] == "d1"]
    assert [(e["kind"], e["step"]) for e in d1] == [
        ("req_add", None), ("blocks_alloc", 0), ("req_wait_kv", 0), ("kv_recv_dest", 0), ("req_finish", None),
        ("kv_recv_done", 1), ("blocks_free", 1), ("blocks_pool_free", 1)]
    finish, recv, free = d1[4], d1[5], d1[6]
    assert (finish["reason"], finish["status"], finish["delay_free"]) == ("abort", "FINISHED_ABORTED", True)
    assert recv["status"] == "FINISHED_ABORTED"
    assert (free["reason"], free["blocks"]) == ("received", [1, 2, 3])


def test_failed_receive_with_nothing_valid_frees_as_load_failed(recording, model_dir):
    """A read whose first block failed leaves no valid token: vLLM frees the request's blocks in
    `_update_waiting_for_remote_kv` (0.11.1+; 0.12.0 scheduler.py:1534-1545) and admits it again at once. That
    free is the failed-load path (`load_failed`), not a finish: no req_finish, the request runs on."""
    import dataclasses

    from vllm.v1.outputs import KVConnectorOutput

    fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    if "invalid_block_ids" not in fields:
        pytest.skip(f"vLLM {H.release()} reports no failed receive (no invalid_block_ids, no failed_recving)")
    vc = H.make_vllm_config(model_dir, kv_role="kv_consumer", engine_id="decode-0")
    if hasattr(vc.kv_transfer_config, "kv_load_failure_policy"):
        vc.kv_transfer_config.kv_load_failure_policy = "recompute"
    s = H.make_scheduler(vc)
    faker = H.OutputFaker()
    s.add_request(H.make_request("d1", 40, remote_prefill=True))
    H.step(s, faker)                                   # step 0: waiting for remote KV in blocks [1, 2, 3]
    so = s.schedule()                                  # step 1: the read fails in its first block
    out = faker.output(so)
    more = {"failed_recving": {"d1"}} if "failed_recving" in fields else {}
    out.kv_connector_output = KVConnectorOutput(finished_recving={"d1"}, invalid_block_ids={1}, **more)
    s.update_from_output(so, out)
    H.step(s, faker)                                   # step 2: freed, admitted again, computed locally

    events = H.close_and_read(recording)
    free = H.of_kind(events, "blocks_free", req="d1")
    assert [(e["step"], e["reason"], e["blocks"]) for e in free] == [(2, "load_failed", [1, 2, 3])]
    assert not H.of_kind(events, "req_finish", req="d1") and "d1" in s.requests
    assert [e["step"] for e in H.of_kind(events, "blocks_alloc", req="d1")] == [0, 2]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_receive(recording, model_dir, policy):
    import dataclasses

    from vllm.v1.outputs import KVConnectorOutput

    fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    if "invalid_block_ids" not in fields:
        pytest.skip(f"vLLM {H.release()} reports no failed receive (no invalid_block_ids, no failed_recving)")
    failed_recving = "failed_recving" in fields  # 0.30+; before, only the invalid blocks say it

    vc = H.make_vllm_config(model_dir, kv_role="kv_consumer", engine_id="decode-0")
    if not hasattr(vc.kv_transfer_config, "kv_load_failure_policy") and policy != "recompute":
        pytest.skip(f"vLLM {H.release()} has no kv_load_failure_policy (it always recomputes)")
    vc.kv_transfer_config.kv_load_failure_policy = policy
    s = H.make_scheduler(vc)
    faker = H.OutputFaker()
    s.add_request(H.make_request("d1", 40, remote_prefill=True))
    H.step(s, faker)                                   # step 0: waiting for remote KV in blocks [1, 2, 3]
    so = s.schedule()                                  # step 1: the read fails (NIXL reports it as done + failed)
    out = faker.output(so)
    more = {"failed_recving": {"d1"}} if failed_recving else {}
    out.kv_connector_output = KVConnectorOutput(finished_recving={"d1"}, invalid_block_ids={2}, **more)
    s.update_from_output(so, out)
    H.step(s, faker)                                   # step 2

    events = H.close_and_read(recording)
    fails = H.of_kind(events, "kv_recv_fail")
    assert [(e["step"], e["req"], e["blocks"]) for e in fails] == [(1, "d1", None)] * failed_recving + [(1, None, [2])]
    free = H.of_kind(events, "blocks_free", req="d1")
    if policy == "recompute" and not failed_recving:   # 0.28 / 0.29: it keeps its blocks, recomputes the tail
        assert not free and not H.of_kind(events, "req_finish", req="d1")
    elif policy == "recompute":                        # vLLM drops the blocks and recomputes locally
        assert (free[0]["step"], free[0]["reason"], free[0]["blocks"]) == (2, "load_failed", [1, 2, 3])
        assert H.of_kind(events, "blocks_alloc", req="d1")[-1]["step"] == 2
        assert not H.of_kind(events, "req_finish", req="d1")
    else:                                              # the request fails with an error
        finish = H.of_kind(events, "req_finish", req="d1")
        assert [(e["step"], e["reason"], e["status"]) for e in finish] == [(1, "error", "FINISHED_ERROR")]
        assert [e["blocks"] for e in free] == [[1, 2, 3]] and H.num_free_blocks(s) == 99


def test_remote_read_after_a_local_prefix_hit_writes_only_the_fresh_blocks(recording, model_dir):
    """D has a's 64-token prompt cached locally; d1 shares it and reads the rest from P: its table opens with the
    hit blocks, its wait and the read's destination (`kv_recv_dest`, NIXL's `_reqs_need_recv`) list only the blocks
    past the hit, which the hooks record, and the lifecycle model finds nothing."""
    from pdtrace import open_trace
    from pdtrace.analysis import analyze

    s = H.make_scheduler(H.make_vllm_config(model_dir, kv_role="kv_consumer", engine_id="decode-0"))
    faker = H.OutputFaker()
    prompt = list(range(100, 164))                    # 4 full blocks
    s.add_request(H.make_request("a", 64, max_tokens=2, prompt=prompt))
    H.step(s, faker)
    H.step(s, faker)                                   # a finishes; its hashed blocks stay revivable
    s.add_request(H.make_request("d1", 112, remote_prefill=True, prompt=prompt + list(range(500, 548)),
                                 max_tokens=2))
    H.step(s, faker)                                   # d1: local hit, then waits for the rest
    H.step(s, faker, finished_recving={"d1"})
    for _ in range(4):
        H.step(s, faker)

    events = H.close_and_read(recording)
    alloc = H.of_kind(events, "blocks_alloc", req="d1")[0]
    wait = H.of_kind(events, "req_wait_kv", req="d1")
    dest = H.of_kind(events, "kv_recv_dest", req="d1")
    hit = alloc["detail"]["hit"]
    assert hit >= 3 and alloc["blocks"][:hit] == H.of_kind(events, "blocks_alloc", req="a")[0]["blocks"][:hit]
    assert len(wait) == 1 and len(dest) == 1
    assert dest[0]["blocks"] == wait[0]["blocks"] == alloc["blocks"][hit:]
    found = analyze(open_trace(recording), rules=["lifecycle"])
    assert found.empty, found[["subrule", "req", "message"]].to_string()
