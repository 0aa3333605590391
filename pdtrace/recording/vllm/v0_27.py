"""Hook table for vLLM 0.27.0 to 0.27.x: the 0.28 table (v0_28.py) with the local prefix hit read from the KV cache
manager, as 0.27 has no `Scheduler._get_local_prefix_cache_hit` (0.28 moved these calls into it).

Read from 0.27.0's and 0.27.1's vllm/v1/core sources (line numbers: 0.27.1):

* With a KV connector the hit comes from `KVCacheManager.get_computed_blocks_for_connector(request)`
  (sched/scheduler.py:757; kv_cache_manager.py:297-342), whose answer starts with the (KVCacheBlocks, hit tokens)
  of `get_computed_blocks`: it calls `get_computed_blocks` itself except for a hybrid Mamba model whose hit diverged
  across groups, which it answers without. Without a connector the hit is `get_computed_blocks(request)`
  (scheduler.py:766), a 3-tuple (kv_cache_manager.py:229), whose [0] and [1] mean what they mean in 0.28; the
  connector path calls it again to reconcile a diverged hit nothing external backs (scheduler.py:821). Both are
  wrapped and note the hit as 0.33's `_get_local_prefix_cache_hit` hook does (the last answer wins, as there).
  Admission attempts only: the scheduler calls them for requests with nothing computed.
* `_preempt_request(request, timestamp, drop_stale_output=False)` (scheduler.py:1274) frees through
  `_free_request_blocks`, as 0.28's; the wrapper passes the new argument through.
* 0.28.0's partial-tail pins are already here (`KVCacheManager._partial_tail_pins`, kv_cache_manager.py:191, popped
  in `free` :575 and prepended by `pop_blocks_for_free` :614): `v0_28._w_kvm_free` records their return to the
  pool (docs/vllm-releases.md, "0.28.0's copy-on-write tail blocks").
* Everything else as 0.28: the held-aside queue `skipped_waiting` (scheduler.py:189) and the inline switch into
  WAITING_FOR_REMOTE_KVS, `_update_waiting_for_remote_kv` called once from `_try_promote_blocked_waiting_request`
  (:2635, :2678-2690), deferred frees, copy-on-write retentions (`_free_cow_retained_blocks` :2356),
  `remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens=None)`
  (kv_cache_coordinator.py:336).
"""

from __future__ import annotations

from typing import Any

from pdtrace.recording.vllm import v0_28, v0_33
from pdtrace.recording.vllm._common import state_get
from pdtrace.recording.vllm._patching import Hook, overlay
from pdtrace.recording.vllm._runtime import guarded


def w_prefix_hit(where: str) -> Any:
    """A wrapper factory for a KVCacheManager method answering (KVCacheBlocks, hit tokens, ...) for a request's
    admission attempt: the answer noted as 0.33's `_get_local_prefix_cache_hit` hook notes it (0.18-0.27's
    `get_computed_blocks`, 0.27's `get_computed_blocks_for_connector`)."""

    def after(ctx: Any, self: Any, out: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        st = state_get(id(self))
        if st is not None:
            v0_33._note_prefix_hit(st, request, out)

    return guarded(where, None, after=after)


TABLE: tuple[Hook, ...] = overlay(
    v0_28.TABLE,
    replace=(
        Hook(v0_33._KVM, "KVCacheManager", "get_computed_blocks",
             w_prefix_hit("KVCacheManager.get_computed_blocks"), ("request",)),
        Hook(v0_33._KVM, "KVCacheManager", "get_computed_blocks_for_connector",
             w_prefix_hit("KVCacheManager.get_computed_blocks_for_connector"), ("request",)),
    ),
    drop=("Scheduler._get_local_prefix_cache_hit",),
)
