"""Qwen3 dense (``Qwen3ForCausalLM``): Llama tensor names plus an RMSNorm weight per query and key head
(``q_norm``/``k_norm``, shape ``[head_dim]``) and a ``head_dim`` independent of the hidden size. HF
``attention_bias`` adds biases to all four attention projections (off in every published Qwen3)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import Fixed, McoreOnly, QwenSlidingWindow, Rope, SharedAttentionBias
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

# Defaults are those of transformers' Qwen3Config, used when a key is absent from config.json.
CONFIG = (
    *shape_fields(max_position_embeddings=32768, head_dim=128),
    SharedAttentionBias(),
    QwenSlidingWindow(default_window=4096, default_max_window_layers=28),
    Rope(default_theta=10000.0),
    Fixed("model_type", "qwen3"),
    Fixed("normalization", "rmsnorm"),
    Fixed("mlp_bias", False),
    Fixed("qk_norm", True),
    McoreOnly("make_vocab_size_divisible_by", 128),
)

MAPPING = FamilyMapping(
    name="qwen3",
    hf_model_type="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    tensors=TENSORS,
    config=CONFIG,
    description="Qwen3 dense (per-head q/k RMSNorm, decoupled head_dim)",
)
