"""Hook table for vLLM 0.33.0: which private methods pdtrace wraps, and the wrappers (trace format v1 kinds).

Line numbers are vLLM 0.33.0's `vllm/v1/...` sources. The research notes (shared/research/vllm_internals.md §8,
vllm-0.33-corrections.md) give the reasoning; in short:

* Scheduler (EngineCore process): `add_request` -> req_add; `schedule` assigns the step id (attached to the
  SchedulerOutput as `_pdtrace_step`), then sched + req_sched (one batched call); `update_from_output` ->
  step_output, kv_recv_fail; `_preempt_request` -> req_preempt; `_connector_finished` (every finish passes there,
  from `_free_request`, before any free) -> req_finish, with delay_free = the connector's answer, or vLLM's delay
  for a request aborted while receiving (noted by the `finish_requests` wrapper); `_update_from_kv_xfer_finished`
  -> kv_send_done / kv_recv_done with the status, at entry, before vLLM's asserts.
* Blocks: blocks_alloc = the growth of the request's block table (allocate_slots returns only new blocks, not
  prefix hits nor external-token blocks), not by wrapping allocate_slots, which runs for every scheduled request in
  every step: at the end of `schedule` from the block ids the SchedulerOutput carries (a new or resumed request's
  whole table, a running one's appended blocks; with several KV cache groups, from the tables), when a
  request enters WAITING_FOR_REMOTE_KVS (`_set_kv_fetch_stage(..., "in_progress")`, with req_wait_kv), and before
  any free of the request (a request preempted in the step that grew its table shows the growth first); the local
  prefix hit comes from `_get_local_prefix_cache_hit`. `KVCacheManager.free` -> blocks_free, then
  blocks_pool_free for the blocks whose ref count reached 0; `pop_blocks_for_free` -> blocks_free deferred with
  its fence, and `_drain_deferred_frees` -> blocks_pool_free when the fence step is processed;
  `_free_cow_retained_blocks` -> blocks_pool_free of copy-on-write retentions;
  `KVCacheCoordinator.remove_skipped_blocks` (sliding-window / chunked-local / Mamba trimming, from allocate_slots
  and `_connector_finished`) -> blocks_free reason `skipped`, then blocks_pool_free. Not covered: connectors that
  free pool blocks directly.
* Engine loop: `EngineCore.step` / `step_with_batch_queue` (class wraps: `step_fn` is bound after the plugin ran)
  -> engine_error; at the first step the executor *instance* is wrapped -> step_submit, and the futures' wait
  (`dur_ns` and `wait_ns` on the session's duration clock: the dry run's virtual clock, else perf_counter_ns).
  `EngineCoreProc._handle_client_request` (client ADD / ABORT / EXECUTOR_FAILED between steps) -> engine_error.
  Runs of empty steps (a delayed free or a KV wait pending: vLLM steps at ~1 kHz with nothing to schedule) are
  coalesced after each empty step's update (`_coalesce_empty_step`): while nothing else is recorded, a step's
  sched/step_submit/step_output rows are taken back out of the recorder's buffer and counted in the run's first
  sched row (detail `empty_run`). In-process workers (UniProcExecutor) record every step, so no run forms there.
* Workers (lazy modules): `Worker.execute_model` / `sample_tokens` -> exec_begin / exec_end per PP and TP rank;
  inside execute_model, the receive of the previous PP stage's tensors (`GroupCoordinator.irecv_tensor_dict`, the
  handles' `AsyncIntermediateTensors.wait_for_comm`) -> exec_wait_begin / exec_wait_end reason `pp_recv`;
  kv_send_rank / kv_recv_rank from each rank's own KVConnectorOutput; V1 `GPUModelRunner._update_states` ->
  batch_add / batch_remove.

Every wrapper: if recording is off, call the original and nothing else; pdtrace's own work under try/except
(RUNTIME.fail); vLLM's exceptions pass through untouched.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any

from pdtrace.recording import session
from pdtrace.recording.vllm._common import (
    RELEASE,
    STEP_ATTR,
    SchedulerState,
    WorkerState,
    attach_state,
    batch_queue_depth,
    fix_engine_identity,
    instance_of,
    remote_instance,
    state_get,
)
from pdtrace.recording.vllm._patching import ORIGINAL_ATTR, REQUIRED, Hook, takes_exactly
from pdtrace.recording.vllm._runtime import RUNTIME, SKIP, guarded

if TYPE_CHECKING:  # the hooks load without pyarrow; the recorder is imported once recording starts
    from pdtrace.recording.recorder import RowView

_RT = RUNTIME

_SCHED = "vllm.v1.core.sched.scheduler"
_KVM = "vllm.v1.core.kv_cache_manager"
_COORD = "vllm.v1.core.kv_cache_coordinator"
_CORE = "vllm.v1.engine.core"
_WORKER = "vllm.v1.worker.gpu_worker"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_EXECUTOR = "vllm.v1.executor.abstract"
_DIST = "vllm.distributed.parallel_state"

_RPC_EXECUTE = '{"rpc":"execute_model"}'
# Pre-encoded details of the common req_add cases (a JSON string is passed through as it is).
_ADD_LOCAL = '{"remote_prefill":false,"remote_decode":false}'
_ADD_REMOTE_DECODE = '{"remote_prefill":false,"remote_decode":true}'
_RPC_SAMPLE = '{"rpc":"sample_tokens"}'


# --------------------------------------------------------------------------------------------------- state


_STATUS_NAMES: dict[Any, str] = {}
_FINISH_REASONS: dict[Any, str | None] = {}


def _status_name(status: Any) -> str:
    """RequestStatus -> its name (enum `.name` is a Python-level property: cached per member)."""
    name = _STATUS_NAMES.get(status)
    if name is None:
        name = _STATUS_NAMES[status] = status.name
    return name


def _finish_reason(request: Any) -> str | None:
    """vLLM's FinishReason string of a finished request (`stop`, `length`, ...), cached per status."""
    status = request.status
    try:
        return _FINISH_REASONS[status]
    except KeyError:
        reason = request.get_finished_reason()
        _FINISH_REASONS[status] = text = None if reason is None else str(reason)
        return text


def _sched_state(sched: Any) -> SchedulerState:
    """The scheduler's state, made at its first hooked call."""
    st = state_get(id(sched))
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
    attach_state(kvm, st)
    attach_state(kvm.block_pool, st)
    trims = any(_trims_blocks(m) for m in kvm.coordinator.single_type_managers)
    if trims:
        attach_state(kvm.coordinator, st)  # only then does the remove_skipped_blocks hook look
    _trimming_hook_needed(kvm.coordinator, trims)
    attach_state(sched, st, owner=True)
    connector = getattr(sched, "connector", None)
    if connector is not None:
        _watch_connector(st, connector)
    # The queue of waiting requests held aside, counted with `waiting`: kv_holding_waiting (0.31+), skipped_waiting
    # (0.28-0.30, grammar and streaming waits too), none before (0.10 / 0.11 keep one waiting queue).
    held = getattr(sched, "kv_holding_waiting", None)
    st.held = held if held is not None else getattr(sched, "skipped_waiting", None)
    pc, sc, kv = vc.parallel_config, vc.scheduler_config, vc.kv_transfer_config
    st.ch.emit(
        "engine_config",
        n=int(kvm.block_pool.num_gpu_blocks),
        detail={
            **RELEASE,
            "block_size": sched.block_size,
            "pp": pc.pipeline_parallel_size,
            "tp": pc.tensor_parallel_size,
            "dp": pc.data_parallel_size,
            "batch_queue_size": batch_queue_depth(vc),  # 0.23+; null before (the executor's)
            "async_scheduling": bool(sc.async_scheduling),
            "defer_block_free": bool(getattr(sched, "defer_block_free", False)),  # none before 0.28
            "kv_role": getattr(kv, "kv_role", None),
            "connector": getattr(kv, "kv_connector", None),
            "runner": "v2" if getattr(vc, "use_v2_model_runner", False) else "v1",
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
        },
    )
    return st


