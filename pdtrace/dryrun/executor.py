"""The simulated executor: vLLM's `Executor` interface over pdtrace's simulated workers, on virtual time.

One `SimExecutor` per engine. `execute_model(so)` lays the step out on the pipeline: stage s of step k starts when
the engine issued it, stage s is free (its previous RPC is done) and stage s-1 has handed over its activations
(forward steps only); it lasts `compute_us_fixed + compute_us_per_token * tokens` (a stage runs 1/pp of the layers).
Every TP rank of a stage runs in lockstep. The worker events of each rank (exec_begin/exec_end per RPC,
batch_add/batch_remove of its persistent batch, kv_send_rank/kv_recv_rank) are put on the engine's timeline and
emitted when virtual time reaches them.

What each rank returns is what vLLM 0.33's V1 runner returns: for a step with tokens, `execute_model` replies None
on every rank and `sample_tokens` replies the sampled tokens on the last stage's TP0 (none for a request whose
prefill chunk is partial) and a kv-connector-only output elsewhere; for a 0-token step `execute_model` replies a
kv-connector-only output (`kv_connector_no_forward`). With a connector the replies of all ranks are merged by
vLLM's own `KVOutputAggregator` (kv_connector/utils.py), exactly as `MultiprocExecutor.collective_rpc` does;
without one only the output rank's reply counts.

The futures are resolved lazily: `result()` moves the engine's virtual time to the moment the last rank replied,
then aggregates. Transfer completions a rank reports are those finished by the end of its forward pass that are
known when the timeline reaches that instant (the simulation runs engines one at a time, smallest time first, so a
completion caused by another engine can show up one step late; that is a lag, never a reordering).
"""

from __future__ import annotations

from concurrent.futures import Future
from copy import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput

from pdtrace.dryrun.compat import model_runner_output, split_sampling
from pdtrace.recording.vllm._common import batch_queue_depth

if TYPE_CHECKING:
    from pdtrace.dryrun.sim import SimEngine

#: 0.11.1+ sample in a second RPC; before, execute_model replies with the sampled tokens.
SPLIT_SAMPLING = split_sampling()
NO_FORWARD_US = 30.0  # a rank's kv_connector_no_forward for a 0-token step
SAMPLE_US_LAST = 60.0  # sampling on the last stage
SAMPLE_US_OTHER = 5.0  # the kv-connector-only sample_tokens reply of a non-last stage
RPC_ISSUE_US = 15.0  # broadcast message queue: engine -> worker
RPC_REPLY_US = 15.0  # response message queue: worker -> engine


@dataclass
class RankState:
    """One simulated worker (pp_rank, tp_rank): its persistent batch and its unreported transfer completions."""

    pp_rank: int
    tp_rank: int
    channel: Any  # the recorder channel ("worker", pp_rank, tp_rank)
    batch: dict[str, None] = field(default_factory=dict)  # the persistent batch (insertion-ordered)
    known: set[str] = field(default_factory=set)  # CachedRequestState entries
    sends_registered: set[str] = field(default_factory=set)  # ids this rank got in reqs_to_send
    done_sends: list[tuple[int, str]] = field(default_factory=list)  # (completion ts, req)
    done_recvs: list[tuple[int, str]] = field(default_factory=list)
    free_at: int = 0  # the rank is busy until then

    def take_completions(self, ts: int) -> tuple[set[str], set[str]]:
        """Pop the sends/receives completed by `ts` (sends only once the id was registered to send)."""
        sends = {r for t, r in self.done_sends if t <= ts and r in self.sends_registered}
        recvs = {r for t, r in self.done_recvs if t <= ts}
        if sends:
            self.done_sends = [(t, r) for t, r in self.done_sends if r not in sends]
            self.sends_registered -= sends
        if recvs:
            self.done_recvs = [(t, r) for t, r in self.done_recvs if t > ts]
        return sends, recvs


@dataclass
class StepRecord:
    """One submitted step: its scheduler output, its layout on the pipeline and the ranks' replies."""

    step: int | None
    so: Any
    tokens: int
    forward: bool
    submit_ns: int
    ready_ns: int = 0  # when the last rank's reply for the output-bearing RPC is in
    rank_kv: dict[tuple[int, int], KVConnectorOutput] = field(default_factory=dict)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


