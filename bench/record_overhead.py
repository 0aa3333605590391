"""Overhead of pdtrace's vLLM hooks on vLLM 0.33.0's real scheduler loop (run by hand, in the vLLM venv).

    .venv-vllm/bin/python bench/record_overhead.py [--requests 200] [--rounds 15]

Workload: one P/D prefill-side scheduler (NixlConnector, kv_producer, prefix caching on) and 200 requests, half
`do_remote_decode` (finish after their prefill, blocks held until a `finished_sending` one step later), half
local (16-48 output tokens); prompts 64-512 tokens (a quarter share a 128-token prefix). Each run drives
schedule() -> fake ModelRunnerOutput -> update_from_output() until the scheduler is empty. Runs alternate without
and with the hooks (installed and removed in the same process: install_hooks / uninstall_hooks); the figures are
medians over the rounds. This is the scheduler-only view; bench/engine_overhead.py measures the whole engine loop
(EngineCore, executor wrappers, the writer thread) in separate processes, as users run it.

Reported: the scheduler's CPU time (thread CPU inside schedule() + update_from_output(); building the fake outputs
is excluded) without and with hooks, the overhead in %, events per step and ns per event (the added scheduler
time divided by the events recorded); and, separately, the recorder's writer cost (process CPU of the flush at
close, on the writer thread), which runs off the scheduler's thread.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm_tier"))

import harness as H  # noqa: E402


def workload(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 50000) for _ in range(128)]
    reqs = []
    for i in range(n):
        length = rng.randrange(64, 513)
        prompt = [rng.randrange(2, 50000) for _ in range(length)]
        if i % 4 == 0:
            prompt[:128] = shared
        reqs.append({"id": f"req-{i}", "prompt": prompt, "remote_decode": i % 2 == 0,
                     "max_tokens": rng.randrange(16, 49)})
    return reqs


def run_once(model_dir: str, reqs: list[dict]) -> tuple[int, int]:
    """One full run; returns (scheduler thread-CPU ns, steps)."""
    vc = H.make_vllm_config(model_dir, kv_role="kv_producer", engine_id="bench-p", max_num_seqs=64,
                            max_num_batched_tokens=2048, num_blocks=4000)
    s = H.make_scheduler(vc, num_blocks=4000)
    faker = H.OutputFaker()
    for r in reqs:
        s.add_request(H.make_request(r["id"], len(r["prompt"]), prompt=r["prompt"], max_tokens=r["max_tokens"],
                                     remote_decode=r["remote_decode"]))
    remote = {r["id"] for r in reqs if r["remote_decode"]}
    sent: set[str] = set()
    to_send: set[str] = set()
    cpu = 0
    steps = 0
    clock = time.thread_time_ns
    while s.has_requests():
        t0 = clock()
        so = s.schedule()
        cpu += clock() - t0
        out = faker.output(so, finished_sending=to_send)
        sent |= to_send
        t0 = clock()
        s.update_from_output(so, out)
        cpu += clock() - t0
        steps += 1
        # P side: the decode instance reads right after the finish; its completion comes with the next output.
        to_send = {rid for rid in remote - sent if rid in s.requests and s.requests[rid].is_finished()}
        if steps > 5000:
            raise RuntimeError("workload did not drain")
    return cpu, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from pdtrace import open_trace
    from pdtrace.recording import session
    from pdtrace.recording.vllm import install_hooks, uninstall_hooks

    tmp = Path(tempfile.mkdtemp(prefix="pdtrace-bench-"))
    model_dir = H.tiny_model_dir(tmp)
    reqs = workload(args.requests, args.seed)
    run_once(model_dir, reqs)  # warm-up (imports, caches)

    base, hooked, writer, events, steps_seen = [], [], [], [], []
    for i in range(args.rounds):
        gc.collect()
        cpu, steps = run_once(model_dir, reqs)
        base.append(cpu)
        trace = tmp / f"trace-{i}"
        session.configure(trace, source="bench")
        assert install_hooks()
        gc.collect()
        cpu_h, steps_h = run_once(model_dir, reqs)
        uninstall_hooks()
        t0 = time.process_time_ns()
        session.close_all()  # the writer's remaining work: flush what the run left in the buffer
        writer.append(time.process_time_ns() - t0)
        hooked.append(cpu_h)
        steps_seen.append(steps_h)
        events.append(open_trace(trace).table.num_rows)
        assert steps == steps_h, "hooks changed the scheduler's behaviour"
        print(f"round {i}: without {cpu / 1e6:7.2f} ms  with {cpu_h / 1e6:7.2f} ms  "
              f"({(cpu_h - cpu) / cpu * 100:+5.1f} %)  {events[-1]} events, {steps} steps", file=sys.stderr)

    b, h = statistics.median(base), statistics.median(hooked)
    ev, st = statistics.median(events), statistics.median(steps_seen)
    paired = sorted((y - x) / x for x, y in zip(base, hooked))  # each round's with/without pair ran back to back
    print(f"workload: {args.requests} requests (half do_remote_decode), {st:.0f} steps, vLLM 0.33.0 Scheduler "
          f"+ NixlConnector (scheduler side), {os.cpu_count()} CPUs")
    print(f"scheduler CPU per run, median of {args.rounds}: without hooks {b / 1e6:.2f} ms, with hooks "
          f"{h / 1e6:.2f} ms")
    print(f"overhead: {statistics.median(paired) * 100:.1f} % of the scheduler's CPU time (median of the rounds' "
          f"paired ratios; ratio of medians {(h - b) / b * 100:.1f} %; rounds ranged {paired[0] * 100:.1f} to "
          f"{paired[-1] * 100:.1f} %)")
    print(f"events: {ev:.0f} per run, {ev / st:.1f} per step; {(h - b) / ev:.0f} ns per event on the scheduler's "
          f"thread")
    print(f"writer (flush at close, off the scheduler's thread): {statistics.median(writer) / 1e6:.2f} ms per run, "
          f"{statistics.median(writer) / ev:.0f} ns per event")


if __name__ == "__main__":
    main()
