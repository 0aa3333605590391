"""Hook table for vLLM 0.10.1.1 to 0.11.0, the V1 engine of the user's original thread: a thin overlay of the 0.33
table (v0_33.py), whose wrappers tolerate what these releases lack.

Read from each release's vllm/v1 sources (0.10.1.1, 0.10.2, 0.11.0):

* `Scheduler.schedule()` takes no `throttle_prefills`.
* Preemption is inline in schedule() (0.10.1.1 scheduler.py:254-271): `kv_cache_manager.free(request)` of a RUNNING
  request, then PREEMPTED. There is no `_preempt_request`: the free wrapper records req_preempt and frees with
  reason `preempted` when the request it frees is still RUNNING (every finish sets a FINISHED status first).
* No deferred frees (no `defer_block_free`, `pop_blocks_for_free`, `_drain_deferred_frees`, copy-on-write
  retentions): every free is immediate.
* The local prefix hit comes from `KVCacheManager.get_computed_blocks(request)`, called once per admission attempt
  of a request with nothing computed (scheduler.py:376-380). Those requests are also where a KV receive starts: the
  switch into WAITING_FOR_REMOTE_KVS is inline (right after `connector.update_state_after_alloc`,
  scheduler.py:466-480), and the request goes back to the one waiting queue. After vLLM's schedule() the wrapper
  looks at the requests whose admission was tried in it, and records blocks_alloc + req_wait_kv for those that now
  wait for remote KV (what 0.33's `_set_kv_fetch_stage` hook records).
* `finish_requests` never delays the free of a request aborted while WAITING_FOR_REMOTE_KVS (no such case in
  0.10's finish_requests): its blocks go back to the pool at once, while the receive may still write them, a real
  bug of these releases that pdtrace reports (premature_free). So no abort-delay hook.
* `_update_waiting_for_remote_kv` is polled at every schedule() while the request waits and returns whether the
  read is done (0.28+ call it once the read is done).
* No `Worker.sample_tokens` (0.11.1 added it: v0_11.py), `resumed_from_preemption` flags instead of
  `resumed_req_ids`, 0.10's batch queue is a `queue.Queue`; 0.10.1.1's `step_with_batch_queue` skips
  `update_from_output` for an empty schedule (such steps have `sched` but no `step_output`; 0.10.2 calls it).
"""

from __future__ import annotations

from typing import Any

from pdtrace.recording.vllm import v0_33
from pdtrace.recording.vllm._common import state_get
from pdtrace.recording.vllm._patching import Hook, overlay
from pdtrace.recording.vllm._runtime import SKIP, guarded
from pdtrace.recording.vllm.v0_28 import note_kv_waits


def _computed_blocks_after(ctx: Any, self: Any, out: Any, request: Any, *args: Any, **kwargs: Any) -> None:
    st = state_get(id(self))
    if st is not None:
        v0_33._note_prefix_hit(st, request, out)
        st.admitting.append(request)


# The local prefix hit, as 0.33's _get_local_prefix_cache_hit hook notes it, and the request as a candidate for
# a KV receive started in this schedule().
_w_get_computed_blocks = guarded("KVCacheManager.get_computed_blocks", None, after=_computed_blocks_after)


def _take_admitting(st: Any) -> list[Any]:
    """The requests whose admission this schedule() tried (and forget them for the next one)."""
    admitting, st.admitting = st.admitting, []
    return admitting


def _w_schedule(orig: Any) -> Any:
    return v0_33._w_schedule(note_kv_waits(orig, _take_admitting))


def _waiting_after(ctx: Any, self: Any, ready: Any, request: Any) -> None:
    if ready:
        st = state_get(id(self))
        if st is not None:
            st.waiting_kv.discard(request.request_id)


# Polled at every schedule() while the request waits (0.10.1.1 scheduler.py:339-349): True once the read is
# done. It frees nothing here (0.11.1 added the failed-load free: v0_11.py).
_w_update_waiting_for_remote_kv = guarded("_update_waiting_for_remote_kv", ("request",), after=_waiting_after)


def _inline_preempt_before(self: Any, request: Any) -> Any:
    st = state_get(id(self))
    if st is None or st.free_reason is not None or v0_33._status_name(request.status) != "RUNNING":
        return SKIP
    st.ch.emit("req_preempt", step=st.cur_step, req=request.request_id)
    st.free_reason = "preempted"
    return st


def _inline_preempt_restore(st: Any) -> None:
    st.free_reason = None


def _w_kvm_free(orig: Any) -> Any:
    # A free of a RUNNING request outside any other free path is schedule()'s inline preemption.
    return guarded("KVCacheManager.free", ("request",), _inline_preempt_before,
                   restore=_inline_preempt_restore)(v0_33._w_kvm_free(orig))


TABLE: tuple[Hook, ...] = overlay(
    v0_33.TABLE,
    replace=(
        Hook(v0_33._SCHED, "Scheduler", "schedule", _w_schedule, ()),
        Hook(v0_33._KVM, "KVCacheManager", "free", _w_kvm_free, ("request",)),
        Hook(v0_33._KVM, "KVCacheManager", "get_computed_blocks", _w_get_computed_blocks, ("request",)),
        Hook(v0_33._SCHED, "Scheduler", "_update_waiting_for_remote_kv", _w_update_waiting_for_remote_kv,
             ("request",)),
        # The same trimming as 0.33 (sliding window, chunked local, Mamba); the parameter is num_computed_tokens.
        Hook(v0_33._COORD, "KVCacheCoordinator", "remove_skipped_blocks", v0_33._w_remove_skipped_blocks,
             ("request_id", "num_computed_tokens")),
        # The V1 Executor inherits its __init__ (which starts the workers) from V0's ExecutorBase here.
        Hook("vllm.executor.executor_base", "ExecutorBase", "__init__", v0_33._w_executor_init, ("vllm_config",)),
        *v0_33.PP_SYNC_HOOKS,  # the PP tensors received and sent synchronously (0.10-0.16: v0_11, v0_14, v0_16; v0_17 on: async)
    ),
    drop=(
        "Scheduler._preempt_request", "Scheduler.finish_requests", "Scheduler._drain_deferred_frees",
        "Scheduler._get_local_prefix_cache_hit", "Scheduler._set_kv_fetch_stage", "Scheduler._free_cow_retained_blocks",
        "KVCacheManager.pop_blocks_for_free", "Worker.sample_tokens", "Executor.__init__", *v0_33.PP_ASYNC_HOOKS,
    ),
)
