"""The installed entry point as a real process (`python -m pdtrace`, what the console script runs): output complete
and the exit status right after a read-only verb's fast exit, usage errors and record's normal exit kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_traces" / "completion_before_finish" / "trace"


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdtrace", *args], capture_output=True, timeout=120, **kwargs)


def test_analyze_output_is_complete_and_the_status_kept() -> None:
    proc = _run("analyze", str(SAMPLE), "--format", "json")
    assert proc.returncode == 1, proc.stderr  # the sample's race is an error finding
    report = json.loads(proc.stdout)  # the whole document arrived before the process left
    assert any(f["rule"] == "completion_before_finish" for f in report["findings"])
    clean = _run("analyze", str(SAMPLE), "--format", "json", "--fail-on", "never")
    assert clean.returncode == 0 and json.loads(clean.stdout) == report


def test_bad_input_still_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = _run("info", str(tmp_path))
    assert proc.returncode == 2
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "no Parquet files" in lines[0]


def test_version_and_usage_errors_keep_their_status() -> None:
    assert _run("--version").returncode == 0
    assert _run("analyze").returncode == 2
    assert _run("record").returncode == 2
