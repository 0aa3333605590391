"""vLLM's `vllm.general_plugins` entry point: `install()` turns pdtrace's recording on in a vLLM process.

vLLM calls `install()` once per process (API server, each EngineCore at the top of `EngineCore.__init__`, each
worker before distributed init); forked children inherit the parent's state instead. It does nothing unless
`PDTRACE_TRACE_DIR` is set. Then it configures the recording session (recorders open lazily, per process) and
applies the hook table of the installed vLLM version. It never raises into vLLM.

Recording path: standard library only at import; with recording on, `install()` loads the recorder (pyarrow).
"""

from __future__ import annotations

import os

from pdtrace.recording import session
from pdtrace.recording.session import TRACE_DIR_ENV


def install() -> None:
    """Entry point: record into `$PDTRACE_TRACE_DIR` if it is set; otherwise do nothing at all."""
    if not os.environ.get(TRACE_DIR_ENV):
        return
    try:
        # lazy: loaded in every vLLM process; without $PDTRACE_TRACE_DIR the plugin loads nothing
        from pdtrace.recording.vllm import install_hooks, installed_vllm_version

        version = installed_vllm_version()
        session.configure_from_env(source=f"vllm-{version}" if version else "vllm")
        if install_hooks(version):
            # The recorder (and pyarrow) loaded now, while vLLM starts, rather than by the first event, inside the
            # engine loop's first step: that import was ~70 ms of the loop thread's time, 60 % of all the
            # recording added to a 600-step run of bench/engine_overhead.py. pyarrow's first conversion and
            # Parquet write are warmed up here too (~30 ms off the first part file; see warm_up).
            from pdtrace.recording.recorder import warm_up

            if session.flight() is None:  # flight mode starts no writer process until a dump
                warm_up()
    except Exception as exc:  # the plugin must never stop vLLM from starting
        # lazy: loaded in every vLLM process; without $PDTRACE_TRACE_DIR the plugin loads nothing
        from pdtrace.recording.vllm._runtime import RUNTIME

        RUNTIME.fail("plugin install", exc)
