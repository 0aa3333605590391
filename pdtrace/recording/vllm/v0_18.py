"""Hook table for vLLM 0.18.0 to 0.23.x: the 0.24 table (v0_24.py) without deferred frees.

Read from 0.18.0's, 0.22.0's and 0.23.0's vllm/v1/core sources (line numbers: 0.18.0; 0.23.0's in brackets):

* A queue of waiting requests held aside, `skipped_waiting` (sched/scheduler.py:168 [167]), and the switch into
  WAITING_FOR_REMOTE_KVS inline in `schedule()`, which sets `num_computed_tokens` = local hit + external tokens
  there (:766-781 [807-822]), and puts the request in the held-aside queue when the admission loop ends
  (:826 [868]), as in 0.28: the 0.28 schedule wrapper (v0_28.note_kv_waits) records the
  blocks_alloc + req_wait_kv, `n` included.
* `_update_waiting_for_remote_kv` returns None and is called once, when the read is done, from
  `_try_promote_blocked_waiting_request` (:2012, :2050-2065 [2154, 2188-2198]); its only free is the failed-load
  path (:2031 [2173]), as 0.28's: 0.33's wrapper.
* An abort while WAITING_FOR_REMOTE_KVS delays the free unless the read already finished (`finish_requests`,
  :1779 [1877]): 0.33's finish_requests wrapper.
* `_preempt_request(request, timestamp)` (:929) frees with `kv_cache_manager.free` (:938 [983]).
* No deferred frees (no `defer_block_free`, `_drain_deferred_frees`, `pop_blocks_for_free`): every free is
  immediate. No copy-on-write, no `_get_local_prefix_cache_hit`: the prefix hit is
  `KVCacheManager.get_computed_blocks(request)` (:603 [612]). `schedule()` takes no `throttle_prefills`
  (:338 [340]). `remove_skipped_blocks(request_id, total_computed_tokens)` (kv_cache_coordinator.py:218 [291]).
"""

from __future__ import annotations

from pdtrace.recording.vllm import v0_24, v0_28, v0_33
from pdtrace.recording.vllm._patching import Hook, overlay

TABLE: tuple[Hook, ...] = overlay(
    v0_24.TABLE,
    replace=(Hook(v0_33._SCHED, "Scheduler", "schedule", v0_28._w_schedule, ()),),
    drop=("Scheduler._drain_deferred_frees", "KVCacheManager.pop_blocks_for_free"),
)
