"""Rules on threads (pdtrace.analysis.parallel): the same findings as one after the other, tables built once and
before the rules that declare them, results in rule order, errors propagated, and the --jobs / [tool.pdtrace] knob."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from pdtrace.analysis import AnalysisConfig, analyze
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.findings import findings_frame
from pdtrace.analysis.once import OnceCache
from pdtrace.analysis.parallel import default_jobs, run_rules, shared_table
from pdtrace.analysis.registry import Rule, load_rules
from pdtrace.trace.builder import EventBuilder

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def _tiny_context() -> AnalysisContext:
    b = EventBuilder()
    b.add("req_add", req="r1", n=16)
    return AnalysisContext(trace=b.trace())


def _rule(name: str, run: Any, needs: tuple = ()) -> Rule:
    return Rule(id=name, summary=name, run=run, needs=needs)


def _one_finding(name: str) -> pd.DataFrame:
    return findings_frame([{"rule": name, "severity": "info", "message": name}])


@pytest.mark.parametrize("sample", sorted(p.name for p in SAMPLES.iterdir() if (p / "trace").is_dir()))
def test_threads_give_the_same_findings_as_one_after_the_other(sample: str) -> None:
    trace = SAMPLES / sample / "trace"
    serial = analyze(trace, config=AnalysisConfig(jobs=1))
    threaded = analyze(trace, config=AnalysisConfig(jobs=4))
    assert len(serial) == len(threaded)
    pd.testing.assert_frame_equal(serial, threaded)


def test_tables_are_built_once_and_before_the_rules_that_need_them() -> None:
    ctx = _tiny_context()
    log: list[str] = []
    lock = threading.Lock()

    def note(what: str) -> None:
        with lock:
            log.append(what)

    @shared_table()
    def base(c: AnalysisContext) -> int:
        return c.cached("base", lambda: (note("base"), time.sleep(0.05), 1)[2])

    @shared_table(base)
    def left(c: AnalysisContext) -> int:
        return c.cached("left", lambda: (note("left"), base(c) + 1)[1])

    @shared_table(base)
    def right(c: AnalysisContext) -> int:
        return c.cached("right", lambda: (note("right"), base(c) + 2)[1])

    def run_a(c: AnalysisContext) -> pd.DataFrame:
        note("rule a")
        assert left(c) == 2 and right(c) == 3
        return _one_finding("a")

    def run_b(c: AnalysisContext) -> pd.DataFrame:
        note("rule b")
        assert right(c) == 3
        return _one_finding("b")

    frames = run_rules(ctx, [_rule("a", run_a, (left, right)), _rule("b", run_b, (right,))], jobs=3)
    assert [f["rule"].tolist() for f in frames] == [["a"], ["b"]]
    assert sorted(log) == ["base", "left", "right", "rule a", "rule b"]  # each table built exactly once
    assert log[0] == "base"
    assert log.index("rule a") > max(log.index("left"), log.index("right"))
    assert log.index("rule b") > log.index("right")


def test_results_keep_the_rules_order_when_the_first_finishes_last() -> None:
    ctx = _tiny_context()
    second_done = threading.Event()

    def slow(c: AnalysisContext) -> pd.DataFrame:
        assert second_done.wait(5)
        return _one_finding("slow")

    def fast(c: AnalysisContext) -> pd.DataFrame:
        second_done.set()
        return _one_finding("fast")

    frames = run_rules(ctx, [_rule("slow", slow), _rule("fast", fast)], jobs=2)
    assert [f["rule"].iloc[0] for f in frames] == ["slow", "fast"]


def test_an_error_in_a_rule_or_a_table_propagates() -> None:
    ctx = _tiny_context()

    @shared_table()
    def broken(c: AnalysisContext) -> None:
        raise RuntimeError("table failed")

    def never(c: AnalysisContext) -> pd.DataFrame:
        raise AssertionError("a rule whose table failed must not run")

    with pytest.raises(RuntimeError, match="table failed"):
        run_rules(ctx, [_rule("x", never, (broken,)), _rule("ok", lambda c: _one_finding("ok"))], jobs=2)

    def failing(c: AnalysisContext) -> pd.DataFrame:
        raise KeyError("rule failed")

    with pytest.raises(KeyError, match="rule failed"):
        run_rules(ctx, [_rule("ok", lambda c: _one_finding("ok")), _rule("bad", failing)], jobs=2)


def test_a_cycle_between_tables_is_refused() -> None:
    def first(c: AnalysisContext) -> None: ...

    @shared_table(first)
    def second(c: AnalysisContext) -> None: ...

    shared_table(second)(first)
    with pytest.raises(ValueError, match="cycle"):
        run_rules(_tiny_context(), [_rule("x", lambda c: _one_finding("x"), (second,))], jobs=2)


def test_one_job_runs_on_the_callers_thread_in_order() -> None:
    seen: list[tuple[str, int]] = []

    def make(name: str) -> Rule:
        return _rule(name, lambda c: (seen.append((name, threading.get_ident())), _one_finding(name))[1])

    run_rules(_tiny_context(), [make("a"), make("b"), make("c")], jobs=1)
    assert seen == [(n, threading.get_ident()) for n in "abc"]


def test_once_cache_builds_a_value_once_under_concurrent_callers() -> None:
    cache = OnceCache()
    calls: list[int] = []
    barrier = threading.Barrier(4)

    def build() -> int:
        calls.append(1)
        time.sleep(0.05)
        return 42

    results: list[int] = []

    def ask() -> None:
        barrier.wait()
        results.append(cache.get("key", build))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [42] * 4 and len(calls) == 1


def test_builtin_rules_declare_registered_shared_tables() -> None:
    for rule in load_rules().values():
        assert rule.needs, f"{rule.id} declares no shared table"
        for table in rule.needs:
            assert callable(table) and hasattr(table, "needs"), f"{rule.id}: {table!r} is not a shared_table"


def test_default_jobs_is_between_one_and_four() -> None:
    assert 1 <= default_jobs() <= 4


def test_jobs_from_the_command_line_and_pyproject(cli: Any, tmp_path: Path) -> None:
    trace = SAMPLES / "completion_before_finish" / "trace"
    outputs = []
    for args in (["-j", "1"], ["--jobs", "3"]):
        res = cli("analyze", trace, "--format", "json", "--fail-on", "never", *args)
        assert res.exit_code == 0, res.stderr
        outputs.append(json.loads(res.stdout)["findings"])
    assert outputs[0] == outputs[1] and outputs[0]
    res = cli("analyze", trace, "--jobs", "-2")
    assert res.exit_code == 2 and "jobs" in res.stderr and "Traceback" not in res.stderr
    project = tmp_path / "pyproject.toml"
    project.write_text("[tool.pdtrace]\njobs = 'many'\n")
    res = cli("analyze", trace, "--config", project)
    assert res.exit_code == 2 and "jobs" in res.stderr
    project.write_text("[tool.pdtrace]\njobs = 1\n")
    res = cli("analyze", trace, "--config", project, "--format", "json", "--fail-on", "never")
    assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == outputs[0]


def test_the_longest_chain_is_scheduled_first() -> None:
    from pdtrace.analysis.parallel import _graph

    @shared_table(cost=0.01)
    def cheap_base(c: AnalysisContext) -> None: ...

    @shared_table(cheap_base, cost=0.5)
    def slow_table(c: AnalysisContext) -> None: ...

    light = _rule("light", lambda c: _one_finding("light"))
    heavy = Rule(id="heavy", summary="heavy", run=lambda c: _one_finding("heavy"), needs=(slow_table,), cost=0.2)
    order, waits = _graph([light, heavy])
    # upward rank: cheap_base 0.71, slow_table 0.7, heavy 0.2, light 0.05 (the default cost)
    assert order == [cheap_base, slow_table, ("rule", 1), ("rule", 0)]
    assert waits[slow_table] == (cheap_base,) and waits[("rule", 1)] == (slow_table,) and waits[("rule", 0)] == ()


def test_build_tables_builds_what_is_asked_and_its_needs_once() -> None:
    from pdtrace.analysis.parallel import build_tables

    ctx = _tiny_context()
    calls: list[str] = []

    @shared_table()
    def base(c: AnalysisContext) -> int:
        return c.cached("base", lambda: (calls.append("base"), 1)[1])

    @shared_table(base)
    def top(c: AnalysisContext) -> int:
        return c.cached("top", lambda: (calls.append("top"), base(c) + 1)[1])

    build_tables(ctx, [top], jobs=1)
    assert calls == []  # one thread: nothing ahead of time, tables build when first read
    build_tables(ctx, [top, base], jobs=2)
    assert sorted(calls) == ["base", "top"] and top(ctx) == 2 and calls.count("base") == 1


def test_every_figure_declares_shared_tables() -> None:
    from pdtrace.plot import KINDS
    from pdtrace.plot.figures import FIGURE_TABLES, FIGURES

    assert set(FIGURE_TABLES) == set(FIGURES) == set(KINDS)
    for kind, tables in FIGURE_TABLES.items():
        assert tables and all(hasattr(t, "needs") for t in tables), kind


def test_allocation_settings_nest_and_are_restored_by_the_last_exit() -> None:
    """analyze() enters them while a figure's table build holds them: the inner exit must not undo them."""
    from pdtrace.analysis import allocation_settings

    setter = getattr(np._core.multiarray, "_set_madvise_hugepage", None)
    if setter is None:
        pytest.skip("this numpy has no huge-page switch")

    def huge_pages() -> bool:
        value = setter(False)
        setter(value)
        return bool(value)

    before = huge_pages()
    setter(True)
    try:
        with allocation_settings():
            assert not huge_pages()
            with allocation_settings():
                assert not huge_pages()
            assert not huge_pages()
        assert huge_pages()
    finally:
        setter(before)
