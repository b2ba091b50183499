"""Mixtral (``MixtralForCausalLM``): a Mistral whose every MLP is a top-2 mixture of 8 SwiGLU experts.

HF's Mixtral router takes a softmax over all experts, the top 2, and renormalizes them (``norm_topk_prob``); the
experts' FFN width is HF's ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

FAMILY = "mixtral"
HF_ARCHITECTURE = "MixtralForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "mixtral",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.0,  # HF applies 0.02 only with output_router_logits (off in config.json)
}

PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-tiny": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "vocab_size": 320,
        "max_position_embeddings": 256,
    },
    "mixtral-8x7b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
    },
    "mixtral-8x22b": {
        "hidden_size": 6144,
        "intermediate_size": 16384,
        "num_hidden_layers": 56,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "vocab_size": 32768,
        "max_position_embeddings": 65536,
    },
}
