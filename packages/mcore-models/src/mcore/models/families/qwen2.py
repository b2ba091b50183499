"""Qwen2 and Qwen2.5: a Llama with biases on the Q/K/V projection (none on the output projection).

Qwen2 checkpoints carry ``sliding_window`` with ``use_sliding_window: false``: every published model attends
to the full context, so the presets leave ``sliding_window`` unset. The small models tie their embeddings.
"""

from __future__ import annotations

from typing import Any

FAMILY = "qwen2"
HF_ARCHITECTURE = "Qwen2ForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "qwen2",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": True,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}

_SMALL = {"vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True}
_LARGE = {"vocab_size": 152064, "max_position_embeddings": 131072}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
    },
    "qwen2-7b": {
        **_LARGE,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
    "qwen2.5-0.5b": {
        **_SMALL,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "qwen2.5-1.5b": {
        **_SMALL,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
    "qwen2.5-3b": {
        **_SMALL,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
    },
    "qwen2.5-7b": {
        **_LARGE,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
    "qwen2.5-14b": {
        **_LARGE,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
    },
    "qwen2.5-32b": {
        **_LARGE,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
    },
    "qwen2.5-72b": {
        **_LARGE,
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
    },
}
