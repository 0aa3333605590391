"""vLLM tier: `pytest -p pdtrace` over tests that drive vLLM 0.33.0's real Scheduler (pytester inner runs).

The plugin installs the real hook table itself (no `recording` fixture), records each inner test into its own
trace and analyses it: a healthy P-side lifecycle stays clean; a test that injects a send completion for a running
request (vLLM asserts; the test expects it) is a true positive that fails the test unless allowed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM 0.33.0 (build its venv with .ci/install-vllm.sh VENV)")

pytestmark = pytest.mark.vllm
pytest_plugins = ["pytester"]

HARNESS_DIR = Path(__file__).resolve().parent

INNER = f'''
import sys
import pytest

sys.path.insert(0, {str(HARNESS_DIR)!r})
import harness as H


def _prefill_scheduler(tmp_path):
    return H.make_scheduler(H.make_vllm_config(H.tiny_model_dir(tmp_path), kv_role="kv_producer",
                                               engine_id="prefill-0"))


def test_prefill_side_lifecycle(tmp_path):
    s = _prefill_scheduler(tmp_path)
    faker = H.OutputFaker()
    s.add_request(H.make_request("r1", 40, remote_decode=True))
    H.step(s, faker)
    H.step(s, faker)
    H.step(s, faker, finished_sending={{"r1"}})
    assert H.num_free_blocks(s) == 99


def _send_done_while_running(tmp_path):
    s = _prefill_scheduler(tmp_path)
    faker = H.OutputFaker()
    s.add_request(H.make_request("r2", 300, remote_decode=True))  # 64 tokens a step: still running after one
    so = s.schedule()
    with pytest.raises(AssertionError):
        s.update_from_output(so, faker.output(so, finished_sending={{"r2"}}))


def test_send_completion_for_a_running_request(tmp_path):
    _send_done_while_running(tmp_path)


@pytest.mark.pdtrace_allow("completion_before_finish")
def test_send_completion_for_a_running_request_allowed(tmp_path):
    _send_done_while_running(tmp_path)
'''


def test_plugin_over_real_scheduler_tests(pytester: pytest.Pytester, tmp_path: Path):
    from pdtrace.recording.vllm import hooks_installed

    assert not hooks_installed()
    pytester.makepyfile(INNER)
    result = pytester.runpytest("-p", "pdtrace", "--pdtrace-dir", str(tmp_path))
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*pdtrace: findings reaching --pdtrace-fail-on=error: completion_before_finish/send*",
        "*ERROR completion_before_finish/send*prefill-0*req r2*",
    ])
    summary = {r["nodeid"].split("::")[-1]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    healthy = summary["test_prefill_side_lifecycle"]
    assert healthy["events"] > 10 and healthy["findings"] == {} and healthy["hook_errors"] == 0
    assert summary["test_send_completion_for_a_running_request"]["failing"] == ["completion_before_finish/send"]
    assert summary["test_send_completion_for_a_running_request_allowed"]["allowed"] == [
        "completion_before_finish/send"]
    assert not hooks_installed()  # the run put vLLM's methods back
