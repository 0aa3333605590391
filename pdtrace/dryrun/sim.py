"""The simulated cluster: the installed vLLM's real EngineCore + Scheduler (+ NixlConnector scheduler side) per
instance, driven cooperatively in one process on virtual time, with simulated workers and a simulated KV transfer
engine (what differs per release: pdtrace/dryrun/compat.py).

Why one process: two EngineCores share a process without trouble. `EngineCore.__init__`'s process-wide side
effects are `gc.freeze()` (moves the startup heap to the permanent generation; harmless to repeat) and
`enable_envs_cache()` (later changes to VLLM_* variables are ignored; the dry run sets the ones it needs before the
first engine), and the scheduler-side NIXL connector opens no side channel when the workers publish no handshake
metadata. Measured on the 2-core box: both engines build in 0.5 s in one process (after a 5.7 s import
of vLLM).

The loop (a discrete-event simulation, one engine at a time): pick the engine whose virtual time is smallest among
those with work (requests, or batches in flight); deliver its due inputs (arrivals, proxy hand-offs, aborts) as
EngineCoreProc._process_input_queue would; call its real `step_fn()` (`step` or `step_with_batch_queue`); hand
the finished P requests' kv_transfer_params to D through the simulated proxy; when the step executed nothing and
the scheduler still has requests, sleep 1 ms of virtual time as `_process_engine_step` does (core.py:1693).

Time spent by the scheduler: a fixed simulated cost per schedule() (`sched_cost_us` + `sched_cost_us_per_req` per
scheduled request) and per update_from_output (`update_cost_us_per_req`), charged on the virtual clock inside those
calls; so the same seed gives the same trace. `real_scheduler_time=True` charges the measured CPU time instead.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import json
import logging
import os
import random
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdtrace.dryrun.clock import Timeline, VirtualClock
from pdtrace.dryrun.compat import (attach_block_hasher, batch_queue_busy, engine_step, ensure_cpu_platform,
                                   full_attention_spec, new_request, post_step, shared_request_ids, split_sampling,
                                   use_v1_scheduler, warm_up_reply)
from pdtrace.dryrun.config import DryRunConfig, distribution_max
from pdtrace.dryrun.faults import FaultInjector
from pdtrace.dryrun.offload import SimOffload
from pdtrace.dryrun.offload import extra_config as offload_extra_config
from pdtrace.dryrun.perturb import pool_blocks
from pdtrace.dryrun.transfer import SimTransferEngine
from pdtrace.dryrun.workload import EOS_TOKEN_ID, VOCAB_FOR_PROMPTS, WorkloadRequest
from pdtrace.recording import session
from pdtrace.recording.vllm._common import instance_of
from pdtrace.recording.vllm.v0_33 import _batch_add_reason as batch_add_reason
from pdtrace.recording.vllm.v0_33 import _resumed_ids as resumed_ids

log = logging.getLogger("pdtrace.dryrun")

NS_PER_US = 1000

#: The tiny Llama config.json the dry run (and the vLLM test tier) builds engines from: no weights, no tokenizer.
TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50304,
    "max_position_embeddings": 131072,
    "bos_token_id": 50256,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "float16",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _model_dir() -> str:
    """A local model directory holding only a tiny Llama config.json (no weights, no tokenizer)."""
    path = Path(tempfile.gettempdir()) / "pdtrace-dryrun-model"
    cfg = path / "config.json"
    text = json.dumps(TINY_MODEL_CONFIG, indent=1, sort_keys=True)
    if not cfg.exists() or cfg.read_text() != text:
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".config.{os.getpid()}.json"
        tmp.write_text(text)
        tmp.replace(cfg)
    return str(path)


@dataclass
class ReqInfo:
    """What the simulated workers know of a request (from the SchedulerOutputs they were sent)."""

    prompt_len: int
    max_tokens: int
    want_eos: bool
    n_out: int = 0


@dataclass
class EngineInput:
    """An input waiting to be delivered to an engine at a virtual instant."""

    ts: int
    order: int
    kind: str  # "add" | "abort"
    payload: Any = None
    min_step: int = -1  # an add held until the engine's next step is this one, while the engine is busy (replay)

    def __lt__(self, other: EngineInput) -> bool:
        return (self.ts, self.order) < (other.ts, other.order)


class SimEngine:
    """One vLLM instance: a real EngineCore over a SimExecutor, its virtual timeline and its simulated workers."""

    def __init__(self, cluster: SimCluster, index: int, instance: str, role: str, kv_role: str | None) -> None:
        self.cluster = cluster
        self.index = index
        self.instance = instance
        self.role = role
        self.kv_role = kv_role
        self.has_connector = kv_role is not None
        cfg = cluster.config
        self.pp, self.tp = cfg.pp, cfg.tp
        self.world_size = self.pp * self.tp
        self.rank_keys = [(p, t) for p in range(self.pp) for t in range(self.tp)]
        self.output_rank = self.world_size - self.tp  # last stage, TP0 (multiproc_executor._get_output_rank)
        self.timeline = Timeline(instance)
        self.rng = random.Random((cfg.seed << 8) ^ (index + 1))
        self.inputs: list[EngineInput] = []
        self.reqs: dict[str, ReqInfo] = {}
        self.stage_free = [0] * self.pp
        self.executor: Any = None
        self.core: Any = None
        self.ranks: dict[tuple[int, int], Any] = {}
        self.recorder: Any = None
        self.engine_id = instance
        self.steps_submitted = 0
        self.next_step = 0  # the step id the hooks give this engine's next schedule() (what replay's adds wait for)
        self.replaying = False  # some input carries the step the recording added it before
        # replay: the steps requests a peer will hand over were added before (sorted; one entry per request)
        self.awaited: list[int] = []
        self.tokens_executed = 0

    # -- construction -------------------------------------------------------------------------------------
    def build(self) -> None:
        """Build the VllmConfig (PP, TP and async poked in afterwards, as this CPU platform needs) and the core."""
        import torch  # lazy: vLLM (optional) loads when a cluster is built, not when this module is imported
        # lazy: vLLM (optional) loads when a cluster is built, not when this module is imported
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        # lazy: vLLM (optional) loads when a cluster is built, not when this module is imported
        from vllm.v1.engine.core import EngineCore

        from pdtrace.dryrun.executor import RankState, SimExecutor  # lazy: the executor imports vLLM at its top

        ensure_cpu_platform()
        cfg = self.cluster.config
        max_len = self.cluster.max_model_len
        mc = ModelConfig(model=self.cluster.model_dir, tokenizer=self.cluster.model_dir, skip_tokenizer_init=True,
                         dtype="float16", seed=cfg.seed, max_model_len=max_len)
        sc = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                             max_model_len=max_len, enable_chunked_prefill=True,
                             long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                             is_encoder_decoder=mc.is_encoder_decoder, async_scheduling=False)
        cc = CacheConfig(block_size=cfg.block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                         enable_prefix_caching=cfg.enable_prefix_caching)
        cc.num_gpu_blocks_override = cfg.num_blocks
        kv = None
        if self.cluster.offload is not None:
            kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role=self.kv_role, engine_id=self.instance,
                                  kv_connector_extra_config=offload_extra_config(cfg.block_size))
        elif self.kv_role is not None:
            kv = KVTransferConfig(kv_connector="NixlConnector", kv_role=self.kv_role, engine_id=self.instance,
                                  kv_connector_extra_config={})
        vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kv,
                        device_config=DeviceConfig("cpu"))
        # The CPU platform refuses PP and forces async off at validation: set them on the built config.
        pc = vc.parallel_config
        pc.pipeline_parallel_size = self.pp
        pc.tensor_parallel_size = self.tp
        pc.world_size = self.world_size
        vc.scheduler_config.async_scheduling = bool(cfg.async_scheduling)
        vc.instance_id = self.instance
        use_v1_scheduler(vc)
        self.vllm_config = vc
        self._torch_dtype = torch.float16

        executor_cls = type(f"SimExecutor_{self.index}", (SimExecutor,), {"sim_engine": self})
        if not split_sampling():  # an executor of 0.10 / 0.11.0 has no sample_tokens (the engine never calls it)
            executor_cls.sample_tokens = None
        self.cluster.clock.current = self.timeline
        self.core = EngineCore(vc, executor_class=executor_cls, log_stats=False)
        self.scheduler = self.core.scheduler
        # The very recorder the hooks use for this engine (same instance, role and dp rank): one writer, one seq.
        instance, role, dp_rank = instance_of(vc)
        self.recorder = session.recorder(instance, role, dp_rank)
        for pp_rank, tp_rank in self.rank_keys:
            chan = self.recorder.channel("worker", pp_rank=pp_rank, tp_rank=tp_rank)
            self.ranks[(pp_rank, tp_rank)] = RankState(pp_rank, tp_rank, chan)
        self._wrap_scheduler_costs()

    def setup_rpc(self, name: str, args: tuple) -> Any:
        """Canned replies of the workers to EngineCore's setup RPCs (one reply per rank)."""
        ws = self.world_size
        cfg = self.cluster.config
        if name == "get_kv_cache_spec":
            spec = full_attention_spec(cfg.block_size, num_kv_heads=2, head_size=16, dtype=self._torch_dtype)
            return [{"model.layers.0.self_attn.attn": spec, "model.layers.1.self_attn.attn": spec}
                    for _ in range(ws)]
        if name == "determine_available_memory":
            return [4 * cfg.num_blocks * 2 * 2 * 16 * 2 * cfg.block_size * 2 + (1 << 20)] * ws
        if name == "get_supported_kv_cache_layouts":
            return [["NHD", "HND"]] * ws
        if name == "compile_or_warm_up_model":
            return [warm_up_reply()] * ws
        if name == "get_kv_connector_handshake_metadata":
            return []  # no metadata: the scheduler-side NIXL connector opens no side channel
        if name in ("get_simple_cpu_offload_num_cpu_blocks",):
            return [None] * ws
        return [None] * ws

    def _wrap_scheduler_costs(self) -> None:
        """Charge the scheduler's simulated CPU time on the virtual clock, inside schedule() and update()."""
        sched = self.scheduler
        cfg = self.cluster.config
        tl = self.timeline
        orig_after = sched._update_after_schedule
        orig_update = sched.update_from_output

        if cfg.real_scheduler_time:
            orig_schedule = sched.schedule
            started = [0]

            def schedule(*args: Any, **kwargs: Any) -> Any:
                started[0] = time.thread_time_ns()
                return orig_schedule(*args, **kwargs)

            def after_schedule(so: Any) -> Any:
                rv = orig_after(so)
                tl.advance_by(time.thread_time_ns() - started[0])  # schedule()'s CPU time so far
                return rv

            sched.schedule = schedule
        else:
            def after_schedule(so: Any) -> Any:
                rv = orig_after(so)
                tl.advance_by((cfg.sched_cost_us + cfg.sched_cost_us_per_req * len(so.num_scheduled_tokens))
                              * NS_PER_US)
                return rv

        def update_from_output(so: Any, mro: Any) -> Any:
            t0 = time.thread_time_ns()
            rv = orig_update(so, mro)
            if cfg.real_scheduler_time:
                tl.advance_by(time.thread_time_ns() - t0)
            else:
                tl.advance_by(cfg.update_cost_us_per_req * len(so.num_scheduled_tokens) * NS_PER_US)
            return rv

        sched._update_after_schedule = after_schedule
        sched.update_from_output = update_from_output

    # -- the workers ----------------------------------------------------------------------------------------
    def submit_step(self, so: Any) -> Any:
        """Lay one step out on the pipeline (called from SimExecutor.execute_model) and return its record."""
        # lazy: the executor imports vLLM at its top
        from pdtrace.dryrun.executor import (
            NO_FORWARD_US,
            RPC_ISSUE_US,
            RPC_REPLY_US,
            SAMPLE_US_LAST,
            SAMPLE_US_OTHER,
            SPLIT_SAMPLING,
            StepRecord,
        )

        cfg = self.cluster.config
        tl = self.timeline
        step = getattr(so, "_pdtrace_step", None)
        if step is not None:
            self.next_step = max(self.next_step, int(step) + 1)
        tokens = int(so.total_num_scheduled_tokens)
        forward = tokens > 0
        rec = StepRecord(step=step, so=so, tokens=tokens, forward=forward, submit_ns=tl.now)
        self.steps_submitted += 1
        if forward:
            self.tokens_executed += tokens
            self._decide_samples(so, rec)
        issue = tl.now + int(RPC_ISSUE_US * NS_PER_US)
        prev_end = 0
        ready = issue
        split = SPLIT_SAMPLING
        for s in range(self.pp):
            begin = max(issue, self.stage_free[s], prev_end if forward else 0)
            dur_us = (cfg.compute_us_fixed + cfg.compute_us_per_token * tokens) if forward else NO_FORWARD_US
            end = begin + int(dur_us * NS_PER_US)
            if forward and s == self.pp - 1:
                sample_end = end + int(SAMPLE_US_LAST * NS_PER_US)
            elif forward and split:  # a non-last stage's kv-connector-only sample_tokens reply
                sample_end = end + int(SAMPLE_US_OTHER * NS_PER_US)
            else:  # one RPC (0.10 / 0.11.0): a non-last stage replies once its activations are sent
                sample_end = end
            self.stage_free[s] = sample_end
            prev_end = end
            ready = max(ready, sample_end)
            if not split:  # one RPC: execute_model's span includes the sampling
                end = sample_end
            for t in range(self.tp):
                rank = self.ranks[(s, t)]
                tl.at(begin, lambda r=rank, b=begin: self._rank_begin(r, rec, b))
                tl.at(end, lambda r=rank, e=end: self._rank_end(r, rec, e))
                if forward and split:
                    tl.at(end, lambda r=rank: r.channel.emit("exec_begin", step=step, n=tokens))
                    tl.at(sample_end, lambda r=rank: r.channel.emit("exec_end", step=step, n=tokens,
                                                                     detail=_RPC_SAMPLE))
        rec.ready_ns = ready + int(RPC_REPLY_US * NS_PER_US)
        return rec

    def _decide_samples(self, so: Any, rec: Any) -> None:
        """Which requests get a sampled token (none for a partial prefill chunk), and which token."""
        computed: dict[str, int] = {}
        for nr in so.scheduled_new_reqs:
            sp = nr.sampling_params
            info = self.reqs.get(nr.req_id)
            if info is None:
                want_eos = self.cluster.want_eos.get(nr.req_id, False)
                info = ReqInfo(len(nr.prompt_token_ids or ()), int(sp.max_tokens or 1), want_eos)
                self.reqs[nr.req_id] = info
            computed[nr.req_id] = nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = cached.num_computed_tokens[i]
        # A resumed request's runner state is rebuilt from the scheduler's tokens (all_token_ids): its outputs are
        # the ones the scheduler kept, not the ones sampled. vLLM 0.27+ drops a preempted request's in-flight
        # output (drop_stale_output); counting that sample kept the resumed prefill from ever sampling again.
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        flags = getattr(cached, "resumed_from_preemption", None) or ()  # before 0.11.1
        resumed.update(rid for rid, flag in zip(cached.req_ids, flags) if flag)
        for rid in resumed:
            info, req = self.reqs.get(rid), self.scheduler.requests.get(rid)
            if info is not None and req is not None:
                info.n_out = req.num_output_tokens
        order = list(so.num_scheduled_tokens)
        rec.order = order
        rng = self.rng
        for rid in order:
            n = so.num_scheduled_tokens[rid]
            info = self.reqs.get(rid)
            if info is None:
                rec.sampled[rid] = [rng.randrange(VOCAB_FOR_PROMPTS)]
                continue
            if computed.get(rid, 0) + n < info.prompt_len + info.n_out:
                rec.sampled[rid] = []  # partial prefill chunk: the V1 runner discards its sample
                continue
            info.n_out += 1
            if info.want_eos and info.n_out >= info.max_tokens:
                rec.sampled[rid] = [EOS_TOKEN_ID]
            else:
                rec.sampled[rid] = [rng.randrange(VOCAB_FOR_PROMPTS)]
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)

    def _rank_begin(self, rank: Any, rec: Any, ts: int) -> None:
        """A rank starts execute_model: exec_begin, the V1 runner's _update_states, the connector's metadata."""
        so = rec.so
        step = rec.step
        chan = rank.channel
        chan.emit("exec_begin", step=step, n=rec.tokens)
        # V1 GPUModelRunner._update_states (gpu_model_runner.py:1176-1237): finished, then unscheduled, then adds.
        batch = rank.batch
        finished = [r for r in so.finished_req_ids if r in batch]
        for r in so.finished_req_ids:
            rank.known.discard(r)
        for r in finished:
            del batch[r]
        if finished:
            _emit_rows(chan, "batch_remove", step, finished, "finished")
        scheduled = so.num_scheduled_tokens
        resumed = resumed_ids(so.scheduled_cached_reqs)
        preempted = getattr(so, "preempted_req_ids", None) or ()  # 0.11.1+
        unscheduled = [r for r in batch if r not in scheduled or r in resumed]
        if unscheduled:
            for r in unscheduled:
                del batch[r]
            pre = [r for r in unscheduled if r in preempted]
            rest = [r for r in unscheduled if r not in preempted]
            if pre:
                _emit_rows(chan, "batch_remove", step, pre, "preempted")
            if rest:
                _emit_rows(chan, "batch_remove", step, rest, "unscheduled")
        new = []
        for nr in so.scheduled_new_reqs:
            rank.known.add(nr.req_id)
            if nr.req_id not in batch:
                batch[nr.req_id] = None
                new.append(nr.req_id)
        if new:
            _emit_rows(chan, "batch_add", step, new, "new")
        readd = []
        for rid in so.scheduled_cached_reqs.req_ids:
            if rid not in batch:
                batch[rid] = None
                readd.append(rid)
        for reason in ("resumed", "rescheduled"):
            back = [r for r in readd if batch_add_reason(r, (), resumed) == reason]
            if back:
                _emit_rows(chan, "batch_add", step, back, reason)
        meta = so.kv_connector_metadata
        if meta is not None and self.cluster.offload is not None:
            self.cluster.offload.on_step_begin(self, rank, meta, ts)
        elif meta is not None and self.has_connector:
            self.cluster.transfers.on_worker_metadata(self, rank, rec, meta, ts)

    def _rank_end(self, rank: Any, rec: Any, ts: int) -> None:
        """A rank's forward (or no-forward) ends: it reports its finished transfers, then replies."""
        # lazy: vLLM (optional) loads when a cluster is built, not when this module is imported
        from vllm.v1.outputs import KVConnectorOutput

        step = rec.step
        chan = rank.channel
        if self.cluster.offload is not None:
            recvs, wmeta = self.cluster.offload.on_step_end(self, rank, rec.so.kv_connector_metadata, ts)
            for r in sorted(recvs):
                chan.emit("kv_recv_rank", step=step, req=r)
            out = KVConnectorOutput(finished_recving=recvs or None)
            if wmeta is not None:
                out.kv_connector_worker_meta = wmeta
            rec.rank_kv[(rank.pp_rank, rank.tp_rank)] = out
        elif self.has_connector:
            sends, recvs = rank.take_completions(ts)
            sends = self.cluster.faults.filter_sends(self, rank, rec, sends)
            sends, recvs, invalid = self.cluster.faults.perturber.filter_reports(self, rank, rec, sends, recvs)
            for r in sorted(sends):
                chan.emit("kv_send_rank", step=step, req=r)
            for r in sorted(recvs):
                chan.emit("kv_recv_rank", step=step, req=r)
            if sends or recvs:
                self.cluster.note_progress(ts)
            out = KVConnectorOutput(finished_sending=sends or None, finished_recving=recvs or None)
            if invalid and hasattr(out, "invalid_block_ids"):  # a failed read (0.11+ report it this way)
                out.invalid_block_ids = set(invalid)
            rec.rank_kv[(rank.pp_rank, rank.tp_rank)] = out
        chan.emit("exec_end", step=step, n=rec.tokens, detail=_RPC_EXEC)

    # -- inputs ----------------------------------------------------------------------------------------------
    def push_input(self, ts: int, kind: str, payload: Any, min_step: int = -1) -> None:
        heapq.heappush(self.inputs, EngineInput(int(ts), self.cluster.next_order(), kind, payload, min_step))
        if min_step >= 0:
            self.replaying = True
            i = bisect.bisect_left(self.awaited, min_step)
            if i < len(self.awaited) and self.awaited[i] == min_step:
                del self.awaited[i]

    def await_from_peer(self, min_step: int) -> None:
        """Replay: a request the recording added before step `min_step` of this engine will come from a peer."""
        bisect.insort(self.awaited, min_step)
        self.replaying = True

    def give_up_waiting(self) -> None:
        """Replay: what the peer was to hand over for the next step will not come (the replay parted from the
        recording there); step without it."""
        del self.awaited[:bisect.bisect_right(self.awaited, self.next_step)]

    def step_ready_ns(self) -> int | None:
        """When this engine's next step may begin: now, or (replay) the arrival of the last request the recording
        added before that step, where it is still to come: the recorded engine had it in its input queue when it
        scheduled, so the replay waits for it instead of scheduling without it. None: such a request is still with
        a peer (P has not finished it), so the time is not known yet."""
        now = self.timeline.now
        if not self.replaying:
            return now
        if self.awaited and self.awaited[0] <= self.next_step:
            return None
        if self.role == "decode":  # what P hands over arrives on the replay's clock, not the recording's: held
            return now             # in order (deliver_inputs), never waited for by the clock
        return max((i.ts for i in self.inputs if i.kind == "add" and 0 <= i.min_step <= self.next_step),
                   default=now)

    @property
    def next_input_ns(self) -> int | None:
        return self.inputs[0].ts if self.inputs else None

    def has_work(self) -> bool:
        core = self.core
        return bool(core.scheduler.has_requests() or batch_queue_busy(core))

    def deliver_inputs(self) -> None:
        """EngineCoreProc._process_input_queue: add and abort whatever is due by now."""
        now = self.timeline.now
        held: list[EngineInput] = []
        due: list[EngineInput] = []
        while self.inputs and self.inputs[0].ts <= now:
            due.append(heapq.heappop(self.inputs))
        # replay: what the recording added before an earlier step first (two transfers may end in either order)
        due.sort(key=lambda i: (i.min_step, i.ts, i.order))
        for item in due:
            if item.kind == "add" and item.min_step > self.next_step and (
                    self.has_work() or (self.awaited and self.awaited[0] < item.min_step)):
                held.append(item)  # replay: the recording added it before a later step of this engine
                continue
            if item.kind == "add":
                req = item.payload
                attach_block_hasher(req, self.core.request_block_hasher)
                self.core.add_request(req)
                self.cluster.faults.perturber.on_added(self, req.request_id, now)
            elif item.kind == "abort":
                if item.payload in self.core.scheduler.requests:
                    self.core.abort_requests([item.payload])
                    # The client sees its request end (a closed-loop client may send the next one).
                    self.cluster._client_done(base_id(item.payload), now)
        for item in held:
            heapq.heappush(self.inputs, item)


