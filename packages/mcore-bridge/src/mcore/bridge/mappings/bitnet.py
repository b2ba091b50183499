"""BitNet b1.58 (``BitNetForCausalLM``): Llama tensor names plus ``self_attn.attn_sub_norm`` and ``mlp.ffn_sub_norm``
(ours: the ``sub_norm`` inside ``out_proj`` and ``down``). Every layer is BitNet's attention and MLP; config.json
has no layer list. Packed ternary checkpoints (``weight`` uint8 + ``weight_scale``): ``bitnet_packing.py``."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import Field, Rope, family_rules
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
    shape_fields,
)
from mcore.bridge.mappings.ssm_rules import LayerPattern

L = "model.layers.{layer}"
BITNET_LAYER = ("bitnet_attention", "bitnet_mlp")

TENSORS = (
    EMBEDDING,
    INPUT_NORM,
    QKV,
    OUT_PROJ,
    TensorRule("layers.{layer}.attention.out_proj.sub_norm.weight", (f"{L}.self_attn.attn_sub_norm.weight",)),
    MLP_NORM,
    GATE_UP,
    DOWN,
    TensorRule("layers.{layer}.mlp.down.sub_norm.weight", (f"{L}.mlp.ffn_sub_norm.weight",)),
    FINAL_NORM,
    OUTPUT,
)


def _layers(hf: dict) -> list[tuple[str, str]]:
    return [BITNET_LAYER] * hf.get("num_hidden_layers", 30)


def _render(pairs: list[tuple[str, str]]) -> dict:
    from mcore.bridge.errors import BridgeError

    if any(p != BITNET_LAYER for p in pairs):
        raise BridgeError(f"BitNetForCausalLM layers are all {BITNET_LAYER}; got {pairs}")
    return {}


def _shape_fields() -> tuple[Field, ...]:
    """The shape fields with transformers' BitNetConfig defaults (relu2, eps 1e-5)."""
    own = {"hidden_act": Field("hidden_act", "relu2"), "rms_norm_eps": Field("rms_norm_eps", 1e-5)}
    fields = shape_fields(max_position_embeddings=2048, num_key_value_heads=5)
    return tuple(own.get(f.name, f) for f in fields)


CONFIG = family_rules(
    "bitnet",
    (
        *_shape_fields(),
        LayerPattern((), _layers, _render),
        Rope(default_theta=500000.0),
    ),
)

MAPPING = FamilyMapping(
    name="bitnet",
    hf_model_type="bitnet",
    tensors=TENSORS,
    config=CONFIG,
    description="BitNet b1.58 (relu2-gated MLP, attention and FFN sub-norms; packed ternary checkpoints)",
)
