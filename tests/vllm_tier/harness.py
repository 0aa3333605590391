"""Drive vLLM 0.33.0's real Scheduler (NixlConnector scheduler side) and real EngineCore on this CPU-only box.

Shared by tests/vllm_tier and bench/record_overhead.py (the dry run keeps its own copy under pdtrace/dryrun/: package
code must not import tests). Adapted from upstream vLLM's tests/v1/kv_connector/unit/utils.py, with a local model
directory (a hand-written Llama config.json, no weights, no tokenizer) so nothing touches the network.

Faithfulness rules for fake model outputs (shared/research/vllm_cpu_feasibility.md §5): no sampled token for a
partial-prefill chunk, and an output-bearing future when nothing was scheduled.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pdtrace.dryrun import compat  # noqa: E402  (no vLLM import)
from pdtrace.dryrun.compat import (attach_block_hasher, full_attention_spec, model_runner_output,  # noqa: E402
                                   new_request, use_v1_scheduler, warm_up_reply)
from pdtrace.dryrun.sim import TINY_MODEL_CONFIG  # noqa: E402  (no vLLM import)
from pdtrace.dryrun.workload import EOS_TOKEN_ID  # noqa: E402

BLOCK_SIZE = 16


def tiny_model_dir(root: str | os.PathLike[str]) -> str:
    """A local model directory holding only the dry run's tiny Llama config.json (no weights, no tokenizer)."""
    path = Path(root) / "tiny-llama"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return str(path)


def make_vllm_config(model_dir: str, *, kv_role: str | None = "kv_both", engine_id: str | None = None,
                     max_num_seqs: int = 16, max_num_batched_tokens: int = 64, enable_prefix_caching: bool = True,
                     block_size: int = BLOCK_SIZE, pp: int = 1, num_blocks: int = 100) -> Any:
    """A VllmConfig for a CPU scheduler, with a NixlConnector unless kv_role is None.

    PP cannot be requested through the config on CPU (validation wants a distributed setup), so it is set after
    the config is built (the research notes verified that this gives max_concurrent_batches == pp).
    """
    from pdtrace.dryrun.compat import ensure_cpu_platform

    ensure_cpu_platform()
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)

    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float16", seed=42,
                     max_model_len=2048)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=2048, enable_chunked_prefill=True, is_encoder_decoder=mc.is_encoder_decoder)
    cc = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=enable_prefix_caching)
    kv = None
    if kv_role is not None:
        kv = KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role, kv_connector_extra_config={},
                              engine_id=engine_id or f"engine-{uuid.uuid4().hex[:8]}")
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, kv_transfer_config=kv,
                    device_config=DeviceConfig("cpu"))
    use_v1_scheduler(vc)
    if pp > 1:
        vc.parallel_config.pipeline_parallel_size = pp
    vc.cache_config.num_gpu_blocks = num_blocks
    return vc


def kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE, spec: Any = None) -> Any:
    """One KV cache group of `spec` (default: full attention) over `num_blocks` blocks."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    if spec is None:
        spec = full_attention_spec(block_size)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], spec)])


def sliding_window_spec(window: int, block_size: int = BLOCK_SIZE) -> Any:
    return compat.sliding_window_spec(block_size, window)


def make_scheduler(vllm_config: Any, num_blocks: int = 100, kv_spec: Any = None) -> Any:
    """vLLM's real Scheduler over `num_blocks` blocks (block 0 is the null block), one group of `kv_spec`."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    import inspect

    vllm_config.cache_config.num_gpu_blocks = num_blocks
    extra = {}
    if "block_size" in inspect.signature(Scheduler.__init__).parameters:  # 0.28+
        extra["block_size"] = vllm_config.cache_config.block_size
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config(num_blocks, spec=kv_spec),
                     log_stats=True, structured_output_manager=StructuredOutputManager(vllm_config), **extra)


_hasher = None


