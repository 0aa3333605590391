"""One offline vLLM run on the CPU build, as a user's script: `python offline_run.py SPEC.json`.

The tier records it with `pdtrace record -o DIR -- python offline_run.py SPEC.json`. SPEC keys: model (a local
directory holding only config.json), requests, prompt_len, max_tokens, pp, kv_blocks (num_gpu_blocks_override, or
null for the 1 GiB cache VLLM_CPU_KVCACHE_SPACE gives), max_num_seqs, shared_prefix (tokens every prompt begins
with), out (a JSON file the script writes: one
record per finished request, its id and tokens out). Weights are random (load_format="dummy"), there is no
tokenizer (token-id prompts), nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
import time


def _pp_compilation_mode() -> int:
    """2 (DYNAMO_TRACE_ONCE, eager backend): the warm-up run without compiling. vllm-cpu 0.26.0's dynamo trace
    fails in SiluAndMul.forward_cpu (`platform.uname()` inside the traced function, with its torch 2.11); mode 0
    (no compilation) warms up too, and is what 0.26 gets."""
    import vllm

    return 0 if vllm.__version__.startswith("0.26.") else 2


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                  max_model_len=spec.get("max_model_len", 1024), seed=0,
                  max_num_seqs=spec.get("max_num_seqs", 16),
                  max_num_batched_tokens=spec.get("max_num_batched_tokens", 1024))
    if spec.get("pp", 1) > 1:
        # Under enforce_eager the CPU worker skips its warm-up run and the last PP rank dies on
        # `assert self.intermediate_tensors is not None`; mode 2 with the eager backend warms up without compiling.
        kwargs.update(pipeline_parallel_size=spec["pp"], distributed_executor_backend="mp",
                      compilation_config={"mode": spec.get("compilation_mode", _pp_compilation_mode()),
                                          "backend": "eager"})
    else:
        kwargs.update(enforce_eager=True)
    if spec.get("kv_blocks"):
        kwargs.update(num_gpu_blocks_override=spec["kv_blocks"])
    if spec.get("block_size"):
        kwargs.update(block_size=spec["block_size"])
    llm = LLM(**kwargs)
    n, plen = spec["requests"], spec["prompt_len"]
    # `shared_prefix` tokens common to every prompt (prefix-cache hits), the rest distinct per request
    shared = [50 + j for j in range(spec.get("shared_prefix", 0))]
    prompts = [TokensPrompt(prompt_token_ids=shared + [100 + (7 * i + j) % 30000 for j in range(plen - len(shared))])
               for i in range(n)]
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False, temperature=0.0)
    if spec.get("kill_worker_after_s") is not None:
        _kill_a_worker_later(float(spec["kill_worker_after_s"]))
    t0 = time.monotonic()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except Exception as exc:  # the engine died (a fault run): say so, exit 3
        print(f"offline_run: generate failed: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    wall = time.monotonic() - t0
    records = [{"req": o.request_id, "tokens": len(o.outputs[0].token_ids),
                "finish_reason": o.outputs[0].finish_reason} for o in outputs]
    with open(spec["out"], "w") as fh:
        json.dump({"generate_s": wall, "outputs": records}, fh)
    print(f"offline_run: {len(records)} requests in {wall:.1f} s", flush=True)


def _kill_a_worker_later(delay_s: float) -> None:
    """A fault: SIGKILL one of the engine's worker processes `delay_s` after generation starts (a rank lost to
    the OOM killer, a segfault in a kernel)."""
    import os
    import signal
    import threading

    import psutil

    def kill() -> None:
        time.sleep(delay_s)
        workers = [p for p in psutil.Process().children(recursive=True) if "Worker" in " ".join(p.cmdline())
                   or "Worker" in p.name()]
        print(f"offline_run: killing worker pid {workers[0].pid if workers else None}", flush=True)
        if workers:
            os.kill(workers[0].pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1])
