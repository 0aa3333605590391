"""Build a config-only Hugging Face cache for vLLM's scheduler and connector unit tests; print its HF_HOME.

Usage: python hf_cache.py HF_HOME

The tests build `ModelConfig(model="facebook/opt-125m", ...)` and friends: vLLM reads the model's config.json (and
looks, optionally, for generation_config.json and a tokenizer it is told to skip), never weights. With
`HF_HUB_OFFLINE=1` the hub client resolves a repo through `hub/models--ORG--NAME/refs/main` to a snapshot folder,
so that folder holding one config.json is all a test needs. The configs below are written from what the tests
read (architecture, model type, sizes, context length, sliding window, dtype); they are not the published files
and carry no weights. A test naming a model that is not here fails on both runs alike (HF_HUB_OFFLINE), which the
comparison shows as an unchanged outcome: the multimodal ones (llava-hf/llava-1.5-7b-hf, Qwen/Qwen2.5-VL-3B-Instruct)
are left out on purpose, since vLLM's model inspection of them imports torchvision, which has no CPU build for the
pinned torch here; with a config they would fail the same way, only slower (an inspection subprocess each).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: The snapshot every repo points to (any 40-hex string: nothing is downloaded).
REVISION = "0" * 40

CONFIGS: dict[str, dict] = {
    # The default of tests/v1/core/utils.py:create_scheduler and tests/v1/kv_connector/unit/utils.py.
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "ffn_dim": 3072,
        "num_attention_heads": 12, "num_hidden_layers": 12, "max_position_embeddings": 2048, "vocab_size": 50272,
        "word_embed_proj_dim": 768, "do_layer_norm_before": True, "activation_function": "relu",
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16",
    },
    # test_priority_preemption_bug.py, test_nixl_connector.py.
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 1024, "ffn_dim": 4096,
        "num_attention_heads": 16, "num_hidden_layers": 24, "max_position_embeddings": 2048, "vocab_size": 50272,
        "word_embed_proj_dim": 512, "do_layer_norm_before": False, "activation_function": "relu",
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16",
    },
    # test_multi_connector.py, test_reset_prefix_cache_e2e.py, test_nixl_connector.py.
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "num_hidden_layers": 28, "max_position_embeddings": 40960, "vocab_size": 151936, "rope_theta": 1000000,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # test_multi_connector.py, test_offloading_connector.py.
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "num_hidden_layers": 16, "max_position_embeddings": 131072, "vocab_size": 128256, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rms_norm_eps": 1e-05, "tie_word_embeddings": True, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    },
    # Sliding window (every sixth layer global): test_offloading_connector.py, test_nixl_connector_hma.py.
    "google/gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "num_hidden_layers": 26, "max_position_embeddings": 32768, "vocab_size": 262144, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "torch_dtype": "bfloat16",
    },
    # test_scheduler.py's hybrid (linear + full attention) tests: transformers' Qwen3NextConfig defaults are this
    # model's, but for its context length.
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
    },
    # test_kv_cache_utils.py, test_kv_cache_planning.py.
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 4096,
        "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
        "max_position_embeddings": 32768, "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
}


def build(hf_home: Path) -> Path:
    hub = hf_home / "hub"
    for repo, config in CONFIGS.items():
        folder = hub / ("models--" + repo.replace("/", "--"))
        snapshot = folder / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1))
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(REVISION)
    return hf_home


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: hf_cache.py HF_HOME")
    print(build(Path(sys.argv[1])))
