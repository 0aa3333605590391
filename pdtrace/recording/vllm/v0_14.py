"""Hook table for vLLM 0.14.0 to 0.15.x: the 0.11 table (v0_11.py) with `KVCacheCoordinator.remove_skipped_blocks`'
second parameter under its new name.

Read from each release's vllm/v1 sources (0.14.0 and 0.14.1 from their sdists; 0.15.1, which has no sdist, from its
installed wheel: the same at shifted lines, scheduler.py 313, 892, 1639, 1853-1870, 1884, 1930-1951; 0.15.0 from its
wheel by shared/research/vllm-0.12-0.27.md; line numbers of 0.14.0 below):

* `KVCacheCoordinator.remove_skipped_blocks(request_id, total_computed_tokens)` (kv_cache_coordinator.py:208-210;
  `num_computed_tokens` before). The 0.33 wrapper records its trims (reason `skipped`) whatever the parameter's
  name; the table names it so that the patcher's exact check holds.
* `_connector_finished` (core/sched/scheduler.py:1663-1693), with a KV connector, first trims the request's
  out-of-window blocks (`remove_skipped_blocks(request_id=..., total_computed_tokens=request.num_tokens)`,
  1675-1680), then hands the block table to the connector: recorded as `blocks_free` `skipped` before the
  request's `req_finish`, as 0.28+ do.
* `SchedulerOutput.resumed_from_preemption` is gone (core/sched/output.py:119: `resumed_req_ids` only), which the
  shared wrappers already read.
* Internal request ids get 8 random characters (v1/engine/input_processor.py:434-444, `assign_request_id`:
  `f"{external_req_id}-{random_uuid():.8}"`), so a request's ids on P and D always differ from here on: D names
  P's through NIXL's `remote_request_id` (nixl_connector.py:80, 219 RemoteMeta, 799).
* Unchanged from 0.13: frees are immediate; an abort while receiving frees at once (finish_requests, 1452-1492);
  a receive completion for an unknown id is kept unchecked (`_update_from_kv_xfer_finished`, 1740); the polled
  `_update_waiting_for_remote_kv` (1694) with its failed-load free (1719); schedule() without
  `throttle_prefills` (252), `_preempt_request` (800) freeing a RUNNING request, the prefix hit from
  `get_computed_blocks` (521), the inline switch into WAITING_FOR_REMOTE_KVS (655-656).
"""

from __future__ import annotations

from pdtrace.recording.vllm import v0_11, v0_33
from pdtrace.recording.vllm._patching import Hook, overlay

TABLE: tuple[Hook, ...] = overlay(
    v0_11.TABLE,
    replace=(Hook(v0_33._COORD, "KVCacheCoordinator", "remove_skipped_blocks", v0_33._w_remove_skipped_blocks,
                  ("request_id", "total_computed_tokens")),),
)