class SimFuture(Future):
    """A future resolved on demand: `result()` advances the engine's virtual time to the replies, then aggregates."""

    def __init__(self, executor: SimExecutor, record: StepRecord, rpc: str) -> None:
        super().__init__()
        self._executor = executor
        self._record = record
        self._rpc = rpc
        self._resolved = False

    def result(self, timeout: float | None = None) -> Any:
        if not self._resolved:
            self._resolved = True
            try:
                self.set_result(self._executor._collect(self._record, self._rpc))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller like a worker failure
                self.set_exception(exc)
        return super().result()


class SimExecutor(Executor):
    """vLLM `Executor` whose workers are simulated. `sim_engine` is set on a per-engine subclass (see sim.py)."""

    sim_engine: SimEngine
    uses_ray = False
    supports_pp = True

    def _init_executor(self) -> None:
        self.engine = type(self).sim_engine
        self.engine.executor = self
        self._last: StepRecord | None = None
        if not hasattr(self, "kv_output_aggregator"):  # 0.10 / 0.11: MultiprocExecutor makes it, not Executor
            # only vLLM 0.10 / 0.11 come here, and the module path is theirs
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            self.kv_output_aggregator = KVOutputAggregator(self.parallel_config.world_size)

    # -- setup RPCs: canned answers, as a worker would give them -------------------------------------------
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):  # type: ignore[override]
        name = method if isinstance(method, str) else getattr(method, "__name__", str(method))
        result = self.engine.setup_rpc(name, args)
        if non_block:
            fut: Future = Future()
            fut.set_result(result)
            return fut
        return result

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    @property
    def max_concurrent_batches(self) -> int:
        vc = self.vllm_config
        depth = batch_queue_depth(vc)  # 0.23+
        if depth is not None:
            return depth
        # Before 0.23: the executor's own answer (MultiprocExecutor.max_concurrent_batches).
        return 2 if vc.scheduler_config.async_scheduling else vc.parallel_config.pipeline_parallel_size

    # -- the model RPCs ------------------------------------------------------------------------------------
    def execute_model(self, scheduler_output, non_block: bool = False):  # type: ignore[override]
        record = self.engine.submit_step(scheduler_output)
        self._last = record
        fut = SimFuture(self, record, "execute_model")
        # 0.10's MultiprocExecutor replies with a future whenever batches are queued, without a non_block argument.
        return fut if non_block or (not SPLIT_SAMPLING and self.max_concurrent_batches > 1) else fut.result()

    def sample_tokens(self, grammar_output, non_block: bool = False):  # type: ignore[override]
        record = self._last
        assert record is not None, "sample_tokens before execute_model"
        fut = SimFuture(self, record, "sample_tokens")
        return fut if non_block else fut.result()

    def execute_dummy_batch(self) -> None:
        return None

    def take_draft_token_ids(self):
        return None

    # -- replies -------------------------------------------------------------------------------------------
    def _collect(self, record: StepRecord, rpc: str) -> ModelRunnerOutput | None:
        eng = self.engine
        eng.timeline.advance_to(record.ready_ns)
        if record.forward and rpc == "execute_model" and SPLIT_SAMPLING:
            # Every rank replies None to execute_model when sampling is split (gpu_model_runner.py:4252).
            return None
        outputs: list[ModelRunnerOutput | None] = []
        out_rank = eng.output_rank
        for idx, key in enumerate(eng.rank_keys):
            kvo = record.rank_kv.get(key)
            if idx == out_rank and record.forward:
                mro = model_runner_output(list(record.order), [record.sampled.get(r, []) for r in record.order], kvo)
            elif eng.has_connector:
                # A fresh object per reply, as a deserialized worker reply is: the aggregator writes the merged
                # connector output into the output rank's reply in place.
                mro = copy(EMPTY_MODEL_RUNNER_OUTPUT)
                mro.kv_connector_output = kvo if kvo is not None else KVConnectorOutput()
            else:
                mro = copy(EMPTY_MODEL_RUNNER_OUTPUT)
            outputs.append(mro)
        agg = self.kv_output_aggregator
        if agg is not None:
            return agg.aggregate(outputs, output_rank=out_rank)
        return outputs[out_rank]
