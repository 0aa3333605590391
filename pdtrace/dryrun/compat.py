"""What the dry run (and the vLLM tier's harness) does differently per vLLM release: small shims, each naming the
releases it covers. The hooks' own differences live in pdtrace.recording.vllm's tables; what the releases do
differently is in docs/vllm-releases.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from functools import partial
from typing import Any

import numpy as np


def attach_block_hasher(request: Any, hasher: Any) -> None:
    """Give a Request built without one EngineCore's block hasher and compute its block hashes, as
    `Request.from_engine_core_request(request, core.request_block_hasher)` does (no-op for None).

    0.28+ keep the hasher in `_block_hasher` and hash in `update_block_hashes()`; 0.10 / 0.11 keep it bound in
    `get_hash_new_full_blocks`. Without hashes, 0.32 and older fail in BlockPool.cache_full_blocks (an
    IndexError: 0.33 caps the caching at the hashed tokens).
    """
    if hasher is None:
        return
    request.block_hashes = []
    if hasattr(request, "_block_hasher"):
        request._block_hasher = hasher
        request.update_block_hashes()
    else:
        request.get_hash_new_full_blocks = partial(hasher, request)
        request.block_hashes = request.get_hash_new_full_blocks()


def recv_plan(meta: Any) -> tuple[int, bool, str | None, str | None]:
    """What one NIXL `reqs_to_recv` entry asks a D rank to read: (blocks, whether the scheduler awaits a
    completion, the remote engine id, the remote request id or None).

    0.31+: `local_block_ids` per KV cache group, `awaiting_kvs`, `remote` (RemoteMeta). 0.28-0.30: no
    `awaiting_kvs` (every read is awaited). 0.10 to 0.12: flat block lists and the remote's fields inline, and no
    remote request id: P and D share one request id there (0.13+ have `remote`).
    """
    local = meta.local_block_ids
    remote = getattr(meta, "remote", None)
    if remote is not None or hasattr(meta, "awaiting_kvs") or (local and isinstance(local[0], (list, tuple))):
        n_blocks = remote_block_count(local)
        if remote is None:
            return n_blocks, bool(getattr(meta, "awaiting_kvs", True)), None, None
        return n_blocks, bool(getattr(meta, "awaiting_kvs", True)), remote.engine_id, remote.request_id
    return remote_block_count(local), True, getattr(meta, "remote_engine_id", None), None


def shared_request_ids() -> bool:
    """Whether a request keeps one id on P and D. 0.10 to 0.12: NIXL's kv_transfer_params name no remote request,
    and D's read notifies P with D's own id (nixl_connector.py `_read_blocks`: `notif_id = f"{request_id}:..."`,
    0.12.0:1991), which P looks up among its own requests; so those releases' proxy gives both sides one
    X-Request-Id. 0.13+: P returns `remote_request_id` (`RemoteMeta.request_id`) and D names its request itself.

    RemoteMeta lives where the release keeps NIXL's metadata: nixl_connector.py (0.13.0:206 to 0.17.1:240, and on
    to the release that split the connector into a package), nixl/metadata.py (0.28+); each candidate is looked
    in, and no RemoteMeta anywhere means no remote request id."""
    for module in _NIXL_METADATA_MODULES:
        try:
            remote_meta = importlib.import_module(module).RemoteMeta
        except (ImportError, AttributeError):  # no such module, or one without RemoteMeta (0.10 to 0.12)
            continue
        return "request_id" not in {f.name for f in dataclasses.fields(remote_meta)}
    return True


#: Where releases keep NIXL's RemoteMeta, newest layout first.
_NIXL_METADATA_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector",
)


def remote_block_count(block_ids: Any) -> int:
    """How many blocks P's kv_transfer_params `remote_block_ids` lists: one list per KV cache group (0.28+; the
    first group's) or a flat list (0.10 / 0.11)."""
    if not block_ids:
        return 0
    first = block_ids[0]
    return len(first) if isinstance(first, (list, tuple)) else len(block_ids)


def ensure_cpu_platform() -> None:
    """0.10 / 0.11 detect the CPU platform only in a CPU build of vLLM (a `cpu` version suffix) or on macOS; the
    CUDA wheel on a machine without a GPU gets UnspecifiedPlatform, which refuses to build a VllmConfig
    (is_async_output_supported raises NotImplementedError). Resolve it to CpuPlatform there, as a CPU build would;
    newer releases already do so themselves.

    The CpuPlatform set here loads no kernels: 0.16-0.17's `CpuPlatform.import_kernels` (called by the first import
    of `vllm._custom_ops`, e.g. from the scheduler's module on 0.17) asks `torch._C._cpu._is_avx512_supported`, which
    the CPU torch the tier runs no longer has, and a CUDA wheel ships no CPU kernels to load; the dry run runs no
    model."""
    import vllm.platforms as platforms  # lazy: vLLM (optional) loads only when a dry run starts

    current = platforms.current_platform
    if type(current).__name__ == "UnspecifiedPlatform":
        from vllm.platforms.cpu import CpuPlatform  # lazy: vLLM (optional) loads only when a dry run starts

        platform = CpuPlatform()
        platform.import_kernels = _no_kernels  # type: ignore[method-assign]
        platforms._current_platform = platform


def _no_kernels() -> None:
    """`import_kernels` of the dry run's CpuPlatform (ensure_cpu_platform): nothing to load."""


