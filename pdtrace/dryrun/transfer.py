"""The simulated KV transfer engine (NIXL pull mode, as 0.33's nixl/pull_worker.py does it, on virtual time).

A D rank starts reading a request's blocks when it executes the step whose connector metadata lists the request in
`reqs_to_recv` (start_load_kv at the start of execute_model). Rank (pp, tp) of D reads from rank (pp, tp) of P
(both instances share one topology). A read of n blocks takes `transfer_setup_us + n *
transfer_latency_us_per_block` (+ bytes / bandwidth when a bandwidth is set). When it ends, the D rank has it to
report in `finished_recving` (only if the scheduler parked the request waiting for it: `awaiting_kvs`), and the P
rank is notified: it reports `finished_sending` once it has also seen the id in `reqs_to_send` (its metadata of a
step after the request finished). Each rank reports at the end of its next forward (`get_finished`), and vLLM's
KVOutputAggregator merges the ranks. A notify-only read (no blocks: the D request was aborted before allocation)
frees P's blocks and reports nothing on D, as in vLLM.

With `--instances p` a phantom decoder reads each finished request's blocks `proxy_delay_us` after P returned its
kv_transfer_params.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdtrace.dryrun.compat import recv_plan, remote_block_count

if TYPE_CHECKING:
    from pdtrace.dryrun.sim import SimCluster, SimEngine

NS_PER_US = 1000


class SimTransferEngine:
    """Reads between simulated ranks, and the per-rank completions they produce."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.reads_started = 0
        self.blocks_read = 0

    def read_ns(self, n_blocks: int) -> int:
        cfg = self.cluster.config
        us = cfg.transfer_setup_us + cfg.transfer_latency_us_per_block * n_blocks
        if cfg.transfer_bandwidth_gbps > 0:
            us += n_blocks * cfg.kv_bytes_per_block * 8 / (cfg.transfer_bandwidth_gbps * 1e3)
        return int(us * NS_PER_US)

    def on_worker_metadata(self, engine: SimEngine, rank: Any, rec: Any, meta: Any, ts: int) -> None:
        """A rank executes a step's connector metadata: P ranks learn what to send, D ranks start reads."""
        to_send = getattr(meta, "reqs_to_send", None)
        if to_send:
            rank.sends_registered.update(to_send)
        to_recv = getattr(meta, "reqs_to_recv", None)
        if not to_recv:
            return
        faults = self.cluster.faults
        for req_id, rm in to_recv.items():
            n_blocks, awaited, remote_engine, remote_req = recv_plan(rm)
            faults.perturber.note_read(req_id, rm.local_block_ids)
            dur = faults.read_ns(engine, req_id, self.read_ns(n_blocks), rank)
            done = ts + dur
            if rank.pp_rank == 0 and rank.tp_rank == 0:
                self.reads_started += 1
                self.blocks_read += n_blocks
                faults.on_read_started(engine, req_id, ts, dur)
            if awaited and n_blocks:
                rank.done_recvs.append((done, req_id))
            if remote_engine is None:
                continue
            producer = self.cluster.by_engine_id.get(remote_engine)
            if producer is None:
                continue
            if remote_req is None:  # 0.10 to 0.12: P and D share one id (compat.shared_request_ids)
                remote_req = req_id
            p_rank = producer.ranks.get((rank.pp_rank, rank.tp_rank))
            if p_rank is not None:
                p_rank.done_sends.append((done, remote_req))

    def phantom_read(self, producer: SimEngine, req_id: str, params: dict, now: int) -> None:
        """P-only runs: an unrecorded decoder reads the finished request's blocks after the proxy's delay."""
        n_blocks = remote_block_count(params.get("remote_block_ids"))
        start = now + int(self.cluster.config.proxy_delay_us * NS_PER_US)
        done = start + self.read_ns(n_blocks)
        self.reads_started += 1
        self.blocks_read += n_blocks
        for rank in producer.ranks.values():
            rank.done_sends.append((done, req_id))
