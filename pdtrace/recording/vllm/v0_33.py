"""Hook table for vLLM 0.33.0: which private methods pdtrace wraps, and the wrappers (trace format v1 kinds).

Line numbers are vLLM 0.33.0's `vllm/v1/...` sources. The research notes (shared/research/vllm_internals.md §8,
vllm-0.33-corrections.md) give the reasoning; in short:

* Scheduler (EngineCore process): `add_request` -> req_add; `schedule` assigns the step id (attached to the
  SchedulerOutput as `_pdtrace_step`), then sched + req_sched (one batched call); `update_from_output` ->
  step_output, kv_recv_fail; `_preempt_request` -> req_preempt; `_free_request` + `_connector_finished` ->
  req_finish (delay_free is what the connector answered, or the abort-while-receiving delay); `KVCacheManager.
  allocate_slots` -> blocks_alloc (the table's growth: the return value holds only new blocks) and req_wait_kv;
  `KVCacheManager.free` / `pop_blocks_for_free` -> blocks_free (reason from the caller's context, deferred with
  the fence); `BlockPool.free_blocks` and `Scheduler._drain_deferred_frees` -> blocks_pool_free;
  `_update_from_kv_xfer_finished` -> kv_send_done / kv_recv_done with the status, at entry, before vLLM's asserts.
* Engine loop: `EngineCore.step` / `step_with_batch_queue` (class wraps: `step_fn` is bound after the plugin ran)
  -> engine_error; at the first step the executor *instance* is wrapped -> step_submit, and the futures' wait.
* Workers (lazy modules): `Worker.execute_model` / `sample_tokens` -> exec_begin / exec_end per PP and TP rank,
  kv_send_rank / kv_recv_rank from each rank's own KVConnectorOutput; V1 `GPUModelRunner._update_states` ->
  batch_add / batch_remove.

Every wrapper: if recording is off, call the original and nothing else; pdtrace's own work under try/except
(RUNTIME.fail); vLLM's exceptions pass through untouched.
"""

from __future__ import annotations

import time
from typing import Any

from pdtrace.recording import session
from pdtrace.recording.vllm._common import (
    STATE_ATTR,
    STEP_ATTR,
    SchedulerState,
    WorkerState,
    instance_of,
    remote_instance,
)
from pdtrace.recording.vllm._patching import Hook
from pdtrace.recording.vllm._runtime import RUNTIME

VERSIONS = ("0.33.0",)

_RT = RUNTIME
_now = time.perf_counter_ns

_SCHED = "vllm.v1.core.sched.scheduler"
_KVM = "vllm.v1.core.kv_cache_manager"
_POOL = "vllm.v1.core.block_pool"
_CORE = "vllm.v1.engine.core"
_WORKER = "vllm.v1.worker.gpu_worker"
_RUNNER = "vllm.v1.worker.gpu_model_runner"

_RPC_EXECUTE = '{"rpc":"execute_model"}'
_RPC_SAMPLE = '{"rpc":"sample_tokens"}'


# --------------------------------------------------------------------------------------------------- state


def _sched_state(sched: Any) -> SchedulerState:
    st = sched.__dict__.get(STATE_ATTR)
    if st is None:
        st = _new_sched_state(sched)
    return st


def _new_sched_state(sched: Any) -> SchedulerState:
    vc = sched.vllm_config
    instance, role, dp_rank = instance_of(vc)
    st = SchedulerState(sched, instance, role, dp_rank)
    kvm = sched.kv_cache_manager
    st.tables = [m.req_to_blocks for m in kvm.coordinator.single_type_managers]
    st.tbl0 = st.tables[0] if len(st.tables) == 1 else None
    setattr(kvm, STATE_ATTR, st)
    setattr(kvm.block_pool, STATE_ATTR, st)
    setattr(sched, STATE_ATTR, st)
    pc, sc, kv = vc.parallel_config, vc.scheduler_config, vc.kv_transfer_config
    st.ch.emit(
        "engine_config",
        n=int(kvm.block_pool.num_gpu_blocks),
        detail={
            "block_size": sched.block_size,
            "pp": pc.pipeline_parallel_size,
            "tp": pc.tensor_parallel_size,
            "dp": pc.data_parallel_size,
            "batch_queue_size": vc.max_concurrent_batches,
            "async_scheduling": bool(sc.async_scheduling),
            "defer_block_free": bool(sched.defer_block_free),
            "kv_role": getattr(kv, "kv_role", None),
            "connector": getattr(kv, "kv_connector", None),
            "runner": "v2" if vc.use_v2_model_runner else "v1",
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
        },
    )
    return st


