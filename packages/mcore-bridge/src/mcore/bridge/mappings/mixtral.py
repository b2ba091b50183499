"""Mixtral (``MixtralForCausalLM``): Mistral's attention names and, in every layer, a router plus 8 experts stored
per expert in the Hub's files (``block_sparse_moe.experts.{i}.w1/w3/w2``)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import Field, Renamed, Rope, RouterAuxLoss, family_rules
from mcore.bridge.mappings.llama_layout import (
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    MLP_NORM,
    OUT_PROJ,
    OUTPUT,
    QKV,
    shape_fields,
)
from mcore.bridge.mappings.moe_layout import MIXTRAL_EXPERTS

TENSORS = (EMBEDDING, INPUT_NORM, QKV, OUT_PROJ, MLP_NORM, *MIXTRAL_EXPERTS, FINAL_NORM, OUTPUT)

# transformers' MixtralConfig defaults; the experts' width is intermediate_size
CONFIG = family_rules(
    "mixtral",
    (
        *shape_fields(max_position_embeddings=4096 * 32, num_key_value_heads=8),
        Field("sliding_window", None),
        Renamed("num_local_experts", "num_experts", 8),
        Field("num_experts_per_tok", 2),
        RouterAuxLoss(default_coef=0.001),
        Rope(default_theta=1000000.0),
    ),
)

MAPPING = FamilyMapping(
    name="mixtral",
    hf_model_type="mixtral",
    tensors=TENSORS,
    config=CONFIG,
    description="Mixtral 8x7B, 8x22B (top-2 of 8 experts in every layer)",
)
