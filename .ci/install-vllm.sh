#!/usr/bin/env bash
# Build the virtual environment of pdtrace's vLLM test tier: a real vLLM release on a CPU torch.
#
# Usage: .ci/install-vllm.sh VENV_DIR [VERSION]     (VERSION: a supported vLLM release, default 0.33.0)
#
# Environment: VLLM_WHEEL_DIR, a folder of already downloaded vllm wheels looked in first; UV, the uv binary
# (default: `uv` on PATH, else one installed once under $PDTRACE_CI_CACHE, default ~/.cache/pdtrace-ci);
# UV_CACHE_DIR, uv's cache (default ~/.cache/uv; keep it on the venvs' filesystem: it is then hard-linked).
#
# Why not `pip install vllm`: that pulls a CUDA torch and ~9.6 GB of GPU packages. vLLM's scheduler and
# EngineCore (all pdtrace's tests need) run on the CPU torch 2.13.0 wheel that the machine's find-links hold, so:
# CPU torch first (2.13.0+cpu for every release: older releases pin CUDA builds of torch 2.7-2.9, of which no CPU
# build exists, and their scheduler and engine core run on 2.13), vllm without its dependencies, then the small
# packages `import vllm` and ModelConfig really need, each in the range the release's own metadata
# (requirements/common.txt) gives: .ci/vllm_deps.py derives the list, then pdtrace.
#
# Why uv: installing is most of the vLLM tier's cost outside the tests, and almost all of it is unpacking the same
# wheels again (torch ~1 GB unpacked, vllm ~0.5 GB) and pip byte-compiling every file of them. uv unpacks each wheel
# once into its cache and hard-links it into every venv after, and compiles nothing (Python compiles what is
# imported: the smoke check below, whose .pyc the tier then reuses). Same release (0.12.0), same load (13-14 on a
# shared 2-core machine), both downloading vllm: pip 265 s before it even reached pdtrace's install, uv 153 s in
# all; per phase with uv (the summary line): venv 4 s, torch 4-5 s, vllm 27-69 s (its download), dependencies and
# pdtrace 23-25 s, the smoke import most of the rest. uv does not read pip's configuration files: the find-links
# (torch's CPU wheel) come from PIP_FIND_LINKS or `pip config`.
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
ci_cache="${PDTRACE_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdtrace-ci}"
start_s=$(date +%s)
phase_s=$start_s
phases=()
phase() {  # name of the phase just done: its seconds go into the summary line
    local now; now=$(date +%s)
    phases+=("$1 $(( now - phase_s )) s")
    phase_s=$now
}

uv="${UV:-$(command -v uv || true)}"
if [[ -z "$uv" ]]; then
    uv="$ci_cache/uv-venv/bin/uv"
    if [[ ! -x "$uv" ]]; then
        "$python_bin" -m venv "$ci_cache/uv-venv"
        "$ci_cache/uv-venv/bin/python" -m pip install -q --disable-pip-version-check uv
    fi
fi
# The machine's find-links (pip.conf or the environment) for uv, which reads neither.
find_links="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$("$python_bin" -m pip config get global.find-links 2>/dev/null || true)}}"
uv_pip=("$uv" pip install --python "$venv_dir/bin/python")
for link in $find_links ${VLLM_WHEEL_DIR:-}; do
    uv_pip+=(--find-links "$link")
done

# --seed: pip in the venv (.ci/vllm_deps.py reads requirements with pip's vendored packaging; people use pip).
"$uv" venv -q --seed --python "$python_bin" "$venv_dir"
phase venv

if ! "${uv_pip[@]}" "$torch_spec"; then
    echo "install-vllm: could not install the CPU torch wheel $torch_spec (found through the machine's" \
         "find-links, e.g. /opt/wheels, in PIP_FIND_LINKS or pip's configuration; its dependencies come from the" \
         "index); refusing to fall back to a CUDA torch. The vLLM tier cannot run." >&2
    exit 3
fi
# Read from the metadata: importing torch costs 5-20 s of a first import (.pyc compiled), twice with the smoke check.
if ! "$venv_dir/bin/python" -c 'import importlib.metadata as md, sys; sys.exit(not md.version("torch").endswith("+cpu"))'
then
    echo "install-vllm: installed torch is not a CPU build; refusing to go on." >&2
    exit 3
fi

phase torch
"${uv_pip[@]}" --no-deps "vllm==$vllm_version"
phase vllm

pin_file="$(mktemp)"
deps_file="$(mktemp)"
trap 'rm -f "$pin_file" "$deps_file"' EXIT
echo "$torch_spec" > "$pin_file"
"$venv_dir/bin/python" "$repo_root/.ci/vllm_deps.py" > "$deps_file"
read -r -a no_deps < <(head -n 1 "$deps_file")
mapfile -t deps < <(tail -n +2 "$deps_file")
echo "install-vllm: vllm $vllm_version; --no-deps: ${no_deps[*]}; deps: ${deps[*]}" >&2
if [[ ${#no_deps[@]} -gt 0 ]]; then
    "${uv_pip[@]}" --no-deps "${no_deps[@]}"
fi
# Both in one resolution: pdtrace's own dependencies within the ranges the release's packages allow.
"${uv_pip[@]}" -c "$pin_file" "${deps[@]}" -e "$repo_root[test]"
phase deps+pdtrace

# Smoke check: the modules the vLLM tier drives import. It also leaves their bytecode behind: uv compiles nothing,
# and where PYTHONDONTWRITEBYTECODE is set (this project's machines and CI) no later import would write any, so
# every fresh process compiled vLLM and torch from source again: 33 s of `import vllm.v1.engine.core` here, 16 s
# from bytecode; a 0.33.0 tier took 187 s without, 111 s with (.ci/run unsets the variable for the tiers too).
env -u PYTHONDONTWRITEBYTECODE "$venv_dir/bin/python" - <<'PY'
import importlib.metadata as md
import vllm.v1.core.sched.scheduler  # noqa: F401
import vllm.v1.engine.core  # noqa: F401
print("install-vllm: vllm", md.version("vllm"), "torch", md.version("torch"))
PY
phase smoke-import
echo "install-vllm: done in $(( $(date +%s) - start_s )) s (${phases[*]}); $(du -sm "$venv_dir" | cut -f1) MB in" \
     "$venv_dir" >&2