def _watch_connector(st: SchedulerState, connector: Any) -> None:
    """Wrap the scheduler's KV connector *instance*'s `update_state_after_alloc(request, blocks, external)`: vLLM
    calls it once per admission (not per running request), with the external tokens the connector will load, right
    after `allocate_slots` (0.33: later, from `_drain_deferred_loads`, for a deferred asynchronous load). That is
    where a connector decides a read's destination: NIXL (and connectors built like it) keep it in their scheduler
    side's `_reqs_need_recv[req_id] = (request, local_block_ids, ...)`. The instance, not a class: every release and
    connector (NIXL's module moved, MultiConnector wraps others) calls it through `Scheduler.connector`. A mock
    connector (vLLM's tests) is left alone: its calls are what those tests assert."""
    if type(connector).__module__.startswith("unittest.mock"):
        return
    orig = getattr(connector, "update_state_after_alloc", None)
    if orig is None or getattr(orig, "_pdtrace_wrapped", False):
        return
    sides = [c for c in (connector, *getattr(connector, "_connectors", ()))
             if getattr(c, "connector_scheduler", None) is not None]

    def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: Any, *args: Any,
                                 **kwargs: Any) -> Any:
        out = orig(request, blocks, num_external_tokens, *args, **kwargs)
        if _RT.active:
            try:
                _after_connector_alloc(st, sides, request.request_id, num_external_tokens)
            except Exception as exc:
                _RT.fail("update_state_after_alloc", exc)
        return out

    update_state_after_alloc._pdtrace_wrapped = True  # type: ignore[attr-defined]
    connector.update_state_after_alloc = update_state_after_alloc


def _after_connector_alloc(st: SchedulerState, sides: list[Any], req_id: str, external: Any) -> None:
    """Note the admission's external tokens (for its blocks_alloc's `loaded`), and the read's destination blocks
    where a connector side decided them: kv_recv_dest now when the request's req_wait_kv is already recorded (a
    deferred load), else right after it (`_record_growth`)."""
    if external:
        st.loaded[req_id] = int(external)
    for side in sides:
        table = getattr(side.connector_scheduler, "_reqs_need_recv", None)
        entry = table.get(req_id) if isinstance(table, dict) else None
        if not entry or len(entry) < 2:
            continue
        ids = entry[1]
        if ids and isinstance(ids[0], (list, tuple)):  # one list per KV cache group
            ids = [b for group in ids for b in group]
        ids = [int(b) for b in ids if b]  # the null block is no destination
        if not ids:
            continue  # a full local hit: nothing is read
        if req_id in st.waiting_kv:
            st.ch.emit("kv_recv_dest", step=st.cur_step, req=req_id, blocks=ids, n=int(external or 0))
        else:
            st.recv_dest[req_id] = ids
        return


def _table_blocks(st: SchedulerState, req_id: str) -> list[Any]:
    """The request's current blocks over all KV cache groups, null blocks left out."""
    tbl0 = st.tbl0
    if tbl0 is not None:
        blocks = tbl0.get(req_id)
        return [b for b in blocks if not b.is_null] if blocks else []
    out: list[Any] = []
    for table in st.tables:
        blocks = table.get(req_id)
        if blocks:
            out.extend(b for b in blocks if not b.is_null)
    return out


def _growth(st: SchedulerState, req_id: str) -> list[int] | None:
    """Block ids the request's table gained since last recorded (None if none), and remember its new length."""
    known = st.known
    tbl0 = st.tbl0
    if tbl0 is not None:
        blocks = tbl0.get(req_id)
        n = len(blocks) if blocks else 0
        k = known.get(req_id, 0)
        if n == k:
            return None
        known[req_id] = n
        if n < k:
            return None
        return [b.block_id for b in blocks[k:] if not b.is_null]
    lengths = tuple(len(t.get(req_id) or ()) for t in st.tables)
    previous = known.get(req_id) or (0,) * len(lengths)
    if lengths == previous:
        return None
    known[req_id] = lengths
    ids: list[int] = []
    for table, n0, n in zip(st.tables, previous, lengths):
        if n > n0:
            ids.extend(b.block_id for b in table[req_id][n0:] if not b.is_null)
    return ids


def _opening_detail(st: SchedulerState, req_id: str, hit: int, computed: Any) -> dict[str, int] | None:
    """The detail of a blocks_alloc that opens a request's table (its admission, or its resumption after a
    preemption): `hit` (leading prefix-cache hits), `computed` (the request's num_computed_tokens when the step
    starts: the tokens the step reads as already in its KV) and `loaded` (external tokens a connector reported for
    this admission), each only where non-zero (a new request without hits gets no detail, as before)."""
    detail: dict[str, int] = {}
    if hit:
        detail["hit"] = hit
    if computed:
        detail["computed"] = int(computed)
    loaded = st.loaded.pop(req_id, 0) if st.loaded else 0
    if loaded:
        detail["loaded"] = loaded
    return detail or None


def _record_growth(st: SchedulerState, req_id: str, wait_kv_request: Any = None, computed: Any = None) -> None:
    """blocks_alloc for the table's growth (detail `hit` for an admission with a local prefix hit; `computed` and
    `loaded` where it opens the table, `computed` given); with `wait_kv_request`, also req_wait_kv (blocks past the
    hit, n = external tokens), then kv_recv_dest where the connector already decided the read's destination."""
    previous = st.known.get(req_id)
    opening = not previous or (isinstance(previous, tuple) and not any(previous))
    ids = _growth(st, req_id) or []
    hit_info = st.hits.pop(req_id, None)
    hit = min(hit_info[0], len(ids)) if hit_info else 0
    if wait_kv_request is None:
        if ids:
            st.ch.emit("blocks_alloc", step=st.cur_step, req=req_id, blocks=ids,
                       detail=_opening_detail(st, req_id, hit, computed) if opening and computed is not None
                       else {"hit": hit} if hit else None)
        return
    if ids:
        st.ch.emit("blocks_alloc", step=st.cur_step, req=req_id, blocks=ids,
                   detail={"hit": hit, "external": len(ids) - hit})
    if st.loaded:
        st.loaded.pop(req_id, None)  # an asynchronous load: req_wait_kv's n says it
    local_tokens = hit_info[1] if hit_info else 0
    st.waiting_kv.add(req_id)
    computed = wait_kv_request.num_computed_tokens  # 0 in 0.10 / 0.11: set when the read completes (n null)
    st.ch.emit("req_wait_kv", step=st.cur_step, req=req_id, blocks=ids[hit:],
               n=max(0, computed - local_tokens) if computed else None)
    dest = st.recv_dest.pop(req_id, None) if st.recv_dest else None
    if dest is not None:
        st.ch.emit("kv_recv_dest", step=st.cur_step, req=req_id, blocks=dest, n=computed - local_tokens
                   if computed else None)


