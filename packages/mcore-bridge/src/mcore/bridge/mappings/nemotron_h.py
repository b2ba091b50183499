"""Nemotron-H (``NemotronHForCausalLM``): ``backbone.layers.i`` is one ``norm`` and one ``mixer`` (Mamba-2,
attention without RoPE, or squared-ReLU MLP); ours is the same block with the other slot empty, so the HF norm is
our ``input_norm`` (Mamba, attention layers) or ``mlp_norm`` (MLP layers). The layer pattern is HF's
``layers_block_type``, or Megatron's ``hybrid_override_pattern`` string in older files (read; written back as it was).
MoE layers (``moe`` / ``E``: our ``moe_relu2`` MLP) hold the router ``mixer.gate.weight``, the experts stored per
expert in the Hub's files (``mixer.experts.{i}.up_proj`` / ``down_proj``; transformers 5 merges them only in
memory) and the shared expert ``mixer.shared_experts``. The router's ``gate.e_score_correction_bias`` is a
persistent buffer (our ``mlp.expert_bias``), carried like a parameter.
"""

from __future__ import annotations

from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import Field, family_rules
from mcore.bridge.mappings.mamba2 import mamba_tensors
from mcore.bridge.mappings.ssm_rules import Alias, LayerPattern, NemotronMoE, TimeStepLimit

L = "backbone.layers.{layer}"
X = f"{L}.mixer"

TENSORS = (
    TensorRule("embedding.weight", ("backbone.embeddings.weight",), "vocab"),
    TensorRule("layers.{layer}.input_norm.weight", (f"{L}.norm.weight",)),
    TensorRule("layers.{layer}.mlp_norm.weight", (f"{L}.norm.weight",)),
    *mamba_tensors(X),
    TensorRule(
        "layers.{layer}.attention.qkv.weight", (f"{X}.q_proj.weight", f"{X}.k_proj.weight", f"{X}.v_proj.weight"), "qkv"
    ),
    TensorRule("layers.{layer}.attention.out_proj.weight", (f"{X}.o_proj.weight",)),
    TensorRule("layers.{layer}.mlp.up.weight", (f"{X}.up_proj.weight",), mlp="relu2"),
    TensorRule("layers.{layer}.mlp.down.weight", (f"{X}.down_proj.weight",), mlp="relu2"),
    TensorRule("layers.{layer}.mlp.up.bias", (f"{X}.up_proj.bias",), when="mlp_bias", mlp="relu2"),
    TensorRule("layers.{layer}.mlp.down.bias", (f"{X}.down_proj.bias",), when="mlp_bias", mlp="relu2"),
    TensorRule("layers.{layer}.mlp.router.weight", (f"{X}.gate.weight",), mlp="moe_relu2"),
    TensorRule("layers.{layer}.mlp.expert_bias", (f"{X}.gate.e_score_correction_bias",), mlp="moe_relu2"),
    TensorRule(
        "layers.{layer}.mlp.experts.up", (f"{X}.experts.{{expert}}.up_proj.weight",), "experts", mlp="moe_relu2"
    ),
    TensorRule(
        "layers.{layer}.mlp.experts.down", (f"{X}.experts.{{expert}}.down_proj.weight",), "experts", mlp="moe_relu2"
    ),
    TensorRule("layers.{layer}.mlp.shared_expert.up.weight", (f"{X}.shared_experts.up_proj.weight",), mlp="moe_relu2"),
    TensorRule(
        "layers.{layer}.mlp.shared_expert.down.weight", (f"{X}.shared_experts.down_proj.weight",), mlp="moe_relu2"
    ),
    TensorRule("final_norm.weight", ("backbone.norm_f.weight",)),
    TensorRule("output.weight", ("lm_head.weight",), "vocab", unless="tie_word_embeddings"),
)


def _parts(hf: dict) -> list[tuple[str, str]]:
    from mcore.models.families.nemotron_h import pattern_parts

    pattern = hf.get("layers_block_type") or hf.get("hybrid_override_pattern")
    if pattern is None:
        raise BridgeError("config.json has neither 'layers_block_type' nor 'hybrid_override_pattern'")
    try:
        parts = pattern_parts(pattern)
    except ValueError as exc:
        raise BridgeError(str(exc)) from None
    return list(zip(parts["layer_types"], parts["mlp_layer_types"], strict=True))


def _render(pairs: list[tuple[str, str]]) -> dict:
    from mcore.models.families.nemotron_h import SYMBOL_HF_BLOCK, parts_pattern

    try:
        pattern = parts_pattern([m for m, _ in pairs], [f for _, f in pairs])
    except ValueError as exc:
        raise BridgeError(str(exc)) from None
    return {"layers_block_type": [SYMBOL_HF_BLOCK[c] for c in pattern]}


def _layer_count(hf: dict) -> int:
    return len(_parts(hf))


def _has_moe(hf: dict) -> bool:
    return any(mlp == "moe_relu2" for _, mlp in _parts(hf))


def _fixed_router() -> tuple:
    from mcore.models.families.nemotron_h import MOE_ROUTER

    return tuple(MOE_ROUTER.items())


class _LayerCount(Field):
    """``num_hidden_layers`` is the pattern's length (transformers derives it the same way)."""

    def to_mcore(self, hf: dict) -> dict:
        return {"num_hidden_layers": _layer_count(hf)}


CONFIG = family_rules(
    "nemotron_h",
    (
        Field("vocab_size"),
        Field("hidden_size"),
        Field("intermediate_size", 21504),
        _LayerCount("num_hidden_layers"),
        LayerPattern(("layers_block_type", "hybrid_override_pattern"), _parts, _render),
        Field("num_attention_heads", 32),
        Field("num_key_value_heads", 8),
        Field("head_dim", 128),
        Field("max_position_embeddings", 4096),
        Field("mamba_num_heads", 128),
        Field("mamba_head_dim", 64),
        Field("ssm_state_size", 128),
        Field("n_groups", 8),
        Field("conv_kernel", 4),
        Field("chunk_size", 128),
        Field("use_conv_bias", True),
        Alias("mamba_proj_bias", ("mamba_proj_bias", "projectors_bias"), False),
        Field("mlp_bias", False),
        Alias("layer_norm_epsilon", ("rms_norm_eps",), 1e-5),
        TimeStepLimit(),
        Field("tie_word_embeddings", False),
        Alias("mamba_hidden_act", ("hidden_act",), "silu"),
        Field("initializer_range", 0.02),
        NemotronMoE(_has_moe, _fixed_router()),
    ),
)

MAPPING = FamilyMapping(
    name="nemotron_h",
    hf_model_type="nemotron_h",
    tensors=TENSORS,
    config=CONFIG,
    description="Nemotron-H (Mamba-2, NoPE attention and squared-ReLU MLP layers in a pattern)",
)