def _table_ids(st: SchedulerState, req_id: str) -> list[int]:
    """The request's current block ids over all KV cache groups, null blocks left out."""
    ids: list[int] = []
    for table in st.tables:
        blocks = table.get(req_id)
        if blocks:
            ids.extend(b.block_id for b in blocks if not b.is_null)
    return ids


def _free_reason(st: SchedulerState, req_id: str) -> str:
    reason = st.free_reason
    if reason == "xfer":
        return "sent" if req_id in st.xfer_sending else "received"
    return reason or "finished"


# ----------------------------------------------------------------------------------------------- scheduler


def _w_add_request(orig: Any) -> Any:
    def add_request(self: Any, request: Any) -> Any:
        if not _RT.active:
            return orig(self, request)
        try:
            st = _sched_state(self)
            req_id = request.request_id
            new = req_id not in self.requests  # an existing id is a streaming-input chunk, not a new request
            if new:
                params = request.kv_transfer_params or {}
                detail: dict[str, Any] = {"remote_prefill": bool(params.get("do_remote_prefill")),
                                          "remote_decode": bool(params.get("do_remote_decode"))}
                if detail["remote_prefill"]:
                    detail["remote_instance"] = remote_instance(params.get("remote_engine_id"))
                    detail["remote_req"] = params.get("remote_request_id")
                    remote_blocks = params.get("remote_block_ids")
                    if remote_blocks:
                        if remote_blocks and isinstance(remote_blocks[0], (list, tuple)):
                            remote_blocks = [b for group in remote_blocks for b in group]
                        detail["remote_blocks"] = [int(b) for b in remote_blocks]
                n_prompt = request.num_prompt_tokens
        except Exception as exc:
            _RT.fail("add_request", exc)
            return orig(self, request)
        out = orig(self, request)
        if new and _RT.active:
            try:
                st.ch.emit("req_add", step=st.cur_step, req=req_id, n=n_prompt, detail=detail)
            except Exception as exc:
                _RT.fail("add_request", exc)
        return out

    return add_request


def _w_schedule(orig: Any) -> Any:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _RT.active:
            return orig(self, *args, **kwargs)
        try:
            st = _sched_state(self)
            step = st.next_step
            st.next_step = step + 1
            st.cur_step = step
            t0 = _now()
        except Exception as exc:
            _RT.fail("schedule", exc)
            return orig(self, *args, **kwargs)
        so = orig(self, *args, **kwargs)
        if _RT.active:
            try:
                dur = _now() - t0
                setattr(so, STEP_ATTR, step)
                nst = so.num_scheduled_tokens
                st.ch.emit("sched", step=step, n=so.total_num_scheduled_tokens, detail={
                    "running": len(self.running),
                    "waiting": len(self.waiting) + len(self.kv_holding_waiting),
                    "waiting_kv": len(st.waiting_kv),
                    "free_blocks": self.kv_cache_manager.block_pool.get_num_free_blocks(),
                    "dur_ns": dur,
                })
                if nst:
                    st.ch.emit_many("req_sched", step=step, reqs=list(nst), ns=list(nst.values()))
            except Exception as exc:
                _RT.fail("schedule", exc)
        st.cur_step = None
        return so

    return schedule


def _w_update_from_output(orig: Any) -> Any:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not _RT.active:
            return orig(self, scheduler_output, model_runner_output)
        try:
            st = _sched_state(self)
            step = getattr(scheduler_output, STEP_ATTR, None)
            st.cur_step = step
            wait_ns, st.wait_ns = st.wait_ns, None
            st.eng.emit("step_output", step=step, detail=None if wait_ns is None else {"wait_ns": wait_ns})
            kvo = model_runner_output.kv_connector_output
            if kvo is not None:
                failed = kvo.failed_recving
                if failed:
                    for req_id in failed:
                        st.ch.emit("kv_recv_fail", step=step, req=req_id)
                if kvo.invalid_block_ids:
                    st.ch.emit("kv_recv_fail", step=step, blocks=sorted(kvo.invalid_block_ids))
        except Exception as exc:
            _RT.fail("update_from_output", exc)
            return orig(self, scheduler_output, model_runner_output)
        out = orig(self, scheduler_output, model_runner_output)  # on a vLLM error cur_step stays for engine_error
        st.cur_step = None
        return out

    return update_from_output


