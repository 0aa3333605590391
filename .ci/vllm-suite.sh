#!/usr/bin/env bash
# CI tier: vLLM 0.33.0's own scheduler and KV-connector unit tests as a witness for pdtrace.
#
# Usage: .ci/vllm-suite.sh VENV_DIR      (the vLLM tier's venv, built by .ci/install-vllm.sh)
#
# 1. fetches vLLM's sdist of the pinned release with pip's own machinery (.ci/vllm_suite/fetch_sdist.py; cached
#    under $PDTRACE_CI_CACHE, default ~/.cache/pdtrace-ci) and extracts its tests (top-level helpers, tests/models
#    for the model registry the conftest imports, tests/v1);
# 2. builds a config-only Hugging Face cache (.ci/vllm_suite/hf_cache.py) and runs offline on CPU;
# 3. installs the test-only dependencies (tblib, anthropic: tests/conftest.py and tests/utils.py import them;
#    compressed-tensors, which the Qwen3-Next model module imports) with
#    the torch pin, as install-vllm.sh does;
# 4. runs the chosen files twice, plain and under `-p pdtrace --pdtrace --pdtrace-report`, and compares (.ci/vllm_suite/compare.py): no test may change outcome, and no trace may have an error
#    finding unless .ci/vllm_suite/allowlist.txt names the test with its reason.
#
# The files: those whose tests drive vLLM's Scheduler, where the hooks record (see FILES below).
set -euo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv_dir="$(cd "$1" && pwd)"
python="$venv_dir/bin/python"
suite_dir="$repo_root/.ci/vllm_suite"
work="${PDTRACE_SUITE_WORK:-$(mktemp -d)}"
cache="${PDTRACE_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdtrace-ci}"
vllm_version="0.33.0"
torch_spec="torch==2.13.0+cpu"
start_s=$(date +%s)

# Scheduler-driving files of tests/v1/core and tests/v1/kv_connector/unit: their tests build a real Scheduler and
# step it (schedule / update_from_output, finishes, aborts, preemption, deferred frees, KV loads and sends, load
# failures, invalid blocks), so the hooks record. Left out: files whose tests record nothing or next to nothing
# (block hashing, prefix-cache primitives, KV cache planning and configs, worker-side transfer code, one
# connector's wire protocol; test_multi_connector.py: 1 of 32 tests with events, test_kv_connector_lifecycle.py:
# none) or cannot run here (test_offloading_connector.py, test_priority_scheduler_random.py: tokenizer files and a
# multimodal model the config-only cache does not hold), and the 443 tests of offloading_connector/test_scheduler.py
# that would double the tier's time.
FILES=(
    tests/v1/core/test_scheduler.py
    tests/v1/core/test_async_scheduler.py
    tests/v1/core/test_deferred_block_free.py
    tests/v1/core/test_swa_inflight_window_free.py
    tests/v1/core/test_priority_preemption_bug.py
    tests/v1/core/test_worker_slot_overflow.py
    tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py
    tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py
    tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py
    tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py
    tests/v1/kv_connector/unit/test_error_propagation.py
    tests/v1/kv_connector/unit/test_cache_pollution_prevention.py
    tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py
)

echo "== vLLM suite: fetching vllm==$vllm_version's sdist"
sdist="$("$python" "$suite_dir/fetch_sdist.py" vllm "$vllm_version" "$cache")"
src="$work/vllm-$vllm_version"
rm -rf "$src"
mkdir -p "$src"
tar xzf "$sdist" -C "$work" --no-wildcards-match-slash --wildcards \
    "vllm-$vllm_version/tests/*.py" "vllm-$vllm_version/tests/models" "vllm-$vllm_version/tests/v1"
"$python" "$suite_dir/hf_cache.py" "$work/hf" > /dev/null

pin_file="$work/torch-pin.txt"
echo "$torch_spec" > "$pin_file"
"$python" -m pip install -q --disable-pip-version-check -c "$pin_file" tblib anthropic compressed-tensors==0.17.0

export HF_HOME="$work/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_TARGET_DEVICE=cpu
unset PDTRACE_TRACE_DIR
# vLLM's tests/ is a package: run from the extracted source so that `import tests...` finds it; no pdtrace
# pyproject there, so neither run picks up pdtrace's own pytest settings.
cd "$src"
pytest=("$python" -m pytest -q -p no:cacheprovider -o addopts= --tb=line)

# The two runs side by side, one per core (CI's machine has two): the tier takes the time of the slower one, and
# both see the same machine at the same time, so their wall times compare.
export OMP_NUM_THREADS=1
timed() {  # NAME CMD...: run CMD, its output to $work/NAME.log, its wall seconds to $work/NAME.secs
    local name="$1" t0
    shift
    t0=$(date +%s)
    "$@" > "$work/$name.log" 2>&1 || true
    echo $(( $(date +%s) - t0 )) > "$work/$name.secs"
}
echo "== vLLM suite: ${#FILES[@]} files, without pdtrace and under pytest -p pdtrace, side by side"
timed plain "${pytest[@]}" -p no:pdtrace --basetemp "$work/tmp-plain" --junitxml "$work/plain.xml" "${FILES[@]}" &
plain_pid=$!
timed pdtrace "${pytest[@]}" -p pdtrace --pdtrace --pdtrace-report --pdtrace-dir "$work/traces" \
    --basetemp "$work/tmp-pdtrace" --junitxml "$work/pdtrace.xml" "${FILES[@]}" &
pdtrace_pid=$!
wait "$plain_pid" "$pdtrace_pid"
tail -n 1 "$work/plain.log" "$work/pdtrace.log"
echo "vllm-suite: wall time without pdtrace $(cat "$work/plain.secs") s, with it $(cat "$work/pdtrace.secs") s" \
     "(logs and traces in $work)"

status=0
"$python" "$suite_dir/compare.py" "$work/plain.xml" "$work/pdtrace.xml" "$work/traces/summary.json" \
    "$suite_dir/allowlist.txt" || status=$?
echo "vllm-suite: done in $(( $(date +%s) - start_s )) s" >&2
exit "$status"
