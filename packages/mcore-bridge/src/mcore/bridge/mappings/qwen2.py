"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama tensor names plus Q/K/V biases, which HF always has (there is
no config switch); the output projection has none. Sliding windows follow ``use_sliding_window``."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import QwenSlidingWindow, Rope, family_rules
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
    QKV_BIAS,
    always,
    shape_fields,
)

TENSORS = (
    EMBEDDING,
    INPUT_NORM,
    QKV,
    always(QKV_BIAS),
    OUT_PROJ,
    MLP_NORM,
    GATE_UP,
    DOWN,
    FINAL_NORM,
    OUTPUT,
)

# What config.json states (defaults are those of transformers' Qwen2Config, used when a key is absent);
# every other field is fixed by the family's DEFAULTS in mcore.models.families.
CONFIG = family_rules(
    "qwen2",
    (
        *shape_fields(max_position_embeddings=32768),
        QwenSlidingWindow(default_window=4096, default_max_window_layers=28),
        Rope(default_theta=10000.0),
    ),
)

MAPPING = FamilyMapping(
    name="qwen2",
    hf_model_type="qwen2",
    tensors=TENSORS,
    config=CONFIG,
    description="Qwen2, Qwen2.5 (Q/K/V biases)",
)
