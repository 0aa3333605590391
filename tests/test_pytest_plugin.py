"""`pytest -p pdtrace` (pdtrace/pytest_plugin.py) on pytester's inner runs, no vLLM needed.

The inner tests stand in for a hooked vLLM: they emit events through the recording session exactly as the hooks
do (`session.recorder(...).channel("scheduler").emit(...)`), so the plugin's per-test directory, closing,
analysis and verdict are exercised on traces whose findings are checked here first with `pdtrace.analyze`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pdtrace
from pdtrace.recording import session

pytest_plugins = ["pytester"]

#: The inner tests' event helpers (a fake hook: what v0_33.py's wrappers emit for these lifecycles).
HELPERS = '''
import os
import pytest
from pdtrace.recording import session


def scheduler():
    return session.recorder("i0", "both").channel("scheduler")


def healthy_request(ch, req="r1", block=1):
    ch.emit("req_add", step=0, req=req, n=16)
    ch.emit("sched", step=0, n=16)
    ch.emit("req_sched", step=0, req=req, n=16)
    ch.emit("blocks_alloc", step=0, req=req, blocks=[block])
    ch.emit("req_finish", step=1, req=req, reason="stop", status="FINISHED_STOPPED", delay_free=False)
    ch.emit("blocks_free", step=1, req=req, blocks=[block], reason="finished", deferred=False)


def double_free(ch):
    healthy_request(ch, "r2", 2)
    ch.emit("blocks_free", step=2, req="r2", blocks=[2], reason="finished", deferred=False)


def unknown_completion(ch):
    ch.emit("kv_send_done", step=3, req="r9")
'''


def _trace_of(emit: str, tmp_path: Path) -> Path:
    """Emit with the helpers into a directory of our own (no plugin involved) and return it."""
    namespace: dict = {}
    exec(HELPERS, namespace)
    trace = tmp_path / f"direct-{emit}"
    session.configure(trace, source="test")
    try:
        namespace[emit](namespace["scheduler"]())
    finally:
        session.reset()
    return trace


@pytest.fixture(scope="module")
def severities(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, str]]]:
    """Each helper's findings as `pdtrace analyze` gives them: the preconditions of the verdicts tested here."""
    out = {}
    for emit in ("double_free", "unknown_completion"):
        findings = pdtrace.analyze(_trace_of(emit, tmp_path_factory.mktemp(emit)))
        out[emit] = sorted(zip(findings["severity"], findings["rule"] + "/" + findings["subrule"]))
    return out


def test_the_helpers_traces_have_the_findings_the_verdicts_rely_on(severities, tmp_path):
    assert severities["double_free"] == [("error", "double_free/not_owned")]
    assert severities["unknown_completion"] == [("warning", "double_free/unknown_id")]
    namespace: dict = {}
    exec(HELPERS, namespace)
    healthy = tmp_path / "healthy"
    session.configure(healthy, source="test")
    try:
        namespace["healthy_request"](namespace["scheduler"]())
    finally:
        session.reset()
    assert len(pdtrace.analyze(healthy)) == 0


def _summary(directory: Path) -> dict[str, dict]:
    return {rec["nodeid"].split("::")[-1]: rec for rec in json.loads((directory / "summary.json").read_text())}


def test_a_clean_test_passes_and_its_trace_is_kept_per_test(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
def test_clean():
    assert session.directory() == os.environ["PDTRACE_TRACE_DIR"]
    healthy_request(scheduler())


def test_nothing_recorded():
    pass
''')
    out = tmp_path / "traces"
    result = pytester.runpytest("-p", "pdtrace", "--pdtrace-dir", str(out))
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*= pdtrace =*", "2 tests recorded, 1 with events, 0 with recording switched off*"])
    summary = _summary(out)
    clean = summary["test_clean"]
    assert clean["events"] == 6 and clean["findings"] == {} and not clean["failed_test"]
    assert Path(clean["trace"]).parent == out and list(Path(clean["trace"]).glob("**/*.parquet"))
    assert summary["test_nothing_recorded"]["events"] == 0
    assert not Path(summary["test_nothing_recorded"]["trace"]).exists()  # an empty directory is not left behind
    assert not session.is_configured()


def test_an_error_finding_fails_the_test_with_the_report(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
def test_double_free():
    double_free(scheduler())


def test_healthy_after():
    healthy_request(scheduler())
''')
    result = pytester.runpytest("--pdtrace", "--pdtrace-dir", str(tmp_path))
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*pdtrace: findings reaching --pdtrace-fail-on=error: double_free/not_owned*",
        "*ERROR double_free/not_owned*req r2*",
        "*ERROR SUMMARY: 1 errors from 1 contexts*",
        "*test_double_free: 1 error; reaching the level: FAILED double_free/not_owned",
    ])
    summary = _summary(tmp_path)
    assert summary["test_double_free"]["failing"] == ["double_free/not_owned"]
    assert summary["test_double_free"]["failed_test"]
    assert summary["test_healthy_after"]["findings"] == {}  # each test has its own trace


