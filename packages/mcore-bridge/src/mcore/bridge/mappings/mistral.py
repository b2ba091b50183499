"""Mistral (``MistralForCausalLM``): Llama tensor names, no biases, one ``sliding_window`` for every layer
(``null`` in v0.3 and NeMo)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import Field, Fixed, McoreOnly, Rope

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
    TensorRule("layers.{layer}.attention.out_proj.weight", (f"{A}.o_proj.weight",)),
    TensorRule("layers.{layer}.mlp_norm.weight", (f"{L}.post_attention_layernorm.weight",)),
    TensorRule("layers.{layer}.mlp.gate_up.weight", (f"{M}.gate_proj.weight", f"{M}.up_proj.weight"), "gate_up"),
    TensorRule("layers.{layer}.mlp.down.weight", (f"{M}.down_proj.weight",)),
    TensorRule("final_norm.weight", ("model.norm.weight",)),
    TensorRule("output.weight", ("lm_head.weight",), "vocab", unless="tie_word_embeddings"),
)

# Defaults are those of transformers' MistralConfig, used when a key is absent from config.json.
CONFIG = (
    Field("vocab_size"),
    Field("hidden_size"),
    Field("intermediate_size"),
    Field("num_hidden_layers"),
    Field("num_attention_heads"),
    Field("num_key_value_heads", 8),
    Field("head_dim", None),
    Field("max_position_embeddings", 4096 * 32),
    Field("rms_norm_eps", 1e-6),
    Field("tie_word_embeddings", False),
    Field("hidden_act", "silu"),
    Field("initializer_range", 0.02),
    Field("sliding_window", 4096),
    Rope(default_theta=10000.0),
    Fixed("model_type", "mistral"),
    Fixed("normalization", "rmsnorm"),
    Fixed("attention_bias", False),
    Fixed("attention_out_bias", False),
    Fixed("mlp_bias", False),
    Fixed("qk_norm", False),
    Fixed("layer_types", None),
    McoreOnly("make_vocab_size_divisible_by", 128),
)

MAPPING = FamilyMapping(
    name="mistral",
    hf_model_type="mistral",
    hf_architectures=("MistralForCausalLM",),
    tensors=TENSORS,
    config=CONFIG,
    description="Mistral 7B v0.1-v0.3, Mistral NeMo (sliding-window attention)",
)
