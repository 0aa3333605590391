"""pdtrace's error type. Each error carries its exit status; the CLI maps it to the process exit in one place."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2


class PdtraceError(Exception):
    """An error a user can act on: printed as one line, never a traceback, and the process exits with `exit_code`."""

    exit_code: int = EXIT_BAD_INPUT

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class TraceError(PdtraceError):
    """A trace that cannot be read: missing, empty, not Parquet, truncated, wrong columns, unknown schema version."""


class UsageError(PdtraceError):
    """Bad command-line usage or configuration: an unknown rule, an invalid threshold, a conflicting option."""


class RecordingError(PdtraceError):
    """`pdtrace record` could not start: an output directory in use, a command that does not exist, no vLLM."""
