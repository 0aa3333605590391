"""Fixtures of the vLLM tier: hooks installed through the plugin entry point into a fresh trace directory.

No skip here (a skip raised while importing a conftest is a collection error): each test module skips itself
when vLLM is absent (`pytest.importorskip("vllm.version")`). The folder is not named `vllm`: tests/ is on
sys.path, so such a folder would pass for a namespace package named `vllm`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _vllm_imported_once_before_any_test() -> None:
    """Each test worker imports vLLM's engine core and scheduler once, on its main thread, before any test starts a
    recorder's threads or signal handlers: CI saw a worker whose first import of them (through openai_harmony, a
    PyO3 extension that can be initialized only once per process) was cut off, and every later import in that
    worker then failed with "PyO3 modules ... may only be initialized once per interpreter process". Where vLLM is
    absent the tier's modules skip themselves; so does this."""
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
        import vllm.v1.engine.core  # noqa: F401
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _dry_runs_share_one_vllm_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier's in-process dry runs fork from a server that imported vLLM once (pdtrace/dryrun/zygote.py says why);
    PDTRACE_TIER_FRESH_DRY_RUNS=1 gives each its own fresh process, as users' runs have."""
    import os

    if os.environ.get("PDTRACE_TIER_FRESH_DRY_RUNS") == "1":
        return
    from pdtrace.dryrun import zygote as dryrun_zygote

    import pdtrace.dryrun

    monkeypatch.setattr(pdtrace.dryrun, "_spawn_child", dryrun_zygote.spawn)


@pytest.fixture
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return harness.tiny_model_dir(tmp_path_factory.getbasetemp())


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Recording on, as in a live run: PDTRACE_TRACE_DIR set, then the entry point function vLLM calls."""
    from pdtrace.recording import plugin, session
    from pdtrace.recording.vllm import hooks_installed, uninstall_hooks
    from pdtrace.recording.vllm._runtime import RUNTIME

    trace = tmp_path / "trace"
    monkeypatch.setenv("PDTRACE_TRACE_DIR", str(trace))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    plugin.install()
    assert hooks_installed()
    yield trace
    session.reset()
    uninstall_hooks()
    RUNTIME.reset()


@pytest.fixture
def live_plugin(tmp_path, monkeypatch):
    """The recording switch on and vLLM's "plugins loaded" flag cleared: EngineCore.__init__ loads pdtrace."""
    import vllm.plugins

    from pdtrace.recording import session
    from pdtrace.recording.vllm import uninstall_hooks
    from pdtrace.recording.vllm._runtime import RUNTIME

    trace = tmp_path / "trace"
    monkeypatch.setenv("PDTRACE_TRACE_DIR", str(trace))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    yield trace
    session.reset()
    uninstall_hooks()
    RUNTIME.reset()
