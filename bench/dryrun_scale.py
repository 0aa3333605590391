"""Scale of `pdtrace record --dry-run`: a 10k-request, PP=4 1P1D dry run with short outputs (mean 32 tokens).

    .venv-vllm/bin/python bench/dryrun_scale.py                      # the issue's workload (target: under 2 min)
    .venv-vllm/bin/python bench/dryrun_scale.py --requests 1000 --keep /tmp/t

Prints wall time (whole call: child process start, vLLM import, both engines, the run, the Parquet flush), the
time inside the run, steps, events written, trace size and the virtual time simulated. Needs vLLM 0.33.0. Run it by
hand on a quiet machine; the figures are wall-clock and depend on the load.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdtrace.dryrun import DryRunConfig, run_dry_run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--instances", default="pd")
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--prompt-len", default="uniform:32:256")
    ap.add_argument("--output-len", default="exp:32")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="keep the trace in this directory (default: a temporary one, deleted)")
    args = ap.parse_args()
    cfg = DryRunConfig(requests=args.requests, pp=args.pp, tp=args.tp, instances=args.instances, rate=args.rate,
                       prompt_len=args.prompt_len, output_len=args.output_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                       seed=args.seed)
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="pdtrace-dryrun-bench-")) / "trace"
    t0 = time.perf_counter()
    res = run_dry_run(cfg, out)
    wall = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"workload: {args.requests} requests, {args.instances} PP={args.pp} TP={args.tp}, rate {args.rate:g}/s, "
          f"prompt {args.prompt_len}, output {args.output_len}, max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, {args.num_blocks} blocks")
    print(f"wall (whole call)   {wall:8.1f} s")
    print(f"wall (inside run)   {res.wall_s:8.1f} s")
    print(f"steps               {res.steps:8d}   ({', '.join(f'{k} {v}' for k, v in res.engine_steps.items())})")
    print(f"events              {res.events:8d}   ({res.events / max(res.wall_s, 1e-9):,.0f} events/s inside run)")
    print(f"finishes seen       {res.requests_finished:8d}")
    print(f"virtual time        {res.virtual_s:8.2f} s")
    print(f"trace size          {size / 1e6:8.1f} MB")
    print(f"child max RSS       {child_rss:8.0f} MB")
    print(f"error               {res.error}")
    if not args.keep:
        shutil.rmtree(out.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
