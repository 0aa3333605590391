"""Virtual time for a dry run: one timeline per simulated engine, and the clock the recorder reads.

Each engine has its own `Timeline` (its virtual `now`, in ns since the Unix epoch) and a heap of worker events
that lie in its future (a pipeline stage finishing, a rank reporting a transfer). `advance_to(t)` runs those
callbacks in time order, each with the clock set to the event's own time, before `now` reaches `t`; so one
writer's events are emitted in timestamp order, and their `seq` agrees with `ts_ns`.

`VirtualClock` is the callable handed to `session.configure(clock=...)`: it returns the `now` of the engine that
is acting at the moment (the simulation runs one engine at a time, in one thread).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

#: Virtual time 0 of every dry run: 2026-01-01T00:00:00Z. Fixed, so that the same seed gives the same trace.
EPOCH_NS = 1_767_225_600_000_000_000


class Timeline:
    """The virtual time of one engine and the callbacks due at future instants on it."""

    def __init__(self, name: str, start_ns: int = EPOCH_NS) -> None:
        self.name = name
        self.now = start_ns
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, ts_ns: int, callback: Callable[[], None]) -> None:
        """Run `callback` when this timeline reaches `ts_ns` (at once, in order, if it already has)."""
        heapq.heappush(self._heap, (int(ts_ns), next(self._order), callback))

    def advance_to(self, ts_ns: int) -> None:
        """Run every callback due up to `ts_ns` (the clock at each callback's time), then set now >= ts_ns."""
        heap = self._heap
        target = int(ts_ns)
        while heap and heap[0][0] <= target:
            ts, _, cb = heapq.heappop(heap)
            self.now = max(self.now, ts)
            cb()
        self.now = max(self.now, target)

    def advance_by(self, dt_ns: float) -> None:
        """Advance by a duration (ns)."""
        self.advance_to(self.now + int(dt_ns))

    def drain(self) -> None:
        """Run every pending callback (end of the run: the workers finish what was submitted)."""
        while self._heap:
            self.advance_to(self._heap[0][0])

    @property
    def next_due(self) -> int | None:
        """Time of the earliest pending callback, or None."""
        return self._heap[0][0] if self._heap else None


class VirtualClock:
    """The recorder's clock: the `now` of whichever engine's timeline is current."""

    def __init__(self) -> None:
        self.current: Timeline | None = None
        self._fallback = EPOCH_NS

    def __call__(self) -> int:
        cur = self.current
        return cur.now if cur is not None else self._fallback
