"""Hook table for vLLM 0.28.0 to 0.31.x: the 0.33 table (v0_33.py) less `Scheduler._set_kv_fetch_stage`, which these
releases do not have, and a schedule wrapper that notes the requests starting a KV receive instead.

Read from each release's vllm/v1/core/sched/scheduler.py (0.28.0, 0.29.0, 0.30.0, 0.31.0):

* The switch into WAITING_FOR_REMOTE_KVS is inline in `schedule()`, right after `connector.update_state_after_alloc`
  (0.28.0 scheduler.py:1061-1086): the status is set, `num_computed_tokens` = local hit + external tokens, and the
  request is put back in the queue of waiting requests held aside (`skipped_waiting` in 0.28-0.30,
  `kv_holding_waiting` in 0.31) when schedule() ends. So after vLLM's schedule() returns, and before the step's
  block growth is recorded, the wrapper looks in that queue for requests in WAITING_FOR_REMOTE_KVS it has not seen
  start waiting, and records for each what 0.33's `_set_kv_fetch_stage` hook records (blocks_alloc with
  `hit` / `external`, then req_wait_kv), at the same step. Only with a KV connector (nothing else sets that status);
  the cost is one pass over the held-aside queue per step, which is short (it holds requests that could not be
  scheduled this step).
* Everything else the 0.33 wrappers read exists with the same meaning, or they tolerate its absence:
  `KVConnectorOutput.failed_recving` (0.30+; before, a failed receive shows only as `invalid_block_ids`),
  `Scheduler.deferred_loads` (0.33+; an abort while receiving is delayed unless the receive already finished, as
  0.28's finish_requests does), the async model runner output's `get_kv_connector_output` (0.33+; before, the
  per-rank completions are read from the ModelRunnerOutput it holds). The order drain -> free -> transfer
  handling in `update_from_output` is unchanged, and so are deferred frees (`pop_blocks_for_free`,
  `_drain_deferred_frees`) and copy-on-write retentions (`_free_cow_retained_blocks`).
* 0.28.0 only (and 0.27.x, whose v0_27 table keeps this wrapper): a KV producer's copy-on-write tail block handed
  to an offloading connector (Mamba "align" groups, `KVCacheManager.take_partial_tail_offloads`) is pinned outside
  the request's block table (`KVCacheManager._partial_tail_pins`, ref count +1) and unpinned with the request's
  blocks: prepended to what `pop_blocks_for_free` returns (a deferred free: `_drain_deferred_frees` reports its
  return to the pool, as for any deferred block), or freed first thing in `KVCacheManager.free`
  (kv_cache_manager.py:570-581), where the 0.33 wrapper looks at the block table only. `_w_kvm_free` adds the pool
  return of those pins. The pin is no block of the request (its `blocks_free` stays the table's, as in 0.29+,
  where nothing is pinned).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdtrace.recording.vllm import v0_33
from pdtrace.recording.vllm._common import state_get
from pdtrace.recording.vllm._patching import Hook, overlay
from pdtrace.recording.vllm._runtime import RUNTIME

_RT = RUNTIME


def record_new_kv_waits(st: Any, requests: Any) -> None:
    """blocks_alloc + req_wait_kv (as 0.33's `_set_kv_fetch_stage` hook records them) for each of `requests` now in
    WAITING_FOR_REMOTE_KVS that was not seen waiting yet."""
    waiting_kv = st.waiting_kv
    for request in requests:
        if (request.request_id not in waiting_kv
                and v0_33._status_name(request.status) == "WAITING_FOR_REMOTE_KVS"):
            v0_33._record_growth(st, request.request_id, wait_kv_request=request)


def note_kv_waits(orig: Any, candidates: Callable[[Any], Any]) -> Any:
    """vLLM's schedule(), then req_wait_kv for those of `candidates(state)` it switched into
    WAITING_FOR_REMOTE_KVS (0.28-0.31: the held-aside queue; 0.10 / 0.11: the requests it tried to admit)."""

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        so = orig(self, *args, **kwargs)
        st = state_get(id(self))
        if st is not None:
            try:
                requests = candidates(st)
                if requests and _RT.active and self.connector is not None:
                    record_new_kv_waits(st, requests)
            except Exception as exc:
                _RT.fail("schedule", exc)
        return so

    return schedule


def _w_schedule(orig: Any) -> Any:
    return v0_33._w_schedule(note_kv_waits(orig, lambda st: st.held))


def _w_kvm_free(orig: Any) -> Any:
    """0.33's KVCacheManager.free wrapper, then blocks_pool_free for the request's partial-tail pins (0.27.0 to
    0.28.0's `_partial_tail_pins`, v0_27 too; none in 0.29-0.31, which have no such attribute) whose ref count reached 0."""
    recorded = v0_33._w_kvm_free(orig)

    def free(self: Any, request: Any) -> Any:
        pins = getattr(self, "_partial_tail_pins", None)  # never self.__dict__: see _common.attach_state
        pinned = list(pins.get(request.request_id, ())) if pins and _RT.active else ()
        out = recorded(self, request)
        if pinned and _RT.active:
            try:
                st = state_get(id(self))
                if st is not None:
                    v0_33._record_pool_return(st, request.request_id, pinned)
            except Exception as exc:
                _RT.fail("KVCacheManager.free", exc)
        return out

    return free


TABLE: tuple[Hook, ...] = overlay(
    v0_33.TABLE,
    replace=(Hook(v0_33._SCHED, "Scheduler", "schedule", _w_schedule, ("throttle_prefills",)),
             Hook(v0_33._KVM, "KVCacheManager", "free", _w_kvm_free, ("request",))),
    drop=("Scheduler._set_kv_fetch_stage",),
)
