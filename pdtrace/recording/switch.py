"""The recording switch and where it points: what the session sets and the writer process reads, kept apart from
both so that neither imports the other (the session opens recorders, whose writer threads start writer processes).

Recording path: imports nothing.
"""

from __future__ import annotations

#: The recording switch: the directory a live vLLM run records into. Unset or empty: the plugin does nothing.
TRACE_DIR_ENV = "PDTRACE_TRACE_DIR"

#: The configured session's trace directory, or None (`session.configure` sets it, `session.reset` clears it).
trace_directory: str | None = None