def block_hasher(block_size: int = BLOCK_SIZE) -> Any:
    global _hasher
    if _hasher is None:
        try:
            from vllm.utils.hashing import sha256
        except ImportError:  # 0.10 / 0.11.0
            from vllm.utils import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        _hasher = get_request_block_hasher(block_size, sha256)
    return _hasher


def make_request(request_id: str, num_tokens: int, *, max_tokens: int = 16, remote_decode: bool = False,
                 remote_prefill: bool = False, remote_engine_id: str = "prefill-engine",
                 remote_request_id: str | None = None, remote_block_ids: list[int] | None = None,
                 prompt: list[int] | None = None, ignore_eos: bool = True) -> Any:
    """A Request as vLLM's EngineCore would admit it; P side (`remote_decode`) or D side (`remote_prefill`)."""
    from vllm.sampling_params import SamplingParams

    if remote_decode:
        max_tokens = 1
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    sp.update_from_generation_config({}, EOS_TOKEN_ID)  # what the input processor does with the model's EOS
    tokens = prompt if prompt is not None else [(hash(request_id) + i) % 50000 + 2 for i in range(num_tokens)]
    req = new_request(request_id, list(tokens), sp, block_hasher=block_hasher(), eos_token_id=EOS_TOKEN_ID)
    if remote_decode:
        req.kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False}
    elif remote_prefill:
        n_blocks = (len(tokens) + BLOCK_SIZE - 1) // BLOCK_SIZE
        req.kv_transfer_params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": remote_block_ids or list(range(1, n_blocks + 1)),
            "remote_engine_id": remote_engine_id, "remote_request_id": remote_request_id or f"p-{request_id}",
            "remote_host": "127.0.0.1", "remote_port": 1234, "tp_size": 1,
        }
    return req


class OutputFaker:
    """Builds faithful ModelRunnerOutputs for SchedulerOutputs: a token only once a request's prompt is covered."""

    def __init__(self, token_id: int = 42) -> None:
        self.token_id = token_id
        self.prompt_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}

    def output(self, so: Any, *, finished_sending: Iterable[str] = (), finished_recving: Iterable[str] = (),
               eos: Iterable[str] = ()) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        for new in so.scheduled_new_reqs:
            self.prompt_len[new.req_id] = len(new.prompt_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        # A resumed request's tokens computed so far (its prefix hit) come with it: resumed requests are cached
        # requests before 0.33, and their count restarts from the hit, not from 0.
        cached = so.scheduled_cached_reqs
        for req_id, n in zip(cached.req_ids, cached.num_computed_tokens):
            self.computed[req_id] = n
        eos = set(eos)
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            done = self.computed.get(req_id, 0) + n
            self.computed[req_id] = done
            req_ids.append(req_id)
            covered = done >= self.prompt_len.get(req_id, 0)
            sampled.append([EOS_TOKEN_ID if req_id in eos else self.token_id] if covered else [])
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            self.computed[req_id] = 0
        kvo = None
        if finished_sending or finished_recving:
            kvo = KVConnectorOutput(finished_sending=set(finished_sending) or None,
                                    finished_recving=set(finished_recving) or None)
        return model_runner_output(req_ids, sampled, kvo)


def step(scheduler: Any, faker: OutputFaker, **kwargs: Any) -> tuple[Any, Any]:
    """schedule() then update_from_output() with a faithful fake output; returns (scheduler_output, outputs)."""
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, faker.output(so, **kwargs))


def release() -> str:
    """The installed vLLM release (the tier runs on every supported one: .ci/run --all-versions)."""
    from pdtrace.recording.vllm import installed_vllm_version

    return installed_vllm_version() or "unknown"


def release_key() -> tuple[int, ...]:
    """The installed release as a tuple of ints, to compare: `release_key() >= (0, 28)`."""
    from pdtrace.analysis.releases import release_key as key

    return key(release())


def behaviour() -> Any:
    """What the installed release does where the rules depend on it (pdtrace.analysis.releases)."""
    from pdtrace.analysis.releases import behaviour_of

    return behaviour_of(release())


