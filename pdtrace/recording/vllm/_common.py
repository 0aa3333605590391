"""Version-independent helpers of the vLLM hooks: instance ids, roles, and the per-scheduler recording state."""

from __future__ import annotations

import os
import re
import weakref
from typing import Any

from pdtrace.recording import session

#: The state pdtrace keeps for vLLM objects (scheduler, KV cache manager, block pool, coordinator, engine core,
#: worker, model runner), by id(obj); read with `state_of`, set with `attach_state`. Kept here, not on the objects:
#: reading an instance's `__dict__` or adding an attribute to it makes CPython 3.11 give up the object's inline
#: attribute values for a real dict, and every attribute vLLM reads on it afterwards (hundreds of thousands per
#: run on the scheduler, KV cache manager and block pool) takes the slower dict path: 6.6 -> 20.9 ns per attribute
#: read (timeit, a SchedulerOutput before / after `__dict__` was read; adding an attribute that fits the class's
#: shared keys costs nothing); in bench/engine_overhead.py reading `__dict__` on the five objects alone, no hook
#: running, cost the loop thread +23 ms (+6.5 %, 5 alternating runs each, shared machine).
_STATES: dict[int, Any] = {}
#: id(obj) -> the weak reference whose callback forgets the entry when obj dies (before its id can be reused).
_REFS: dict[int, Any] = {}

#: The state attached to `obj`, or None (hot path: `state_get(id(obj))`).
state_get = _STATES.get


def state_of(obj: Any) -> Any:
    """The state `attach_state` attached to `obj`, or None."""
    return _STATES.get(id(obj))


def attach_state(obj: Any, state: Any, owner: bool = False) -> None:
    """Attach `state` to `obj` without touching obj (see `_STATES`); forgotten when obj is garbage, and with
    `owner`, forgotten for every object it is attached to (the scheduler owns its state: its KV cache manager and
    block pool may outlive it, held by blocks the state refers to). `state` must not refer to `obj` (it would keep
    it alive); an object without weak references keeps its state, and stays alive, for the rest of the process."""
    key = id(obj)

    def forget(ref: Any, key: int = key) -> None:
        if _REFS.get(key) is ref:
            del _REFS[key]
            _STATES.pop(key, None)
        if owner:
            for other in [k for k, v in list(_STATES.items()) if v is state]:  # list(): one C-level copy
                _STATES.pop(other, None)
                _REFS.pop(other, None)

    try:
        ref: Any = weakref.ref(obj, forget)
    except TypeError:
        ref = obj
    _REFS[key] = ref
    _STATES[key] = state

#: Attribute carrying the recorder's step id on a SchedulerOutput (pickled to the workers with it).
STEP_ATTR = "_pdtrace_step"

#: The release being recorded and the hook table applied to it (`vllm_version`, `table`), set by install_hooks and
#: written into each engine_config event.
RELEASE: dict[str, str] = {}

_DP_SUFFIX = re.compile(r"^(?P<name>.*)_dp(?P<rank>\d+)$")
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def split_dp_suffix(engine_id: str) -> tuple[str, int | None]:
    """vLLM rewrites a data-parallel engine's id to `{id}_dp{N}`: return (id, N), or (engine_id, None)."""
    m = _DP_SUFFIX.match(engine_id)
    if m is None:
        return engine_id, None
    return m.group("name"), int(m.group("rank"))


#: How an engine hands its identity to the worker processes its executor starts: `pid|dp_rank|role|instance` of the
#: engine (core) process, in the environment those processes inherit (forked or spawned alike); a process takes it
#: only from its parent (the pid), so that nothing else that inherited the variable mistakes it for its own.
ENGINE_ENV = "PDTRACE_ENGINE"

#: id(vllm_config) -> the engine identity fixed when its executor started (see `fix_engine_identity`).
_ENGINES: dict[int, tuple[str, str, int | None]] = {}
_ENGINE_REFS: dict[int, Any] = {}


def _identity_from_config(vllm_config: Any) -> tuple[str, str, int | None]:
    """(instance, role, dp_rank) as the config says now (trace-format rules for `instance`): the KV connector's
    `engine_id`, else vLLM's `instance_id`, each with vLLM's data-parallel suffix `_dp{N}` moved to dp_rank."""
    parallel = getattr(vllm_config, "parallel_config", None)
    dp_rank = getattr(parallel, "data_parallel_rank", None)
    kv = getattr(vllm_config, "kv_transfer_config", None)
    engine_id = getattr(kv, "engine_id", None) if kv is not None else None
    if engine_id:
        name = str(engine_id)
        role = _ROLES.get(getattr(kv, "kv_role", None) or "", "none")
    else:
        name = str(getattr(vllm_config, "instance_id", None) or "vllm")
        role = "none"
    name, suffix_rank = split_dp_suffix(name)
    if suffix_rank is not None:
        dp_rank = suffix_rank
    return name, role, (int(dp_rank) if dp_rank is not None else None)


def fix_engine_identity(vllm_config: Any) -> tuple[str, str, int | None]:
    """Fix the identity of the engine `vllm_config` configures, as it is when the engine's executor starts its
    workers (the executor hook calls this, in the engine process, before any worker exists), for this config
    object and for every worker process the executor starts (`ENGINE_ENV`). Why: vLLM 0.28+ sets
    `VllmConfig.instance_id = time.time_ns()` in `__post_init__`, and `EngineCoreProc.__init__` runs that again
    after its workers started with the first value (0.32.0 v1/engine/core.py:1311, 0.33.0 :1349), so the
    scheduler and its workers would read two instance ids. Returns the identity."""
    identity = _identity_from_config(vllm_config)
    key = id(vllm_config)

    def forget(ref: Any, key: int = key) -> None:
        if _ENGINE_REFS.get(key) is ref:
            del _ENGINE_REFS[key]
            _ENGINES.pop(key, None)

    try:
        _ENGINE_REFS[key] = weakref.ref(vllm_config, forget)
    except TypeError:  # no weak references: kept for the rest of the process
        _ENGINE_REFS[key] = vllm_config
    _ENGINES[key] = identity
    name, role, dp_rank = identity
    os.environ[ENGINE_ENV] = f"{os.getpid()}|{'' if dp_rank is None else dp_rank}|{role}|{name}"
    return identity


