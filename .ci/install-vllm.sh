#!/usr/bin/env bash
# Build the virtual environment of pdtrace's vLLM test tier: a real vLLM release on a CPU torch.
#
# Usage: .ci/install-vllm.sh VENV_DIR [VERSION]     (VERSION: a supported vLLM release, default 0.33.0)
#
# Environment: VLLM_WHEEL_DIR, a folder of already downloaded vllm wheels pip looks in first (CI's matrix
# downloads each release once; pip's own cache also keeps them).
#
# Why not `pip install vllm`: that pulls a CUDA torch and ~9.6 GB of GPU packages. vLLM's scheduler and
# EngineCore (all pdtrace's tests need) run on the CPU torch 2.13.0 wheel that the machine's pip
# configuration finds (find-links), so: CPU torch first (2.13.0+cpu for every release: older releases pin CUDA
# builds of torch 2.7/2.8, of which no CPU build exists, and their scheduler and engine core run on 2.13), vllm
# without its dependencies, then the small packages `import vllm` and ModelConfig really need, each in the range
# the release's own metadata (requirements/common.txt) gives: .ci/vllm_deps.py derives the list, then pdtrace.
# Uses pip only: uv and poetry do not read the machine's find-links.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || -z "$1" ]]; then
    echo "usage: $0 VENV_DIR [VERSION]" >&2
    exit 2
fi
venv_dir="$1"
vllm_version="${2:-0.33.0}"
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

find_links=()
if [[ -n "${VLLM_WHEEL_DIR:-}" ]]; then
    find_links=(--find-links "$VLLM_WHEEL_DIR")
fi
"${pip[@]}" install --no-deps "${find_links[@]}" "vllm==$vllm_version"

pin_file="$(mktemp)"
deps_file="$(mktemp)"
trap 'rm -f "$pin_file" "$deps_file"' EXIT
echo "$torch_spec" > "$pin_file"
"$venv_dir/bin/python" "$repo_root/.ci/vllm_deps.py" > "$deps_file"
read -r -a no_deps < <(head -n 1 "$deps_file")
mapfile -t deps < <(tail -n +2 "$deps_file")
echo "install-vllm: vllm $vllm_version; --no-deps: ${no_deps[*]}; deps: ${deps[*]}" >&2
if [[ ${#no_deps[@]} -gt 0 ]]; then
    "${pip[@]}" install --no-deps "${no_deps[@]}"
fi
# pip warns that "vllm X requires ..., which is not installed": expected, the exit status stays 0.
"${pip[@]}" install -c "$pin_file" "${deps[@]}"

"${pip[@]}" install -c "$pin_file" -e "$repo_root[test]"

# Smoke check: the modules the vLLM tier drives import.
"$venv_dir/bin/python" - <<'PY'
import importlib.metadata as md
import vllm.v1.core.sched.scheduler  # noqa: F401
import vllm.v1.engine.core  # noqa: F401
print("install-vllm: vllm", md.version("vllm"), "torch", md.version("torch"))
PY
echo "install-vllm: done in $(( $(date +%s) - start_s )) s; $(du -sm "$venv_dir" | cut -f1) MB in $venv_dir" >&2
