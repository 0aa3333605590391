#!/usr/bin/env bash
# Build the virtual environment of pdtrace's vLLM test tier: real vLLM 0.33.0 on a CPU torch.
#
# Usage: .ci/install-vllm.sh VENV_DIR
#
# Why not `pip install vllm`: that pulls a CUDA torch and ~9.6 GB of GPU packages. vLLM's scheduler and
# EngineCore (all pdtrace's tests need) run on the CPU torch 2.13.0 wheel that the machine's pip
# configuration finds (find-links), so: CPU torch first, vllm and xgrammar without their dependencies, then
# the small packages `import vllm` and ModelConfig really need (list from
# shared/research/vllm_cpu_feasibility.md section 1; re-derive it when the vLLM pin changes), then pdtrace.
# Uses pip only: uv and poetry do not read the machine's find-links.
set -euo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
venv_dir="$1"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python3.11}"
torch_spec="torch==2.13.0+cpu"   # the local version label pins the CPU build: never fall back to CUDA torch
start_s=$(date +%s)

"$python_bin" -m venv "$venv_dir"
pip=("$venv_dir/bin/python" -m pip --disable-pip-version-check)

if ! "${pip[@]}" install "$torch_spec"; then
    echo "install-vllm: could not install the CPU torch wheel $torch_spec (pip finds it through its configured" \
         "find-links, e.g. /opt/wheels; its dependencies come from the index); refusing to fall back to a CUDA" \
         "torch. The vLLM tier cannot run." >&2
    exit 3
fi
if ! "$venv_dir/bin/python" -c 'import sys, torch; sys.exit(0 if torch.__version__.endswith("+cpu") else 1)'; then
    echo "install-vllm: installed torch is not a CPU build; refusing to go on." >&2
    exit 3
fi

"${pip[@]}" install --no-deps vllm==0.33.0 xgrammar==0.2.8

pin_file="$(mktemp)"
trap 'rm -f "$pin_file"' EXIT
echo "$torch_spec" > "$pin_file"
# pip warns that "vllm 0.33.0 requires ..., which is not installed": expected, the exit status stays 0.
"${pip[@]}" install -c "$pin_file" \
    numpy==2.3.5 packaging msgspec==0.23.0 pydantic==2.14.4 regex psutil cbor2 pyzmq urllib3 \
    transformers==5.20.2 aiohttp requests openai-harmony==0.0.8 openai cloudpickle pillow pybase64 \
    cachetools uvloop py-cpuinfo prometheus-client fastapi==0.136.3 partial-json-parser \
    llguidance==1.7.6 einops apache-tvm-ffi

"${pip[@]}" install -c "$pin_file" -e "$repo_root[test]"

# Smoke check: the modules the vLLM tier drives import.
"$venv_dir/bin/python" - <<'PY'
import importlib.metadata as md
import vllm.v1.core.sched.scheduler  # noqa: F401
import vllm.v1.engine.core  # noqa: F401
print("install-vllm: vllm", md.version("vllm"), "torch", md.version("torch"))
PY
echo "install-vllm: done in $(( $(date +%s) - start_s )) s; $(du -sm "$venv_dir" | cut -f1) MB in $venv_dir" >&2