def _w_preempt_request(orig: Any) -> Any:
    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if not _RT.active:
            return orig(self, request, *args, **kwargs)
        try:
            st = _sched_state(self)
            st.ch.emit("req_preempt", step=st.cur_step, req=request.request_id)
            previous, st.free_reason = st.free_reason, "preempted"
        except Exception as exc:
            _RT.fail("_preempt_request", exc)
            return orig(self, request, *args, **kwargs)
        try:
            return orig(self, request, *args, **kwargs)
        finally:
            st.free_reason = previous

    return _preempt_request


def _w_free_request(orig: Any) -> Any:
    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if not _RT.active:
            return orig(self, request, *args, **kwargs)
        try:
            st = _sched_state(self)
            status = request.status.name
            reason = request.get_finished_reason()
            delay_arg = bool(args[0] if args else kwargs.get("delay_free_blocks", False))
            req_id = request.request_id
            st.waiting_kv.discard(req_id)
            previous = (st.finishing, st.free_reason)
            st.finishing = (req_id, None if reason is None else str(reason), status, delay_arg)
            st.free_reason = "aborted" if status == "FINISHED_ABORTED" else "finished"
        except Exception as exc:
            _RT.fail("_free_request", exc)
            return orig(self, request, *args, **kwargs)
        try:
            return orig(self, request, *args, **kwargs)
        finally:
            st.finishing, st.free_reason = previous

    return _free_request


def _w_connector_finished(orig: Any) -> Any:
    # _free_request calls this before it frees anything: req_finish lands before the request's blocks_free.
    def _connector_finished(self: Any, request: Any) -> Any:
        out = orig(self, request)
        if _RT.active:
            try:
                st = self.__dict__.get(STATE_ATTR)
                finishing = st.finishing if st is not None else None
                if finishing is not None and finishing[0] == request.request_id:
                    req_id, reason, status, delay_arg = finishing
                    st.ch.emit("req_finish", step=st.cur_step, req=req_id, reason=reason, status=status,
                               delay_free=bool(out[0]) or delay_arg)
            except Exception as exc:
                _RT.fail("_connector_finished", exc)
        return out

    return _connector_finished


def _w_update_from_kv_xfer_finished(orig: Any) -> Any:
    def _update_from_kv_xfer_finished(self: Any, kv_connector_output: Any) -> Any:
        if not _RT.active:
            return orig(self, kv_connector_output)
        try:
            st = _sched_state(self)
            step = st.cur_step
            requests = self.requests
            recving = kv_connector_output.finished_recving or ()
            sending = kv_connector_output.finished_sending or ()
            # Emitted before vLLM acts: its asserts (scheduler.py:3571/3577/3581, _free_blocks:3065) would
            # otherwise take the evidence with them.
            for req_id in recving:
                req = requests.get(req_id)
                st.ch.emit("kv_recv_done", step=step, req=req_id,
                           status="unknown" if req is None else req.status.name)
            for req_id in sending:
                req = requests.get(req_id)
                st.ch.emit("kv_send_done", step=step, req=req_id,
                           status="unknown" if req is None else req.status.name)
            previous = (st.free_reason, st.xfer_sending)
            st.free_reason, st.xfer_sending = "xfer", frozenset(sending)
        except Exception as exc:
            _RT.fail("_update_from_kv_xfer_finished", exc)
            return orig(self, kv_connector_output)
        try:
            return orig(self, kv_connector_output)
        finally:
            st.free_reason, st.xfer_sending = previous

    return _update_from_kv_xfer_finished


