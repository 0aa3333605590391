"""Print the small dependencies `.ci/install-vllm.sh` installs next to a `--no-deps` vLLM, one requirement a line.

Run by the venv's python after `pip install --no-deps vllm==VERSION`: it reads that release's Requires-Dist (its
requirements/common.txt, in the installed wheel's METADATA) and keeps only the packages that `import vllm`, the
Scheduler, EngineCore and ModelConfig really need on a CPU box (IMPORT_NEEDS: the GPU kernels, the API server's
extras and torch's companions are left out), each with the release's own version range. PINS then narrows a few
where the newest version inside the release's range does not import on this machine (found by trying).

Usage: python .ci/vllm_deps.py  (prints requirements; the first line names xgrammar, installed --no-deps)
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

#: What `import vllm.v1.engine.core` and a ModelConfig need, by distribution name (shared/research/
#: vllm_cpu_feasibility.md section 1, re-checked per release with the smoke import of install-vllm.sh).
IMPORT_NEEDS = (
    "numpy", "packaging", "msgspec", "pydantic", "regex", "psutil", "cbor2", "pyzmq", "urllib3", "transformers",
    "aiohttp", "requests", "openai", "cloudpickle", "pillow", "pybase64", "cachetools", "uvloop", "py-cpuinfo",
    "prometheus-client", "fastapi", "partial-json-parser", "llguidance", "einops", "apache-tvm-ffi",
    "openai-harmony",
)
#: What 0.10 to 0.17 import at module level on top of IMPORT_NEEDS (0.14+: also mistral_common, imported by the
#: tokenizer registry); each only where the release's metadata names it.
_OLDER_NEEDS = ("setproctitle", "blake3", "diskcache", "compressed-tensors", "gguf", "numba", "mistral-common")
#: Per release (by its `major.minor` prefix): what it needs on top of IMPORT_NEEDS.
EXTRA_NEEDS: dict[str, tuple[str, ...]] = {f"0.{minor}": _OLDER_NEEDS for minor in range(10, 18)}
#: 0.18 to 0.23 import gguf (transformers_utils.gguf_utils) and the rest at module level, without mistral_common.
EXTRA_NEEDS.update({f"0.{minor}": ("setproctitle", "blake3", "diskcache", "compressed-tensors", "gguf", "numba")
                    for minor in range(18, 24)})
#: Needed though a release's metadata may not name them (pulled in transitively by a full install; the harmony
#: parser module `openai_harmony` is imported by `vllm.entrypoints` whatever the metadata calls its package).
UNLISTED: dict[str, str] = {"numpy": "", "packaging": "", "urllib3": "", "uvloop": "", "pyzmq": "",
                            "openai-harmony": "==0.0.8"}
#: Installed without dependencies (xgrammar would pull triton, ~1 GB).
NO_DEPS = ("xgrammar",)

#: Per release (an exact release, else its `major.minor`): pins that replace the release's range (0.33.0: the
#: pins the tier was first verified with; 0.10 / 0.11: transformers 5 removed what their config code imports).
PINS: dict[str, dict[str, str]] = {
    "0.10": {"transformers": "<5"},
    "0.11": {"transformers": "<5"},
    "0.18": {"xgrammar": "==0.1.32"},  # as 0.20
    "0.19": {"xgrammar": "==0.1.32"},
    "0.20": {"xgrammar": "==0.1.32"},  # 0.2.x fails against the release's apache-tvm-ffi
    "0.21": {"xgrammar": "==0.1.32"},
    "0.22": {"xgrammar": "==0.2.5.post1"},  # as 0.24: the release pins apache-tvm-ffi==0.1.9
    "0.23": {"xgrammar": "==0.2.5.post1"},
    "0.24": {"xgrammar": "==0.2.5.post1"},  # the newest xgrammar for the release's apache-tvm-ffi==0.1.9
    "0.25": {"xgrammar": "==0.2.5.post1"},  # as 0.24: the newest passes extra_lib_paths, which 0.1.9 lacks
    "0.26": {"xgrammar": "==0.2.5.post1"},  # 0.2.9 needs apache-tvm-ffi>=0.1.11, the release pins 0.1.10
    "0.33.0": {"numpy": "==2.3.5", "msgspec": "==0.23.0", "pydantic": "==2.14.4", "transformers": "==5.20.2",
               "openai-harmony": "==0.0.8", "fastapi": "==0.136.3", "llguidance": "==1.7.6"},
}


def main() -> int:
    version = md.version("vllm").split("+", 1)[0]
    by_name: dict[str, Requirement] = {}
    for line in md.requires("vllm") or ():
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        by_name.setdefault(canonicalize_name(req.name), req)
    minor = ".".join(version.split(".")[:2])
    pins = {canonicalize_name(k): v for k, v in PINS.get(version, PINS.get(minor, {})).items()}

    def spec(name: str) -> str | None:
        key = canonicalize_name(name)
        if key in pins:
            return f"{name}{pins[key]}"
        req = by_name.get(key)
        if req is None:
            return None
        return f"{name}{req.specifier}"

    no_deps = [s for s in (spec(n) for n in NO_DEPS) if s]
    print(" ".join(no_deps))
    for name in IMPORT_NEEDS + EXTRA_NEEDS.get(minor, ()):
        s = spec(name)
        if s is None and name in UNLISTED:
            s = name + UNLISTED[name]  # needed whatever the metadata says (transitive in a full install)
        if s is not None:
            print(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
