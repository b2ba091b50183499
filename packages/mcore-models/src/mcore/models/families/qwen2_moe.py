"""Qwen1.5-MoE / Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2 attention (Q/K/V biases) and a top-4 mixture of 60
experts without renormalization, plus a shared expert whose output a sigmoid gate scales.
"""

from __future__ import annotations

from typing import Any

FAMILY = "qwen2_moe"
HF_ARCHITECTURE = "Qwen2MoeForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "qwen2_moe",
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
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "norm_topk_prob": False,
    "shared_expert_gate": True,
    "router_aux_loss_coef": 0.0,  # HF applies 0.001 only with output_router_logits (off in config.json)
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2_moe-tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
    },
    "qwen2_moe-a2.7b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
    },
}
