"""Mistral: a Llama with sliding-window attention (v0.1: every layer sees the last 4096 tokens).

v0.3 dropped the window and grew the vocabulary; Mistral NeMo decouples ``head_dim`` (128) from
``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

from typing import Any

FAMILY = "mistral"
HF_ARCHITECTURE = "MistralForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "mistral",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}

_7B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Window 8 is shorter than the test sequences, so the window is exercised.
    "mistral-tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "sliding_window": 8,
    },
    "mistral-7b": {**_7B, "vocab_size": 32000, "rope_theta": 10000.0, "sliding_window": 4096},
    "mistral-7b-v0.3": {**_7B, "vocab_size": 32768, "rope_theta": 1000000.0, "sliding_window": None},
    "mistral-nemo-12b": {
        "hidden_size": 5120,
        "intermediate_size": 14336,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 131072,
        "max_position_embeddings": 1024000,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
}
