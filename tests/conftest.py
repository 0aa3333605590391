"""Shared fixtures: run the CLI in-process exactly as the console script does (errors mapped to exit codes)."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TRACES = REPO / "sample_traces"


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    """`cli("info", path)` runs `pdtrace info path` through `pdtrace.cli.main` and returns exit code and output."""
    from pdtrace.cli import main

    def run(*args: object) -> CliResult:
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        finally:
            monkeypatch.undo()
        return CliResult(code, out.getvalue(), err.getvalue())

    return run
