"""Ministral (``MinistralForCausalLM``): a Mistral whose layers alternate sliding-window and full attention
(``layer_types``). This module is what ``mcore/models/families/<family>.py`` would be; the tests register it."""

from __future__ import annotations

from typing import Any

FAMILY = "ministral"
HF_ARCHITECTURE = "MinistralForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "ministral",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Window 8 < the test sequences; layer 0 slides, layer 1 attends fully. head_dim stated (decoupled from
    # hidden / heads), as every published Ministral config.json does: transformers' Ministral needs it.
    "ministral-tiny": {
        "head_dim": 32,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
