"""Hook table for vLLM 0.24.0 to 0.25.x: the 0.26 table (v0_26.py) without copy-on-write, and the trimming
parameter under its older name.

Read from 0.24.0's and 0.25.0's vllm/v1/core sources (line numbers: 0.24.0):

* Deferred frees, line for line as in 0.28: `defer_block_free` (sched/scheduler.py:130-152), `_free_request_blocks`
  (:2082-2095) and `_drain_deferred_frees` (:2097-2109), `KVCacheManager.pop_blocks_for_free`
  (kv_cache_manager.py:483-494); `_preempt_request` frees through `_free_request_blocks` (:1116);
  `schedule(throttle_prefills=False)` (:388). So a table for 0.18-0.23 (no deferred-free hooks) would pass its
  checks here and lose every deferred free: the range comes from the code, not from the checks.
* No copy-on-write (`_free_cow_retained_blocks` arrives in 0.26).
* `KVCacheCoordinator.remove_skipped_blocks(request_id, total_computed_tokens)` (kv_cache_coordinator.py:331; 0.25
  adds `num_prompt_tokens=None`): the same trimming, its second parameter not yet `processed_computed_tokens`.
* The local prefix hit is `KVCacheManager.get_computed_blocks(request)` (scheduler.py:711), a 2-tuple
  (kv_cache_manager.py:202).
* The PP receive is 0.26's, asynchronous (`irecv_tensor_dict`, `AsyncIntermediateTensors.wait_for_comm`: read in
  the v1/worker/gpu_worker.py of 0.18.0, 0.19.0, 0.20.0, 0.21.0, 0.22.1, 0.23.0, 0.24.0, 0.25.0 and 0.25.1), so
  0.26's hooks record the PP wait here and in the 0.18 table built on this one.
"""

from __future__ import annotations

from pdtrace.recording.vllm import v0_26, v0_33
from pdtrace.recording.vllm._patching import Hook, overlay

TABLE: tuple[Hook, ...] = overlay(
    v0_26.TABLE,
    replace=(Hook(v0_33._COORD, "KVCacheCoordinator", "remove_skipped_blocks", v0_33._w_remove_skipped_blocks,
                  ("request_id", "total_computed_tokens")),),
    drop=("Scheduler._free_cow_retained_blocks",),
)