def _w_update_waiting_for_remote_kv(orig: Any) -> Any:
    def _update_waiting_for_remote_kv(self: Any, request: Any) -> Any:
        if not _RT.active:
            return orig(self, request)
        try:
            st = _sched_state(self)
            st.waiting_kv.discard(request.request_id)
            previous, st.free_reason = st.free_reason, "load_failed"  # its only free is the failed-load path
        except Exception as exc:
            _RT.fail("_update_waiting_for_remote_kv", exc)
            return orig(self, request)
        try:
            return orig(self, request)
        finally:
            st.free_reason = previous

    return _update_waiting_for_remote_kv


def _w_drain_deferred_frees(orig: Any) -> Any:
    def _drain_deferred_frees(self: Any) -> Any:
        pending = self.deferred_frees
        if not pending or not _RT.active:
            return orig(self)
        try:
            st = _sched_state(self)
            before = list(pending)
            st.draining = True
        except Exception as exc:
            _RT.fail("_drain_deferred_frees", exc)
            return orig(self)
        try:
            out = orig(self)
        finally:
            st.draining = False
        if _RT.active:
            try:
                drained = before[: len(before) - len(self.deferred_frees)]  # popleft only, nothing appended
                seen: set[int] = set()
                for fence, blocks in drained:
                    ids = [b.block_id for b in blocks
                           if b.ref_cnt == 0 and not b.is_null and b.block_id not in seen]
                    if ids:
                        seen.update(ids)
                        st.ch.emit("blocks_pool_free", step=st.cur_step, blocks=ids, detail={"fence": fence})
            except Exception as exc:
                _RT.fail("_drain_deferred_frees", exc)
        return out

    return _drain_deferred_frees


# ------------------------------------------------------------------------------------- KV cache manager, pool


def _w_allocate_slots(orig: Any) -> Any:
    # Hot path: called for every scheduled request in every step. Most calls add no block.
    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        st = self.__dict__.get(STATE_ATTR)
        if st is None or not _RT.active:
            return orig(self, request, *args, **kwargs)
        try:
            req_id = request.request_id
            tbl0 = st.tbl0
            if tbl0 is not None:
                blocks = tbl0.get(req_id)
                before: Any = len(blocks) if blocks is not None else 0
            else:
                before = [len(t.get(req_id) or ()) for t in st.tables]
        except Exception as exc:
            _RT.fail("allocate_slots", exc)
            return orig(self, request, *args, **kwargs)
        out = orig(self, request, *args, **kwargs)
        if out is None or not _RT.active:
            return out
        try:
            if tbl0 is not None:
                blocks = tbl0.get(req_id)
                if blocks is None or len(blocks) == before:
                    return out
                new_ids = [b.block_id for b in blocks[before:] if not b.is_null]
            else:
                new_ids = []
                for table, n0 in zip(st.tables, before):
                    blocks = table.get(req_id)
                    if blocks is not None and len(blocks) > n0:
                        new_ids.extend(b.block_id for b in blocks[n0:] if not b.is_null)
            if not new_ids and not kwargs.get("delay_cache_blocks"):
                return out
            step = st.cur_step
            if kwargs:  # admission from the waiting queue: prefix hits and external tokens are possible
                hit_blocks = kwargs.get("new_computed_blocks")
                hit = 0
                if hit_blocks is not None:
                    hit = sum(1 for group in hit_blocks.blocks for b in group if not b.is_null)
                n_new = sum(len(ids) for ids in out.get_block_ids())
                external = max(0, len(new_ids) - hit - n_new)
                detail = {"hit": hit, "external": external} if hit or external else None
                st.ch.emit("blocks_alloc", step=step, req=req_id, blocks=new_ids, detail=detail)
                if kwargs.get("delay_cache_blocks"):
                    # The scheduler sets WAITING_FOR_REMOTE_KVS right after this call (scheduler.py:1523).
                    st.waiting_kv.add(req_id)
                    st.ch.emit("req_wait_kv", step=step, req=req_id, blocks=new_ids[hit:],
                               n=int(kwargs.get("num_external_computed_tokens", 0)))
            else:
                st.ch.emit("blocks_alloc", step=step, req=req_id, blocks=new_ids)
        except Exception as exc:
            _RT.fail("allocate_slots", exc)
        return out

    return allocate_slots


