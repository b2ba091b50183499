"""Qwen3 dense (``Qwen3ForCausalLM``): Llama tensor names plus an RMSNorm weight per query and key head
(``q_norm``/``k_norm``, shape ``[head_dim]``) and a ``head_dim`` independent of the hidden size. HF
``attention_bias`` adds biases to all four attention projections (off in every published Qwen3)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import QwenSlidingWindow, Rope, SharedAttentionBias, family_rules
from mcore.bridge.mappings.llama_layout import (
    DOWN,
    EMBEDDING,
    FINAL_NORM,
    GATE_UP,
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
    GATE_UP,
    DOWN,
    FINAL_NORM,
    OUTPUT,
)

# What config.json states (defaults are those of transformers' Qwen3Config, used when a key is absent);
# every other field is fixed by the family's DEFAULTS in mcore.models.families.
CONFIG = family_rules(
    "qwen3",
    (
        *shape_fields(max_position_embeddings=32768, head_dim=128),
        SharedAttentionBias(),
        QwenSlidingWindow(default_window=4096, default_max_window_layers=28),
        Rope(default_theta=10000.0),
    ),
)

MAPPING = FamilyMapping(
    name="qwen3",
    hf_model_type="qwen3",
    tensors=TENSORS,
    config=CONFIG,
    description="Qwen3 dense (per-head q/k RMSNorm, decoupled head_dim)",
)
