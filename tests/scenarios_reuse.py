"""Blocks reused under work that still references them (issue 22 items 6 and 7), with healthy twins.

Built with `scenarios.Engine` in vLLM's order of events (see its docstring). Each builder's docstring names the
tracker threads it follows; block ids and steps are illustrative. `FAULTY` maps names to the traces with an
incident and `EXPECTED` to the finding each must give; `HEALTHY` maps the look-alikes no rule may report as an
error (and where their own finding is named, only that one: `NEGATIVE_ONLY`).
"""

from __future__ import annotations

from typing import Callable

from pdtrace.trace.model import Trace
from scenarios import Engine, builder


def _rank_reports(d: Engine, req: str, tp: int) -> None:
    """Every rank's `kv_recv_rank` for req (a load finished on that rank), in the current update."""
    for rank in range(tp):
        d.ev("kv_recv_rank", component="worker", pid=d.pid + 1 + rank, pp_rank=0, tp_rank=rank,
             step=d._current_step(), req=req)


def double_load(reuse: bool = True, late: bool = True, tp: int = 2) -> Trace:
    """vllm#53049: a decode instance with a MultiConnector (NIXL plus a KV store) broadcasts `start_load_kv` to
    both children, so two loads start for r1's blocks 1, 2. The store's load completes (every rank reports, then
    `kv_recv_done`), r1 runs, finishes and is freed; r2 gets blocks 1, 2 (`reuse`) and prefills into them; then the
    late NIXL load lands (`late`): its ranks report and a second `kv_recv_done` comes for the forgotten r1.
    `reuse=False`: r2 gets other blocks (only the second completion is wrong); `late=False`: a healthy load."""
    b = builder()
    d = Engine(b, instance="D", role="decode", tp=tp, kv_role="kv_consumer")
    d.add("r1", n=32, remote_prefill=True, remote_instance="P", remote_req="r1", remote_blocks=2)
    d.step({}, wait_kv={"r1": [1, 2]})
    d.output()
    _rank_reports(d, "r1", tp)  # the store connector's load
    d.recv_done("r1")
    for _ in range(2):
        d.step({"r1": 1})
        d.output()
    d.finish("r1", reason="length", status="RUNNING")
    d.add("r2", n=32)
    d.step({"r2": 32}, alloc={"r2": [1, 2] if reuse else [3, 4]})
    d.output()
    if late:
        _rank_reports(d, "r1", tp)  # NIXL's load of r1, started by the same broadcast, lands now
        d.recv_done("r1", status="unknown")
    d.step({"r2": 1})
    d.output()
    d.finish("r2", reason="length", status="RUNNING")
    return b.trace()


def async_prefill(b, num_blocks: int = 6) -> Engine:
    """A prefill instance (NIXL, kv_producer) under async scheduling: schedule() runs while a step is in flight."""
    p = Engine(b, instance="P", role="prefill", num_blocks=num_blocks, config=False)
    p.ev("engine_config", n=num_blocks, detail={
        "block_size": 16, "pp": 1, "tp": 1, "dp": 1, "batch_queue_size": 1, "async_scheduling": True,
        "defer_block_free": False, "kv_role": "kv_producer", "connector": "NixlConnector", "runner": "v1",
        "max_num_seqs": 64, "max_num_batched_tokens": 64})
    return p


def preempted_then_finished(how: str = "stale", peer: bool = True) -> Trace:
    """Issue 22 item 7: on a prefill instance under async scheduling, r1 (its whole prompt, one step: the P side
    of a P/D request, max_tokens 1) is preempted while that step is in flight; its blocks 1, 2 go to r2's next
    prefill chunk in the same schedule(); then the older step's output finishes r1 normally, holding no block, so
    there is nothing to send (`delay_free` false) and the decode side reads nothing.
    `how="resumed"`: r1 (max_tokens 2) is not finished by that output, resumes with new blocks and is finished by
    its own later step (healthy). `how="no_preemption"`: the in-flight step's output finishes r1 with its blocks
    kept for the peer's read (healthy). `peer=False`: r1 is a plain request (no peer reads its KV): its token was
    computed before the hand-over, so finishing by it loses nothing."""
    b = builder()
    p = async_prefill(b, num_blocks=8 if how == "no_preemption" else 6)
    p.add("r1", n=32, remote_decode=peer)
    p.add("r2", n=96, remote_decode=True)
    p.step({"r1": 32, "r2": 32}, alloc={"r1": [1, 2], "r2": [3, 4]})
    if how == "no_preemption":
        p.step({"r2": 32}, alloc={"r2": [5, 6]})
        p.output()
        p.finish("r1", reason="length", status="RUNNING", delay_free=True)
    else:
        p.step({"r2": 32}, alloc={"r2": [1, 2]}, preempt={"r1": [1, 2]})
        p.output()  # step 0's output: r1's token
        if how == "stale":
            p.finish("r1", reason="length", status="RUNNING", delay_free=False, free=False)
    p.output()
    p.step({"r2": 32}, alloc={"r2": [7, 8] if how == "no_preemption" else [5, 6]})
    p.output()
    p.finish("r2", reason="length", status="RUNNING", delay_free=True)
    p.step({})
    p.output()
    p.send_done("r2")
    if how == "resumed":
        p.step({"r1": 33}, alloc={"r1": [3, 4, 1]})
        p.output()
        p.finish("r1", reason="length", status="RUNNING", delay_free=True)
        p.step({})
        p.output()
        p.send_done("r1")
    if how == "no_preemption":
        p.step({})
        p.output()
        p.send_done("r1")
    return b.trace()


FAULTY: dict[str, Callable[[], Trace]] = {
    "late_load_into_reused_blocks": double_load,
    "preempted_finished_by_older_step": preempted_then_finished,
}
HEALTHY: dict[str, Callable[[], Trace]] = {
    "double_load_blocks_not_reused": lambda: double_load(reuse=False),
    "single_load_then_reuse": lambda: double_load(late=False),
    "preempted_resumed_finished_by_own_step": lambda: preempted_then_finished("resumed"),
    "finished_by_in_flight_step_no_preemption": lambda: preempted_then_finished("no_preemption"),
    "plain_request_finished_by_older_step": lambda: preempted_then_finished(peer=False),
}
#: (rule, subrule, severity) each faulty trace must give
EXPECTED: dict[str, tuple[str, str, str]] = {
    "late_load_into_reused_blocks": ("use_after_free", "transfer_after_reuse", "error"),
    "preempted_finished_by_older_step": ("preemption_race", "finished_while_preempted", "error"),
}
#: the only findings a healthy look-alike may give (its real, other defect): (rule, subrule, severity)
NEGATIVE_ONLY: dict[str, set[tuple[str, str, str]]] = {
    "double_load_blocks_not_reused": {("double_free", "completion_after_free", "error")},
}
