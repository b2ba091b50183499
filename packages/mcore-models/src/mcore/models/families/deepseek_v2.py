"""DeepSeek-V2 (``DeepseekV2ForCausalLM``; V2-Lite): multi-head latent attention as in V3 (its complex-number RoPE
rotates interleaved pairs: ``rope_interleave``), softmax-scored experts chosen greedily (no group limit in V2-Lite,
no renormalisation), times ``routed_scaling_factor``, plus shared experts; the first ``first_k_dense_replace``
layers dense.
"""

from __future__ import annotations

from typing import Any

FAMILY = "deepseek_v2"
HF_ARCHITECTURE = "DeepseekV2ForCausalLM"

# V2's long-context YaRN (x40, mscale 0.707 in both places)
_V2_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

DEFAULTS: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,  # V2's complex rotation pairs adjacent dims
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.0,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "kv_lora_rank": 512,
}

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek_v2-tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 24,  # q/k heads of 32 = 24 + 8
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,  # FlexAttention (CUDA fp32) needs head dims >= 16
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_router": {"routed_scaling_factor": 1.5},
        "vocab_size": 320,
        "max_position_embeddings": 256,
    },
    # deepseek-ai/DeepSeek-V2 (236B): q-LoRA, 160 experts top-6 in 3 of 8 groups (group_limited_greedy) + 2 shared
    "deepseek-v2": {
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "shared_expert_intermediate_size": 3072,
        "num_hidden_layers": 60,
        "first_k_dense_replace": 1,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "num_experts": 160,
        "num_experts_per_tok": 6,
        "moe_router": {"n_group": 8, "topk_group": 3, "group_score": "max", "routed_scaling_factor": 16.0},
        "vocab_size": 102400,
        "max_position_embeddings": 163840,
        "rope_scaling": dict(_V2_YARN),
    },
    # deepseek-ai/DeepSeek-V2-Lite: no q-LoRA, 64 experts top-6 + 2 shared, YaRN x40 with mscale 0.707
    "deepseek-v2-lite": {
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 2816,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 6,
        "vocab_size": 102400,
        "max_position_embeddings": 163840,
        "rope_scaling": dict(_V2_YARN),
    },
}