def _record_step_growth(st: SchedulerState, so: Any) -> None:
    """blocks_alloc for one step, single KV cache group: from the block ids vLLM put in the SchedulerOutput (a new
    or resumed request's whole table, a running one's appended blocks), minus what was already recorded. A table
    that opens here (admission, resumption) gets `hit`, `computed` and `loaded` (`_opening_detail`)."""
    known = st.known
    hits = st.hits
    ch = st.ch
    step = st.cur_step
    for new_req in so.scheduled_new_reqs:
        req_id = new_req.req_id
        table = new_req.block_ids[0]
        k = known.get(req_id, 0)
        known[req_id] = len(table)
        ids = table[k:] if k else table
        if 0 in ids:  # null blocks (sliding-window tables) are not KV blocks
            ids = [b for b in ids if b]
        hit_info = hits.pop(req_id, None) if hits else None
        if ids:
            hit = min(hit_info[0], len(ids)) if hit_info and not k else 0
            ch.emit("blocks_alloc", step, req_id, ids, None, None, None, None, None,
                    None if k else _opening_detail(st, req_id, hit, getattr(new_req, "num_computed_tokens", None)))
    cached = so.scheduled_cached_reqs
    grew = cached.new_block_ids
    if any(grew):
        resumed = _resumed_ids(cached)
        # Only the requests that grew (compress in C: a step's few growths among dozens of running requests).
        counts = getattr(cached, "num_computed_tokens", None) or repeat(None)
        for (req_id, grown), computed in compress(zip(zip(cached.req_ids, grew), counts), grew):
            ids = grown[0]
            k = known.get(req_id, 0)
            if req_id in resumed:  # the whole table again
                known[req_id] = len(ids)
                ids = ids[k:]
                if 0 in ids:
                    ids = [b for b in ids if b]
                # A resumption looks its prefix up again (`_get_local_prefix_cache_hit`, num_computed_tokens 0):
                # its re-hits lead its new table, as an admission's do.
                hit_info = hits.pop(req_id, None) if hits else None
                if ids:
                    hit = min(hit_info[0], len(ids)) if hit_info and not k else 0
                    ch.emit("blocks_alloc", step, req_id, ids, None, None, None, None, None,
                            None if k else _opening_detail(st, req_id, hit, computed))
                continue
            known[req_id] = k + len(ids)
            if 0 in ids:
                ids = [b for b in ids if b]
            if ids:
                ch.emit("blocks_alloc", step, req_id, ids)


def _resumed_ids(cached: Any) -> Any:
    """The ids of the step's resumed requests: `resumed_req_ids` (0.11.1+), a flag per request before."""
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is None:
        resumed = {r for r, flag in zip(cached.req_ids, cached.resumed_from_preemption) if flag}
    return resumed


def _free_reason(st: SchedulerState, request: Any) -> str:
    reason = st.free_reason
    if reason is None:  # a finish (Scheduler._free_request -> _free_blocks)
        return "aborted" if _status_name(request.status) == "FINISHED_ABORTED" else "finished"
    if reason == "xfer":
        return "sent" if request.request_id in st.xfer_sending else "received"
    return reason


# ----------------------------------------------------------------------------------------------- scheduler


def _add_request_before(self: Any, request: Any) -> Any:
    st = _sched_state(self)
    req_id = request.request_id
    if req_id in self.requests:  # an existing id is a streaming-input chunk, not a new request
        return SKIP
    params = request.kv_transfer_params
    detail: Any = _ADD_LOCAL
    if params and params.get("do_remote_prefill"):
        detail = {"remote_prefill": True, "remote_decode": bool(params.get("do_remote_decode"))}
        detail["remote_instance"] = remote_instance(params.get("remote_engine_id"))
        detail["remote_req"] = params.get("remote_request_id")
        remote_blocks = params.get("remote_block_ids")
        if remote_blocks:
            if remote_blocks and isinstance(remote_blocks[0], (list, tuple)):
                remote_blocks = [b for group in remote_blocks for b in group]
            detail["remote_blocks"] = [int(b) for b in remote_blocks]
    elif params and params.get("do_remote_decode"):
        detail = _ADD_REMOTE_DECODE
    return st, req_id, request.num_prompt_tokens, detail


def _add_request_after(ctx: Any, self: Any, out: Any, request: Any) -> None:
    st, req_id, n_prompt, detail = ctx
    st.ch.emit("req_add", st.cur_step, req_id, None, n_prompt, None, None, None, None, detail)


_w_add_request = guarded("add_request", ("request",), _add_request_before, _add_request_after)


def _w_schedule(orig: Any) -> Any:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _RT.active:
            return orig(self, *args, **kwargs)
        try:
            st = _sched_state(self)
            step = st.next_step
            st.next_step = step + 1
            st.cur_step = step
            now = st.now
            t0 = now()
        except Exception as exc:
            _RT.fail("schedule", exc)
            return orig(self, *args, **kwargs)
        so = orig(self, *args, **kwargs)
        if _RT.active:
            try:
                dur = now() - t0
                setattr(so, STEP_ATTR, step)
                nst = so.num_scheduled_tokens
                # Which tables grew: new requests, and cached ones whose new_block_ids is not None (vLLM's own
                # "blocks added in this step", allow_none=True); `any` scans that list in C. The growth itself
                # is read from the table (prefix hits and external-token blocks included).
                if st.tbl0 is not None:
                    _record_step_growth(st, so)
                else:
                    for new_req in so.scheduled_new_reqs:
                        _record_growth(st, new_req.req_id, computed=getattr(new_req, "num_computed_tokens", None))
                    cached = so.scheduled_cached_reqs
                    if any(cached.new_block_ids):
                        resumed = _resumed_ids(cached)
                        for req_id, grown, computed in zip(cached.req_ids, cached.new_block_ids,
                                                           getattr(cached, "num_computed_tokens", None)
                                                           or repeat(None)):
                            if grown is not None:
                                _record_growth(st, req_id, computed=computed if req_id in resumed else None)
                st.ch.emit("sched", step, None, None, so.total_num_scheduled_tokens, None, None, None, None, {
                    "running": len(self.running),
                    "waiting": len(self.waiting) + (len(st.held) if st.held is not None else 0),
                    "waiting_kv": len(st.waiting_kv),
                    "free_blocks": self.kv_cache_manager.block_pool.get_num_free_blocks(),
                    "dur_ns": dur,
                })
                if nst:
                    st.ch.emit_counts("req_sched", step, nst)
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
            # The detail as the writer's JSON encoder writes {"wait_ns": <int>}: a str, not a dict the garbage
            # collector counts while it is buffered.
            st.eng.emit("step_output", step, None, None, None, None, None, None, None,
                        None if wait_ns is None else '{"wait_ns":%d}' % wait_ns)
            kvo = model_runner_output.kv_connector_output
            if kvo is not None:
                failed = getattr(kvo, "failed_recving", None)  # 0.30+
                if failed:
                    for req_id in failed:
                        st.ch.emit("kv_recv_fail", step=step, req=req_id)
                if getattr(kvo, "invalid_block_ids", None):
                    st.ch.emit("kv_recv_fail", step=step, blocks=sorted(kvo.invalid_block_ids))
        except Exception as exc:
            _RT.fail("update_from_output", exc)
            return orig(self, scheduler_output, model_runner_output)
        out = orig(self, scheduler_output, model_runner_output)  # on a vLLM error cur_step stays for engine_error
        st.cur_step = None
        if step is not None and not scheduler_output.total_num_scheduled_tokens and _RT.active:
            try:
                _coalesce_empty_step(st, step)
            except Exception as exc:
                _RT.fail("update_from_output", exc)
        return out

    return update_from_output


_STEP_KINDS = frozenset(("sched", "step_submit", "step_output"))
#: sched detail keys that must agree for a step to join a run (the coalesced row then holds for every step of it).
_RUN_SAME = ("running", "waiting", "waiting_kv", "free_blocks")
#: How far back from the newest row the run's head is looked for (a run leaves at most a few rows after it).
_RUN_WINDOW = 32
#: The longest stretch of time one coalesced row stands for: a later empty step heads a new run. A trace's end is
#: its last row's ts_ns, so an engine that steps idly (a delayed free or a KV wait pending) until it is stopped
#: still has its end, and the time its requests were held, right to within this (without it, to within the
#: writer's flush interval, 1 s, which made a leak with a short grace period come and go). Costs ~12 rows a second
#: of idle stepping at vLLM's ~1 kHz, against ~3000 uncoalesced.
RUN_MAX_SPAN_NS = 250_000_000


