"""The real-engine tier's one hook: on CI (env CI=true), a test or module of this folder that skips fails the run.

A module here skips itself where vLLM's CPU build or NIXL is missing (real_engines.skip_unless_vllm_cpu,
`pytest.importorskip("nixl")`). On a developer's machine that is a skip, printed with its reason (`-rs`); on CI it
means the tier checked nothing of that module, so the run fails, after every module ran, naming each skip. Only a
run that selects the tier (its `-m` takes `real_vllm` tests, as .ci/real-engine.sh's does) is judged: the core tier
collects this folder too, under `-m 'not vllm and not real_vllm'`, and skips it there by design.

This file is named conftest.py, so pytest imports it as the module `conftest` (this folder is no package): the
core tier's modules read tests/conftest.py's names from their own paths, never by `from conftest import`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_SKIPS: list[tuple[str, str]] = []  # (node id, reason) of each skip under HERE, this run
_ROOT: list[Path] = []


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def selects_the_tier(config: pytest.Config) -> bool:
    """Whether the run's marker expression takes a `real_vllm` test (no expression takes every test)."""
    expr = (config.getoption("markexpr", "") or "").strip()
    if not expr:
        return True
    try:
        from _pytest.mark.expression import Expression

        return bool(Expression.compile(expr).evaluate(lambda name, *args, **kwargs: name == "real_vllm"))
    except Exception:  # pytest's expression module moved: read the expression as words
        return "real_vllm" in expr and "not real_vllm" not in expr


def pytest_configure(config: pytest.Config) -> None:
    _ROOT[:] = [Path(config.rootpath)]
    _SKIPS.clear()


def _mine(nodeid: str) -> bool:
    path = nodeid.split("::", 1)[0]
    if not path or not _ROOT:
        return False
    return (_ROOT[0] / path).resolve().is_relative_to(HERE)


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and _mine(report.nodeid):
        _SKIPS.append((report.nodeid, _reason(report)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and _mine(report.nodeid):
        _SKIPS.append((report.nodeid, _reason(report)))


def _judged(config: pytest.Config) -> bool:
    # the controller judges a pytest-xdist run (its workers' reports reach it); a worker does not
    return on_ci() and selects_the_tier(config) and not hasattr(config, "workerinput")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _SKIPS and _judged(session.config) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _SKIPS and _judged(config):
        terminalreporter.section("real-engine tier: a skip fails the run on CI", sep="=", red=True)
        for nodeid, reason in _SKIPS:
            terminalreporter.write_line(f"SKIPPED ON CI (fails the run): {nodeid}: {reason}")
