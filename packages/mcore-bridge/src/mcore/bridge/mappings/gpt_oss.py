"""GPT-OSS (``GptOssForCausalLM``): Llama's attention names plus biases and ``self_attn.sinks``; in every layer a
router with a bias (``mlp.router``) and the experts stored stacked in the Hub's files (``mlp.experts.gate_up_proj``
[E, H, 2I] with gate and up interleaved, ``gate_up_proj_bias``, ``down_proj`` [E, I, H], ``down_proj_bias``). The
released checkpoints hold the two expert weights in MXFP4 (``*_blocks`` + ``*_scales``): ``mcore.bridge.mxfp4``
dequantizes them on import and, on request, writes them back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import (
    ConfigRule,
    Field,
    Renamed,
    Rope,
    RouterAuxLoss,
    SharedAttentionBias,
    family_rules,
)
from mcore.bridge.mappings.llama_layout import (
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    MLP_NORM,
    OUT_PROJ,
    OUT_PROJ_BIAS,
    OUTPUT,
    QKV,
    QKV_BIAS,
    A,
    M,
    shape_fields,
)
from mcore.bridge.mappings.moe_layout import EXPERTS_DOWN, EXPERTS_GATE_UP, ROUTER

X = f"{M}.experts"
TENSORS = (
    EMBEDDING,
    INPUT_NORM,
    QKV,
    QKV_BIAS,
    TensorRule("layers.{layer}.attention.sinks.weight", (f"{A}.sinks",), when="attention_sinks"),
    OUT_PROJ,
    OUT_PROJ_BIAS,
    MLP_NORM,
    TensorRule(ROUTER, (f"{M}.router.weight",)),
    TensorRule("layers.{layer}.mlp.router.bias", (f"{M}.router.bias",), when="router_bias"),
    TensorRule(EXPERTS_GATE_UP, (f"{X}.gate_up_proj",), "gate_up_interleaved"),
    TensorRule(
        "layers.{layer}.mlp.experts.gate_up_bias", (f"{X}.gate_up_proj_bias",), "bias_interleaved", when="expert_biases"
    ),
    TensorRule(EXPERTS_DOWN, (f"{X}.down_proj",), "transposed"),
    TensorRule("layers.{layer}.mlp.experts.down_bias", (f"{X}.down_proj_bias",), when="expert_biases"),
    FINAL_NORM,
    OUTPUT,
)


@dataclass(frozen=True)
class AlternatingLayers(ConfigRule):
    """``sliding_window`` and ``layer_types`` (transformers' default when absent: sliding on even layers)."""

    default_window: int = 128
    hf_keys = ("sliding_window", "layer_types")
    mcore_fields = ("sliding_window", "layer_types")

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        n = hf.get("num_hidden_layers") or 0
        types = hf.get("layer_types")
        if types is None:
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        return {"sliding_window": hf.get("sliding_window", self.default_window), "layer_types": list(types)}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        n, window, types = values["num_hidden_layers"], values["sliding_window"], values["layer_types"]
        if types is None:
            types = ["full_attention" if window is None else "sliding_attention"] * n
        return {"sliding_window": window, "layer_types": list(types)}


_LLAMA_SHAPES = shape_fields(max_position_embeddings=131072, num_key_value_heads=8, head_dim=64)
_SHAPES = tuple(f for f in _LLAMA_SHAPES if f.name != "rms_norm_eps")

# transformers' GptOssConfig defaults
CONFIG = family_rules(
    "gpt_oss",
    (
        *_SHAPES,
        Field("rms_norm_eps", 1e-5),
        SharedAttentionBias(),
        AlternatingLayers(),
        Renamed("num_local_experts", "num_experts", 128),
        Field("num_experts_per_tok", 4),
        Field("swiglu_alpha", 1.702),
        Field("swiglu_limit", 7.0),
        RouterAuxLoss(default_coef=0.001),
        Rope(default_theta=150000.0),
    ),
)

MAPPING = FamilyMapping(
    name="gpt_oss",
    hf_model_type="gpt_oss",
    tensors=TENSORS,
    config=CONFIG,
    description="gpt-oss-20b, gpt-oss-120b (sinks, sliding/full layers, YaRN, biased top-4 experts; MXFP4 files)",
)
