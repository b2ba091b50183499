"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; also Moonlight and Kimi-K2, which use the same class with other values):
multi-head latent attention in every layer (``mla``), the first ``first_k_dense_replace`` layers with a dense MLP,
the others a mixture of sigmoid-scored experts chosen group-limited with an aux-loss-free bias
(``e_score_correction_bias``), renormalised top-k weights times ``routed_scaling_factor``, plus shared experts
(``n_shared_experts x moe_intermediate_size`` wide: ``shared_expert_intermediate_size`` here).

Presets are the base models as transformers builds them: ``num_nextn_predict_layers`` (the multi-token-prediction
modules the checkpoints also ship) is 0 here; set it to 1 to train with MTP (the bridge imports those tensors then).
"""

from __future__ import annotations

from typing import Any

FAMILY = "deepseek_v3"
HF_ARCHITECTURE = "DeepseekV3ForCausalLM"


def _router(n_group: int, topk_group: int, routed_scaling_factor: float) -> dict[str, Any]:
    return {
        "score_function": "sigmoid",
        "expert_bias": True,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": routed_scaling_factor,
    }


# DeepSeek-V3's long-context YaRN (config.json's rope_scaling)
_V3_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

DEFAULTS: dict[str, Any] = {
    "model_type": "deepseek_v3",
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
    "rope_interleave": True,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.0,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "kv_lora_rank": 512,
}

PRESETS: dict[str, dict[str, Any]] = {
    # 4 groups of 2 experts, top-2 groups: the group limit changes which experts win.
    "deepseek_v3-tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 24,  # q/k heads of 32 = 24 + 8
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,  # FlexAttention (CUDA fp32) needs head dims >= 16
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_router": _router(4, 2, 2.5),
        "vocab_size": 320,
        "max_position_embeddings": 256,
    },
    "deepseek-v3": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "shared_expert_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_router": _router(8, 4, 2.5),
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "rope_scaling": dict(_V3_YARN),
    },
    # moonshotai/Moonlight-16B-A3B: no q-LoRA, 64 experts top-6 + 2 shared, one dense layer
    "moonlight-16b-a3b": {
        "hidden_size": 2048,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 2816,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 6,
        "moe_router": _router(1, 1, 2.446),
        "vocab_size": 163840,
        "max_position_embeddings": 8192,
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-5,
    },
    # moonshotai/Kimi-K2-Base: V3's layout with 64 heads, 384 experts, one dense layer, YaRN x32
    "kimi-k2": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "shared_expert_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 1,
        "num_attention_heads": 64,
        "q_lora_rank": 1536,
        "num_experts": 384,
        "num_experts_per_tok": 8,
        "moe_router": _router(1, 1, 2.827),
        "vocab_size": 163840,
        "max_position_embeddings": 131072,
        "rope_theta": 50000.0,
        "rope_scaling": {**_V3_YARN, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0},
    },
}
