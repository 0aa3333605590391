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


def test_partitions_in_worker_processes_of_a_real_cli_process(tmp_path: Path) -> None:
    """`--partitions --jobs 2` starts a process pool (forkserver) from the CLI's own process, whose `__main__` is
    pdtrace's (a test process's is pytest's): the same report as the whole-trace analysis (issue 22 item 8)."""
    from test_partitions import cross_instance_trace

    from pdtrace.trace.builder import write_table

    trace = tmp_path / "trace"
    write_table(cross_instance_trace().table, trace)
    parts = _run("analyze", str(trace), "--format", "json", "--partitions", "--jobs", "2", "--fail-on", "never")
    assert parts.returncode == 0, parts.stderr
    whole = _run("analyze", str(trace), "--format", "json", "--whole", "--fail-on", "never")
    assert json.loads(parts.stdout) == json.loads(whole.stdout)
    assert b"linked" in parts.stderr  # phase 2 ran in the pool too


def test_files_written_by_read_only_verbs_are_complete_after_the_fast_exit(tmp_path: Path) -> None:
    """plot and export write files, then the process leaves with os._exit (no interpreter teardown, no atexit):
    the files must be whole. An in-process CLI run never takes that exit (issue 22 item 8)."""
    png, chrome = tmp_path / "p.png", tmp_path / "e.json"
    assert _run("plot", str(SAMPLE), "-o", str(png)).returncode == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[-12:-4] == b"\x00\x00\x00\x00IEND"  # the last chunk arrived
    assert _run("export", str(SAMPLE), "--to", "chrome", "-o", str(chrome)).returncode == 0
    assert json.loads(chrome.read_text())["traceEvents"]


def test_show_output_is_the_in_process_output(cli) -> None:
    """`show` through a pipe from a real process prints what the in-process run prints."""
    proc = _run("show", str(SAMPLE), "--req", "r00000-p", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads(cli("show", SAMPLE, "--req", "r00000-p", "--format", "json").stdout)
