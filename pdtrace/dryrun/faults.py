"""Fault injection: each fault reproduces one real class of incident in the simulated workers, transfer engine or
client; vLLM's own code then does what it does (including raising its asserts).

| fault | what the simulation does | what real vLLM 0.33 then does |
| --- | --- | --- |
| completion_before_finish | the target P request gets a prompt longer than the token budget; every P rank reports `finished_sending` for it at the end of its first (partial) prefill chunk | `_free_blocks` asserts `request.is_finished()` (scheduler.py:3065) |
| lost_send_completion | P ranks never report the target's send | its delayed free never happens: the blocks leak |
| abort_while_waiting_kv | the target D read takes 20x longer (>= 20 ms); D is asked to abort it halfway | the abort is delayed until `finished_recving` (scheduler.py:3015-3024) |
| duplicate_completion | P rank 0 reports the target's send once more at its next step (with several ranks, the others' reads of it take >= 50 ms) | with one rank: `assert req_id in self.requests` (:3581); with more, KVOutputAggregator counts rank 0 twice and frees the blocks while the other ranks still read them |
| missing_rank_completion | the last P rank never reports the target's send | the aggregator waits forever: the blocks leak |
| slow_transfer | the target read takes `slow_transfer_ms` | D keeps it WAITING_FOR_REMOTE_KVS (and P holds its blocks) |
| starve | the target's prompt needs every usable block of P's pool (vLLM 0.33 refuses a max_model_len that could never fit, so the pool must shrink at run time): request 0's send completion is lost, pinning its blocks | the target never fits and waits at the head of the line; FCFS blocks the requests behind it |
| few_requests_pp | a closed-loop client keeps at most max(1, pp // 2) requests in flight | fewer ready micro-batches than stages: bubbles |

The target is workload request `fault_request` (default: request 1 for completion_before_finish, else requests // 3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdtrace.dryrun.config import DryRunConfig
from pdtrace.dryrun.perturb import Perturber
from pdtrace.dryrun.workload import VOCAB_FOR_PROMPTS, WorkloadRequest

if TYPE_CHECKING:
    from pdtrace.dryrun.sim import SimCluster, SimEngine

NS_PER_MS = 1_000_000


def fault_target(config: DryRunConfig, fault: str) -> int:
    """Index of the workload request a fault targets."""
    if config.fault_request >= 0:
        return min(config.fault_request, max(0, config.requests - 1))
    if fault == "completion_before_finish":
        return min(1, max(0, config.requests - 1))
    return config.requests // 3


def reshape_workload(config: DryRunConfig, workload: list[WorkloadRequest]) -> None:
    """Faults that need a particular request shape get it (deterministically)."""
    faults = set(config.faults)
    if "completion_before_finish" in faults and workload:
        wl = workload[fault_target(config, "completion_before_finish")]
        need = config.max_num_batched_tokens + 2 * config.block_size
        _resize_prompt(wl, need)
    if "starve" in faults and workload:
        wl = workload[fault_target(config, "starve")]
        # All num_blocks - 1 usable blocks (block 0 is vLLM's null block): fits an empty pool, nothing less.
        _resize_prompt(wl, starve_prompt_len(config))


def starve_prompt_len(config: DryRunConfig) -> int:
    """The starving prompt: as long as the usable pool holds (P's max_tokens=1 makes it exactly the pool)."""
    return (config.num_blocks - 1) * config.block_size - 1


def _resize_prompt(wl: WorkloadRequest, n: int) -> None:
    toks = wl.prompt_token_ids
    if len(toks) < n:
        # Extend deterministically from the prompt itself.
        toks.extend((toks[i % len(toks)] * 7 + i) % VOCAB_FOR_PROMPTS for i in range(n - len(toks)))


class FaultInjector:
    """The faults of one run, consulted by the simulated workers and the transfer engine."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        cfg = cluster.config
        self.faults = set(cfg.faults)
        self.p_target = {f: cluster.req_id(f"r{fault_target(cfg, f):05d}", "p") for f in self.faults}
        self.d_target = {f: cluster.req_id(f"r{fault_target(cfg, f):05d}", "d") for f in self.faults}
        # starve: the request whose lost send completion pins blocks for good (shrinking P's pool).
        self.pin_target = cluster.req_id("r00000", "p") if "starve" in self.faults else None
        self._cbf_step: Any = None
        self._dup_armed = False
        self._dup_done = False
        self.injected: list[str] = []
        self.perturber = Perturber(cluster)

    def client_concurrency(self) -> int:
        """0 for an open-loop client; the closed-loop limit for few_requests_pp."""
        if "few_requests_pp" in self.faults:
            limit = max(1, self.cluster.config.pp // 2)
            self.injected.append(f"closed-loop client: at most {limit} request(s) in flight")
            return limit
        return 0

    def read_ns(self, engine: SimEngine, req_id: str, normal_ns: int, rank: Any = None) -> int:
        normal_ns = self.perturber.read_ns(req_id, normal_ns)
        if "slow_transfer" in self.faults and req_id == self.d_target["slow_transfer"]:
            if engine.ranks and not any("slow read" in x for x in self.injected):
                self.injected.append(f"slow read of {req_id}: {self.cluster.config.slow_transfer_ms:.0f} ms")
            return int(self.cluster.config.slow_transfer_ms * NS_PER_MS)
        if "abort_while_waiting_kv" in self.faults and req_id == self.d_target["abort_while_waiting_kv"]:
            return max(20 * normal_ns, 20 * NS_PER_MS)
        if ("duplicate_completion" in self.faults and req_id == self.d_target["duplicate_completion"]
                and rank is not None and (rank.pp_rank, rank.tp_rank) != (0, 0)):
            # The other ranks' reads are slower, so rank 0's second report counts toward their quorum first.
            return max(50 * normal_ns, 50 * NS_PER_MS)
        return normal_ns

    def on_read_started(self, engine: SimEngine, req_id: str, ts: int, dur: int) -> None:
        self.perturber.on_read_started(engine, req_id, ts, dur)
        if "abort_while_waiting_kv" in self.faults and req_id == self.d_target["abort_while_waiting_kv"]:
            engine.push_input(ts + dur // 2, "abort", req_id)
            self.injected.append(f"abort {req_id} at +{dur // 2 / 1e6:.1f} ms into its read")

    def filter_sends(self, engine: SimEngine, rank: Any, rec: Any, sends: set[str]) -> set[str]:
        """The sends a P rank reports at the end of a step, after the faults."""
        if engine is not self.cluster.prefill or not self.faults:
            return sends
        f = self.faults
        if "completion_before_finish" in f:
            target = self.p_target["completion_before_finish"]
            if self._cbf_step is None and rec.forward and rec.sampled.get(target) == []:
                self._cbf_step = rec  # the target's partial prefill chunk: every rank reports it now
                self.injected.append(f"finished_sending {target} in step {rec.step} (partial prefill chunk)")
            if self._cbf_step is rec:
                sends = sends | {target}
                rank.sends_registered.discard(target)
        if "lost_send_completion" in f:
            target = self.p_target["lost_send_completion"]
            if target in sends:
                sends = sends - {target}
                if rank.pp_rank == 0 and rank.tp_rank == 0:
                    self.injected.append(f"lost finished_sending {target}")
        if self.pin_target is not None and self.pin_target in sends:
            sends = sends - {self.pin_target}
            if rank.pp_rank == 0 and rank.tp_rank == 0:
                self.injected.append(f"lost finished_sending {self.pin_target}: its blocks stay pinned")
        if "missing_rank_completion" in f:
            target = self.p_target["missing_rank_completion"]
            last = (engine.pp - 1, engine.tp - 1)
            if target in sends and (rank.pp_rank, rank.tp_rank) == last:
                sends = sends - {target}
                self.injected.append(f"rank pp={last[0]} tp={last[1]} drops finished_sending {target}")
        if "duplicate_completion" in f and (rank.pp_rank, rank.tp_rank) == (0, 0):
            target = self.p_target["duplicate_completion"]
            if target in sends:
                self._dup_armed = True
            elif self._dup_armed and not self._dup_done:
                self._dup_done = True
                sends = sends | {target}
                self.injected.append(f"rank 0 reports finished_sending {target} again in step {rec.step}")
        return sends