def _coalesce_empty_step(st: SchedulerState, step: int) -> None:
    """After the update of an empty step: fold it into the run's `sched` row when nothing but empty-step rows
    (`sched` with 0 tokens, `step_submit`, `step_output` of this scheduler) were recorded since that row, the step
    follows the run's last one, the row's counters still hold and the run spans less than `RUN_MAX_SPAN_NS`. Its
    three rows are removed from the recorder's buffer, the head's detail gets `empty_run` = k and the summed
    `dur_ns`. A row already taken by the writer is never touched: the next empty step then starts a new run.
    Otherwise this step's `sched` row heads a new run."""
    head, k = st.run_head, st.run_k
    sched_id, engine_id = st.ch.channel_id, st.eng.channel_id

    def edit(rows: RowView) -> tuple[tuple | None, int]:
        mine: list[int] = []  # this step's rows, newest first
        sched_at = head_at = -1
        i = len(rows) - 1
        stop = max(-1, i - _RUN_WINDOW)
        while i > stop:
            row = rows[i]
            if row == head:  # by value: the view's rows are new tuples (the head: one step's sched row, unique)
                head_at = i
                break
            cid = row[1]
            if row[2] not in _STEP_KINDS or (cid != sched_id and cid != engine_id) or row[3] is None:
                break
            if row[2] == "sched" and row[6]:
                break
            if row[3] == step:
                mine.append(i)
                if row[2] == "sched":
                    sched_at = i
            i -= 1
        if sched_at < 0:  # this step's sched row is behind other events, or already written
            return None, 0
        row = rows[sched_at]
        if (head_at >= 0 and step == head[3] + k and isinstance(head[11], dict) and isinstance(row[11], dict)
                and rows[mine[0]][0] - head[0] < RUN_MAX_SPAN_NS):
            hd, sd = head[11], row[11]
            if all(hd.get(key) == sd.get(key) for key in _RUN_SAME):
                detail = dict(hd)
                detail["empty_run"] = k + 1
                if "dur_ns" in hd and "dur_ns" in sd:
                    detail["dur_ns"] = hd["dur_ns"] + sd["dur_ns"]
                new_head = head[:11] + (detail,)
                rows[head_at] = new_head
                for j in mine:
                    del rows[j]
                return new_head, k + 1
        return row, 1

    st.run_head, st.run_k = st.rec.edit_recent(edit)