#: Replay: how long (virtual) D waits for a request the recording added before its next step and P has not handed
#: over yet, while P runs on (a P that idles with a send pending would otherwise keep D waiting to the time limit)
PEER_WAIT_NS = 2_000_000_000

_RPC_EXEC = '{"rpc":"execute_model"}'
_RPC_SAMPLE = '{"rpc":"sample_tokens"}'


def engine_req_id(base: str, side: str, shared: bool) -> str:
    """Client request `base`'s id on the prefill (`side` "p") or decode ("d") engine: `base` itself where P and D
    share one id (one instance; compat.shared_request_ids), else `base-p` / `base-d`."""
    return base if shared else f"{base}-{side}"


def base_id(req_id: str) -> str:
    """The client's id of an engine request (`r00001-p`, `r00001-d`, `r00001` -> `r00001`)."""
    return req_id.removesuffix("-d").removesuffix("-p")


def _emit_rows(chan: Any, kind: str, step: int | None, reqs: list[str], reason: str) -> None:
    """One row per request, same kind/step/reason (one recorder call)."""
    chan.emit_many(kind, step=step, reqs=reqs, reason=reason)


@dataclass
class ClientRequest:
    """A workload request as the simulated client and proxy see it."""

    wl: WorkloadRequest
    base_id: str
    released: bool = False
    done: bool = False