def test_report_only_keeps_the_outcome_and_reports(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
def test_double_free():
    double_free(scheduler())
''')
    result = pytester.runpytest("--pdtrace", "--pdtrace-report", "--pdtrace-dir", str(tmp_path), "-rA")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*- pdtrace -*", "*ERROR double_free/not_owned*",
                                 "*test_double_free: 1 error; reaching the level: double_free/not_owned"])
    record = _summary(tmp_path)["test_double_free"]
    assert record["failing"] == ["double_free/not_owned"] and not record["failed_test"]


def test_fail_on_sets_the_least_severity_that_fails(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
def test_unknown_completion():
    unknown_completion(scheduler())
''')
    pytester.runpytest("--pdtrace", "--pdtrace-dir", str(tmp_path / "e")).assert_outcomes(passed=1)
    result = pytester.runpytest("--pdtrace", "--pdtrace-fail-on", "warning", "--pdtrace-dir", str(tmp_path / "w"))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*--pdtrace-fail-on=warning: double_free/unknown_id*"])


def test_a_failing_test_keeps_its_own_failure(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
def test_fails_itself():
    double_free(scheduler())
    assert False, "the test's own failure"
''')
    result = pytester.runpytest("--pdtrace", "--pdtrace-dir", str(tmp_path))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the test's own failure*", "*- pdtrace -*", "*ERROR double_free/not_owned*"])
    assert not _summary(tmp_path)["test_fails_itself"]["failed_test"]


def test_allow_marker_names_a_rule_or_a_subrule(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
@pytest.mark.pdtrace_allow("double_free")
def test_allowed_rule():
    double_free(scheduler())


@pytest.mark.pdtrace_allow("leaked_blocks", "double_free/not_owned")
def test_allowed_subrule():
    double_free(scheduler())


@pytest.mark.pdtrace_allow("double_free/unknown_id")
def test_other_subrule_allowed():
    double_free(scheduler())
''')
    result = pytester.runpytest("--pdtrace", "--pdtrace-dir", str(tmp_path), "--strict-markers")
    result.assert_outcomes(passed=2, failed=1)
    summary = _summary(tmp_path)
    assert summary["test_allowed_rule"]["allowed"] == ["double_free/not_owned"]
    assert summary["test_allowed_rule"]["failing"] == []
    assert summary["test_other_subrule_allowed"]["failing"] == ["double_free/not_owned"]
    result.stdout.fnmatch_lines(["*test_allowed_rule: 1 error; reaching the level: - (allowed: double_free/not_owned)"])


def test_skip_marker_leaves_a_test_unrecorded(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
@pytest.mark.pdtrace_skip
def test_unrecorded():
    assert not session.is_configured()
    assert "PDTRACE_TRACE_DIR" not in os.environ


def test_recorded():
    assert session.is_configured()
    double_free(scheduler())
''')
    result = pytester.runpytest("--pdtrace", "--pdtrace-dir", str(tmp_path), "--strict-markers")
    result.assert_outcomes(passed=1, failed=1)
    assert set(_summary(tmp_path)) == {"test_recorded"}


def test_a_hook_error_switches_recording_off_and_keeps_the_outcome(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
from pdtrace.recording.vllm._runtime import RUNTIME


def test_hook_fails():
    ch = scheduler()
    ch.emit("req_add", step=0, req="r1", n=16)
    RUNTIME.fail("fake hook", ValueError("a test double"))  # what a wrapper does when its own code raises


def test_next_test_starts_clean():
    assert RUNTIME.errors == 0 and RUNTIME.first_error is None
''')
    result = pytester.runpytest("--pdtrace", "--pdtrace-dir", str(tmp_path))
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*1 with recording switched off by a hook error*",
                                 "*test_hook_fails: recording off after 1 hook error(s): fake hook: ValueError: a "
                                 "test double"])
    record = _summary(tmp_path)["test_hook_fails"]
    assert record["hook_errors"] == 1 and record["events"] == 2  # req_add, then recorder_off