def _w_kvm_free(orig: Any) -> Any:
    def free(self: Any, request: Any) -> Any:
        st = self.__dict__.get(STATE_ATTR)
        if st is None or not _RT.active:
            return orig(self, request)
        try:
            req_id = request.request_id
            ids = _table_ids(st, req_id)
            if ids:  # emitted first: the pool frees inside the call must follow the owner's free
                st.ch.emit("blocks_free", step=st.cur_step, req=req_id, blocks=ids, deferred=False,
                           reason=_free_reason(st, req_id))
            previous, st.free_req = st.free_req, req_id
        except Exception as exc:
            _RT.fail("KVCacheManager.free", exc)
            return orig(self, request)
        try:
            return orig(self, request)
        finally:
            st.free_req = previous

    return free


def _w_pop_blocks_for_free(orig: Any) -> Any:
    # Only the deferred path of Scheduler._free_request_blocks calls this (scheduler.py:3084-3093).
    def pop_blocks_for_free(self: Any, request: Any) -> Any:
        st = self.__dict__.get(STATE_ATTR)
        if st is None or not _RT.active:
            return orig(self, request)
        try:
            req_id = request.request_id
            ids = _table_ids(st, req_id)
            if ids:
                st.ch.emit("blocks_free", step=st.cur_step, req=req_id, blocks=ids, deferred=True,
                           reason=_free_reason(st, req_id), detail={"fence": st.sched.sched_step_seq})
        except Exception as exc:
            _RT.fail("KVCacheManager.pop_blocks_for_free", exc)
        return orig(self, request)

    return pop_blocks_for_free


def _w_pool_free_blocks(orig: Any) -> Any:
    def free_blocks(self: Any, ordered_blocks: Any) -> Any:
        st = self.__dict__.get(STATE_ATTR)
        if st is None or not _RT.active:
            return orig(self, ordered_blocks)
        try:
            blocks = list(ordered_blocks)  # may be a one-shot iterator (reversed(...)): read it once, pass the list
        except Exception as exc:
            _RT.fail("BlockPool.free_blocks", exc)
            raise
        out = orig(self, blocks)
        if st.draining or not _RT.active:
            return out
        try:
            ids = [b.block_id for b in blocks
                   if b.ref_cnt == 0 and not b.is_null and (b.pool is None or b.pool is self)]
            if ids:
                st.ch.emit("blocks_pool_free", step=st.cur_step, req=st.free_req, blocks=ids)
        except Exception as exc:
            _RT.fail("BlockPool.free_blocks", exc)
        return out

    return free_blocks


# ------------------------------------------------------------------------------------------------ engine loop


def _engine_state(engine: Any) -> SchedulerState:
    """At the first step: the scheduler's state, and the executor instance wrapped (it did not exist when the
    plugin ran inside EngineCore.__init__)."""
    st = _sched_state(engine.scheduler)
    if not st.engine_attached:
        st.engine_attached = True
        _wrap_executor(engine, engine.model_executor, st)
    setattr(engine, STATE_ATTR, st)
    return st


def _timed_future(future: Any, st: SchedulerState) -> None:
    result = future.result

    def timed_result(*args: Any, **kwargs: Any) -> Any:
        t0 = _now()
        try:
            return result(*args, **kwargs)
        finally:
            st.wait_ns = (st.wait_ns or 0) + (_now() - t0)

    try:
        future.result = timed_result
    except Exception:  # a future type that takes no attributes: no wait_ns, nothing else lost
        pass


def _wrap_executor(engine: Any, executor: Any, st: SchedulerState) -> None:
    execute_model = executor.execute_model
    sample_tokens = executor.sample_tokens

    def wrapped_execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if _RT.active:
            try:
                queue = engine.batch_queue
                st.eng.emit("step_submit", step=getattr(scheduler_output, STEP_ATTR, None),
                            n=1 if queue is None else len(queue) + 1)
            except Exception as exc:
                _RT.fail("execute_model", exc)
        out = execute_model(scheduler_output, *args, **kwargs)
        if _RT.active and (args[0] if args else kwargs.get("non_block", False)):
            _timed_future(out, st)
        return out

    def wrapped_sample_tokens(grammar_output: Any, *args: Any, **kwargs: Any) -> Any:
        non_block = args[0] if args else kwargs.get("non_block", False)
        if not _RT.active:
            return sample_tokens(grammar_output, *args, **kwargs)
        if non_block:
            out = sample_tokens(grammar_output, *args, **kwargs)
            _timed_future(out, st)
            return out
        t0 = _now()
        try:
            return sample_tokens(grammar_output, *args, **kwargs)
        finally:
            st.wait_ns = (st.wait_ns or 0) + (_now() - t0)

    executor.execute_model = wrapped_execute_model
    executor.sample_tokens = wrapped_sample_tokens


