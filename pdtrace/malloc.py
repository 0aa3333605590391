"""glibc malloc settings for pdtrace's big-array work (stdlib only; every function is a no-op off glibc).

Why they matter: an analysis at 10M events allocates and frees many 10-80 MB numpy arrays. By default glibc serves
each from a fresh mmap and unmaps it on free, so every array is page-faulted in again (~0.5 s of system time per
10M events), and each worker thread gets its own arena, where blocks above 64 MiB are always mmapped.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc mallopt parameters
GLIBC_DEFAULT_THRESHOLD = 128 * 1024


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where there is none."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def single_arena() -> bool:
    """Every thread allocates from the main arena from now on (for a whole process: glibc fixes the arena limit the
    first time a thread needs one, so it cannot be undone). The CLI does this when `pdtrace.cli` is imported,
    before numpy and pyarrow are: each of their imports starts a thread, which would get an arena of its own, and
    glibc hands later threads (the rules') one of those, where every large array is page-faulted in afresh. The
    rules' threads then reuse the memory other threads freed (100 MB lower peak RSS and less system time at 10M
    events; called after those imports, it left 410-440K page faults at 20M events in bench/long_trace.py, called
    before them 270K, and 0.3 s less system time)."""
    mallopt: Any = glibc_mallopt()
    return mallopt is not None and mallopt(M_ARENA_MAX, 1) == 1