def _preempt_before(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    st = _sched_state(self)
    st.ch.emit("req_preempt", step=st.cur_step, req=request.request_id)
    previous, st.free_reason = st.free_reason, "preempted"
    return st, previous


def _restore_free_reason(ctx: Any) -> None:
    st, st.free_reason = ctx


#: (request, timestamp) in 0.12+, (request) before: the parameters pass through as given.
_w_preempt_request = guarded("_preempt_request", None, _preempt_before, restore=_restore_free_reason)


def _w_finish_requests(orig: Any) -> Any:
    # The abort/error path (rare). vLLM delays the free of a request aborted while WAITING_FOR_REMOTE_KVS unless
    # its load never started or already finished (scheduler.py:3015-3024): note that before vLLM forgets it.
    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        if _RT.active:
            try:
                st = _sched_state(self)
                if isinstance(request_ids, str):
                    ids: Any = (request_ids,)
                elif request_ids is None:
                    ids = list(self.requests)
                else:
                    request_ids = ids = list(request_ids)  # may be a one-shot iterable: read it once
                for req_id in ids:
                    req = self.requests.get(req_id)
                    if req is not None and _status_name(req.status) == "WAITING_FOR_REMOTE_KVS":
                        st.abort_delay[req_id] = (req_id not in getattr(self, "deferred_loads", ())  # 0.33+
                                                  and req_id not in self.finished_recving_kv_req_ids)
            except Exception as exc:
                _RT.fail("finish_requests", exc)
        return orig(self, request_ids, finished_status)

    return finish_requests


def _connector_finished_after(ctx: Any, self: Any, out: Any, request: Any) -> None:
    # Only a finished request finishes here: vLLM's tests also call it on a running one, for its
    # sliding-window prune (test_swa_inflight_window_free), which the remove_skipped_blocks hook records.
    if not request.is_finished():
        return
    st = _sched_state(self)
    req_id = request.request_id
    st.waiting_kv.discard(req_id)
    st.hits.pop(req_id, None)
    if st.loaded:
        st.loaded.pop(req_id, None)
    if st.recv_dest:
        st.recv_dest.pop(req_id, None)
    delay = bool(out[0])
    if st.abort_delay:
        delay = st.abort_delay.pop(req_id, False) or delay
    st.ch.emit("req_finish", st.cur_step, req_id, None, None, _finish_reason(request),
               _status_name(request.status), delay)


# Every finish passes here (Scheduler._free_request, before it frees anything), HMA connectors or not, and
# without a connector too: req_finish lands before the request's blocks_free.
_w_connector_finished = guarded("_connector_finished", ("request",), after=_connector_finished_after)


def _xfer_finished_before(self: Any, kv_connector_output: Any) -> Any:
    st = _sched_state(self)
    step = st.cur_step
    requests = self.requests
    recving = kv_connector_output.finished_recving or ()
    sending = kv_connector_output.finished_sending or ()
    # Emitted before vLLM acts: its asserts (scheduler.py:3571/3577/3581, _free_blocks:3065) would
    # otherwise take the evidence with them.
    for req_id in recving:
        req = requests.get(req_id)
        st.ch.emit("kv_recv_done", step, req_id, None, None, None,
                   "unknown" if req is None else _status_name(req.status))
    for req_id in sending:
        req = requests.get(req_id)
        st.ch.emit("kv_send_done", step, req_id, None, None, None,
                   "unknown" if req is None else _status_name(req.status))
    previous = (st.free_reason, st.xfer_sending)
    st.free_reason, st.xfer_sending = "xfer", frozenset(sending)
    return st, previous


def _xfer_finished_restore(ctx: Any) -> None:
    st, (st.free_reason, st.xfer_sending) = ctx


_w_update_from_kv_xfer_finished = guarded("_update_from_kv_xfer_finished", ("kv_connector_output",),
                                          _xfer_finished_before, restore=_xfer_finished_restore)


def _waiting_for_remote_kv_before(self: Any, request: Any) -> Any:
    st = _sched_state(self)
    st.waiting_kv.discard(request.request_id)
    previous, st.free_reason = st.free_reason, "load_failed"  # its only free is the failed-load path
    return st, previous


_w_update_waiting_for_remote_kv = guarded("_update_waiting_for_remote_kv", ("request",),
                                          _waiting_for_remote_kv_before, restore=_restore_free_reason)


def _drain_before(self: Any) -> Any:
    pending = self.deferred_frees
    if not pending:
        return SKIP
    return _sched_state(self), list(pending)


def _drain_after(ctx: Any, self: Any, out: Any) -> None:
    st, before = ctx
    drained = before[: len(before) - len(self.deferred_frees)]  # popleft only, nothing appended
    seen: set[int] = set()
    for fence, blocks in drained:
        ids = [b.block_id for b in blocks
               if b.ref_cnt == 0 and not b.is_null and b.block_id not in seen]
        if ids:
            seen.update(ids)
            st.ch.emit("blocks_pool_free", step=st.cur_step, blocks=ids, detail={"fence": fence})


_w_drain_deferred_frees = guarded("_drain_deferred_frees", (), _drain_before, _drain_after)


# ------------------------------------------------------------------------------------- KV cache manager, pool


def _note_prefix_hit(st: SchedulerState, request: Any, out: Any) -> None:
    """Remember a request's local prefix hit from a (KVCacheBlocks, hit tokens) answer, or forget a stale one."""
    if out[1]:
        hit = sum(1 for group in out[0].blocks for b in group if not b.is_null)
        st.hits[request.request_id] = (hit, int(out[1]))
    elif st.hits:
        st.hits.pop(request.request_id, None)


def _w_get_local_prefix_cache_hit(orig: Any) -> Any:
    # Called once per admission attempt from the waiting queue (not per running request).
    if takes_exactly(orig, (("request", REQUIRED), ("max_cache_hit_length", None))):  # 0.33 (takes_exactly)
        def _get_local_prefix_cache_hit(self: Any, request: Any, max_cache_hit_length: Any = None) -> Any:
            out = orig(self, request, max_cache_hit_length)
            if _RT.active:
                _prefix_hit_seen(self, request, out)
            return out

        return _get_local_prefix_cache_hit

    def _get_local_prefix_cache_hit_any(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, request, *args, **kwargs)
        if _RT.active:
            _prefix_hit_seen(self, request, out)
        return out

    return _get_local_prefix_cache_hit_any


def _prefix_hit_seen(sched: Any, request: Any, out: Any) -> None:
    try:
        _note_prefix_hit(_sched_state(sched), request, out)
    except Exception as exc:
        _RT.fail("_get_local_prefix_cache_hit", exc)


def _w_set_kv_fetch_stage(orig: Any) -> Any:
    # vLLM's, at call time: a hook table imports no vLLM at load (hooks patch vLLM's modules as they load)
    from vllm.v1.metrics.stats import KV_FETCH_IN_PROGRESS

    # "in_progress" is set right after the request became WAITING_FOR_REMOTE_KVS with its blocks allocated and
    # num_computed_tokens = local hit + external tokens (scheduler.py:1513-1543), whatever log_stats says.
    def after(ctx: Any, self: Any, out: Any, request: Any, stage: Any) -> None:
        if stage == KV_FETCH_IN_PROGRESS:
            _record_growth(_sched_state(self), request.request_id, wait_kv_request=request)

    return guarded("_set_kv_fetch_stage", ("request", "stage"), after=after)(orig)


def _record_pool_return(st: SchedulerState, req_id: str, given_up: list[Any]) -> None:
    """blocks_pool_free for the blocks a request just gave up whose ref count reached 0 (shared prefix blocks stay
    referenced by their other owners), tail first as vLLM frees them."""
    ids = [b.block_id for b in reversed(given_up) if b.ref_cnt == 0 and not b.is_null]
    if ids:
        st.ch.emit("blocks_pool_free", st.cur_step, req_id, ids)


def _kvm_free_before(self: Any, request: Any) -> Any:
    st = state_get(id(self))
    if st is None:
        return SKIP
    req_id = request.request_id
    known = st.known.pop(req_id, 0)
    tbl0 = st.tbl0
    if tbl0 is not None:
        # One pass for the ids; the pool return below reads the same list (vLLM pops it from the table,
        # it does not change it), null blocks skipped there as here.
        blocks = tbl0.get(req_id)
        ids = [b.block_id for b in blocks if not b.is_null] if blocks else None
        if blocks and len(blocks) > known:  # grown in this very step (then preempted): growth first
            grown = [b.block_id for b in blocks[known:] if not b.is_null]
            if grown:
                st.ch.emit("blocks_alloc", st.cur_step, req_id, grown)
    else:
        if known:
            st.known[req_id] = known
        _record_growth(st, req_id)
        st.known.pop(req_id, None)
        blocks = _table_blocks(st, req_id)
        ids = [b.block_id for b in blocks]
    if ids:
        st.ch.emit("blocks_free", st.cur_step, req_id, ids, None, _free_reason(st, request), None, None,
                   False)
    return st, req_id, ids, blocks


def _kvm_free_after(ctx: Any, self: Any, out: Any, request: Any) -> None:
    st, req_id, ids, blocks = ctx
    if ids:
        _record_pool_return(st, req_id, blocks)


# Immediate frees: the owner's blocks_free first, then blocks_pool_free for the blocks whose ref count reached
# 0 in this call (shared prefix blocks stay referenced by their other owners).
_w_kvm_free = guarded("KVCacheManager.free", ("request",), _kvm_free_before, _kvm_free_after)


def _pop_blocks_before(self: Any, request: Any) -> None:
    st = state_get(id(self))
    if st is None:
        return
    req_id = request.request_id
    _record_growth(st, req_id)
    st.known.pop(req_id, None)
    blocks = _table_blocks(st, req_id)
    if blocks:
        st.ch.emit("blocks_free", step=st.cur_step, req=req_id, blocks=[b.block_id for b in blocks],
                   deferred=True, reason=_free_reason(st, request),
                   detail={"fence": st.sched().sched_step_seq})


# Only the deferred path of Scheduler._free_request_blocks calls this (scheduler.py:3084-3093); the blocks go
# back to the pool in _drain_deferred_frees once the fence step is processed.
_w_pop_blocks_for_free = guarded("KVCacheManager.pop_blocks_for_free", ("request",), _pop_blocks_before)


def _cow_before(self: Any, blocks: Any, fence_seq: Any) -> int:
    return len(self.deferred_frees)


def _cow_after(parked: int, self: Any, out: Any, blocks: Any, fence_seq: Any) -> None:
    if len(self.deferred_frees) == parked:
        ids = [b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null]
        if ids:
            st = _sched_state(self)
            st.ch.emit("blocks_pool_free", step=st.cur_step, blocks=ids, detail={"cow": True})


# Copy-on-write retentions released (rare): straight to the pool, or parked in deferred_frees (then reported
# by the drain like any deferred free).
_w_free_cow_retained_blocks = guarded("_free_cow_retained_blocks", ("blocks", "fence_seq"), _cow_before, _cow_after)


def _trims_blocks(manager: Any) -> bool:
    """Whether a KV cache group's manager can give blocks up while the request runs (sliding window, chunked
    local attention, Mamba): it overrides the no-op trimming of the base class (0.11+) or, in 0.10, whose base
    method is abstract, of FullAttentionManager; 0.10 has no get_num_skipped_tokens."""
    # vLLM's, at call time: a hook table imports no vLLM at load (hooks patch vLLM's modules as they load)
    from vllm.v1.core import single_type_kv_cache_manager as managers

    cls, no_ops = type(manager), (managers.SingleTypeKVCacheManager, managers.FullAttentionManager)
    return any(all(getattr(cls, name, None) is not getattr(base, name, None) for base in no_ops)
               for name in ("get_num_skipped_tokens", "remove_skipped_blocks"))


#: Whether a coordinator whose managers trim has had its state made in this process: from then on the class keeps
#: its remove_skipped_blocks wrapper.
_TRIMMING_SEEN = False
#: Classes whose remove_skipped_blocks wrapper is set aside (vLLM's own method in its place) -> that wrapper.
_SET_ASIDE: dict[type, Any] = {}


def _trimming_hook_needed(coordinator: Any, trims: bool) -> None:
    """Keep the remove_skipped_blocks wrapper on the coordinator's class only while a coordinator that trims exists.

    allocate_slots calls remove_skipped_blocks for every scheduled request in every step (17 230 calls in a
    580-step run of bench/engine_overhead.py, the most of any hook), and a full-attention model never trims. So
    while no coordinator of this process trims, vLLM's own method goes back on the class (no wrapper frame); the
    first that trims puts the wrapper back, for good (the wrapper, seeing no state, passes the others through).
    Per class, not per instance: a method bound on the instance would add an attribute to it (see _common._STATES:
    that costs more than the wrapper). A state is made at a scheduler's first hooked call (add_request or
    schedule), before it allocates anything; a reverted table leaves vLLM's method in place either way."""
    global _TRIMMING_SEEN
    name = "remove_skipped_blocks"
    if trims:
        _TRIMMING_SEEN = True
        for cls, wrapper in list(_SET_ASIDE.items()):
            if cls.__dict__.get(name) is getattr(wrapper, ORIGINAL_ATTR, None):
                setattr(cls, name, wrapper)
        _SET_ASIDE.clear()
        return
    if _TRIMMING_SEEN:
        return
    for cls in type(coordinator).__mro__:
        func = cls.__dict__.get(name)
        if func is None:
            continue
        original = getattr(func, ORIGINAL_ATTR, None)
        if original is not None:
            _SET_ASIDE[cls] = func
            setattr(cls, name, original)
        return


def _w_remove_skipped_blocks(orig: Any) -> Any:
    # Trimming while the request runs: KVCacheManager.allocate_slots and Scheduler._connector_finished call it
    # through the coordinator; the managers put the null block in place of each out-of-window block and give it
    # back to the pool. Recorded as blocks_free reason `skipped` (table order), then blocks_pool_free for those
    # whose ref count reached 0. No growth is pending at these calls (allocate_slots trims before it allocates;
    # a finish comes after the step's growth was recorded). Coordinators whose managers never trim carry no state;
    # while none of this process trims, vLLM's own method stands in the class in place of this wrapper
    # (_trimming_hook_needed).
    if takes_exactly(orig, _TRIM_PARAMS):  # 0.33 (see takes_exactly: ~230 ns per call less)
        def remove_skipped_blocks(self: Any, request_id: Any, processed_computed_tokens: Any,
                                  num_prompt_tokens: Any = None) -> Any:
            st = state_get(id(self))
            if st is None or not _RT.active:
                if st is None and not _TRIMMING_SEEN:
                    _no_state_yet(self)
                return orig(self, request_id, processed_computed_tokens, num_prompt_tokens)
            return _trim_and_record(st, orig, self, request_id, (processed_computed_tokens, num_prompt_tokens), {})

        return remove_skipped_blocks

    def remove_skipped_blocks_any(self: Any, request_id: Any, *args: Any, **kwargs: Any) -> Any:  # other releases
        st = state_get(id(self))
        if st is None or not _RT.active:
            if st is None and not _TRIMMING_SEEN:
                _no_state_yet(self)
            return orig(self, request_id, *args, **kwargs)
        return _trim_and_record(st, orig, self, request_id, args, kwargs)

    return remove_skipped_blocks_any


def _no_state_yet(coordinator: Any) -> None:
    """A coordinator called before any state of this process was made (hooks installed with recording off, or
    switched off before the first scheduler call): set the wrapper aside as a scheduler's first state would
    (`_trimming_hook_needed`), so that recording off costs no wrapper frame per allocate_slots either."""
    try:
        _trimming_hook_needed(coordinator, any(_trims_blocks(m) for m in coordinator.single_type_managers))
    except Exception as exc:
        _RT.fail("remove_skipped_blocks", exc)


#: vLLM 0.33's KVCacheCoordinator.remove_skipped_blocks parameters (0.10: request_id, num_computed_tokens).
_TRIM_PARAMS = (("request_id", REQUIRED), ("processed_computed_tokens", REQUIRED), ("num_prompt_tokens", None))


def _trim_and_record(st: SchedulerState, orig: Any, coordinator: Any, request_id: Any, args: tuple,
                     kwargs: dict) -> Any:
    """remove_skipped_blocks while recording: vLLM's call, with blocks_free `skipped` + blocks_pool_free for what
    it took out of the request's tables."""
    try:
        tables = [m.req_to_blocks.get(request_id) for m in coordinator.single_type_managers]
        before = [list(t) if t else None for t in tables]
    except Exception as exc:
        _RT.fail("remove_skipped_blocks", exc)
        return orig(coordinator, request_id, *args, **kwargs)
    out = orig(coordinator, request_id, *args, **kwargs)
    if _RT.active:
        try:
            trimmed = []
            for manager, table, old in zip(coordinator.single_type_managers, tables, before):
                if not old:
                    continue
                at = [i for i, (b, now) in enumerate(zip(old, table)) if now is not b and not b.is_null]
                if at:
                    trimmed.append((manager, [old[i] for i in at], at[-1]))
            if trimmed:
                basis = args[0] if args else next(iter(kwargs.values()), None)
                for manager, freed, last in trimmed:  # one row per KV cache group that gave blocks up
                    st.ch.emit("blocks_free", st.cur_step, request_id, [b.block_id for b in freed], None,
                               "skipped", None, None, False, _trim_detail(st, request_id, manager, last, basis))
                _record_pool_return(st, request_id, [b for _, freed, _ in trimmed for b in freed])
        except Exception as exc:
            _RT.fail("remove_skipped_blocks", exc)
    return out


def _trim_detail(st: SchedulerState, request_id: Any, manager: Any, last: int, basis: Any) -> dict[str, int]:
    """What a trim was computed on, for premature_free to tell whether a step still in flight reads the trimmed
    blocks (vllm#47282: trims on the optimistic token count under async scheduling): `window` (the group's sliding
    window in tokens, where it is one), `block_size` (the group's), `upto` (every trimmed block holds only tokens
    below it: the end of the last trimmed block), `tokens` (the count vLLM trimmed on: `processed_computed_tokens`
    since vllm#47728, before that the request's optimistic `num_computed_tokens`), `computed` (the request's
    `num_computed_tokens` at the trim, tokens of the steps in flight included). Keys that cannot be read are left
    out. Only a call that trimmed builds it (at most one per block of a request's tokens)."""
    detail: dict[str, int] = {}
    window = getattr(manager, "sliding_window", None)
    if isinstance(window, int):
        detail["window"] = window
    block_size = getattr(manager, "block_size", None)
    if isinstance(block_size, int):
        detail["block_size"] = block_size
        detail["upto"] = (last + 1) * block_size
    if isinstance(basis, int):
        detail["tokens"] = basis
    sched = st.sched()
    request = getattr(sched, "requests", {}).get(request_id) if sched is not None else None
    computed = getattr(request, "num_computed_tokens", None)
    if isinstance(computed, int):
        detail["computed"] = computed
    return detail


# ------------------------------------------------------------------------------------------------ engine loop


def _engine_state(engine: Any) -> SchedulerState:
    """At the first step: the scheduler's state, and the executor instance wrapped (it did not exist when the
    plugin ran inside EngineCore.__init__)."""
    st = _sched_state(engine.scheduler)
    if not st.engine_attached:
        st.engine_attached = True
        _wrap_executor(engine, engine.model_executor, st)
    attach_state(engine, st)
    return st


def _timed_future(future: Any, st: SchedulerState) -> None:
    """Time the wait in `future.result()` into `st.wait_ns`, through an instance attribute that reaches the future
    only by a weak reference. A bound `future.result` kept in the future's own __dict__ made a reference cycle per
    future (vLLM never calls `result()` on a forward step's execute_model future), so each future, its condition
    and its output lived until the cyclic GC ran: in a 600-step run of bench/engine_overhead.py the loop made 72
    young collections (3 without recording), 41 with this; GC time in the loop 18 -> 10 ms (-2 % of it)."""
    try:
        future_ref = weakref.ref(future)
        result = type(future).result
    except TypeError:  # a future type without weak references: no wait_ns, nothing else lost
        return
    now = st.now

    def timed_result(*args: Any, **kwargs: Any) -> Any:
        t0 = now()
        try:
            return result(future_ref(), *args, **kwargs)
        finally:
            st.wait_ns = (st.wait_ns or 0) + (now() - t0)

    try:
        future.result = timed_result
    except Exception:  # a future type that takes no attributes: no wait_ns, nothing else lost
        pass


def _wrap_executor(engine: Any, executor: Any, st: SchedulerState) -> None:
    execute_model = executor.execute_model
    sample_tokens = getattr(executor, "sample_tokens", None)  # 0.28+: the step's second RPC

    def wrapped_execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if _RT.active:
            try:
                queue = engine.batch_queue  # a deque; a queue.Queue in 0.10
                st.eng.emit("step_submit", step=getattr(scheduler_output, STEP_ATTR, None),
                            n=1 if queue is None else (queue.qsize() if hasattr(queue, "qsize") else len(queue)) + 1)
            except Exception as exc:
                _RT.fail("execute_model", exc)
        if sample_tokens is None and _RT.active:  # 0.10 / 0.11.0: the model runs and samples in this one call
            t0 = st.now()
            out = execute_model(scheduler_output, *args, **kwargs)
            if isinstance(out, Future):  # 0.10's executor whenever batches are queued (no non_block argument)
                _timed_future(out, st)
            else:
                st.wait_ns = (st.wait_ns or 0) + (st.now() - t0)
            return out
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
        now = st.now
        t0 = now()
        try:
            return sample_tokens(grammar_output, *args, **kwargs)
        finally:
            st.wait_ns = (st.wait_ns or 0) + (now() - t0)

    executor.execute_model = wrapped_execute_model
    if sample_tokens is not None:
        executor.sample_tokens = wrapped_sample_tokens


def _record_engine_error(st: Any, exc: BaseException, where: str, **more: Any) -> None:
    """engine_error for what vLLM raised in `where`, flushed at once (the process is likely to die next)."""
    st.eng.emit("engine_error", step=st.cur_step,
                detail={"error": f"{type(exc).__name__}: {exc}", "where": where, **more})
    st.cur_step = None
    st.rec.flush()


def _w_engine_step(where: str) -> Any:
    # The ~9 us per step this wrapper seemed to cost (cProfile of bench/engine_overhead.py: 18-21 ms tottime over
    # 580 steps) is not its own: the profiler charges the freeing of a callee's locals, which happens after the
    # callee's return event, to the caller. A function that builds and drops 2000 objects shows 42 us tottime per
    # call in its one-line wrapper under cProfile, and 119.5 us per call with or without the wrapper (timeit).
    # What the frame does per step (a global and a slot read, one dict lookup) is ~0.1 us.
    def factory(orig: Any) -> Any:
        def step(self: Any) -> Any:
            st = None
            if _RT.active:
                try:
                    st = state_get(id(self)) or _engine_state(self)
                except Exception as exc:
                    _RT.fail(where, exc)
            try:
                return orig(self)
            except Exception as exc:
                if st is not None and _RT.active:
                    try:
                        _record_engine_error(st, exc, where)
                    except Exception as inner:
                        _RT.fail(where, inner)
                raise

        return step

    return factory


def _w_handle_client_request(orig: Any) -> Any:
    # The busy loop handles client input between steps (EngineCoreProc._process_input_queue, core.py:1647): an ADD
    # or ABORT that raises in the scheduler (e.g. its "duplicate request id" assert), or EXECUTOR_FAILED, ends the
    # loop as surely as a step does. Aborts drained inside a step (_process_aborts_queue) are the step wrapper's;
    # the preprocess path (input thread) answers its errors per request and never reaches here. Nothing is done
    # unless vLLM raises: a client request costs one extra Python call.
    def _handle_client_request(self: Any, request_type: Any, request: Any) -> Any:
        try:
            return orig(self, request_type, request)
        except Exception as exc:
            if _RT.active:
                try:
                    st = state_get(id(self)) or _sched_state(self.scheduler)
                    kind = getattr(request_type, "name", str(request_type))
                    more = {"req": str(request[0].request_id)} if kind == "ADD" else {}
                    _record_engine_error(st, exc, "_handle_client_request", request=kind, **more)
                except Exception as inner:
                    _RT.fail("_handle_client_request", inner)
            raise

    return _handle_client_request


# --------------------------------------------------------------------------------------------------- executor


def _w_executor_init(orig: Any) -> Any:
    # The engine's executor starts its workers inside this call: the engine's identity is fixed first, for the
    # scheduler and for every worker (see _common.fix_engine_identity). Done whether or not recording is on at this
    # moment (once per engine; the pytest plugin switches recording on per test, after an engine may exist).
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            fix_engine_identity(vllm_config)
        except Exception as exc:
            _RT.fail("Executor.__init__", exc)
        return orig(self, vllm_config, *args, **kwargs)

    return __init__


# ---------------------------------------------------------------------------------------------------- workers


def _worker_ranks() -> tuple[int | None, int | None]:
    """(pp_rank, tp_rank) from vLLM's process groups; (None, None) where they are not initialised."""
    try:
        # vLLM's, at call time: a hook table imports no vLLM at load (hooks patch vLLM's modules as they load)
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_pp_group().rank_in_group), int(get_tp_group().rank_in_group)
    except Exception:
        return None, None


