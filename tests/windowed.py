"""Cut a trace at a time, as a trace that starts mid-run holds it (docs/trace-format.md, "Traces that start
mid-run"): `Trace.cut(t)` keeps the rows at or after t (and the engine_config rows: configuration, not history) and
marks the result as a window starting at t, what a flight-recorder dump of that moment or `pdtrace analyze --since`
gives.

`cut_times(table)` picks the cuts deterministically: EVEN times evenly spaced inside the trace's span, plus a
nanosecond after the first row of each kind in NOTABLE (the first finish, free, completion, preemption, wait for
KV, step output, engine error), where a window starts with the most history behind it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

EVEN = 8
NOTABLE = ("req_finish", "blocks_free", "kv_send_done", "kv_recv_done", "req_preempt", "req_wait_kv",
           "step_output", "engine_error", "kv_send_rank")


def cut_times(table: pa.Table, even: int = EVEN, notable: tuple[str, ...] = NOTABLE) -> list[int]:
    """The cut times of a table (ns since the epoch), ascending, each strictly after its first row."""
    ts = table.column("ts_ns").to_numpy()
    if len(ts) == 0:
        return []
    lo, hi = int(ts.min()), int(ts.max())
    out = {lo + (hi - lo) * k // (even + 1) for k in range(1, even + 1)}
    kinds = np.asarray(table.column("kind").cast(pa.string()).to_pylist(), dtype=object)
    for kind in notable:
        at = ts[kinds == kind]
        if len(at):
            out.add(int(at.min()) + 1)
    return sorted(t for t in out if lo < t <= hi)