def full_attention_spec(block_size: int, num_kv_heads: int = 1, head_size: int = 1, dtype: Any = None) -> Any:
    """A FullAttentionSpec (default: one KV head of size 1, float32); 0.10 / 0.11 also require `use_mla`."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # lazy: vLLM (optional) loads only when a dry run starts

    return _attention_spec(FullAttentionSpec, block_size, num_kv_heads, head_size, dtype)


def sliding_window_spec(block_size: int, window: int, num_kv_heads: int = 1, head_size: int = 1,
                        dtype: Any = None) -> Any:
    """A SlidingWindowSpec of `window` tokens, with the same defaults and `use_mla` handling."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec  # lazy: vLLM (optional) loads only when a dry run starts

    return _attention_spec(SlidingWindowSpec, block_size, num_kv_heads, head_size, dtype, sliding_window=window)


def _attention_spec(spec_type: Any, block_size: int, num_kv_heads: int, head_size: int, dtype: Any,
                    **fields: Any) -> Any:
    import torch  # lazy: torch comes with vLLM (optional), loaded only when a dry run starts

    if "use_mla" in {f.name for f in dataclasses.fields(spec_type)}:
        fields["use_mla"] = False
    return spec_type(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                     dtype=torch.float32 if dtype is None else dtype, **fields)


def new_request(request_id: str, prompt_token_ids: list[int], sampling_params: Any, **kwargs: Any) -> Any:
    """A text-only vllm.v1.request.Request: the multimodal parameters each release requires are passed as None
    (0.10: multi_modal_kwargs / _hashes / _placeholders; 0.11.0: also mm_features; 0.28+: mm_features only);
    `kwargs` (block_hasher, arrival_time, eos_token_id: 0.10 / 0.11 only, ...) where the release takes them."""
    from vllm.v1.request import Request  # lazy: vLLM (optional) loads only when a dry run starts

    params = inspect.signature(Request.__init__).parameters
    args: dict[str, Any] = {"request_id": request_id, "prompt_token_ids": prompt_token_ids,
                            "sampling_params": sampling_params, "pooling_params": None}
    for name in ("multi_modal_kwargs", "multi_modal_hashes", "multi_modal_placeholders", "mm_features"):
        if name in params:
            args[name] = None
    args.update((k, v) for k, v in kwargs.items() if k in params)
    return Request(**args)


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: Any = None,
                        ) -> Any:
    """A ModelRunnerOutput of sampled tokens: the fields a release requires without a default are given empty
    (0.10: spec_token_ids; 0.10-0.11: logprobs, prompt_logprobs_dict, pooler_output), and 0.11.1 / 0.11.2 take
    the sampled tokens as numpy arrays (their update_from_output calls .tolist())."""
    from vllm.v1.outputs import ModelRunnerOutput  # lazy: vLLM (optional) loads only when a dry run starts

    fields = {f.name: f for f in dataclasses.fields(ModelRunnerOutput)}
    if "ndarray" in str(fields["sampled_token_ids"].type):
        sampled_token_ids = [np.array(t, dtype=np.int64) for t in sampled_token_ids]
    args: dict[str, Any] = {"req_ids": req_ids, "req_id_to_index": {r: i for i, r in enumerate(req_ids)},
                            "sampled_token_ids": sampled_token_ids, "kv_connector_output": kv_connector_output}
    empty = {"prompt_logprobs_dict": {}}
    for name, f in fields.items():
        if name not in args and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            args[name] = empty.get(name)
    return ModelRunnerOutput(**args)


def warm_up_reply() -> Any:
    """One worker's reply to the `compile_or_warm_up_model` RPC: CompilationTimes (0.28+), else seconds as a float
    (0.16-0.27 take the `max` of the ranks' replies; 0.10-0.15 ignore it)."""
    try:
        from vllm.v1.worker.worker_base import CompilationTimes  # type: ignore[attr-defined]
    except ImportError:
        return 0.0
    return CompilationTimes(0.0, 0.0)


def use_v1_scheduler(vllm_config: Any) -> None:
    """0.10 / 0.11's SchedulerConfig defaults to the V0 scheduler class (`vllm.core.scheduler.Scheduler`); vLLM's
    EngineArgs switch it to the V1 one for the V1 engine, a VllmConfig built directly does not."""
    sc = vllm_config.scheduler_config
    if str(getattr(sc, "scheduler_cls", "")) == "vllm.core.scheduler.Scheduler":
        sc.scheduler_cls = "vllm.v1.core.sched.scheduler.Scheduler"


def engine_step(core: Any) -> Any:
    """One turn of EngineCoreProc's busy loop: `core.step_fn()` (bound in EngineCore.__init__ from 0.11.1; in 0.10
    / 0.11.0 only EngineCoreProc binds it, to `step` or `step_with_batch_queue` by the batch queue), then
    Returns step_fn's (outputs, model_executed)."""
    step_fn = core.__dict__.get("step_fn")
    if step_fn is None:
        step_fn = core.step if core.batch_queue is None else core.step_with_batch_queue
    outputs, executed = step_fn()
    return outputs, executed


def post_step(core: Any, executed: bool) -> None:
    """EngineCore.post_step where the release has it (0.11.0+)."""
    post = getattr(core, "post_step", None)
    if post is not None:
        post(executed)


def batch_queue_busy(core: Any) -> bool:
    """Whether the engine's batch queue holds a step: a deque (0.10.2+) or a queue.Queue (0.10.1.1)."""
    queue = core.batch_queue
    if queue is None:
        return False
    empty = getattr(queue, "empty", None)
    return not empty() if empty is not None else bool(queue)


def split_sampling() -> bool:
    """Whether the engine samples in a second RPC (`Executor.sample_tokens`, 0.11.1+): execute_model then replies
    None for a step with tokens. Before, execute_model's reply carries the sampled tokens."""
    from vllm.v1.executor.abstract import Executor  # lazy: vLLM (optional) loads only when a dry run starts

    return hasattr(Executor, "sample_tokens")
