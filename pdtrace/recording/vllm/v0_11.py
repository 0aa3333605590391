"""Hook table for vLLM 0.11.1 to 0.11.x: the 0.10 table (v0_10.py) plus `Worker.sample_tokens`, which 0.11.1 added
(the step's second RPC, as in 0.28+); 0.11.1 also replaced `resumed_from_preemption` with `resumed_req_ids` and
0.10's `queue.Queue` batch queue with a deque, which the shared wrappers read either way, and removed V0's
`ExecutorBase` (the V1 `Executor` starts the workers in its own `__init__`). Preemption stays inline,
frees stay immediate, an abort while receiving still frees at once (0.11.2 scheduler.py finish_requests).
"""

from __future__ import annotations

from pdtrace.recording.vllm import v0_10, v0_33
from pdtrace.recording.vllm._patching import Hook, overlay

TABLE: tuple[Hook, ...] = overlay(
    v0_10.TABLE,
    replace=(Hook(v0_33._WORKER, "Worker", "sample_tokens", v0_33._w_worker_sample_tokens, ("grammar_output",),
                  lazy=True),
             # 0.11.1 removed V0's ExecutorBase: the V1 Executor has its own __init__, as in 0.28+.
             Hook(v0_33._EXECUTOR, "Executor", "__init__", v0_33._w_executor_init, ("vllm_config",))),
    drop=("ExecutorBase.__init__",),
)
