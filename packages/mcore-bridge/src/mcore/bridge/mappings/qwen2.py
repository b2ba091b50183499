"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama tensor names plus Q/K/V biases, which HF always has (there is
no config switch); the output projection has none. Sliding windows follow ``use_sliding_window``."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import Field, Fixed, McoreOnly, QwenSlidingWindow, Rope

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
    ),
    TensorRule("layers.{layer}.attention.out_proj.weight", (f"{A}.o_proj.weight",)),
    TensorRule("layers.{layer}.mlp_norm.weight", (f"{L}.post_attention_layernorm.weight",)),
    TensorRule("layers.{layer}.mlp.gate_up.weight", (f"{M}.gate_proj.weight", f"{M}.up_proj.weight"), "gate_up"),
    TensorRule("layers.{layer}.mlp.down.weight", (f"{M}.down_proj.weight",)),
    TensorRule("final_norm.weight", ("model.norm.weight",)),
    TensorRule("output.weight", ("lm_head.weight",), "vocab", unless="tie_word_embeddings"),
)

# Defaults are those of transformers' Qwen2Config, used when a key is absent from config.json.
CONFIG = (
    Field("vocab_size"),
    Field("hidden_size"),
    Field("intermediate_size"),
    Field("num_hidden_layers"),
    Field("num_attention_heads"),
    Field("num_key_value_heads", None),
    Field("head_dim", None),
    Field("max_position_embeddings", 32768),
    Field("rms_norm_eps", 1e-6),
    Field("tie_word_embeddings", False),
    Field("hidden_act", "silu"),
    Field("initializer_range", 0.02),
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
