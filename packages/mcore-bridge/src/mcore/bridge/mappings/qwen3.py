"""Qwen3 dense (``Qwen3ForCausalLM``): Llama tensor names plus an RMSNorm weight per query and key head
(``q_norm``/``k_norm``, shape ``[head_dim]``) and a ``head_dim`` independent of the hidden size. HF
``attention_bias`` adds biases to all four attention projections (off in every published Qwen3)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import Field, Fixed, McoreOnly, QwenSlidingWindow, Rope, SharedAttentionBias

L = "model.layers.{layer}"
A = f"{L}.self_attn"
M = f"{L}.mlp"

TENSORS = (
    TensorRule("embedding.weight", ("model.embed_tokens.weight",), "vocab"),
    TensorRule("layers.{layer}.input_norm.weight", (f"{L}.input_layernorm.weight",)),
    TensorRule(
        "layers.{layer}.attention.qkv.weight",
        (f"{A}.q_proj.weight", f"{A}.k_proj.weight", f"{A}.v_proj.weight"),
        "qkv",
    ),
    TensorRule(
        "layers.{layer}.attention.qkv.bias",
        (f"{A}.q_proj.bias", f"{A}.k_proj.bias", f"{A}.v_proj.bias"),
        "qkv",
        when="attention_bias",
    ),
    TensorRule("layers.{layer}.attention.q_norm.weight", (f"{A}.q_norm.weight",)),
    TensorRule("layers.{layer}.attention.k_norm.weight", (f"{A}.k_norm.weight",)),
    TensorRule("layers.{layer}.attention.out_proj.weight", (f"{A}.o_proj.weight",)),
    TensorRule("layers.{layer}.attention.out_proj.bias", (f"{A}.o_proj.bias",), when="attention_out_bias"),
    TensorRule("layers.{layer}.mlp_norm.weight", (f"{L}.post_attention_layernorm.weight",)),
    TensorRule("layers.{layer}.mlp.gate_up.weight", (f"{M}.gate_proj.weight", f"{M}.up_proj.weight"), "gate_up"),
    TensorRule("layers.{layer}.mlp.down.weight", (f"{M}.down_proj.weight",)),
    TensorRule("final_norm.weight", ("model.norm.weight",)),
    TensorRule("output.weight", ("lm_head.weight",), "vocab", unless="tie_word_embeddings"),
)

# Defaults are those of transformers' Qwen3Config, used when a key is absent from config.json.
CONFIG = (
    Field("vocab_size"),
    Field("hidden_size"),
    Field("intermediate_size"),
    Field("num_hidden_layers"),
    Field("num_attention_heads"),
    Field("num_key_value_heads", None),
    Field("head_dim", 128),
    Field("max_position_embeddings", 32768),
    Field("rms_norm_eps", 1e-6),
    Field("tie_word_embeddings", False),
    Field("hidden_act", "silu"),
    Field("initializer_range", 0.02),
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
