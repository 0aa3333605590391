""".ci/vllm_suite/compare.py on fake inputs: the witness of vLLM's own suite must fail when it saw nothing (no test
recorded, a file whose tests recorded no event, hooks that switched themselves off unexplained), as it fails when an
outcome changed or an error finding is unexplained; and pass on a healthy comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

COMPARE = Path(__file__).resolve().parents[1] / ".ci" / "vllm_suite" / "compare.py"
TESTS = ["tests/v1/core/test_scheduler.py::test_a", "tests/v1/core/test_scheduler.py::test_b",
         "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py::test_c"]


def junit(path: Path, outcomes: dict[str, str]) -> Path:
    cases = []
    for nodeid, outcome in outcomes.items():
        module, name = nodeid.split("::")
        classname = module[:-3].replace("/", ".")
        inner = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped message='x'/>"}[outcome]
        cases.append(f'<testcase classname="{classname}" name="{name}">{inner}</testcase>')
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(cases)}</testsuite>'
                    "</testsuites>")
    return path


def record(nodeid: str, events: int = 12, hook_errors: int = 0, error_rules: tuple[str, ...] = ()) -> dict:
    return {"nodeid": nodeid, "trace": f"/traces/{nodeid}", "events": events,
            "findings": {"error": len(error_rules)} if error_rules else {}, "failing": list(error_rules),
            "allowed": [], "hook_errors": hook_errors,
            "first_hook_error": "update_from_output: TypeError: int() of a 'Mock'" if hook_errors else None,
            "pdtrace_error": None, "failed_test": False}


def compare(tmp_path: Path, records: list[dict] | None, allowlist: str = "",
            traced: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    plain = junit(tmp_path / "plain.xml", {t: "passed" for t in TESTS})
    with_pdtrace = junit(tmp_path / "pdtrace.xml", traced or {t: "passed" for t in TESTS})
    summary = tmp_path / "summary.json"
    if records is not None:
        summary.write_text(json.dumps(records))
    allow = tmp_path / "allowlist.txt"
    allow.write_text(allowlist)
    return subprocess.run([sys.executable, str(COMPARE), str(plain), str(with_pdtrace), str(summary), str(allow)],
                          capture_output=True, text=True, timeout=60)


def test_a_healthy_comparison_passes(tmp_path):
    out = compare(tmp_path, [record(t) for t in TESTS])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "vllm-suite: ok" in out.stdout


def test_hooks_that_recorded_nothing_fail(tmp_path):
    out = compare(tmp_path, [record(t, events=0) for t in TESTS])
    assert out.returncode == 1, out.stdout
    assert "nothing recorded" in out.stdout


@pytest.mark.parametrize("summary", [[], None], ids=["empty summary", "no summary"])
def test_a_run_the_plugin_recorded_no_test_of_fails(tmp_path, summary):
    out = compare(tmp_path, summary)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no test recorded at all" in out.stdout


def test_a_file_whose_tests_recorded_nothing_fails(tmp_path):
    records = [record(TESTS[0]), record(TESTS[1]), record(TESTS[2], events=0)]
    out = compare(tmp_path, records)
    assert out.returncode == 1, out.stdout
    assert "test files whose tests recorded no event: 1" in out.stdout
    assert "  tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py" in out.stdout


def test_one_test_of_a_file_that_recorded_nothing_is_no_failure(tmp_path):
    """A test that never steps a Scheduler (a config check beside the scheduling tests) records nothing."""
    out = compare(tmp_path, [record(TESTS[0]), record(TESTS[1], events=0), record(TESTS[2])])
    assert out.returncode == 0, out.stdout


def test_hooks_that_switched_themselves_off_fail(tmp_path):
    out = compare(tmp_path, [record(TESTS[0], hook_errors=1), record(TESTS[1]), record(TESTS[2])])
    assert out.returncode == 1, out.stdout
    assert "1 tests whose hooks switched off unexplained" in out.stdout
    assert f"{TESTS[0]}: update_from_output" in out.stdout and "NOT IN THE ALLOWLIST" in out.stdout


def test_hooks_off_named_by_the_allowlist_pass(tmp_path):
    allow = f"# a test double\nhooks-off | {TESTS[0]} | a Mock reaches the hook\n"
    out = compare(tmp_path, [record(TESTS[0], hook_errors=1), record(TESTS[1]), record(TESTS[2])], allow)
    assert out.returncode == 0, out.stdout
    # and one that no longer switches off is reported, not failed
    again = compare(tmp_path, [record(t) for t in TESTS], allow)
    assert again.returncode == 0 and "allowlisted (hooks-off) but recorded without a hook error now" in again.stdout


def test_a_changed_outcome_and_an_unexplained_error_still_fail(tmp_path):
    changed = compare(tmp_path, [record(t) for t in TESTS], traced={**{t: "passed" for t in TESTS}, TESTS[1]: "failed"})
    assert changed.returncode == 1 and "CHANGED" in changed.stdout
    error = compare(tmp_path, [record(TESTS[0], error_rules=("lifecycle/x",)), record(TESTS[1]), record(TESTS[2])])
    assert error.returncode == 1 and "NOT IN THE ALLOWLIST" in error.stdout
