"""Qwen1.5-MoE / Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention names (Q/K/V biases), per-expert
``mlp.experts.{i}.*`` tensors and a gated shared expert (``mlp.shared_expert.*``, ``mlp.shared_expert_gate``)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import (
    ExpertCount,
    Field,
    QwenSlidingWindow,
    Rope,
    RouterAuxLoss,
    SparseLayers,
    family_rules,
)
from mcore.bridge.mappings.llama_layout import (
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    MLP_NORM,
    OUT_PROJ,
    OUTPUT,
    QKV,
    QKV_BIAS,
    always,
    shape_fields,
)
from mcore.bridge.mappings.moe_layout import DENSE_DOWN, DENSE_GATE_UP, QWEN_EXPERTS, SHARED_EXPERT

TENSORS = (
    EMBEDDING,
    INPUT_NORM,
    QKV,
    always(QKV_BIAS),
    OUT_PROJ,
    MLP_NORM,
    DENSE_GATE_UP,
    DENSE_DOWN,
    *QWEN_EXPERTS,
    *SHARED_EXPERT,
    FINAL_NORM,
    OUTPUT,
)

# transformers' Qwen2MoeConfig defaults (Qwen1.5-MoE-A2.7B's sizes)
CONFIG = family_rules(
    "qwen2_moe",
    (
        *shape_fields(max_position_embeddings=32768, num_key_value_heads=16),
        QwenSlidingWindow(default_window=4096, default_max_window_layers=28),
        ExpertCount(default=60),
        Field("num_experts_per_tok", 4),
        Field("moe_intermediate_size", 1408),
        Field("shared_expert_intermediate_size", 5632),
        Field("norm_topk_prob", False),
        SparseLayers(),
        RouterAuxLoss(default_coef=0.001),
        Rope(default_theta=1000000.0),
    ),
)

MAPPING = FamilyMapping(
    name="qwen2_moe",
    hf_model_type="qwen2_moe",
    tensors=TENSORS,
    config=CONFIG,
    description="Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B (top-4 of 60 experts plus a gated shared expert)",
)
