"""Llama 2 / 3 / 3.1 / 3.2 (``LlamaForCausalLM``): names, fusions and config translation.

HF ``attention_bias`` adds biases to all four attention projections and ``mlp_bias`` to the three MLP
projections; both are off in every published Llama. ``rope_scaling`` (Llama 3.1's ``llama3`` type) is translated.
"""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import Field, Rope, SharedAttentionBias, family_rules
from mcore.bridge.mappings.llama_layout import (
    DOWN,
    DOWN_BIAS,
    EMBEDDING,
    FINAL_NORM,
    GATE_UP,
    GATE_UP_BIAS,
    INPUT_NORM,
    MLP_NORM,
    OUT_PROJ,
    OUT_PROJ_BIAS,
    OUTPUT,
    QKV,
    QKV_BIAS,
    shape_fields,
)

TENSORS = (
    EMBEDDING,
    INPUT_NORM,
    QKV,
    QKV_BIAS,
    OUT_PROJ,
    OUT_PROJ_BIAS,
    MLP_NORM,
    GATE_UP,
    GATE_UP_BIAS,
    DOWN,
    DOWN_BIAS,
    FINAL_NORM,
    OUTPUT,
)

# What config.json states (defaults are those of transformers' LlamaConfig, used when a key is absent);
# every other field is fixed by the family's DEFAULTS in mcore.models.families.
CONFIG = family_rules(
    "llama",
    (
        *shape_fields(max_position_embeddings=2048),
        Field("mlp_bias", False),
        SharedAttentionBias(),
        Rope(default_theta=10000.0),
    ),
)

MAPPING = FamilyMapping(
    name="llama",
    hf_model_type="llama",
    tensors=TENSORS,
    config=CONFIG,
    description="Llama 2, Llama 3, 3.1 (llama3 rope scaling), 3.2",
)
