"""`pdtrace analyze` through the CLI: exit statuses, formats, rule selection, windows, instances, thresholds from
flags and from [tool.pdtrace], bad input as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import scenarios
import test_rules_blocks as faults
from pdtrace.analysis import analyze
from pdtrace.analysis.findings import FINDING_COLUMNS
from pdtrace.cli.analyze import parse_time
from pdtrace.errors import UsageError
from pdtrace.trace.builder import write_table


@pytest.fixture
def c02_dir(tmp_path: Path) -> Path:
    return write_table(faults.c02().table, tmp_path / "c02")


@pytest.fixture
def c11_dir(tmp_path: Path) -> Path:
    return write_table(faults.c11(600).table, tmp_path / "c11")


@pytest.fixture
def healthy_dir(tmp_path: Path) -> Path:
    return write_table(scenarios.healthy_pd().table, tmp_path / "healthy")


def test_clean_trace_exits_0(cli, healthy_dir):
    result = cli("analyze", healthy_dir)
    assert result.exit_code == 0, result.stderr
    assert "ERROR SUMMARY: 0 errors from 0 contexts" in result.stdout


def test_errors_exit_1_and_the_report_shows_the_evidence(cli, c02_dir):
    result = cli("analyze", c02_dir)
    assert result.exit_code == 1
    assert "completion_before_finish/send" in result.stdout
    assert "ERROR SUMMARY: 1 errors from 1 contexts" in result.stdout
    assert "the engine failed after it: engine_error" in result.stdout
    assert result.stderr == ""


def test_json_is_the_findings_document(cli, c02_dir):
    result = cli("analyze", c02_dir, "--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert set(doc) == {"pdtrace", "trace", "summary", "findings"}
    assert doc["trace"] == str(c02_dir)
    (finding,) = doc["findings"]
    assert set(FINDING_COLUMNS) <= set(finding)
    assert finding["rule"] == "completion_before_finish" and finding["subrule"] == "send"
    assert finding["instance"] == "P" and finding["dp_rank"] == 0 and finding["step"] == 1
    assert isinstance(finding["ts_ns"], int)
    ev = finding["evidence"][0]
    assert {"kind", "ts_ns", "seq", "req", "step"} <= set(ev)
    assert ev["kind"] == "kv_send_done" and ev["req"] == "r1"
    assert doc["summary"]["by_severity"]["error"] == 1


def test_json_matches_the_python_api(cli, c02_dir):
    result = cli("analyze", c02_dir, "--format", "json")
    api = analyze(str(c02_dir))
    doc = json.loads(result.stdout)
    assert [f["message"] for f in doc["findings"]] == list(api["message"])


def test_fail_on_levels(cli, c11_dir, tmp_path):
    gap = write_table(faults.c11(600, gap=True).table, tmp_path / "gap")   # only a warning
    assert cli("analyze", gap).exit_code == 0
    assert cli("analyze", gap, "--fail-on", "warning").exit_code == 1
    assert cli("analyze", c11_dir, "--fail-on", "never").exit_code == 0
    bad = cli("analyze", c11_dir, "--fail-on", "sometimes")
    assert bad.exit_code == 2 and "--fail-on" in bad.stderr


def test_rule_selection_and_unknown_rule(cli, c02_dir):
    assert cli("analyze", c02_dir, "--rules", "leaked_blocks,double_free").exit_code == 0
    assert cli("analyze", c02_dir, "--rules", "leaked_blocks", "--rules", "completion_before_finish").exit_code == 1
    bad = cli("analyze", c02_dir, "--rules", "leaked_blocks,no_such_rule")
    assert bad.exit_code == 2
    assert "unknown rule 'no_such_rule'" in bad.stderr and "Traceback" not in bad.stderr


def test_grace_threshold_flag(cli, tmp_path):
    short = write_table(faults.c11(20).table, tmp_path / "short")  # within NIXL's 30 s lease (newest release)
    assert cli("analyze", short).exit_code == 0
    assert cli("analyze", short, "--grace-s", "10").exit_code == 1
    assert cli("analyze", short, "--grace-s", "-1").exit_code == 2


def test_thresholds_from_pyproject(cli, tmp_path, monkeypatch):
    short = write_table(faults.c11(60).table, tmp_path / "short")
    project = tmp_path / "proj"
    (project / "sub").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[tool.pdtrace]\ngrace_s = 30\n")
    monkeypatch.chdir(project / "sub")                         # found from the cwd upward
    assert cli("analyze", short).exit_code == 1
    assert cli("analyze", short, "--grace-s", "100").exit_code == 0   # flags win
    other = tmp_path / "other.toml"
    other.write_text("[tool.pdtrace]\nfail_on = 'never'\n")
    assert cli("analyze", short, "--config", other).exit_code == 0
    typo = tmp_path / "typo.toml"
    typo.write_text("[tool.pdtrace]\ngrace = 30\n")
    result = cli("analyze", short, "--config", typo)
    assert result.exit_code == 2 and "unknown analysis setting 'grace'" in result.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[tool.pdtrace\n")
    assert cli("analyze", short, "--config", broken).exit_code == 2


def test_instance_filter(cli, tmp_path):
    both = write_table(faults.c11(600).table, tmp_path / "pd")    # the leak is on P
    assert cli("analyze", both, "--instance", "D").exit_code == 0
    assert cli("analyze", both, "--instance", "P").exit_code == 1
    bad = cli("analyze", both, "--instance", "X")
    assert bad.exit_code == 2 and "not in the trace" in bad.stderr


def test_time_window(cli, c02_dir):
    # the completion happens 1.8 ms into the trace
    assert cli("analyze", c02_dir, "--until", "1ms").exit_code == 0
    assert cli("analyze", c02_dir, "--since", "0.0015").exit_code == 1
    assert cli("analyze", c02_dir, "--since", "later").exit_code == 2


def test_parse_time_forms():
    start = 1_700_000_000_000_000_000
    assert parse_time("1.5", start, "--since") == start + 1_500_000_000
    assert parse_time("500ms", start, "--since") == start + 500_000_000
    assert parse_time("2min", start, "--since") == start + 120_000_000_000
    assert parse_time("1700000000000000123", start, "--since") == 1_700_000_000_000_000_123
    with pytest.raises(UsageError):
        parse_time("soon", start, "--since")


def test_unreadable_trace_is_one_line_exit_2(cli, tmp_path):
    missing = cli("analyze", tmp_path / "nope")
    assert missing.exit_code == 2 and missing.stderr.count("\n") == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("analyze", empty).exit_code == 2
    bad = empty / "part-000000.parquet"
    bad.write_bytes(b"PAR1 not really")
    result = cli("analyze", empty)
    assert result.exit_code == 2 and "Traceback" not in result.stderr


def test_help_lists_the_options(cli):
    result = cli("analyze", "--help")
    assert result.exit_code == 0
    for option in ("--format", "--rules", "--instance", "--since", "--until", "--fail-on", "--grace-s",
                   "--config"):
        assert option in result.stdout


def test_python_api_sorts_errors_first_and_records_what_ran():
    from pdtrace.analysis.registry import Rule

    trace = faults.c11(600, gap=True)                      # one warning (downgraded leak)
    extra = Rule(id="always", summary="test rule", run=lambda ctx: __import__(
        "pdtrace.analysis.findings", fromlist=["x"]).findings_frame([
            {"rule": "always", "subrule": "x", "severity": "error", "instance": "P", "ts_ns": 2**62,
             "message": "late error", "evidence": [], "blocks": [], "context": "always", "extra": {}}]))
    df = analyze(trace, rules=["leaked_blocks", extra])
    assert list(df["severity"]) == ["error", "warning"]     # errors first although later in time
    assert df.attrs["rules"] == ["leaked_blocks", "always"] and df.attrs["events"] == len(trace)
    with pytest.raises(UsageError):
        analyze(trace, rules=["nope"])
    with pytest.raises(UsageError):
        analyze(42)