def test_a_trace_that_cannot_be_analysed_changes_nothing(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makepyfile(HELPERS + '''
def test_writes_garbage():
    (__import__("pathlib").Path(session.directory()) / "part-garbage.parquet").write_bytes(b"not parquet")
''')
    result = pytester.runpytest("--pdtrace", "--pdtrace-dir", str(tmp_path))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*1 with a pdtrace error*", "*test_writes_garbage: trace not analysed: TraceError*"])


def test_recording_that_cannot_start_changes_nothing(pytester: pytest.Pytester, tmp_path: Path):
    pytester.makeconftest('''
from pdtrace.recording import session


def fail(*args, **kwargs):
    raise OSError("disk full")


session.configure = fail
''')
    pytester.makepyfile(HELPERS + '''
def test_runs_unrecorded():
    assert not session.is_configured() and "PDTRACE_TRACE_DIR" not in os.environ
''')
    result = pytester.runpytest_subprocess("--pdtrace", "--pdtrace-dir", str(tmp_path), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_runs_unrecorded: recording not started: OSError: disk full"])


def test_inert_unless_asked_for(pytester: pytest.Pytester):
    pytester.makepyfile('''
import os
import sys
import pytest


@pytest.mark.pdtrace_skip
@pytest.mark.pdtrace_allow("double_free")
def test_nothing_of_pdtrace_runs(request):
    assert request.config.pluginmanager.has_plugin("pdtrace")  # the entry point is loaded
    assert request.config.pluginmanager.get_plugin("pdtrace-recording") is None
    assert "PDTRACE_TRACE_DIR" not in os.environ
    assert "pdtrace.recording.session" not in sys.modules
''')
    # A subprocess, so that sys.modules is the inner run's own; markers stay registered for --strict-markers.
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "= pdtrace =" not in result.stdout.str()


def test_under_xdist_the_controller_gathers_every_workers_records(pytester: pytest.Pytester, tmp_path: Path):
    # With `-n 2` the tests run in two worker processes: each worker records and judges its own tests (a verdict
    # travels back in the report), and the controller, which runs none, writes the one summary.json and prints the
    # summary of all of them. Without --pdtrace-dir the workers write under the controller's temporary directory.
    pytest.importorskip("xdist")
    pytester.makepyfile(HELPERS + '''
def test_double_free():
    double_free(scheduler())


def test_clean_1():
    healthy_request(scheduler())


def test_clean_2():
    healthy_request(scheduler(), "r3", 3)


def test_clean_3():
    healthy_request(scheduler(), "r4", 4)
''')
    out = tmp_path / "traces"
    result = pytester.runpytest_subprocess("-p", "xdist", "-n", "2", "--pdtrace", "--pdtrace-dir", str(out),
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "*pdtrace: findings reaching --pdtrace-fail-on=error: double_free/not_owned*",
        "*= pdtrace =*",
        "4 tests recorded, 4 with events, 0 with recording switched off*",
        "*test_double_free: 1 error; reaching the level: FAILED double_free/not_owned",
    ])
    summary = _summary(out)
    assert sorted(summary) == ["test_clean_1", "test_clean_2", "test_clean_3", "test_double_free"]
    assert summary["test_double_free"]["failed_test"] and summary["test_clean_2"]["events"] == 6
    assert all(Path(rec["trace"]).parent == out for rec in summary.values())

    result = pytester.runpytest_subprocess("-p", "xdist", "-n", "2", "--pdtrace", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    line = next(line for line in result.stdout.lines if line.startswith("4 tests recorded"))
    root = Path(line.rsplit("traces in ", 1)[1])
    assert sorted(_summary(root)) == sorted(summary)
    assert all(Path(rec["trace"]).parent == root for rec in _summary(root).values())
