"""Hook table for vLLM 0.16.0 to 0.16.x: the 0.14 table (v0_14.py) plus `Scheduler.finish_requests`, because an
abort while receiving now delays the free. 0.17.x is this table with the asynchronous PP receive (v0_17.py).

Read from each release's vllm/v1 sources (0.16.0, 0.17.0, 0.17.1 sdists; line numbers of 0.16.0's
core/sched/scheduler.py):

* `finish_requests` (1664-1714) delays the free of a request aborted while WAITING_FOR_REMOTE_KVS unless its read
  already finished (`delay_free_blocks = request_id not in finished_recving_kv_req_ids`, 1705-1714): its blocks
  stay until the receive completion, which `_update_from_kv_xfer_finished` then frees (`_free_blocks` of a
  finished request, 1984-1992). The 0.33 wrapper notes that delay before vLLM forgets it (req_finish's
  `delay_free`), as for 0.28+; the receive's free is recorded with reason `received`.
* A receive completion for an id the scheduler no longer knows now asserts (`assert req_id in self.requests`,
  1986), as a send completion already did.
* 0.17.0: `finish_requests(request_ids: str | Iterable[str] | None, ...)` finishes every request for None and
  returns the (id, client index) pairs it aborted (0.17.0:1683-1743); the 0.33 wrapper reads None as every
  request and passes the result through.
* Unchanged from 0.14: `remove_skipped_blocks(request_id, total_computed_tokens)` (kv_cache_coordinator.py:218),
  `_connector_finished` trimming first (1892-1910), the polled `_update_waiting_for_remote_kv` returning a bool
  (1923, called at 543) with its failed-load free (1948), `get_computed_blocks` (601), the inline switch into
  WAITING_FOR_REMOTE_KVS (759-760), schedule() without `throttle_prefills` (321), `_preempt_request` (898), no
  deferred frees; the engine still sleeps once only finished requests awaiting their send are left
  (`has_finished_requests` is `len(finished_req_ids) > 0`, 0.17.1:1785).
"""

from __future__ import annotations

from pdtrace.recording.vllm import v0_14, v0_33
from pdtrace.recording.vllm._patching import Hook, overlay

TABLE: tuple[Hook, ...] = overlay(
    v0_14.TABLE,
    replace=(Hook(v0_33._SCHED, "Scheduler", "finish_requests", v0_33._w_finish_requests,
                  ("request_ids", "finished_status")),),
)
