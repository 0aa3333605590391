"""pdtrace's command line. One module per verb; this module only wires them up and maps errors to exit codes."""

from __future__ import annotations

import os
import sys

from pdtrace.malloc import single_arena

# before anything starts a thread: numpy's and pyarrow's imports start threads that would each get an arena of
# their own, and glibc hands later threads (the rules') one of those (see pdtrace.malloc)
single_arena()

import typer  # noqa: E402

from pdtrace.cli.app import app, err_console
from pdtrace.errors import EXIT_BAD_INPUT, PdtraceError  # noqa: E402

# Each import registers one verb on `app`, in the order `pdtrace --help` lists them.
from pdtrace.cli import record, dump, info, analyze, show, plot, export, chaos, replay  # noqa: E402,F401  isort: skip


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `pdtrace` console script: the one place where errors become exit statuses."""
    try:
        rv = app(args=argv, prog_name="pdtrace", standalone_mode=False)
    except PdtraceError as exc:
        err_console.print(f"pdtrace: error: {exc}", markup=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("pdtrace: aborted", markup=False)
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors: unknown option, missing argument (exit 2)
        show_usage = getattr(exc, "show", None)
        if show_usage is not None:
            show_usage()
        else:
            err_console.print(f"pdtrace: error: {exc.format_message()}", markup=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as exc:  # a bug in pdtrace: still one line, unless the user asks for the traceback
        if os.environ.get("PDTRACE_DEBUG"):
            raise
        err_console.print(f"pdtrace: internal error: {type(exc).__name__}: {exc} (set PDTRACE_DEBUG=1 for the "
                          "traceback)", markup=False)
        sys.exit(EXIT_BAD_INPUT)
    sys.exit(rv if isinstance(rv, int) else 0)


#: Verbs that only read a trace and write their output through files they close: nothing is lost if their process
#: skips the interpreter's teardown.
READ_ONLY_VERBS = frozenset({"info", "analyze", "show", "plot", "export"})


def console_main() -> None:
    """The `pdtrace` console script: `main()`; after a read-only verb, the process then exits without tearing the
    interpreter down. Freeing a 10M-event trace and its analysis (2 GB in many blocks) at exit costs ~0.1 s and
    helps nobody; `record` keeps the normal exit (recorders flush from atexit handlers)."""
    verb = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    if verb not in READ_ONLY_VERBS or not isinstance(code, int):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


__all__ = ["app", "console_main", "main", "typer"]
