"""Tensor and config rules shared by DeepSeek-V3 and V2 (and Moonlight / Kimi-K2, which use V3's class).

Multi-head latent attention: ``q_proj`` (no q-LoRA) or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` and ``o_proj``, copied as they are (our heads are laid
out as HF's). MoE layers (from ``first_k_dense_replace`` on) store per-expert tensors like Qwen-MoE, plus
``shared_experts`` (plural) and, in V3, the router's ``e_score_correction_bias`` (our ``mlp.expert_bias`` buffer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings.base import TensorRule
from mcore.bridge.mappings.config_rules import ConfigRule, Field, McoreOnly, Renamed, Rope
from mcore.bridge.mappings.llama_layout import (
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    MLP_NORM,
    OUT_PROJ,
    OUTPUT,
    A,
    M,
    shape_fields,
)
from mcore.bridge.mappings.moe_layout import DENSE_DOWN, DENSE_GATE_UP, QWEN_EXPERTS

_ATT = "layers.{layer}.attention"
MLA_TENSORS = (
    TensorRule(f"{_ATT}.q_proj.weight", (f"{A}.q_proj.weight",), unless="q_lora_rank"),
    TensorRule(f"{_ATT}.q_down.weight", (f"{A}.q_a_proj.weight",), when="q_lora_rank"),
    TensorRule(f"{_ATT}.q_norm.weight", (f"{A}.q_a_layernorm.weight",), when="q_lora_rank"),
    TensorRule(f"{_ATT}.q_up.weight", (f"{A}.q_b_proj.weight",), when="q_lora_rank"),
    TensorRule(f"{_ATT}.kv_down.weight", (f"{A}.kv_a_proj_with_mqa.weight",)),
    TensorRule(f"{_ATT}.kv_norm.weight", (f"{A}.kv_a_layernorm.weight",)),
    TensorRule(f"{_ATT}.kv_up.weight", (f"{A}.kv_b_proj.weight",)),
    OUT_PROJ,
)
S = f"{M}.shared_experts"
SHARED_EXPERTS = (
    TensorRule(
        "layers.{layer}.mlp.shared_expert.gate_up.weight",
        (f"{S}.gate_proj.weight", f"{S}.up_proj.weight"),
        "gate_up",
        mlp="moe",
    ),
    TensorRule("layers.{layer}.mlp.shared_expert.down.weight", (f"{S}.down_proj.weight",), mlp="moe"),
)
# DeepSeek-V3's MTP depth k at HF layer num_hidden_layers + k (see FamilyMapping.mtp_tensors)
_D = "model.layers.{layer}"
MTP_TENSORS = (
    TensorRule("mtp.layers.{layer}.enorm.weight", (f"{_D}.enorm.weight",)),
    TensorRule("mtp.layers.{layer}.hnorm.weight", (f"{_D}.hnorm.weight",)),
    TensorRule("mtp.layers.{layer}.eh_proj.weight", (f"{_D}.eh_proj.weight",)),
    TensorRule("mtp.layers.{layer}.final_norm.weight", (f"{_D}.shared_head.norm.weight",)),
)
MTP_COPIES = (("embedding.weight", f"{_D}.embed_tokens.weight"), ("output.weight", f"{_D}.shared_head.head.weight"))
EXPERT_BIAS = TensorRule("layers.{layer}.mlp.expert_bias", (f"{M}.gate.e_score_correction_bias",), mlp="moe")


def deepseek_tensors(*, expert_bias: bool) -> tuple[TensorRule, ...]:
    bias = (EXPERT_BIAS,) if expert_bias else ()
    return (
        EMBEDDING,
        INPUT_NORM,
        *MLA_TENSORS,
        MLP_NORM,
        DENSE_GATE_UP,
        DENSE_DOWN,
        *QWEN_EXPERTS,
        *bias,
        *SHARED_EXPERTS,
        FINAL_NORM,
        OUTPUT,
    )


@dataclass(frozen=True)
class SharedExperts(ConfigRule):
    """``n_shared_experts`` experts of ``moe_intermediate_size`` run as one MLP ``shared_expert_intermediate_size``
    wide (the sum of their widths: the same function, their weights concatenated)."""

    default: int = 1
    hf_keys = ("n_shared_experts",)
    mcore_fields = ("shared_expert_intermediate_size",)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        n = hf.get("n_shared_experts", self.default)
        return {"shared_expert_intermediate_size": n * hf["moe_intermediate_size"] if n else None}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        width, ffn = values["shared_expert_intermediate_size"], values["moe_intermediate_size"]
        if width is not None and width % ffn:
            raise BridgeError(
                f"shared_expert_intermediate_size {width} is not a multiple of moe_intermediate_size {ffn}; "
                "DeepSeek's config can only state a whole number of shared experts (n_shared_experts)"
            )
        return {"n_shared_experts": 0 if width is None else width // ffn}


@dataclass(frozen=True)
class DeepSeekRouter(ConfigRule):
    """The routing keys of DeepSeek's config as our ``moe_router``: V3's ``noaux_tc`` (sigmoid scores, the
    ``e_score_correction_bias``, groups scored by their two best experts) or V2's softmax ``greedy`` /
    ``group_limited_greedy`` (groups scored by their best expert). Training knobs of ``moe_router`` that HF has
    no key for (bias update rate, dispatcher...) start from their defaults on import and are not exported."""

    version: int = 3
    hf_keys = ("n_group", "topk_group", "routed_scaling_factor", "topk_method", "scoring_func")
    mcore_fields = ("moe_router",)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
        router: dict[str, Any] = {
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 2.5 if self.version == 3 else 1.0))
        }
        if self.version == 3:
            method, scoring = hf.get("topk_method", "noaux_tc"), hf.get("scoring_func", "sigmoid")
            if method != "noaux_tc" or scoring != "sigmoid":
                raise BridgeError(
                    f"topk_method={method!r} / scoring_func={scoring!r}: transformers' DeepseekV3 routes with "
                    "'noaux_tc' and 'sigmoid' only"
                )
            router.update(score_function="sigmoid", expert_bias=True)
        else:
            method = hf.get("topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):
                raise BridgeError(
                    f"topk_method={method!r} is not supported (DeepseekV2: 'greedy', 'group_limited_greedy')"
                )
            if method == "greedy":
                n_group = topk_group = 1
            router["group_score"] = "max"
        if n_group > 1:
            router.update(n_group=n_group, topk_group=topk_group)
        return {"moe_router": router}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        router = dict(values["moe_router"] or {})
        n_group, topk_group = router.get("n_group", 1), router.get("topk_group", 1)
        out = {
            "n_group": n_group,
            "topk_group": topk_group,
            "routed_scaling_factor": router.get("routed_scaling_factor", 1.0),
        }
        if self.version == 3:
            if router.get("score_function") != "sigmoid" or not router.get("expert_bias"):
                raise BridgeError(
                    "DeepseekV3 routes with sigmoid scores and an expert bias; moe_router has "
                    f"score_function={router.get('score_function')!r}, expert_bias={router.get('expert_bias')!r}"
                )
            return {**out, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
        if router.get("score_function", "softmax") != "softmax" or router.get("expert_bias"):
            raise BridgeError("DeepseekV2 routes with softmax scores and no expert bias; use the deepseek_v3 family")
        if n_group > 1 and router.get("group_score") != "max":
            raise BridgeError(
                "DeepseekV2's group_limited_greedy scores a group by its best expert: set group_score='max'"
            )
        return {**out, "topk_method": "group_limited_greedy" if n_group > 1 else "greedy"}


def deepseek_config_rules(*, version: int, max_position_embeddings: int, moe_intermediate_size: int,
                          q_lora_rank: int | None) -> tuple[ConfigRule, ...]:  # fmt: skip
    """The config keys of DeepseekV3Config / DeepseekV2Config, with transformers' defaults."""
    # V3 only: V2 always rotates interleaved pairs, has no MTP modules, and its router ignores norm_topk_prob (so
    # that key is carried, and the field stays the family's False).
    v3_only = (
        (Field("rope_interleave", True), Field("norm_topk_prob", True), Field("num_nextn_predict_layers", 0))
        if version == 3
        else ()
    )
    return (
        *shape_fields(max_position_embeddings=max_position_embeddings, num_key_value_heads=None, head_dim=None),
        Field("moe_intermediate_size", moe_intermediate_size),
        Renamed("n_routed_experts", "num_experts", 256 if version == 3 else 64),
        Field("num_experts_per_tok", 8) if version == 3 else Field("num_experts_per_tok"),
        Field("first_k_dense_replace", 3 if version == 3 else 0),
        SharedExperts(default=1 if version == 3 else 2),
        DeepSeekRouter(version=version),
        Field("q_lora_rank", q_lora_rank),
        Field("kv_lora_rank", 512),
        Field("qk_nope_head_dim", 128),
        Field("qk_rope_head_dim", 64),
        Field("v_head_dim", 128),
        *v3_only,
        # HF applies no auxiliary loss in these classes: a model trained with one exports without it
        McoreOnly("router_aux_loss_coef", 0.0),
        Rope(default_theta=10000.0),
    )
