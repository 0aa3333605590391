"""Hook table for vLLM 0.11.1 to 0.13.x: the 0.10 table (v0_10.py) plus `Worker.sample_tokens`, which 0.11.1 added
(the step's second RPC, as in 0.28+), and the failed-load free.

Read from each release's vllm/v1 sources (0.11.1, 0.11.2, 0.12.0, 0.13.0; line numbers of 0.12.0's
core/sched/scheduler.py unless another file is named):

* 0.11.1 replaced `resumed_from_preemption` with `resumed_req_ids` and 0.10's `queue.Queue` batch queue with a
  deque, which the shared wrappers read either way, and removed V0's `ExecutorBase` (the V1 `Executor` starts
  the workers in its own `__init__`, hooked as in 0.28+). Frees stay immediate; an abort while receiving still
  frees at once (finish_requests, 1309-1351: no delay for WAITING_FOR_REMOTE_KVS).
* A failed read (`invalid_block_ids`, 0.11.1+) that left no valid token frees the request's blocks in
  `_update_waiting_for_remote_kv` (0.11.1 / 0.11.2 scheduler.py:1427-1438; 0.12.0:1534-1545; 0.13.0:1600-1611):
  the request is still WAITING_FOR_REMOTE_KVS and is admitted again at once (a local hit may serve it). Recorded
  as `blocks_free` reason `load_failed`, as the 0.28+ tables record the same path, not as a finish.
* 0.12.0 adds `_preempt_request(request, timestamp)` (749-770), called by schedule() (350) and
  reset_prefix_cache (1397): it asserts RUNNING and frees through `kv_cache_manager.free` while the request is
  still RUNNING, so v0_10's free wrapper records it as the preemption it is (req_preempt, reason `preempted`)
  without a hook of its own. `SchedulerOutput.preempted_req_ids` appears (sched/output.py:198), unread.
* Everything else the table wraps keeps its name, parameters and meaning through 0.13.x: `schedule()` without
  `throttle_prefills` (205), `get_computed_blocks` for the prefix hit of a request with nothing computed (469),
  the inline switch into WAITING_FOR_REMOTE_KVS back into the waiting queue (603-604), the polled
  `_update_waiting_for_remote_kv` returning a bool (1518), `_update_from_kv_xfer_finished` (1564: a receive
  completion of an unknown id kept unchecked, a send completion asserted), `_connector_finished` (1494, no
  trimming), `KVCacheCoordinator.remove_skipped_blocks(request_id, num_computed_tokens)`
  (kv_cache_coordinator.py:187), EngineCore.step / step_with_batch_queue (engine/core.py:331, 366), the workers'
  execute_model / sample_tokens (worker/gpu_worker.py:543, 537). 0.13.0 has the same at shifted lines (scheduler.py
  216, 759, 1353, 1560, 1584, 1630).
* NIXL: 0.12.0's D notifies P with D's own request id (nixl_connector.py:1991), so P and D share one id; 0.13.0
  adds `remote_request_id` (nixl_connector.py:74, 206 RemoteMeta, 263, 775), the P side's own id
  (pdtrace.dryrun.compat.shared_request_ids).
"""

from __future__ import annotations

from typing import Any

from pdtrace.recording.vllm import v0_10, v0_33
from pdtrace.recording.vllm._common import state_get
from pdtrace.recording.vllm._patching import Hook, overlay
from pdtrace.recording.vllm._runtime import SKIP, guarded


def _load_failed_before(self: Any, request: Any) -> Any:
    st = state_get(id(self))
    if st is None:
        return SKIP
    previous, st.free_reason = st.free_reason, "load_failed"
    return st, previous


def _w_update_waiting_for_remote_kv(orig: Any) -> Any:
    """v0_10's polled wrapper, with the free it may make (a failed read with nothing valid) recorded as
    `load_failed`: the only free this method makes."""
    return guarded("_update_waiting_for_remote_kv", ("request",), _load_failed_before,
                   restore=v0_33._restore_free_reason)(v0_10._w_update_waiting_for_remote_kv(orig))


TABLE: tuple[Hook, ...] = overlay(
    v0_10.TABLE,
    replace=(Hook(v0_33._WORKER, "Worker", "sample_tokens", v0_33._w_worker_sample_tokens, ("grammar_output",),
                  lazy=True),
             Hook(v0_33._SCHED, "Scheduler", "_update_waiting_for_remote_kv", _w_update_waiting_for_remote_kv,
                  ("request",)),
             # 0.11.1 removed V0's ExecutorBase: the V1 Executor has its own __init__, as in 0.28+.
             Hook(v0_33._EXECUTOR, "Executor", "__init__", v0_33._w_executor_init, ("vllm_config",))),
    drop=("ExecutorBase.__init__",),
)
