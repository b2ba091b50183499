"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (per-head q/k RMSNorm, head_dim 128) and a top-8 mixture of
128 small experts in every layer (``decoder_sparse_step`` 1, no ``mlp_only_layers``), renormalized top-k weights.
"""

from __future__ import annotations

from typing import Any

FAMILY = "qwen3_moe"
HF_ARCHITECTURE = "Qwen3MoeForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": True,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.0,  # HF applies 0.001 only with output_router_logits (off in config.json)
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3_moe-tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
    },
    "qwen3_moe-30b-a3b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
    "qwen3_moe-235b-a22b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
    },
}
