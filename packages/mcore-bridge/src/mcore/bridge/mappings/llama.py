"""Llama 2 / 3 / 3.1 / 3.2 (``LlamaForCausalLM``): names, fusions and config translation.

HF ``attention_bias`` adds biases to all four attention projections and ``mlp_bias`` to the three MLP
projections; both are off in every published Llama. ``rope_scaling`` (Llama 3.1's ``llama3`` type) is translated.
"""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import Field, Fixed, McoreOnly, Rope, SharedAttentionBias

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
    TensorRule("layers.{layer}.attention.out_proj.weight", (f"{A}.o_proj.weight",)),
    TensorRule("layers.{layer}.attention.out_proj.bias", (f"{A}.o_proj.bias",), when="attention_out_bias"),
    TensorRule("layers.{layer}.mlp_norm.weight", (f"{L}.post_attention_layernorm.weight",)),
    TensorRule("layers.{layer}.mlp.gate_up.weight", (f"{M}.gate_proj.weight", f"{M}.up_proj.weight"), "gate_up"),
    TensorRule(
        "layers.{layer}.mlp.gate_up.bias",
        (f"{M}.gate_proj.bias", f"{M}.up_proj.bias"),
        "gate_up",
        when="mlp_bias",
    ),
    TensorRule("layers.{layer}.mlp.down.weight", (f"{M}.down_proj.weight",)),
    TensorRule("layers.{layer}.mlp.down.bias", (f"{M}.down_proj.bias",), when="mlp_bias"),
    TensorRule("final_norm.weight", ("model.norm.weight",)),
    TensorRule("output.weight", ("lm_head.weight",), "vocab", unless="tie_word_embeddings"),
)

# Defaults are those of transformers' LlamaConfig, used when a key is absent from config.json.
CONFIG = (
    Field("vocab_size"),
    Field("hidden_size"),
    Field("intermediate_size"),
    Field("num_hidden_layers"),
    Field("num_attention_heads"),
    Field("num_key_value_heads", None),
    Field("head_dim", None),
    Field("max_position_embeddings", 2048),
    Field("rms_norm_eps", 1e-6),
    Field("tie_word_embeddings", False),
    Field("hidden_act", "silu"),
    Field("initializer_range", 0.02),
    Field("mlp_bias", False),
    SharedAttentionBias(),
    Rope(default_theta=10000.0),
    Fixed("model_type", "llama"),
    Fixed("normalization", "rmsnorm"),
    Fixed("qk_norm", False),
    Fixed("sliding_window", None),
    Fixed("layer_types", None),
    McoreOnly("make_vocab_size_divisible_by", 128),
)

MAPPING = FamilyMapping(
    name="llama",
    hf_model_type="llama",
    hf_architectures=("LlamaForCausalLM",),
    tensors=TENSORS,
    config=CONFIG,
    description="Llama 2, Llama 3, 3.1 (llama3 rope scaling), 3.2",
)
