"""OLMoE (``OlmoeForCausalLM``): a Llama-style attention whose q/k RMSNorms span the whole projection (not one
head), and a top-8 mixture of 64 experts in every layer, weights not renormalized; the experts' width is HF's
``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

FAMILY = "olmoe"
HF_ARCHITECTURE = "OlmoeForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "olmoe",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": True,
    "qk_norm_scope": "projection",
    "sliding_window": None,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "vocab_size": 50304,
    "max_position_embeddings": 4096,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.0,  # HF applies 0.01 only with output_router_logits (off in config.json)
}

PRESETS: dict[str, dict[str, Any]] = {
    "olmoe-tiny": {
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
    },
    "olmoe-1b-7b": {
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
    },
}
