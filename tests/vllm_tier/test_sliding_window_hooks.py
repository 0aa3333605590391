"""vLLM tier: sliding-window trimming on the real Scheduler and KV cache manager of each supported release.

A SlidingWindowSpec group frees the blocks that fall out of the window while the request runs
(`KVCacheCoordinator.remove_skipped_blocks`, from allocate_slots and from `_connector_finished`): the hooks record
them as `blocks_free reason=skipped`. vLLM's own tests also call `_connector_finished` on a running request for
that prune (tests/v1/core/test_swa_inflight_window_free.py::test_connector_finish_frees_on_settled_basis): that is
no finish.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM 0.33.0 (build its venv with .ci/install-vllm.sh VENV)")

import harness as H  # noqa: E402

pytestmark = pytest.mark.vllm

WINDOW = 16
PROMPT = 100  # tokens 0..84 leave the window of token 101: 5 full blocks (vLLM's test_swa_inflight_window_free)
OUT_OF_WINDOW = 85 // H.BLOCK_SIZE


def _swa_scheduler(model_dir, kv_role=None):
    config = H.make_vllm_config(model_dir, kv_role=kv_role, max_num_batched_tokens=128,
                                enable_prefix_caching=False)
    return H.make_scheduler(config, kv_spec=H.sliding_window_spec(WINDOW))


def _null_blocks(scheduler, req_id):
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return sum(1 for b in manager.req_to_blocks[req_id] if b.is_null)


def _blocks_given_up(events, req):
    return [b for e in H.of_kind(events, "blocks_free", req=req) for b in e["blocks"]]


def test_blocks_out_of_the_window_are_recorded_as_skipped(recording, model_dir):
    import pdtrace

    s = _swa_scheduler(model_dir)
    faker = H.OutputFaker()
    s.add_request(H.make_request("r1", PROMPT, max_tokens=4))
    H.step(s, faker)                                   # step 0: the prompt, 7 blocks
    H.step(s, faker)                                   # step 1: decode; allocate_slots trims first
    assert _null_blocks(s, "r1") == OUT_OF_WINDOW
    for _ in range(4):
        H.step(s, faker)
    assert "r1" not in s.requests

    events = H.close_and_read(recording)
    alloc = [b for e in H.of_kind(events, "blocks_alloc", req="r1") for b in e["blocks"]]
    skipped = [e for e in H.of_kind(events, "blocks_free", req="r1") if e["reason"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["step"] == 1 and len(skipped[0]["blocks"]) == OUT_OF_WINDOW
    assert skipped[0]["blocks"] == alloc[:OUT_OF_WINDOW]  # the oldest blocks, in table order
    pool = H.of_kind(events, "blocks_pool_free", req="r1")
    assert sorted(pool[0]["blocks"]) == sorted(skipped[0]["blocks"])
    # Every block the request held is given up exactly once: trimmed, or freed at the finish.
    given_up = _blocks_given_up(events, "r1")
    assert sorted(given_up) == sorted(alloc) and len(set(given_up)) == len(given_up)
    finish = H.of_kind(events, "blocks_free", req="r1")[-1]
    assert finish["reason"] == "finished" and not set(finish["blocks"]) & set(skipped[0]["blocks"])
    assert H.num_free_blocks(s) == 99
    assert len(pdtrace.analyze(recording)) == 0


def test_full_attention_coordinators_carry_no_trimming_state(recording, model_dir, monkeypatch):
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    from pdtrace.recording.vllm import v0_33
    from pdtrace.recording.vllm._common import state_of
    from pdtrace.recording.vllm._patching import ORIGINAL_ATTR

    monkeypatch.setattr(v0_33, "_TRIMMING_SEEN", False)  # as in a fresh process
    wrapper = KVCacheCoordinator.__dict__["remove_skipped_blocks"]
    original = getattr(wrapper, ORIGINAL_ATTR)
    full = H.make_scheduler(H.make_vllm_config(model_dir, kv_role=None))
    full.add_request(H.make_request("r-full", 20))
    full.schedule()
    # No coordinator trims yet: vLLM's own method is back on the class, no wrapper frame per allocate_slots, and
    # nothing was added to the coordinator (no state attached, no attribute).
    assert KVCacheCoordinator.__dict__["remove_skipped_blocks"] is original
    coordinator = full.kv_cache_manager.coordinator
    assert state_of(coordinator) is None and "remove_skipped_blocks" not in vars(coordinator)
    # The first coordinator that trims puts the wrapper back for good; the full-attention one passes through it.
    swa = _swa_scheduler(model_dir)
    swa.add_request(H.make_request("r-swa", 20))
    swa.schedule()
    assert KVCacheCoordinator.__dict__["remove_skipped_blocks"] is wrapper
    assert state_of(swa.kv_cache_manager.coordinator) is state_of(swa) is not None
    assert state_of(coordinator) is None
    third = H.make_scheduler(H.make_vllm_config(model_dir, kv_role=None))
    third.add_request(H.make_request("r-third", 20))
    third.schedule()
    assert KVCacheCoordinator.__dict__["remove_skipped_blocks"] is wrapper


def test_with_recording_off_from_the_start_the_trimming_wrapper_is_set_aside_too(recording, model_dir, monkeypatch):
    # No state is ever made with recording off: the wrapper's first pass-through sets itself aside as a first
    # state would, and a coordinator that trims still gets it back (and recorded) once recording is on.
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    from pdtrace.recording.vllm import v0_33
    from pdtrace.recording.vllm._common import state_of
    from pdtrace.recording.vllm._patching import ORIGINAL_ATTR
    from pdtrace.recording.vllm._runtime import RUNTIME

    monkeypatch.setattr(v0_33, "_TRIMMING_SEEN", False)  # as in a fresh process
    monkeypatch.setattr(v0_33, "_SET_ASIDE", {})
    wrapper = KVCacheCoordinator.__dict__["remove_skipped_blocks"]
    monkeypatch.setattr(KVCacheCoordinator, "remove_skipped_blocks", wrapper)  # put back after the test
    if H.release_key() >= (0, 33):  # vLLM's own signature, no *args / **kwargs (_patching.takes_exactly)
        assert tuple(inspect.signature(wrapper).parameters) == (
            "self", "request_id", "processed_computed_tokens", "num_prompt_tokens")
    monkeypatch.setattr(RUNTIME, "active", False)
    full = H.make_scheduler(H.make_vllm_config(model_dir, kv_role=None))
    full.add_request(H.make_request("r-off", 20))
    full.schedule()
    assert KVCacheCoordinator.__dict__["remove_skipped_blocks"] is getattr(wrapper, ORIGINAL_ATTR)
    assert state_of(full) is None and state_of(full.kv_cache_manager.coordinator) is None
    monkeypatch.setattr(RUNTIME, "active", True)
    swa = _swa_scheduler(model_dir)
    faker = H.OutputFaker()
    swa.add_request(H.make_request("r-swa", PROMPT, max_tokens=4))
    H.step(swa, faker)
    H.step(swa, faker)  # allocate_slots trims
    assert KVCacheCoordinator.__dict__["remove_skipped_blocks"] is wrapper
    skipped = [e for e in H.of_kind(H.close_and_read(recording), "blocks_free", req="r-swa")
               if e["reason"] == "skipped"]
    assert len(skipped) == 1 and len(skipped[0]["blocks"]) == OUT_OF_WINDOW


@pytest.mark.skipif(H.release_key() < (0, 14), reason="before 0.14 _connector_finished does not prune the window")
def test_connector_finished_on_a_running_request_is_no_finish(recording, model_dir):
    """What test_connector_finish_frees_on_settled_basis does: the prune at _connector_finished, request running."""
    import pdtrace

    s = _swa_scheduler(model_dir, kv_role="kv_both")
    faker = H.OutputFaker()
    request = H.make_request("r1", PROMPT, max_tokens=4)
    s.add_request(request)
    H.step(s, faker)                                   # step 0: prefill processed, token 101 next
    s._connector_finished(request)                     # running: only the out-of-window prune happens
    assert _null_blocks(s, "r1") == OUT_OF_WINDOW and request.status.name == "RUNNING"
    for _ in range(5):
        H.step(s, faker)
    assert "r1" not in s.requests

    events = H.close_and_read(recording)
    finishes = H.of_kind(events, "req_finish", req="r1")
    assert len(finishes) == 1 and finishes[0]["status"] == "FINISHED_LENGTH_CAPPED"
    frees = H.of_kind(events, "blocks_free", req="r1")
    assert [e["reason"] for e in frees] == ["skipped", "finished"]
    assert events.index(frees[0]) < events.index(finishes[0])
    assert frees[0]["step"] is None  # between steps, as the test calls it
    assert len(pdtrace.analyze(recording)) == 0