def _inherited_identity() -> tuple[str, str, int | None] | None:
    """The identity the engine process that started this one exported (`ENGINE_ENV`), or None."""
    value = os.environ.get(ENGINE_ENV)
    if not value:
        return None
    try:
        pid, dp_rank, role, name = value.split("|", 3)
        if int(pid) != os.getppid():
            return None
        return name, role, (int(dp_rank) if dp_rank else None)
    except ValueError:
        return None


def instance_of(vllm_config: Any, worker: bool = False) -> tuple[str, str, int | None]:
    """(instance, role, dp_rank) of the engine a vllm_config describes: the one function every hook (scheduler and
    worker sides) and the dry run ask. The identity fixed when the engine's executor started its workers, for this
    config object (the engine process; a worker in it, or forked from it, holds the same object); else, on the
    `worker` side, the one the engine process that started this process exported (a spawned worker's config is a
    copy; a scheduler never takes it: it is the engine); else the config's own (an engine whose executor started
    before the hooks were installed, where both sides read the same object)."""
    identity = _ENGINES.get(id(vllm_config))
    if identity is None:
        identity = (worker and _inherited_identity()) or _identity_from_config(vllm_config)
    return identity


def batch_queue_depth(vllm_config: Any) -> int | None:
    """How many batches the engine core's batch queue holds, where the config says it:
    `VllmConfig.max_concurrent_batches` (0.23+, config/vllm.py:497 of 0.23.0: pp, pp + 1 with async scheduling on
    the V2 runner, 2 with async scheduling on one stage). None before: there only the executor answers it (its own
    `max_concurrent_batches`, which EngineCore reads), and a reader that needs a number applies that executor's
    rule itself (the dry run's executor) or its own default (no_progress: 1, 2 with async scheduling)."""
    return getattr(vllm_config, "max_concurrent_batches", None)


def remote_instance(engine_id: Any) -> str | None:
    """A remote engine id as `instance` (same `_dp{N}` rule)."""
    if not engine_id:
        return None
    return split_dp_suffix(str(engine_id))[0]


class SchedulerState:
    """What pdtrace keeps per vLLM scheduler: its recorder channels, step counter and call context."""

    __slots__ = (
        "sched", "rec", "ch", "eng", "next_step", "cur_step", "tables", "tbl0", "free_reason",
        "xfer_sending", "abort_delay", "waiting_kv", "wait_ns", "engine_attached", "known", "hits", "now",
        "run_head", "run_k", "held", "admitting", "loaded", "recv_dest",
    )

    def __init__(self, scheduler: Any, instance: str, role: str, dp_rank: int | None) -> None:
        #: The scheduler, weakly (call it): the state lives in the module's index (`attach_state`) while it does.
        try:
            self.sched: Any = weakref.ref(scheduler)
        except TypeError:  # None (tests), or a scheduler without weak references
            self.sched = lambda: scheduler
        self.rec = session.recorder(instance, role, dp_rank)
        #: The clock of `dur_ns` and `wait_ns`: the session's (a dry run's virtual clock), read with the recorder.
        self.now = session.duration_clock()
        self.ch = self.rec.channel("scheduler")
        self.eng = self.rec.channel("engine")
        self.next_step = 0
        self.cur_step: int | None = None
        self.tables: list[dict[str, list[Any]]] = []
        self.tbl0: dict[str, list[Any]] | None = None
        self.free_reason: str | None = None
        self.xfer_sending: frozenset[str] | set[str] = frozenset()
        #: Requests aborted while WAITING_FOR_REMOTE_KVS -> whether vLLM delays their free (finish_requests).
        self.abort_delay: dict[str, bool] = {}
        self.waiting_kv: set[str] = set()
        self.wait_ns: int | None = None
        self.engine_attached = False
        #: Block-table length per request as last recorded (a tuple of per-group lengths with several groups).
        self.known: dict[str, Any] = {}
        #: Local prefix hit of a request being admitted: (hit blocks, hit tokens).
        self.hits: dict[str, tuple[int, int]] = {}
        #: The latest empty step's `sched` row still in the recorder's buffer, and how many steps it stands for.
        self.run_head: tuple | None = None
        self.run_k = 0
        #: The scheduler's queue of waiting requests held aside (kv_holding_waiting / skipped_waiting), if any.
        self.held: Any = None
        #: Requests whose admission was tried in this schedule() (0.10 / 0.11 tables: where a KV receive starts).
        self.admitting: list[Any] = []
        #: External tokens a connector reported for a request's admission (`update_state_after_alloc`), until its
        #: table-opening blocks_alloc records them (detail `loaded`); only non-zero counts are kept.
        self.loaded: dict[str, int] = {}
        #: A KV read's destination blocks as the connector decided them, until the request's req_wait_kv is
        #: recorded (then kv_recv_dest follows it).
        self.recv_dest: dict[str, list[int]] = {}


class WorkerState:
    """What pdtrace keeps per worker (or model runner): its channel, once the ranks are known, and the last step."""

    __slots__ = ("ch", "conn", "step", "n")

    def __init__(self, ch: Any, conn: Any) -> None:
        self.ch = ch
        self.conn = conn
        self.step: int | None = None
        self.n: int | None = None
