"""Hook table for vLLM 0.17.0 to 0.17.x: the 0.16 table (v0_16.py) with the asynchronous PP receive.

Read from 0.17.0's and 0.17.1's vllm/v1/worker/gpu_worker.py (line numbers: 0.17.0): `execute_model` receives the
previous PP stage's tensors with `get_pp_group().irecv_tensor_dict(...)` (:707), which blocks on their metadata and
hands the tensors back as `AsyncIntermediateTensors` (:71), whose `wait_for_comm` (:85) waits for the handles on
the forward's first use of `.tensors`; it sends with `isend_tensor_dict` (:742), waited at the next step's start
(`_pp_send_work`). Both methods are line for line 0.26.0's, so the 0.33 wrappers of `irecv_tensor_dict` and
`wait_for_comm` record the wait (`exec_wait_*`, reason `pp_recv`) as there; 0.16.0's synchronous
`recv_tensor_dict` / `send_tensor_dict` (v0_10's `PP_SYNC_HOOKS`) are no longer called by the worker. The scheduler
side is 0.16's.
"""

from __future__ import annotations

from pdtrace.recording.vllm import v0_16, v0_33
from pdtrace.recording.vllm._patching import overlay

#: 0.33's asynchronous-receive hooks, as its table has them.
PP_ASYNC_TABLE_HOOKS = tuple(h for h in v0_33.TABLE if f"{h.owner}.{h.name}" in v0_33.PP_ASYNC_HOOKS)

TABLE = overlay(
    v0_16.TABLE,
    replace=PP_ASYNC_TABLE_HOOKS,
    drop=tuple(f"{h.owner}.{h.name}" for h in v0_33.PP_SYNC_HOOKS),
)
