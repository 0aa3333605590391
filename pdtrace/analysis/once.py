"""Compute-once caches that several threads may ask at the same time.

The rules run on a thread pool (`pdtrace.analysis.parallel`), and two of them may ask for the same derived table
(request state, block ownership, the global event order) at the same moment. Each key has its own lock: the first
caller builds the value, the others wait for it instead of building it again (a 10M-row table built twice costs its
time and its memory twice). A builder may ask for other keys; dependencies between tables are acyclic, so per-key
locks cannot deadlock.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class OnceCache:
    """key -> value, each value built once by the first caller of `get`."""

    def __init__(self) -> None:
        self._values: dict[Any, Any] = {}
        self._locks: dict[Any, threading.RLock] = {}
        self._guard = threading.Lock()

    def get(self, key: Any, build: Callable[[], T]) -> T:
        try:
            return self._values[key]
        except KeyError:
            pass
        with self._guard:
            lock = self._locks.setdefault(key, threading.RLock())
        with lock:
            if key not in self._values:
                self._values[key] = build()
        return self._values[key]


class once_property(Generic[T]):
    """Like `functools.cached_property`, built at most once per instance even under threads (Python 3.12 dropped
    cached_property's lock). The instance needs an `OnceCache` in `self._once`."""

    def __init__(self, build: Callable[[Any], T]) -> None:
        self.build = build
        self.name = build.__name__
        self.__doc__ = build.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return instance._once.get(self.name, lambda: self.build(instance))