def _worker_state(obj: Any) -> WorkerState:
    """A worker's (or model runner's) channels, opened at its first step: the plugin ran before distributed init,
    so the ranks are read here."""
    wst = state_get(id(obj))
    if wst is None:
        instance, role, dp_rank = instance_of(obj.vllm_config, worker=True)
        rec = session.recorder(instance, role, dp_rank)
        pp_rank, tp_rank = _worker_ranks()
        wst = WorkerState(rec.channel("worker", pp_rank=pp_rank, tp_rank=tp_rank),
                          rec.channel("connector", pp_rank=pp_rank, tp_rank=tp_rank))
        attach_state(obj, wst)
    return wst


def _rank_completions(wst: WorkerState, output: Any, step: int | None) -> None:
    if output is None:
        return
    get_kvo = getattr(output, "get_kv_connector_output", None)  # AsyncModelRunnerOutput: do not block on it
    if get_kvo is not None:
        kvo = get_kvo()
    else:
        # Before 0.33 the async output has no accessor: AsyncGPUModelRunnerOutput keeps the step's
        # ModelRunnerOutput in `_model_runner_output` (0.28-0.32 gpu_model_runner.py, its __init__).
        kvo = getattr(getattr(output, "_model_runner_output", output), "kv_connector_output", None)
    if kvo is None:
        return
    if kvo.finished_sending:
        for req_id in kvo.finished_sending:
            wst.conn.emit("kv_send_rank", step=step, req=req_id)
    if kvo.finished_recving:
        for req_id in kvo.finished_recving:
            wst.conn.emit("kv_recv_rank", step=step, req=req_id)


