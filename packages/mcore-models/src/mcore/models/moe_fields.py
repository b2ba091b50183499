"""The MoE fields of ``TransformerConfig``: their rules and the ``MoEConfig`` of a model's MoE layers.

Kept apart from ``layers/moe.py`` (the part itself) so that ``config.py`` can validate the fields at construction
without importing the layers, which import the config.
"""

from __future__ import annotations

from typing import Any

from mcore.parallel.expert_parallel import MoEConfig

__all__ = ["ROUTER_KNOBS", "check_moe_fields", "moe_layer_config"]

# moe_router keys -> the MoEConfig field each sets
ROUTER_KNOBS = (
    "score_function",
    "softmax_before_topk",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "expert_bias",
    "bias_update_rate",
    "aux_loss_type",
    "z_loss_coef",
    "capacity_factor",
    "drop_policy",
    "pad_to_capacity",
    "align",
    "dispatcher",
    "expert_gemm",
)


def moe_layer_config(config: Any) -> MoEConfig:
    """The ``MoEConfig`` of ``config``'s MoE layers (raises ``ValueError`` naming the field when invalid)."""
    knobs = dict(config.moe_router or {})
    unknown = sorted(set(knobs) - set(ROUTER_KNOBS))
    if unknown:
        raise ValueError(f"TransformerConfig.moe_router: unknown keys {unknown}; valid keys: {list(ROUTER_KNOBS)}")
    ffn = config.intermediate_size if config.moe_intermediate_size is None else config.moe_intermediate_size
    return MoEConfig(
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        topk=config.num_experts_per_tok,
        moe_intermediate_size=ffn,
        norm_topk_prob=config.norm_topk_prob,
        aux_loss_coef=config.router_aux_loss_coef,
        **knobs,
    )


def check_moe_fields(config: Any) -> None:
    """Validate the MoE fields of a ``TransformerConfig`` (called from its ``__post_init__``)."""
    try:
        moe_layer_config(config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"TransformerConfig MoE fields: {exc}") from None
    size = config.shared_expert_intermediate_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(
            f"TransformerConfig.shared_expert_intermediate_size must be a positive int or None, got {size!r}"
        )
    if config.shared_expert_gate and size is None:
        raise ValueError("TransformerConfig.shared_expert_gate=True needs shared_expert_intermediate_size")
