"""Running the rules and the shared tables they read on a few threads.

Most of an analysis is numpy and Arrow work on whole columns (sorts, gathers, scatters), which runs without the GIL,
and the rules are independent of each other once the shared tables exist. So `run_rules` schedules one graph:

- nodes are the selected rules and every shared table they declare (`Rule.needs`), with the tables those tables
  declare (`shared_table(*needs)` on the function that returns the table), transitively;
- a node starts on one of `jobs` threads when every node it needs is done and a thread is free; among the ready
  nodes, the one with the longest remaining chain goes first (list scheduling by upward rank: a node's rank is
  its own cost plus the largest rank of the nodes waiting for it; costs are the hints `Rule.cost` and
  `shared_table(cost=...)`, seconds at 10M events, default DEFAULT_COST), so the critical path starts early and
  light nodes fill the gaps;
- each node calls its function once; the tables are cached on the context (`AnalysisContext.cached`, per-key
  locks), so a rule that asks for a table it did not declare still gets the one copy, just later.

Declarations only decide what runs early and side by side; a missing or extra one changes the speed, never the
findings. The findings are returned in the order the rules were given, whatever order they finished in, and the
first exception raised (in completion order) propagates after the running nodes stop. `jobs=1` runs the rules
one after the other on the caller's thread, building tables lazily, exactly as without this module.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.analysis.registry import Rule

Table = Callable[["AnalysisContext"], Any]

#: More threads than this gain nothing: the graph of the built-in rules is at most four nodes wide.
MAX_JOBS = 4


#: Cost hint of a node that gives none (seconds at 10M events: a typical rule or table).
DEFAULT_COST = 0.05


def shared_table(*needs: Table, cost: float = DEFAULT_COST) -> Callable[[Table], Table]:
    """Mark `fn(ctx) -> table` as a shared table built on the tables `needs`; `cost` is a hint for the scheduler
    (seconds at 10M events; see the module docstring)."""

    def mark(fn: Table) -> Table:
        fn.needs = tuple(needs)  # type: ignore[attr-defined]
        fn.cost = float(cost)  # type: ignore[attr-defined]
        return fn

    return mark


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it, else every CPU), at least 1: the one
    count behind both defaults, threads (`default_jobs`) and worker processes (`partitions.default_workers`)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_jobs() -> int:
    """One thread per CPU this process may run on, at most MAX_JOBS."""
    return min(MAX_JOBS, usable_cpus())


def _needs(node: Any) -> tuple[Table, ...]:
    return tuple(getattr(node, "needs", ()) or ())


def _cost(node: Any) -> float:
    return float(getattr(node, "cost", DEFAULT_COST))


def _graph(rules: Sequence[Any]) -> tuple[list[Any], dict[Any, tuple[Any, ...]]]:
    """(every node, highest upward rank first, ties in discovery order; node -> the nodes it waits for). Rules are
    the nodes ("rule", index); tables are their functions, found depth-first from the rules' `needs`."""
    found: list[Any] = []
    seen: set[int] = set()

    def visit(table: Table, path: tuple[int, ...]) -> None:
        if id(table) in path:
            raise ValueError(f"shared tables depend on each other in a cycle through {table.__qualname__}")
        if id(table) in seen:
            return
        for need in _needs(table):
            visit(need, path + (id(table),))
        seen.add(id(table))
        found.append(table)

    for index, rule in enumerate(rules):
        for table in _needs(rule):
            visit(table, ())
        found.append(("rule", index))
    waits: dict[Any, tuple[Any, ...]] = {node: _needs(node) for node in found if not isinstance(node, tuple)}
    for index, rule in enumerate(rules):
        waits[("rule", index)] = _needs(rule)
    rank: dict[Any, float] = {}
    for node in reversed(found):  # every node comes after what it needs, so its dependents are ranked already
        cost = _cost(rules[node[1]]) if isinstance(node, tuple) else _cost(node)
        rank[node] = cost
    for node in reversed(found):
        for need in waits[node]:
            rank[need] = max(rank[need], _cost(need) + rank[node])
    position = {node: i for i, node in enumerate(found)}
    return sorted(found, key=lambda node: (-rank[node], position[node])), waits


def run_rules(ctx: "AnalysisContext", rules: Sequence["Rule"], jobs: int) -> list["pd.DataFrame"]:
    """`[rule.run(ctx) for rule in rules]`, on `jobs` threads (see the module docstring)."""
    if jobs <= 1 or not rules:
        return [rule.run(ctx) for rule in rules]
    return _run(ctx, rules, jobs)


def build_tables(ctx: "AnalysisContext", tables: Sequence[Table], jobs: int) -> None:
    """Build these shared tables (and the tables they need) on `jobs` threads, e.g. everything a figure reads
    before it draws; the results are in the context's cache. One thread: nothing to do ahead, they build lazily."""
    if jobs > 1 and tables:
        _run(ctx, [_TableAsRule(table) for table in tables], jobs)


class _TableAsRule:
    """A table in the place of a rule (a sink of the graph), so one scheduler serves both."""

    def __init__(self, table: Table) -> None:
        self.needs = (table,)
        self.cost = 0.0

    def run(self, ctx: "AnalysisContext") -> None:
        return None


def _run(ctx: "AnalysisContext", rules: Sequence[Any], jobs: int) -> list[Any]:
    order, waits = _graph(rules)
    results: dict[int, Any] = {}
    done: set[Any] = set()
    started: set[Any] = set()
    running: dict[Future, Any] = {}
    error: BaseException | None = None

    def call(node: Any) -> Any:
        if isinstance(node, tuple):
            return rules[node[1]].run(ctx)
        return node(ctx)

    workers = min(jobs, MAX_JOBS)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pdtrace-rule") as pool:
        while True:
            if error is None:
                # a node is handed to a thread only when one is free, so a table that just became ready (say
                # request_state, on the critical path) is not queued behind independent work submitted earlier
                for node in order:
                    if len(running) >= workers:
                        break
                    if node not in started and all(need in done for need in waits[node]):
                        started.add(node)
                        running[pool.submit(call, node)] = node
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                node = running.pop(future)
                exc = future.exception()
                if exc is not None:
                    error = error or exc
                    continue
                done.add(node)
                if isinstance(node, tuple):
                    results[node[1]] = future.result()
    if error is not None:
        raise error
    return [results[i] for i in range(len(rules))]
