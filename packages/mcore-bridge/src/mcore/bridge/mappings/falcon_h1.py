"""Falcon-H1 (``FalconH1ForCausalLM``): Llama-style ``model.*`` names with ``mamba`` and ``self_attn`` side by side
in each layer (ours: ``layers.{i}.parallel.mamba`` / ``.parallel.attention``), ``pre_ff_layernorm`` and
``feed_forward`` for the MLP, ``final_layernorm``; the muP multipliers are config keys of the same names.
"""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import Field, Rope, SharedAttentionBias, family_rules
from mcore.bridge.mappings.mamba2 import mamba_tensors
from mcore.bridge.mappings.ssm_rules import Alias, LayerPattern, MambaInnerWidth, TimeStepLimit

L = "model.layers.{layer}"
A, F = f"{L}.self_attn", f"{L}.feed_forward"
P = "layers.{layer}.parallel"

TENSORS = (
    TensorRule("embedding.weight", ("model.embed_tokens.weight",), "vocab"),
    TensorRule("layers.{layer}.input_norm.weight", (f"{L}.input_layernorm.weight",)),
    *mamba_tensors(f"{L}.mamba", f"{P}.mamba"),
    TensorRule(f"{P}.attention.qkv.weight", (f"{A}.q_proj.weight", f"{A}.k_proj.weight", f"{A}.v_proj.weight"), "qkv"),
    TensorRule(
        f"{P}.attention.qkv.bias",
        (f"{A}.q_proj.bias", f"{A}.k_proj.bias", f"{A}.v_proj.bias"),
        "qkv",
        when="attention_bias",
    ),  # fmt: skip
    TensorRule(f"{P}.attention.out_proj.weight", (f"{A}.o_proj.weight",)),
    TensorRule(f"{P}.attention.out_proj.bias", (f"{A}.o_proj.bias",), when="attention_out_bias"),
    TensorRule("layers.{layer}.mlp_norm.weight", (f"{L}.pre_ff_layernorm.weight",)),
    TensorRule("layers.{layer}.mlp.gate_up.weight", (f"{F}.gate_proj.weight", f"{F}.up_proj.weight"), "gate_up"),
    TensorRule(
        "layers.{layer}.mlp.gate_up.bias", (f"{F}.gate_proj.bias", f"{F}.up_proj.bias"), "gate_up", when="mlp_bias"
    ),
    TensorRule("layers.{layer}.mlp.down.weight", (f"{F}.down_proj.weight",)),
    TensorRule("layers.{layer}.mlp.down.bias", (f"{F}.down_proj.bias",), when="mlp_bias"),
    TensorRule("final_norm.weight", ("model.final_layernorm.weight",)),
    TensorRule("output.weight", ("lm_head.weight",), "vocab", unless="tie_word_embeddings"),
)


def _parallel_layers(hf: dict) -> list[tuple[str, str]]:
    return [("falcon_h1_parallel", "falcon_h1_mlp")] * hf["num_hidden_layers"]


def _render(pairs: list[tuple[str, str]]) -> dict:
    from mcore.bridge.errors import BridgeError

    if any(p != ("falcon_h1_parallel", "falcon_h1_mlp") for p in pairs):
        raise BridgeError(f"FalconH1ForCausalLM layers are all parallel attention + Mamba-2 and MLP; got {pairs}")
    return {}


_MULTIPLIERS = (
    "embedding_multiplier",
    "lm_head_multiplier",
    "key_multiplier",
    "attention_in_multiplier",
    "attention_out_multiplier",
    "ssm_in_multiplier",
    "ssm_out_multiplier",
)

CONFIG = family_rules(
    "falcon_h1",
    (
        Field("vocab_size"),
        Field("hidden_size"),
        Field("intermediate_size", 14336),
        Field("num_hidden_layers", 32),
        LayerPattern((), _parallel_layers, _render),
        Field("num_attention_heads", 32),
        Field("num_key_value_heads", 8),
        Field("head_dim", None),
        Field("max_position_embeddings", 8192),
        Field("rms_norm_eps", 1e-5),
        Field("tie_word_embeddings", False),
        Field("hidden_act", "silu"),
        Field("initializer_range", 0.02),
        Field("mlp_bias", False),
        SharedAttentionBias(),
        Rope(default_theta=10000.0),
        Alias("mamba_n_heads", ("mamba_num_heads",), 128),
        Alias("mamba_d_head", ("mamba_head_dim",), 8),
        MambaInnerWidth(),
        Alias("mamba_n_groups", ("n_groups",), 1),
        Alias("mamba_d_state", ("ssm_state_size",), 256),
        Alias("mamba_d_conv", ("conv_kernel",), 4),
        Alias("mamba_chunk_size", ("chunk_size",), 256),
        Alias("mamba_conv_bias", ("use_conv_bias",), True),
        Field("mamba_proj_bias", False),
        Field("projectors_bias", False),
        Field("mamba_rms_norm", False),
        Field("mamba_norm_before_gate", True),
        TimeStepLimit(),
        *(Field(name, 1.0) for name in _MULTIPLIERS),
        Field("ssm_multipliers", [1.0] * 5),
        Field("mlp_multipliers", [1.0, 1.0]),
    ),
)

MAPPING = FamilyMapping(
    name="falcon_h1",
    hf_model_type="falcon_h1",
    tensors=TENSORS,
    config=CONFIG,
    description="Falcon-H1 (attention and Mamba-2 in parallel in every layer, muP multipliers)",
)
