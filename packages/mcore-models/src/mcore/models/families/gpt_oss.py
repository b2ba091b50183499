"""GPT-OSS (``GptOssForCausalLM``): alternating sliding-window (128) and full attention, starting with sliding at
layer 0, each head with a learned sink logit in its softmax denominator; YaRN RoPE (factor 32 over an original
4096-token context, beta_fast 32, beta_slow 1, untruncated ramp; its attention factor scales cos and sin, which is
where Hugging Face applies it); biases on q/k/v and o; every MLP a top-4 mixture whose router has a bias and takes
the top-k of the logits before a softmax over the k chosen (Hugging Face's order), with experts that carry biases
and apply the clamped SwiGLU ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, ``g = min(gate, 7)``.

``layer_types`` depends on the depth, so each preset states it (:func:`alternating_layer_types` builds it).
"""

from __future__ import annotations

from typing import Any

FAMILY = "gpt_oss"
HF_ARCHITECTURE = "GptOssForCausalLM"


def alternating_layer_types(num_layers: int) -> list[str]:
    """``sliding_attention`` on even layers, ``full_attention`` on odd ones (Hugging Face's default)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

DEFAULTS: dict[str, Any] = {
    "model_type": "gpt_oss",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": True,
    "attention_out_bias": True,
    "mlp_bias": False,
    "qk_norm": False,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "rope_theta": 150000.0,
    "rope_scaling": YARN,
    "rms_norm_eps": 1e-5,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "head_dim": 64,
    "num_experts_per_tok": 4,
    "router_aux_loss_coef": 0.0,  # HF applies 0.001 only with output_router_logits (off in config.json)
    "moe_router": {"softmax_before_topk": False},
    "attention_sinks": True,
    "router_bias": True,
    "expert_biases": True,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}

_RELEASED = {"hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8}

PRESETS: dict[str, dict[str, Any]] = {
    # Window 8 is shorter than the test sequences; YaRN over a 32-token original context, so its ramp and
    # attention factor matter at the tests' positions.
    "gpt_oss-tiny": {
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "sliding_window": 8,
        "layer_types": alternating_layer_types(2),
        "rope_scaling": {**YARN, "factor": 8.0, "original_max_position_embeddings": 32},
    },
    "gpt-oss-20b": {
        **_RELEASED,
        "num_hidden_layers": 24,
        "num_experts": 32,
        "layer_types": alternating_layer_types(24),
    },
    "gpt-oss-120b": {
        **_RELEASED,
        "num_hidden_layers": 36,
        "num_experts": 128,
        "layer_types": alternating_layer_types(36),
    },
}
