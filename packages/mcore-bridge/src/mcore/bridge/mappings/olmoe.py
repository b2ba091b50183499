"""OLMoE (``OlmoeForCausalLM``): Llama attention names with q/k norms over the whole projection
(``self_attn.q_norm.weight`` [q_size], ``k_norm`` [kv_size]) and per-expert ``mlp.experts.{i}.*`` tensors."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import (
    ExpertCount,
    Field,
    MustBe,
    Rope,
    RouterAuxLoss,
    SharedAttentionBias,
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
from mcore.bridge.mappings.moe_layout import QWEN_EXPERTS

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
    *QWEN_EXPERTS,
    FINAL_NORM,
    OUTPUT,
)

# transformers' OlmoeConfig defaults (OLMoE-1B-7B's sizes)
CONFIG = family_rules(
    "olmoe",
    (
        *shape_fields(max_position_embeddings=4096),
        SharedAttentionBias(),
        ExpertCount(default=64),
        Field("num_experts_per_tok", 8),
        Field("norm_topk_prob", False),
        MustBe("clip_qkv", None),
        RouterAuxLoss(default_coef=0.01),
        Rope(default_theta=10000.0),
    ),
)

MAPPING = FamilyMapping(
    name="olmoe",
    hf_model_type="olmoe",
    tensors=TENSORS,
    config=CONFIG,
    description="OLMoE-1B-7B (top-8 of 64 experts, q/k norms over the whole projection)",
)
