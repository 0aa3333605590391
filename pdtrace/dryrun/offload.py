"""The simulated worker side of vLLM's OffloadingConnector (`--instances offload`): GPU<->CPU stores and loads on
virtual time, reported to the real scheduler side the way vLLM's OffloadingConnectorWorker does.

The scheduler side (`OffloadingConnectorScheduler`, the CPU offloading spec and its `CPUOffloadingManager`) is
vLLM's own and runs unchanged; only `CPUOffloadingSpec.get_worker` needs CUDA (vllm/v1/kv_offload/cpu/spec.py:145-148
on 0.26.0: "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), and the engine never calls it
here because there are no real workers. What one simulated rank does, after offloading/worker.py (0.26.0):

- at the start of a step (`handle_preemptions`, then `start_kv_transfers`): the store jobs in the metadata's
  `jobs_to_flush` are submitted with the stores deferred from the previous step, and the flushed ones are waited
  for (done at once: the wait is not charged to the forward); then every load job of the metadata starts;
- at the end of the step (`get_finished`): the step's other store jobs are deferred to the next step's start
  (`prepare_store_kv`); every job finished by now is reported once in `kv_connector_worker_meta`
  (`OffloadingWorkerMetadata.completed_jobs`, {job: 1} per rank, summed by vLLM's aggregator), and a finished load
  also names its request in `finished_recving`.

A store of n blocks takes `transfer_setup_us + n * transfer_latency_us_per_block` (the dry run's transfer timings),
a load the same; `slow_store` / `slow_load` multiply it. The per-job protocol (`OffloadingWorkerMetadata`, vLLM
#39186) is in 0.23.0 and later (checked: 0.23.0, 0.25.1, 0.26.0, 0.27.0); earlier OffloadingConnectors (0.11.1 to
0.17.1 checked) report completions by request in `finished_sending` / `finished_recving`, a protocol this module
does not speak (`run_dry_run` refuses `--instances offload` there: pdtrace/dryrun/__init__.py `offload_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdtrace.dryrun.sim import SimCluster, SimEngine

NS_PER_US = 1000
#: The CPU pool the simulated spec gets (`cpu_bytes_to_use`): room for a few thousand of the tiny model's blocks.
CPU_BYTES = 64 << 20


def extra_config(block_size: int) -> dict[str, Any]:
    """The connector's kv_connector_extra_config: the CPU spec, one GPU block per offloaded chunk."""
    return {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES, "block_size": block_size}


@dataclass
class _Job:
    job_id: int
    req_id: str
    is_load: bool
    n_blocks: int
    done_ns: int = -1


@dataclass
class OffloadRank:
    """One rank's worker-side connector state."""

    deferred: list[_Job] = field(default_factory=list)  # stores waiting for the next step's start
    in_flight: list[_Job] = field(default_factory=list)
    held: list[tuple[int, _Job]] = field(default_factory=list)  # (report no earlier than this step count, job)
    steps: int = 0  # steps this rank ended
    flushed: set[int] = field(default_factory=set)  # the step's store jobs it flushed at its start


def _specs(job: Any) -> tuple[Any, ...]:
    """A job's (source, destination) specs: `src_spec` / `dst_spec` from 0.26, one `transfer_spec` pair before."""
    if hasattr(job, "src_spec"):
        return (job.src_spec, getattr(job, "dst_spec", None))
    spec = getattr(job, "transfer_spec", None)
    return tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)


def _blocks(job: Any) -> int:
    for spec in _specs(job):
        ids = getattr(spec, "block_ids", None)
        if ids is not None:
            try:
                return max(1, len(ids))
            except TypeError:
                continue
    return 1


class SimOffload:
    """The offloading workers of the cluster's one engine."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.ranks: dict[tuple[int, int], OffloadRank] = {}
        self.stores = 0
        self.loads = 0

    def _rank(self, rank: Any) -> OffloadRank:
        key = (rank.pp_rank, rank.tp_rank)
        st = self.ranks.get(key)
        if st is None:
            st = self.ranks[key] = OffloadRank()
        return st

    def _duration(self, job: _Job) -> int:
        cfg = self.cluster.config
        us = cfg.transfer_setup_us + cfg.transfer_latency_us_per_block * job.n_blocks
        return int(us * NS_PER_US * self.cluster.faults.perturber.offload_factor(job.req_id, job.is_load))

    def _submit(self, job: _Job, ts: int, rank: Any) -> None:
        job.done_ns = ts + self._duration(job)
        self._rank(rank).in_flight.append(job)
        if rank.pp_rank == 0 and rank.tp_rank == 0:
            if job.is_load:
                self.loads += 1
            else:
                self.stores += 1

    def on_step_begin(self, engine: SimEngine, rank: Any, meta: Any, ts: int) -> None:
        """handle_preemptions + start_kv_transfers of one rank, at the start of its step."""
        st = self._rank(rank)
        flush = set(getattr(meta, "jobs_to_flush", None) or ())
        stores = getattr(meta, "store_jobs", None) or {}
        # 0.26+ (`src_spec`) pops a flushed job of this very step out of its store jobs and submits it now; before,
        # `handle_preemptions` only waits for jobs already submitted
        st_flushed = [_Job(j, stores[j].req_id, False, _blocks(stores[j])) for j in sorted(flush)
                      if j in stores and hasattr(stores[j], "src_spec")]
        st.flushed = {j.job_id for j in st_flushed}  # this step's metadata: not deferred again at its end
        for job in st.deferred + st_flushed:
            self._submit(job, ts, rank)
        st.deferred = []
        if flush:  # worker.wait(jobs_to_flush): they are done before the forward pass touches the blocks
            for job in st.in_flight:
                if job.job_id in flush:
                    job.done_ns = min(job.done_ns, ts)
        for job_id, entry in sorted((getattr(meta, "load_jobs", None) or {}).items()):
            self._submit(_Job(job_id, entry.req_id, True, _blocks(entry)), ts, rank)

    def on_step_end(self, engine: SimEngine, rank: Any, meta: Any, ts: int) -> tuple[set[str], Any]:
        """get_finished of one rank: defer the step's stores, report what finished. (finished_recving, worker meta)"""
        st = self._rank(rank)
        st.steps += 1
        if meta is not None:
            for job_id, entry in sorted((getattr(meta, "store_jobs", None) or {}).items()):
                if job_id not in st.flushed:
                    st.deferred.append(_Job(job_id, entry.req_id, False, _blocks(entry)))
            st.flushed = set()
        perturber = self.cluster.faults.perturber
        done = [j for j in st.in_flight if j.done_ns <= ts]
        st.in_flight = [j for j in st.in_flight if j.done_ns > ts]
        for job in done:
            verdict = perturber.offload_report(engine, rank, job.req_id, job.is_load)
            if verdict is None:
                continue  # dropped: never reported
            st.held.append((st.steps + verdict, job))
        ready = [j for at, j in st.held if at <= st.steps]
        st.held = [(at, j) for at, j in st.held if at > st.steps]
        if not ready:
            return set(), None
        # lazy: vLLM (optional) loads when a cluster is built, not when this module is imported
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        wmeta = OffloadingWorkerMetadata()
        recvs: set[str] = set()
        for job in sorted(ready, key=lambda j: j.job_id):
            wmeta.mark_completed(job.job_id)
            if job.is_load:
                recvs.add(job.req_id)
        self.cluster.note_progress(ts)
        return recvs, wmeta
