"""Tensor rules and config fields shared by the Llama-style decoder families (Llama, Qwen2, Qwen3, Mistral).

They all use Hugging Face's Llama tensor names; a family file lists, in order, which of these rules it has
(plus its own), so each family stays readable as data while the names are written once.
"""

from __future__ import annotations

from dataclasses import replace

from mcore.bridge.mappings.base import TensorRule
from mcore.bridge.mappings.config_rules import Field

L = "model.layers.{layer}"
A = f"{L}.self_attn"
M = f"{L}.mlp"

EMBEDDING = TensorRule("embedding.weight", ("model.embed_tokens.weight",), "vocab")
INPUT_NORM = TensorRule("layers.{layer}.input_norm.weight", (f"{L}.input_layernorm.weight",))
QKV = TensorRule(
    "layers.{layer}.attention.qkv.weight", (f"{A}.q_proj.weight", f"{A}.k_proj.weight", f"{A}.v_proj.weight"), "qkv"
)
# Present when ``attention_bias`` is set; Qwen2 always has it (``replace(QKV_BIAS, when=None)``).
QKV_BIAS = TensorRule(
    "layers.{layer}.attention.qkv.bias",
    (f"{A}.q_proj.bias", f"{A}.k_proj.bias", f"{A}.v_proj.bias"),
    "qkv",
    when="attention_bias",
)
Q_NORM = TensorRule("layers.{layer}.attention.q_norm.weight", (f"{A}.q_norm.weight",))
K_NORM = TensorRule("layers.{layer}.attention.k_norm.weight", (f"{A}.k_norm.weight",))
OUT_PROJ = TensorRule("layers.{layer}.attention.out_proj.weight", (f"{A}.o_proj.weight",))
OUT_PROJ_BIAS = TensorRule("layers.{layer}.attention.out_proj.bias", (f"{A}.o_proj.bias",), when="attention_out_bias")
MLP_NORM = TensorRule("layers.{layer}.mlp_norm.weight", (f"{L}.post_attention_layernorm.weight",))
GATE_UP = TensorRule("layers.{layer}.mlp.gate_up.weight", (f"{M}.gate_proj.weight", f"{M}.up_proj.weight"), "gate_up")
GATE_UP_BIAS = TensorRule(
    "layers.{layer}.mlp.gate_up.bias", (f"{M}.gate_proj.bias", f"{M}.up_proj.bias"), "gate_up", when="mlp_bias"
)
DOWN = TensorRule("layers.{layer}.mlp.down.weight", (f"{M}.down_proj.weight",))
DOWN_BIAS = TensorRule("layers.{layer}.mlp.down.bias", (f"{M}.down_proj.bias",), when="mlp_bias")
FINAL_NORM = TensorRule("final_norm.weight", ("model.norm.weight",))
OUTPUT = TensorRule("output.weight", ("lm_head.weight",), "vocab", unless="tie_word_embeddings")


def always(rule: TensorRule) -> TensorRule:
    """``rule`` without its config condition (a family that always has the tensor)."""
    return replace(rule, when=None)


def shape_fields(
    *, max_position_embeddings: int, num_key_value_heads: int | None = None, head_dim: int | None = None
) -> tuple[Field, ...]:
    """The model-shape fields every family translates, with that family's transformers defaults."""
    return (
        Field("vocab_size"),
        Field("hidden_size"),
        Field("intermediate_size"),
        Field("num_hidden_layers"),
        Field("num_attention_heads"),
        Field("num_key_value_heads", num_key_value_heads),
        Field("head_dim", head_dim),
        Field("max_position_embeddings", max_position_embeddings),
        Field("rms_norm_eps", 1e-6),
        Field("tie_word_embeddings", False),
        Field("hidden_act", "silu"),
        Field("initializer_range", 0.02),
    )
