"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama tensor names plus Q/K/V biases, which HF always has (there is
no config switch); the output projection has none. Sliding windows follow ``use_sliding_window``."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import Fixed, McoreOnly, QwenSlidingWindow, Rope
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

# Defaults are those of transformers' Qwen2Config, used when a key is absent from config.json.
CONFIG = (
    *shape_fields(max_position_embeddings=32768),
    QwenSlidingWindow(default_window=4096, default_max_window_layers=28),
    Rope(default_theta=10000.0),
    Fixed("model_type", "qwen2"),
    Fixed("normalization", "rmsnorm"),
    Fixed("attention_bias", True),
    Fixed("attention_out_bias", False),
    Fixed("mlp_bias", False),
    Fixed("qk_norm", False),
    McoreOnly("make_vocab_size_divisible_by", 128),
)

MAPPING = FamilyMapping(
    name="qwen2",
    hf_model_type="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    tensors=TENSORS,
    config=CONFIG,
    description="Qwen2, Qwen2.5 (Q/K/V biases)",
)