def _w_engine_step(where: str) -> Any:
    def factory(orig: Any) -> Any:
        def step(self: Any) -> Any:
            st = None
            if _RT.active:
                try:
                    st = self.__dict__.get(STATE_ATTR) or _engine_state(self)
                except Exception as exc:
                    _RT.fail(where, exc)
            try:
                return orig(self)
            except Exception as exc:
                if st is not None and _RT.active:
                    try:
                        st.eng.emit("engine_error", step=st.cur_step,
                                    detail={"error": f"{type(exc).__name__}: {exc}", "where": where})
                        st.cur_step = None
                        st.rec.flush()
                    except Exception as inner:
                        _RT.fail(where, inner)
                raise

        return step

    return factory


# ---------------------------------------------------------------------------------------------------- workers


def _worker_ranks() -> tuple[int | None, int | None]:
    """(pp_rank, tp_rank) from vLLM's process groups; (None, None) where they are not initialised."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_pp_group().rank_in_group), int(get_tp_group().rank_in_group)
    except Exception:
        return None, None


def _worker_state(obj: Any) -> WorkerState:
    """A worker's (or model runner's) channels, opened at its first step: the plugin ran before distributed init,
    so the ranks are read here."""
    wst = obj.__dict__.get(STATE_ATTR)
    if wst is None:
        instance, role, dp_rank = instance_of(obj.vllm_config)
        rec = session.recorder(instance, role, dp_rank)
        pp_rank, tp_rank = _worker_ranks()
        wst = WorkerState(rec.channel("worker", pp_rank=pp_rank, tp_rank=tp_rank),
                          rec.channel("connector", pp_rank=pp_rank, tp_rank=tp_rank))
        setattr(obj, STATE_ATTR, wst)
    return wst


def _rank_completions(wst: WorkerState, output: Any, step: int | None) -> None:
    if output is None:
        return
    get_kvo = getattr(output, "get_kv_connector_output", None)  # AsyncModelRunnerOutput: do not block on it
    kvo = get_kvo() if get_kvo is not None else getattr(output, "kv_connector_output", None)
    if kvo is None:
        return
    if kvo.finished_sending:
        for req_id in kvo.finished_sending:
            wst.conn.emit("kv_send_rank", step=step, req=req_id)
    if kvo.finished_recving:
        for req_id in kvo.finished_recving:
            wst.conn.emit("kv_recv_rank", step=step, req=req_id)


def _w_worker_execute_model(orig: Any) -> Any:
    def execute_model(self: Any, scheduler_output: Any) -> Any:
        if not _RT.active:
            return orig(self, scheduler_output)
        try:
            wst = _worker_state(self)
            step = getattr(scheduler_output, STEP_ATTR, None)
            n = scheduler_output.total_num_scheduled_tokens
            wst.step, wst.n = step, n
            wst.ch.emit("exec_begin", step=step, n=n)
        except Exception as exc:
            _RT.fail("Worker.execute_model", exc)
            return orig(self, scheduler_output)
        out = orig(self, scheduler_output)
        if _RT.active:
            try:
                wst.ch.emit("exec_end", step=step, n=n, detail=_RPC_EXECUTE)
                _rank_completions(wst, out, step)
            except Exception as exc:
                _RT.fail("Worker.execute_model", exc)
        return out

    return execute_model


def _w_worker_sample_tokens(orig: Any) -> Any:
    # sample_tokens carries no SchedulerOutput; it always follows its step's execute_model on this worker.
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        if not _RT.active:
            return orig(self, grammar_output)
        try:
            wst = _worker_state(self)
            step, n = wst.step, wst.n
            wst.ch.emit("exec_begin", step=step, n=n)
        except Exception as exc:
            _RT.fail("Worker.sample_tokens", exc)
            return orig(self, grammar_output)
        out = orig(self, grammar_output)
        if _RT.active:
            try:
                wst.ch.emit("exec_end", step=step, n=n, detail=_RPC_SAMPLE)
                _rank_completions(wst, out, step)
            except Exception as exc:
                _RT.fail("Worker.sample_tokens", exc)
        return out

    return sample_tokens


def _w_update_states(orig: Any) -> Any:
    # V1 runner only (the V2 runner has no persistent batch). Diff of the batch's request ids around the call.
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        if not _RT.active:
            return orig(self, scheduler_output)
        try:
            wst = _worker_state(self)
            before = set(self.input_batch.req_id_to_index)
        except Exception as exc:
            _RT.fail("GPUModelRunner._update_states", exc)
            return orig(self, scheduler_output)
        out = orig(self, scheduler_output)
        if _RT.active:
            try:
                after = self.input_batch.req_id_to_index.keys()
                removed = before - after
                added = after - before
                if removed or added:
                    step = getattr(scheduler_output, STEP_ATTR, None)
                    finished = scheduler_output.finished_req_ids
                    preempted = scheduler_output.preempted_req_ids or ()
                    for req_id in removed:
                        reason = ("finished" if req_id in finished
                                  else "preempted" if req_id in preempted else "unscheduled")
                        wst.ch.emit("batch_remove", step=step, req=req_id, reason=reason)
                    if added:
                        new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
                        for req_id in added:
                            wst.ch.emit("batch_add", step=step, req=req_id,
                                        reason="new" if req_id in new_ids else "resumed")
            except Exception as exc:
                _RT.fail("GPUModelRunner._update_states", exc)
        return out

    return _update_states


# ------------------------------------------------------------------------------------------------------ table

TABLE: tuple[Hook, ...] = (
    Hook(_SCHED, "Scheduler", "add_request", _w_add_request, ("request",)),
    Hook(_SCHED, "Scheduler", "schedule", _w_schedule, ("throttle_prefills",)),
    Hook(_SCHED, "Scheduler", "update_from_output", _w_update_from_output,
         ("scheduler_output", "model_runner_output")),
    Hook(_SCHED, "Scheduler", "_preempt_request", _w_preempt_request, ("request", "timestamp")),
    Hook(_SCHED, "Scheduler", "_free_request", _w_free_request, ("request", "delay_free_blocks")),
    Hook(_SCHED, "Scheduler", "_connector_finished", _w_connector_finished, ("request",)),
    Hook(_SCHED, "Scheduler", "_update_from_kv_xfer_finished", _w_update_from_kv_xfer_finished,
         ("kv_connector_output",)),
    Hook(_SCHED, "Scheduler", "_update_waiting_for_remote_kv", _w_update_waiting_for_remote_kv, ("request",)),
    Hook(_SCHED, "Scheduler", "_drain_deferred_frees", _w_drain_deferred_frees, ()),
    Hook(_KVM, "KVCacheManager", "allocate_slots", _w_allocate_slots,
         ("request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens",
          "num_external_computed_tokens", "delay_cache_blocks")),
    Hook(_KVM, "KVCacheManager", "free", _w_kvm_free, ("request",)),
    Hook(_KVM, "KVCacheManager", "pop_blocks_for_free", _w_pop_blocks_for_free, ("request",)),
    Hook(_POOL, "BlockPool", "free_blocks", _w_pool_free_blocks, ("ordered_blocks",)),
    Hook(_CORE, "EngineCore", "step", _w_engine_step("step"), ()),
    Hook(_CORE, "EngineCore", "step_with_batch_queue", _w_engine_step("step_with_batch_queue"), ()),
    Hook(_WORKER, "Worker", "execute_model", _w_worker_execute_model, ("scheduler_output",), lazy=True),
    Hook(_WORKER, "Worker", "sample_tokens", _w_worker_sample_tokens, ("grammar_output",), lazy=True),
    Hook(_RUNNER, "GPUModelRunner", "_update_states", _w_update_states, ("scheduler_output",), lazy=True),
)