@dataclass
class RunStats:
    steps: int = 0
    requests_finished: int = 0
    error: str | None = None
    engine_steps: dict[str, int] = field(default_factory=dict)
    traceback: str | None = None  # vLLM's, when it raised


class SimCluster:
    """The engines, the client/proxy, the transfer engine and the faults of one dry run."""

    def __init__(self, config: DryRunConfig, workload: list[WorkloadRequest]) -> None:
        self.config = config
        self.clock = VirtualClock()
        self.model_dir = _model_dir()
        longest = max([len(w.prompt_token_ids) + w.max_tokens for w in workload], default=0)
        self.max_model_len = max(256, longest + 16,
                                 distribution_max(config.prompt_len) + distribution_max(config.output_len) + 16)
        if "starve" in config.faults:
            # vLLM refuses a max_model_len its pool could never hold: exactly the usable pool.
            self.max_model_len = (config.num_blocks - 1) * config.block_size
        elif config.given_requests:
            # vLLM refuses a max_model_len its pool could never hold (a replayed pool may be small): the pool's
            self.max_model_len = min(self.max_model_len, max(256, (config.num_blocks - 1) * config.block_size))
        if config.perturbations:  # small_pool: the pool shrinks, never below what max_model_len needs
            need = -(-self.max_model_len // config.block_size) + 1
            blocks = pool_blocks(config.perturbations, config.num_blocks, need)
            config = self.config = dataclasses.replace(config, num_blocks=blocks)
        self._order = 0
        self.want_eos: dict[str, bool] = {}
        # P and D name a request `rNNNNN-p` / `rNNNNN-d`, or both `rNNNNN` where the release has one id for both.
        self.shared_ids = config.instances in ("single", "offload") or shared_request_ids()
        self.faults = FaultInjector(self)
        self.transfers = SimTransferEngine(self)
        self.offload = SimOffload(self) if config.instances == "offload" else None
        self.workload = workload
        self.clients: list[ClientRequest] = [ClientRequest(w, f"r{w.index:05d}") for w in workload]
        self.by_engine_id: dict[str, SimEngine] = {}
        self.engines: list[SimEngine] = []
        self.last_progress = 0
        self.in_flight = 0
        self._next_client = 0
        self.stats = RunStats()
        prefix = config.instance_prefix
        if config.instances in ("single", "offload"):
            kv_role = "kv_both" if config.instances == "offload" else None
            self.engines.append(SimEngine(self, 0, f"{prefix}engine-0", "both", kv_role))
            self.prefill = self.engines[0]
            self.decode: SimEngine | None = None
        else:
            self.prefill = SimEngine(self, 0, f"{prefix}prefill-0", "prefill", "kv_producer")
            self.engines.append(self.prefill)
            self.decode = None
            if config.instances == "pd":
                self.decode = SimEngine(self, 1, f"{prefix}decode-0", "decode", "kv_consumer")
                self.engines.append(self.decode)
        for e in self.engines:
            self.by_engine_id[e.engine_id] = e
        if self.decode is not None:  # replay: D's steps wait for the requests P hands over before them
            for c in self.clients:
                if c.wl.decode_step >= 0:
                    self.decode.await_from_peer(c.wl.decode_step)
        self.client_limit = self.faults.client_concurrency()

    def req_id(self, base: str, side: str) -> str:
        """The engine request id of client request `base` on the prefill (`side` "p") or decode ("d") side."""
        return engine_req_id(base, side, self.shared_ids)

    def next_order(self) -> int:
        self._order += 1
        return self._order

    def note_progress(self, ts: int) -> None:
        self.last_progress = max(self.last_progress, ts)

    # -- requests ----------------------------------------------------------------------------------------------
    def _make_request(self, req_id: str, wl: WorkloadRequest, max_tokens: int, params: dict | None,
                      arrival_ns: int) -> Any:
        # lazy: vLLM (optional) loads when a cluster is built, not when this module is imported
        from vllm.sampling_params import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[EOS_TOKEN_ID],
                            skip_special_tokens=False)
        req = new_request(req_id, list(wl.prompt_token_ids), sp, arrival_time=arrival_ns / 1e9,
                          eos_token_id=EOS_TOKEN_ID)
        if params is not None:
            req.kv_transfer_params = params
        return req

    def release_clients(self) -> None:
        """Hand the workload's requests to the first engine at their arrival times (within the client's limit)."""
        first = self.prefill
        while self._next_client < len(self.clients):
            if self.client_limit and self.in_flight >= self.client_limit:
                return
            c = self.clients[self._next_client]
            self._next_client += 1
            c.released = True
            self.in_flight += 1
            start = self.start_ns + c.wl.arrival_ns
            if self.client_limit:
                start = max(start, self.limit_free_ns)
            if self.config.instances in ("single", "offload"):
                req_id = c.base_id
                self.want_eos[req_id] = c.wl.wants_eos()
                req = self._make_request(req_id, c.wl, c.wl.max_tokens, None, start)
            else:
                req_id = self.req_id(c.base_id, "p")
                params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                          "remote_block_ids": None, "remote_host": None, "remote_port": None}
                req = self._make_request(req_id, c.wl, 1, params, start)
            first.push_input(start, "add", req, c.wl.first_step)

    def on_outputs(self, engine: SimEngine, outputs: dict | None) -> None:
        """The proxy: P's finished request goes to D with its kv_transfer_params; D's finish completes the client."""
        if not outputs:
            return
        now = engine.timeline.now
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is None:
                    continue
                self.stats.requests_finished += 1
                rid = o.request_id
                base = base_id(rid)
                if engine is self.prefill and engine.has_connector:
                    params = o.kv_transfer_params
                    client = self._client(base)
                    if params and self.decode is not None and client is not None:
                        d_id = self.req_id(base, "d")
                        self.want_eos[d_id] = client.wl.wants_eos()
                        d_params = dict(params)
                        arrival = now + int(self.config.proxy_delay_us * NS_PER_US)
                        req = self._make_request(d_id, client.wl, client.wl.max_tokens, d_params, arrival)
                        self.decode.push_input(arrival, "add", req, client.wl.decode_step)
                        continue
                    if params and self.decode is None:
                        self.transfers.phantom_read(engine, rid, params, now)
                    self._client_done(base, now)
                else:
                    self._client_done(base, now)

    def _client(self, base: str) -> ClientRequest | None:
        try:
            idx = int(base[1:])
        except ValueError:
            return None
        return self.clients[idx] if 0 <= idx < len(self.clients) else None

    def _client_done(self, base: str, now: int) -> None:
        c = self._client(base)
        if c is not None and not c.done:
            c.done = True
            self.in_flight -= 1
            self.limit_free_ns = max(self.limit_free_ns, now)

    # -- the loop ----------------------------------------------------------------------------------------------
    def build(self) -> None:
        for e in self.engines:
            e.build()
        self.start_ns = max(e.timeline.now for e in self.engines)
        for e in self.engines:
            e.timeline.advance_to(self.start_ns)
        self.limit_free_ns = self.start_ns
        self.last_progress = self.start_ns

    def run(self) -> RunStats:
        cfg = self.config
        drain_ns = int(cfg.drain_timeout_ms * 1e6)
        hard_stop = self.start_ns + int(cfg.max_virtual_s * 1e9)
        idle_ns = int(cfg.idle_sleep_us * NS_PER_US)
        clock = self.clock
        while True:
            self.release_clients()
            pending_clients = self._next_client < len(self.clients)
            # Pick the engine to act next: smallest virtual time among those with work or a due input.
            best: SimEngine | None = None
            best_key = None
            waiting_on_peer: list[SimEngine] = []
            for e in self.engines:
                if e.has_work():
                    key = e.step_ready_ns()
                    if key is None:
                        waiting_on_peer.append(e)
                        continue
                elif e.inputs:
                    key = max(e.timeline.now, e.next_input_ns or 0)
                else:
                    continue
                if best_key is None or key < best_key:
                    best, best_key = e, key
            for e in waiting_on_peer:  # replay: a peer that has not handed it over by now will not
                if best is None or best_key - e.timeline.now > PEER_WAIT_NS:
                    e.give_up_waiting()
                    key = e.step_ready_ns()
                    if key is not None and (best is None or key < best_key):
                        best, best_key = e, key
            if best is None:
                # Nothing runs and nothing is due: done (or a closed-loop client waits for a slot that will never
                # free, because its in-flight requests are stuck).
                break
            if best_key > hard_stop:
                log.warning("dry run stopped at the virtual time limit (%.0f s)", cfg.max_virtual_s)
                break
            if (not pending_clients and not any(e.inputs for e in self.engines)
                    and best_key - self.last_progress > drain_ns):
                # Nothing progressed for drain_timeout_ms: the rest is stuck (a leak, a starved request).
                self._hold_and_step_once()
                break
            e = best
            clock.current = e.timeline
            if best_key > e.timeline.now:  # idle until an input, or (replay) waiting for a recorded arrival
                e.timeline.advance_to(best_key)
            e.deliver_inputs()
            ready = e.step_ready_ns()
            if not e.has_work() or ready is None or ready > e.timeline.now:
                continue
            before_tokens = e.tokens_executed
            try:
                outputs, executed = engine_step(e.core)
            except Exception as exc:  # vLLM itself raised (its assert): the hooks recorded engine_error
                tb = traceback.extract_tb(exc.__traceback__)
                where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
                msg = f": {exc}" if str(exc) else ""
                self.stats.error = f"{e.instance}: {type(exc).__name__}{msg}{where}"
                self.stats.traceback = "".join(traceback.format_exception(exc))
                self._record_engine_error(e, exc)
                break
            self.stats.steps += 1
            self.stats.engine_steps[e.instance] = self.stats.engine_steps.get(e.instance, 0) + 1
            post_step(e.core, executed)
            self.on_outputs(e, outputs)
            if e.tokens_executed > before_tokens or (outputs and any(eco.outputs for eco in outputs.values())):
                self.note_progress(e.timeline.now)
            if not executed and e.core.scheduler.has_requests():
                e.timeline.advance_by(idle_ns)
        for e in self.engines:
            clock.current = e.timeline
            e.timeline.drain()
        return self.stats

    def _hold_and_step_once(self) -> None:
        """The stuck engines jump `end_hold_s` ahead (the empty steps between are not simulated) and step once."""
        hold_ns = int(self.config.end_hold_s * 1e9)
        if hold_ns <= 0:
            return
        for e in self.engines:
            if not e.has_work():
                continue
            self.clock.current = e.timeline
            e.timeline.advance_by(hold_ns)
            e.deliver_inputs()
            try:
                outputs, executed = engine_step(e.core)
            except Exception as exc:  # noqa: BLE001 - recorded by the hooks, reported in the result
                self.stats.error = f"{e.instance}: {type(exc).__name__}: {exc}"
                return
            self.stats.steps += 1
            post_step(e.core, executed)
            self.on_outputs(e, outputs)

    def _record_engine_error(self, engine: SimEngine, exc: BaseException) -> None:
        """vLLM raised inside step_fn: the hooks' step_fn wrapper has emitted engine_error; flush what we hold."""
        log.info("dry run: %s raised %s: %s", engine.instance, type(exc).__name__, exc)
