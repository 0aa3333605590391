"""What an analysis reads of a trace, and how the process allocates while analyses run: `window` (the rows inside a
config's time window and instances) and `allocation_settings`. Below the engine's modules (`pdtrace.analysis`,
`partitions`, `windows` all use them), so none of them imports the package for them."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.malloc import GLIBC_DEFAULT_THRESHOLD, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, glibc_mallopt
from pdtrace.trace.model import Trace, dictionary_decoded, later_window, since_mask


def window(trace: Trace, config: AnalysisConfig) -> Trace:
    """The rows of the trace inside the config's time window and instances (the trace itself if unbounded). A
    `since_ns` that leaves earlier rows out marks the result as a window starting there (`Trace.window_start_ns`)."""
    table = trace.table
    mask = None
    if config.since_ns is not None:
        mask = since_mask(table, int(config.since_ns))  # engine_config rows stay: configuration, not history
    if config.until_ns is not None:
        m = pc.less(table.column("ts_ns"), pa.scalar(int(config.until_ns), pa.int64()))
        mask = m if mask is None else pc.and_(mask, m)
    if config.instances:
        inst = dictionary_decoded(table.column("instance"))
        m = pc.is_in(inst, value_set=pa.array(list(config.instances), pa.string()))
        mask = m if mask is None else pc.and_(mask, m)
    if mask is None:
        return trace
    filtered = trace.filter(mask)
    filtered.__dict__.pop("events", None)
    if config.since_ns is not None and len(table) and int(pc.min(table.column("ts_ns")).as_py()) < config.since_ns:
        # earlier rows were left out: the rest is a window of the run (pdtrace.analysis.history)
        filtered.window_start_ns, filtered.window_source = later_window(
            trace.window_start_ns, trace.window_source, int(config.since_ns), "since")
    return filtered


_SETTINGS_LOCK = threading.Lock()
_settings_users = 0
_settings_undo: list[Callable[[], None]] = []


@contextmanager
def allocation_settings() -> Iterator[None]:
    """While analyses run: numpy does not ask for transparent huge pages, and glibc keeps freed large blocks.

    Why: the analyses allocate and free many short-lived 10M-row arrays. (1) Numpy madvises each for huge pages,
    and with the kernel's default THP `defrag=madvise` a first touch may compact memory synchronously: 2-4 s of
    system time at 10M events on a busy machine (user time is the same with 4 KiB pages). (2) glibc serves blocks
    over its mmap threshold (at most 32 MiB) with fresh mmaps and unmaps them on free, so every array is
    page-faulted in again; from the heap, freed memory is reused (600k -> 350k page faults at 10M events, same peak
    RSS). Both are restored afterwards (glibc's thresholds to its defaults). Re-entrant and shared between threads
    (the settings are process-wide): the first entry applies them, the last exit restores them, so `analyze`
    running inside a figure's table build does not undo the figure's settings."""
    global _settings_users
    with _SETTINGS_LOCK:
        if _settings_users == 0:
            _settings_undo.extend(_apply_allocation_settings())
        _settings_users += 1
    try:
        yield
    finally:
        with _SETTINGS_LOCK:
            _settings_users -= 1
            if _settings_users == 0:
                while _settings_undo:
                    _settings_undo.pop()()


def _apply_allocation_settings() -> list[Callable[[], None]]:
    """Apply the settings of `allocation_settings`; returns how to undo each."""
    undo: list[Callable[[], None]] = []
    setter = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "_set_madvise_hugepage", None)
    if setter is not None:
        previous = setter(False)
        undo.append(lambda: setter(previous))
    mallopt = glibc_mallopt()
    if mallopt is not None and mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(M_TRIM_THRESHOLD, 1 << 31) == 1:
        def restore_thresholds() -> None:
            mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
            mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)

        undo.append(restore_thresholds)
    return undo
