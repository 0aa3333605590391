"""pdtrace's hooks into vLLM: one shim table per supported vLLM version, applied by `install_hooks()`.

`install_hooks()` is what the `vllm.general_plugins` entry point (pdtrace.recording.plugin.install) and the dry
run call, after the recording session is configured. It reads the installed vLLM's version, picks that version's
table (`v0_33.py` for 0.33.0; supporting another release is one more module and one more line in `_TABLES`),
checks every name and parameter the table relies on, and wraps them. On a version it does not know it warns once,
naming the supported versions, and wraps nothing: pdtrace never guesses at private names.

Recording path: stdlib only here; vLLM is imported inside `install_hooks()` (which runs inside vLLM anyway).
"""

from __future__ import annotations

import importlib
import threading

from pdtrace.recording.vllm._runtime import RUNTIME, log

#: Supported vLLM releases -> the module holding their hook table.
_TABLES: dict[str, str] = {
    "0.33.0": "pdtrace.recording.vllm.v0_33",
}

_lock = threading.Lock()
_patcher = None
_installed_version: str | None = None


def supported_versions() -> tuple[str, ...]:
    """The vLLM releases pdtrace has a hook table for."""
    return tuple(_TABLES)


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (its release part, e.g. `0.33.0` of `0.33.0+cpu`), or None without vLLM."""
    try:
        from vllm import __version__ as version
    except Exception:
        try:
            from importlib.metadata import PackageNotFoundError, version as dist_version

            version = dist_version("vllm")
        except (ImportError, PackageNotFoundError):
            return None
    return str(version).split("+", 1)[0]


def _lazy_mismatch(message: str) -> None:
    RUNTIME.warn_once("mismatch", f"pdtrace: the installed vLLM does not match pdtrace's hook table ({message}); "
                                  "recording is off in this process")
    RUNTIME.active = False


def install_hooks(version: str | None = None) -> bool:
    """Wrap vLLM's methods for recording (idempotent). False, with one warning, on an unsupported version.

    `version` overrides the detected vLLM version (tests); the recording session must be configured first
    (pdtrace.recording.session.configure) for events to go anywhere.
    """
    global _patcher, _installed_version
    with _lock:
        if _patcher is not None:
            RUNTIME.active = RUNTIME.first_error is None
            return True
        detected = version or installed_vllm_version()
        if detected is None:
            RUNTIME.warn_once("no-vllm", "pdtrace: vLLM is not installed; nothing to record")
            return False
        table_module = _TABLES.get(detected)
        if table_module is None:
            RUNTIME.warn_once(
                "version", f"pdtrace: vLLM {detected} is not supported (supported: {', '.join(_TABLES)}); "
                           "recording nothing")
            return False
        from pdtrace.recording.vllm._patching import Patcher, TableMismatch

        table = importlib.import_module(table_module).TABLE
        patcher = Patcher(table, on_lazy_mismatch=_lazy_mismatch)
        try:
            patcher.apply()
        except (TableMismatch, ImportError) as exc:
            patcher.revert()
            RUNTIME.warn_once("mismatch", f"pdtrace: vLLM {detected} does not match pdtrace's hook table for it "
                                          f"({exc}); recording nothing")
            return False
        _patcher, _installed_version = patcher, detected
        RUNTIME.active = True
        log.debug("pdtrace: hooks installed for vLLM %s", detected)
        return True


def uninstall_hooks() -> None:
    """Put vLLM's original methods back and stop recording (benchmarks and tests alternate with it)."""
    global _patcher, _installed_version
    with _lock:
        RUNTIME.active = False
        if _patcher is not None:
            _patcher.revert()
        _patcher, _installed_version = None, None


def hooks_installed() -> bool:
    """Whether a hook table is applied in this process."""
    return _patcher is not None


__all__ = ["install_hooks", "uninstall_hooks", "hooks_installed", "supported_versions", "installed_vllm_version"]