def vllm_source_line(module_file: str, where: str) -> str:
    """The line `where` (`scheduler.py:3065`) of the installed vLLM's `module_file` (`v1/core/sched/scheduler.py`)."""
    import vllm

    line = int(where.rsplit(":", 1)[1])
    return (Path(vllm.__file__).parent / module_file).read_text().splitlines()[line - 1]


def dry_req(base: str, side: str) -> str:
    """The dry run's id of client request `base` (`r00001`) on P (`side` "p") or D ("d"): `r00001-p` / `r00001-d`,
    or `r00001` on both where the release keeps one id on P and D (0.10 to 0.12: compat.shared_request_ids)."""
    from pdtrace.dryrun.sim import engine_req_id

    return engine_req_id(base, side, compat.shared_request_ids())


def sample_req(req: Any) -> Any:
    """The installed release's dry-run id for request `req` of a shipped sample (made with two ids, `r00001-p` /
    `r00001-d`): the same, or `r00001` where the release keeps one id on P and D (dry_req)."""
    from pdtrace.dryrun.sim import base_id

    return dry_req(base_id(req), req[-1]) if isinstance(req, str) and req.endswith(("-p", "-d")) else req


def num_free_blocks(scheduler: Any) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


# ----------------------------------------------------------------------------------- EngineCore, fake executor


def fake_executor_class(pp: int = 2, available_memory: int = 64 << 20) -> type:
    """An Executor whose workers are canned answers; execute_model / sample_tokens return resolved futures.

    `inject` (class attribute, dict step-index -> dict of finished_sending / finished_recving) lets a test put
    transfer completions into the output of the n-th executed step.
    """
    from vllm.v1.executor.abstract import Executor

    split = compat.split_sampling()  # 0.11.1+ sample in a second RPC; before, execute_model replies with tokens

    class FakeExecutor(Executor):
        uses_ray = False
        supports_pp = True
        inject: dict[int, dict[str, set[str]]] = {}
        submitted: list[Any] = []

        def _init_executor(self) -> None:
            self.faker = OutputFaker()
            self._pending: Any = None

        @property
        def max_concurrent_batches(self) -> int:
            return pp

        def check_health(self) -> None:
            return None

        def collective_rpc(self, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None,
                           non_block: bool = False, **_: Any) -> Any:
            name = method if isinstance(method, str) else getattr(method, "__name__", str(method))
            spec = full_attention_spec(self.vllm_config.cache_config.block_size)
            answers = {
                "get_kv_cache_spec": [{"layer": spec}],
                "determine_available_memory": [available_memory],
                "get_supported_kv_cache_layouts": [["NHD", "HND"]],
                "get_kv_connector_handshake_metadata": [],  # no NIXL side channel is opened
            }
            if name == "compile_or_warm_up_model":
                result: Any = [warm_up_reply()]
            else:
                result = answers.get(name, [None])
            if non_block:
                fut: Future = Future()
                fut.set_result(result)
                return fut
            return result

        def _output(self, so: Any) -> Any:
            FakeExecutor.submitted.append(so)
            extra = FakeExecutor.inject.pop(len(FakeExecutor.submitted) - 1, {})
            return self.faker.output(so, **extra)

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            fut: Future = Future()
            if scheduler_output.total_num_scheduled_tokens > 0 and split:
                self._pending = scheduler_output
                fut.set_result(None)
            else:
                fut.set_result(self._output(scheduler_output))
            # 0.10's executors reply with a future whenever batches are queued, without a non_block argument.
            return fut if non_block or (not split and pp > 1) else fut.result()

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            fut: Future = Future()
            so, self._pending = self._pending, None
            fut.set_result(self._output(so))
            return fut if non_block else fut.result()

        def take_draft_token_ids(self) -> Any:
            return None

    if not split:  # an executor of 0.10 / 0.11.0 has no sample_tokens (the engine never calls it)
        del FakeExecutor.sample_tokens
    return FakeExecutor


def engine_step(engine: Any) -> Any:
    """One turn of EngineCoreProc's loop: its step_fn (EngineCore has none before 0.11.1; pdtrace.dryrun.compat)."""
    return compat.engine_step(engine)