def _execute_model_before(self: Any, scheduler_output: Any) -> Any:
    global _RPC_OPEN
    wst = _worker_state(self)
    step = getattr(scheduler_output, STEP_ATTR, None)
    n = scheduler_output.total_num_scheduled_tokens
    wst.step, wst.n = step, n
    wst.ch.emit("exec_begin", step=step, n=n)
    _RPC_OPEN = wst  # the PP waits inside this RPC are recorded against it (_w_pp_wait)
    return wst, step, n


def _execute_model_restore(ctx: Any) -> None:
    global _RPC_OPEN
    _RPC_OPEN = None


def _execute_model_after(ctx: Any, self: Any, out: Any, scheduler_output: Any) -> None:
    wst, step, n = ctx
    wst.ch.emit("exec_end", step=step, n=n, detail=_RPC_EXECUTE)
    _rank_completions(wst, out, step)


_w_worker_execute_model = guarded("Worker.execute_model", ("scheduler_output",), _execute_model_before,
                                  _execute_model_after, _execute_model_restore)


#: The worker whose execute_model runs now in this process (a worker process runs one RPC at a time), else None:
#: a PP wait outside an RPC (none in vLLM's workers) or nested in an outer one being timed is not recorded.
_RPC_OPEN: WorkerState | None = None


