"""Hook table for vLLM 0.26.0 to 0.26.x: the 0.27 table (v0_27.py) without what 0.27 added.

Read from 0.26.0's vllm/v1/core sources:

* No `KVCacheManager.get_computed_blocks_for_connector`: with or without a connector the local prefix hit is
  `get_computed_blocks(request)` (sched/scheduler.py:762), a 3-tuple whose [0] and [1] are 0.28's
  (kv_cache_manager.py:207).
* No partial-tail pins (no `_partial_tail_pins` in kv_cache_manager.py): `KVCacheManager.free` frees the block
  table only, 0.33's wrapper.
* As 0.27 / 0.28: deferred frees (`_free_request_blocks`, `_drain_deferred_frees`, `pop_blocks_for_free`
  kv_cache_manager.py:535), copy-on-write retentions (`_free_cow_retained_blocks`, scheduler.py:1129, 2263),
  `schedule(throttle_prefills=False)` (:425), `remove_skipped_blocks(request_id, processed_computed_tokens,
  num_prompt_tokens=None)` (kv_cache_coordinator.py:336), `_preempt_request(request, timestamp)` (:1212) freeing
  through `_free_request_blocks`, the held-aside queue `skipped_waiting` and the once-called
  `_update_waiting_for_remote_kv`.
"""

from __future__ import annotations

from pdtrace.recording.vllm import v0_27, v0_33
from pdtrace.recording.vllm._patching import Hook, overlay

TABLE: tuple[Hook, ...] = overlay(
    v0_27.TABLE,
    replace=(Hook(v0_33._KVM, "KVCacheManager", "free", v0_33._w_kvm_free, ("request",)),),
    drop=("KVCacheManager.get_computed_blocks_for_connector",),
)
