"""Mistral (``MistralForCausalLM``): Llama tensor names, no biases, one ``sliding_window`` for every layer
(``null`` in v0.3 and NeMo)."""

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

TENSORS = (
    EMBEDDING,
    INPUT_NORM,
    QKV,
    OUT_PROJ,
    MLP_NORM,
    GATE_UP,
    DOWN,
    FINAL_NORM,
    OUTPUT,
)

# What config.json states (defaults are those of transformers' MistralConfig, used when a key is absent);
# every other field is fixed by the family's DEFAULTS in mcore.models.families.
CONFIG = family_rules(
    "mistral",
    (
        *shape_fields(max_position_embeddings=4096 * 32, num_key_value_heads=8),
        Field("sliding_window", 4096),
        Rope(default_theta=10000.0),
    ),
)

MAPPING = FamilyMapping(
    name="mistral",
    hf_model_type="mistral",
    tensors=TENSORS,
    config=CONFIG,
    description="Mistral 7B v0.1-v0.3, Mistral NeMo (sliding-window attention)",
)