def _w_pp_wait(reason: str) -> Any:
    """A wrapper factory for a call inside execute_model that blocks on another PP stage: exec_wait_begin /
    exec_wait_end (reason `pp_recv` or `pp_send`) around it, on the rank's worker channel, at the RPC's step. The
    receive of the previous stage's tensors: `GroupCoordinator.recv_tensor_dict` (0.10-0.17: receives everything),
    `irecv_tensor_dict` (0.26+: blocks on the metadata, which the previous stage sends when its forward is done;
    the tensors' handles are waited later, `AsyncIntermediateTensors.wait_for_comm`). The send: `send_tensor_dict`
    (synchronous before 0.26). One clock pair per call (the recorder's); nested calls (0.26+'s recv_tensor_dict
    calls irecv_tensor_dict) are timed once, by the outer one."""

    def factory(orig: Any) -> Any:
        def pp_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            global _RPC_OPEN
            wst = _RPC_OPEN
            if wst is None or not _RT.active:
                return orig(self, *args, **kwargs)
            step = wst.step
            wst.ch.emit("exec_wait_begin", step=step, reason=reason)  # emit never raises
            _RPC_OPEN = None
            try:
                return orig(self, *args, **kwargs)
            finally:
                _RPC_OPEN = wst
                wst.ch.emit("exec_wait_end", step=step, reason=reason)

        return pp_wait

    return factory


def _w_wait_for_comm(orig: Any) -> Any:
    # 0.26+: the receive's tensor handles, waited on first use of `.tensors` inside the forward; once per RPC.
    timed = _w_pp_wait("pp_recv")(orig)

    def wait_for_comm(self: Any) -> Any:
        if _RPC_OPEN is None or object.__getattribute__(self, "_comm_waited"):
            return orig(self)
        return timed(self)

    return wait_for_comm


def _sample_tokens_before(self: Any, grammar_output: Any) -> Any:
    wst = _worker_state(self)
    step, n = wst.step, wst.n
    wst.ch.emit("exec_begin", step=step, n=n)
    return wst, step, n


def _sample_tokens_after(ctx: Any, self: Any, out: Any, grammar_output: Any) -> None:
    wst, step, n = ctx
    wst.ch.emit("exec_end", step=step, n=n, detail=_RPC_SAMPLE)
    _rank_completions(wst, out, step)


# sample_tokens carries no SchedulerOutput; it always follows its step's execute_model on this worker.
_w_worker_sample_tokens = guarded("Worker.sample_tokens", ("grammar_output",), _sample_tokens_before,
                                  _sample_tokens_after)


def _batch_add_reason(req_id: str, new_ids: Any, resumed: Any) -> str:
    """Why a request (re)joins the persistent batch: `new`; `resumed` after a preemption (the scheduler says so);
    `rescheduled` when it was only left out of earlier steps (removed as `unscheduled`, its state kept)."""
    return "new" if req_id in new_ids else "resumed" if req_id in resumed else "rescheduled"


def _update_states_before(self: Any, scheduler_output: Any) -> Any:
    return _worker_state(self), set(self.input_batch.req_id_to_index)


def _update_states_after(ctx: Any, self: Any, out: Any, scheduler_output: Any) -> None:
    wst, before = ctx
    after = self.input_batch.req_id_to_index.keys()
    removed = before - after
    added = after - before
    if removed or added:
        step = getattr(scheduler_output, STEP_ATTR, None)
        finished = scheduler_output.finished_req_ids
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()  # 0.11.1+
        for req_id in removed:
            reason = ("finished" if req_id in finished
                      else "preempted" if req_id in preempted else "unscheduled")
            wst.ch.emit("batch_remove", step=step, req=req_id, reason=reason)
        if added:
            new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            resumed = _resumed_ids(scheduler_output.scheduled_cached_reqs)
            for req_id in added:
                wst.ch.emit("batch_add", step=step, req=req_id,
                            reason=_batch_add_reason(req_id, new_ids, resumed))


# V1 runner only (the V2 runner has no persistent batch). Diff of the batch's request ids around the call.
_w_update_states = guarded("GPUModelRunner._update_states", ("scheduler_output",), _update_states_before,
                           _update_states_after)


# ------------------------------------------------------------------------------------------------------ table

#: Before 0.26 execute_model receives and sends the PP tensors synchronously (`recv_tensor_dict` /
#: `send_tensor_dict`; 0.10.2, 0.11.1, 0.15.1, 0.16.0 gpu_worker.py): the older tables put these in the place of
#: 0.26+'s asynchronous receive (`PP_ASYNC_HOOKS`, names as overlay() drops them).
PP_SYNC_HOOKS: tuple[Hook, ...] = (
    Hook(_DIST, "GroupCoordinator", "recv_tensor_dict", _w_pp_wait("pp_recv"), (), lazy=True),
    Hook(_DIST, "GroupCoordinator", "send_tensor_dict", _w_pp_wait("pp_send"), (), lazy=True),
)
PP_ASYNC_HOOKS = ("AsyncIntermediateTensors.wait_for_comm", "GroupCoordinator.irecv_tensor_dict")

TABLE: tuple[Hook, ...] = (
    Hook(_SCHED, "Scheduler", "add_request", _w_add_request, ("request",)),
    Hook(_SCHED, "Scheduler", "schedule", _w_schedule, ("throttle_prefills",)),
    Hook(_SCHED, "Scheduler", "update_from_output", _w_update_from_output,
         ("scheduler_output", "model_runner_output")),
    Hook(_SCHED, "Scheduler", "_preempt_request", _w_preempt_request, ("request", "timestamp")),
    Hook(_SCHED, "Scheduler", "finish_requests", _w_finish_requests, ("request_ids", "finished_status")),
    Hook(_SCHED, "Scheduler", "_connector_finished", _w_connector_finished, ("request",)),
    Hook(_SCHED, "Scheduler", "_update_from_kv_xfer_finished", _w_update_from_kv_xfer_finished,
         ("kv_connector_output",)),
    Hook(_SCHED, "Scheduler", "_update_waiting_for_remote_kv", _w_update_waiting_for_remote_kv, ("request",)),
    Hook(_SCHED, "Scheduler", "_drain_deferred_frees", _w_drain_deferred_frees, ()),
    Hook(_SCHED, "Scheduler", "_get_local_prefix_cache_hit", _w_get_local_prefix_cache_hit, ("request",)),
    Hook(_SCHED, "Scheduler", "_set_kv_fetch_stage", _w_set_kv_fetch_stage, ("request", "stage")),
    Hook(_KVM, "KVCacheManager", "free", _w_kvm_free, ("request",)),
    Hook(_KVM, "KVCacheManager", "pop_blocks_for_free", _w_pop_blocks_for_free, ("request",)),
    Hook(_COORD, "KVCacheCoordinator", "remove_skipped_blocks", _w_remove_skipped_blocks,
         ("request_id", "processed_computed_tokens")),
    Hook(_SCHED, "Scheduler", "_free_cow_retained_blocks", _w_free_cow_retained_blocks, ("blocks", "fence_seq")),
    Hook(_CORE, "EngineCore", "step", _w_engine_step("step"), ()),
    Hook(_CORE, "EngineCore", "step_with_batch_queue", _w_engine_step("step_with_batch_queue"), ()),
    Hook(_CORE, "EngineCoreProc", "_handle_client_request", _w_handle_client_request, ("request_type", "request")),
    Hook(_EXECUTOR, "Executor", "__init__", _w_executor_init, ("vllm_config",)),
    Hook(_WORKER, "Worker", "execute_model", _w_worker_execute_model, ("scheduler_output",), lazy=True),
    Hook(_WORKER, "Worker", "sample_tokens", _w_worker_sample_tokens, ("grammar_output",), lazy=True),
    Hook(_RUNNER, "GPUModelRunner", "_update_states", _w_update_states, ("scheduler_output",), lazy=True),
    Hook(_WORKER, "AsyncIntermediateTensors", "wait_for_comm", _w_wait_for_comm, (), lazy=True),
    Hook(_DIST, "GroupCoordinator", "irecv_tensor_dict", _w_pp_wait("pp_recv"), (), lazy=True),
)
