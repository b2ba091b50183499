"""Llama 2, Llama 3, Llama 3.1 and Llama 3.2: RMSNorm, SwiGLU, no biases, rotate-half RoPE.

Llama 3.1 and 3.2 add the ``llama3`` RoPE frequency scaling; 3.2's small models tie their embeddings.
Sizes are those of the published Hugging Face ``config.json`` files.
"""

from __future__ import annotations

from typing import Any

FAMILY = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "llama",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
}


def _llama3_scaling(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


_LLAMA2 = {"vocab_size": 32000, "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
_LLAMA3 = {"vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
_LLAMA31 = {**_LLAMA3, "max_position_embeddings": 131072, "rope_scaling": _llama3_scaling(8.0)}
_LLAMA32 = {**_LLAMA3, "max_position_embeddings": 131072, "rope_scaling": _llama3_scaling(32.0)}

PRESETS: dict[str, dict[str, Any]] = {
    # A few-second model for tests and smoke runs; vocab not a multiple of 128 so padding is exercised.
    "llama-tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
    },
    "llama2-7b": {
        **_LLAMA2,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "llama2-13b": {
        **_LLAMA2,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
    },
    "llama2-70b": {
        **_LLAMA2,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "llama3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "llama3.1-8b": {
        **_LLAMA31,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama3.1-70b": {
        **_LLAMA31,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "llama3.1-405b": {
        **_LLAMA31,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
    },
    "llama3.2-1b": {
        **_LLAMA32,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "llama3.2-3b": {
        **_LLAMA32,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
}
