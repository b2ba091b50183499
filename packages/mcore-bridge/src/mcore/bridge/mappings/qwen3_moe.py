"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention names (per-head q/k norms) and, in each sparse layer, a
router and per-expert ``mlp.experts.{i}.{gate,up,down}_proj``; ``mlp_only_layers`` keep a dense MLP."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import (
    ExpertCount,
    Field,
    Rope,
    RouterAuxLoss,
    SharedAttentionBias,
    SparseLayers,
    UseSlidingWindow,
    family_rules,
)
from mcore.bridge.mappings.llama_layout import (
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    K_NORM,
    MLP_NORM,
    OUT_PROJ,
    OUT_PROJ_BIAS,
    OUTPUT,
    Q_NORM,
    QKV,
    QKV_BIAS,
    shape_fields,
)
from mcore.bridge.mappings.moe_layout import DENSE_DOWN, DENSE_GATE_UP, QWEN_EXPERTS

TENSORS = (
    EMBEDDING,
    INPUT_NORM,
    QKV,
    QKV_BIAS,
    Q_NORM,
    K_NORM,
    OUT_PROJ,
    OUT_PROJ_BIAS,
    MLP_NORM,
    DENSE_GATE_UP,
    DENSE_DOWN,
    *QWEN_EXPERTS,
    FINAL_NORM,
    OUTPUT,
)

# transformers' Qwen3MoeConfig defaults (Qwen3-30B-A3B's sizes)
CONFIG = family_rules(
    "qwen3_moe",
    (
        *shape_fields(max_position_embeddings=32768, num_key_value_heads=4, head_dim=128),
        SharedAttentionBias(),
        UseSlidingWindow(default_window=4096),
        ExpertCount(default=128),
        Field("num_experts_per_tok", 8),
        Field("moe_intermediate_size", 768),
        Field("norm_topk_prob", False),
        SparseLayers(),
        RouterAuxLoss(default_coef=0.001),
        Rope(default_theta=10000.0),
    ),
)

MAPPING = FamilyMapping(
    name="qwen3_moe",
    hf_model_type="qwen3_moe",
    tensors=TENSORS,
    config=CONFIG,
    description="Qwen3-30B-A3B, Qwen3-235B-A22B (top-8 of 128 experts)",
)
