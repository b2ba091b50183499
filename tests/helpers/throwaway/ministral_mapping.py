"""The bridge side of the throwaway Ministral family: HF's Llama tensor names, and the config keys
``config.json`` states (``layer_types`` is always written by transformers' MinistralConfig)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import Field, Rope, family_rules
from mcore.bridge.mappings.llama_layout import (
    DOWN,
    EMBEDDING,
    FINAL_NORM,
    GATE_UP,
    INPUT_NORM,
    MLP_NORM,
    OUT_PROJ,
    OUTPUT,
    QKV,
    shape_fields,
)

MAPPING = FamilyMapping(
    name="ministral",
    hf_model_type="ministral",
    tensors=(EMBEDDING, INPUT_NORM, QKV, OUT_PROJ, MLP_NORM, GATE_UP, DOWN, FINAL_NORM, OUTPUT),
    config=family_rules(
        "ministral",
        (
            *shape_fields(max_position_embeddings=32768, num_key_value_heads=8),
            Field("sliding_window", 4096),
            Field("layer_types", None),
            Rope(default_theta=10000.0),
        ),
    ),
    description="Ministral (alternating sliding-window and full attention)",
)