def engine_busy(engine: Any) -> bool:
    """Whether the engine's batch queue holds a step (a deque, or 0.10's queue.Queue)."""
    return compat.batch_queue_busy(engine)


def step_fn_name(engine: Any) -> str:
    """`step` or `step_with_batch_queue`: what the busy loop calls."""
    fn = engine.__dict__.get("step_fn")
    if fn is None:
        return "step" if engine.batch_queue is None else "step_with_batch_queue"
    return fn.__name__


def make_engine(vllm_config: Any, pp: int = 2) -> Any:
    """vLLM's real EngineCore (batch queue of `pp` steps) on the fake executor."""
    from vllm.v1.engine.core import EngineCore

    return EngineCore(vllm_config, executor_class=fake_executor_class(pp), log_stats=False)


def make_engine_proc(vllm_config: Any, pp: int = 1) -> Any:
    """vLLM's real EngineCoreProc busy loop (`run_busy_loop`, `_process_input_queue`, `_handle_client_request`) on
    the fake executor, without the ZMQ handshakes and socket threads of its __init__: a test puts the client's
    messages into `input_queue` itself, as the input thread does after preprocessing."""
    import queue

    from vllm.v1.engine import core as engine_core
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    shutdown_state = getattr(engine_core, "EngineShutdownState", None)  # 0.28+

    class InProcessEngineCoreProc(EngineCoreProc):
        def __init__(self, vllm_config: Any, executor_class: type) -> None:
            # The attributes EngineCoreProc.__init__ sets around EngineCore.__init__ (core.py:1184-1245), sockets
            # and data parallelism aside.
            self.input_queue = queue.Queue()
            self.output_queue = queue.Queue()
            self.engine_index = 0
            self.engines_running = False
            if shutdown_state is not None:
                self.shutdown_state = shutdown_state.RUNNING
            self.reject_new_requests = False
            self.tensor_ipc_receiver = None
            self.has_coordinator = False
            self.publish_dp_lb_stats = False
            self.last_counts = (0, 0)
            self.process_input_queue_block = True
            EngineCore.__init__(self, vllm_config, executor_class, False)
            if "step_fn" not in self.__dict__:  # 0.10 / 0.11.0 bind it in EngineCoreProc.__init__
                self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
            self.enable_fault_tolerance = False

    return InProcessEngineCoreProc(vllm_config, fake_executor_class(pp))


def client_add(engine: Any, request: Any) -> None:
    """Queue an ADD from the client, as EngineCoreProc's input thread does after preprocess_add_request."""
    from vllm.v1.engine import EngineCoreRequestType

    attach_block_hasher(request, engine.request_block_hasher)
    engine.input_queue.put_nowait((EngineCoreRequestType.ADD, (request, 0)))


def engine_add(engine: Any, request: Any) -> None:
    """Add a request as EngineCore.add_request would after preprocessing (hashing set up)."""
    attach_block_hasher(request, engine.request_block_hasher)
    engine.scheduler.add_request(request)


# ------------------------------------------------------------------------------------------- reading back


def read_events(trace_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a trace through pdtrace.open_trace, as dicts (detail parsed), in (pid, instance, seq) order."""
    import pdtrace

    rows = pdtrace.open_trace(str(trace_dir)).table.to_pylist()
    for row in rows:
        row["detail"] = json.loads(row["detail"]) if row["detail"] else {}
    rows.sort(key=lambda r: (r["pid"], r["instance"], r["seq"]))
    return rows


def of_kind(events: list[dict[str, Any]], *kinds: str, req: str | None = None) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] in kinds and (req is None or e["req"] == req)]


def brief(events: list[dict[str, Any]]) -> list[tuple]:
    """(kind, step, req, blocks) per event: what most assertions compare."""
    return [(e["kind"], e["step"], e["req"], e["blocks"]) for e in events]


def close_and_read(trace_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Close this process's recorders (flushing them), then read the trace back (`read_events`)."""
    from pdtrace.recording import session

    session.close_all()
    return read_events(trace_dir)
