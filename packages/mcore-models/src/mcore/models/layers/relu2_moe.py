"""The ``moe_relu2`` MLP part: Nemotron-H's MoE layers (HF ``NemotronHMoE``, Megatron's ``E`` pattern symbol).

Routed experts are non-gated squared-ReLU MLPs, ``down(relu(up(x))^2)``: the ``moe`` part's router, dispatch,
expert / expert-tensor parallelism and grouped experts (:class:`mcore.models.layers.moe.MoEMLP` over
``mcore.parallel.MoELayer``) with the experts' ``relu2`` activation (``GroupedExperts(activation="relu2")``). The
shared expert, when ``shared_expert_intermediate_size`` is set, is the same non-gated squared-ReLU MLP as
Nemotron-H's dense layers, added ungated. The routing is what the config's ``moe_router`` says; Nemotron-H's is
sigmoid scores with ``e_score_correction_bias`` (our ``expert_bias`` buffer) added for the choice only, group-limited
(``n_group`` / ``topk_group``), the top-k weights renormalised and times ``routed_scaling_factor``.

Parameters: ``router.weight`` [E, H], ``experts.up`` [E_local, F/etp, H], ``experts.down`` [E_local, H, F/etp]
(HF's merged ``experts.up_proj`` / ``experts.down_proj`` layouts), ``shared_expert.{up,down}.weight``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mcore.models.layers.moe import MoEMLP
from mcore.models.layers.relu2_mlp import SquaredReluMLP
from mcore.models.moe_fields import moe_layer_config
from mcore.models.parts.registry import PartContext, PartSpec


class SquaredReluMoEMLP(MoEMLP):
    """Routed squared-ReLU experts (+ an ungated squared-ReLU shared expert) on ``[s(/tp), b, h]``."""

    def __init__(self, config: Any, layer_index: int = 0, context: PartContext | None = None) -> None:
        if config.num_experts is None:
            raise ValueError("the 'moe_relu2' MLP part needs TransformerConfig.num_experts (and num_experts_per_tok)")
        if config.shared_expert_gate:
            raise ValueError("the 'moe_relu2' MLP part has an ungated shared expert; set shared_expert_gate=False")
        ctx = PartContext() if context is None else context
        # the parent builds the router, dispatcher and relu2 experts; the shared expert is ours, not its gated one
        unshared = dataclasses.replace(config, shared_expert_intermediate_size=None)
        super().__init__(unshared, layer_index, ctx, activation="relu2")
        if config.shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = SquaredReluMLP(shared, layer_index, ctx)


def _sizes(config: Any) -> tuple[int, int, int]:
    return (
        config.hidden_size,
        moe_layer_config(config).moe_intermediate_size,
        config.shared_expert_intermediate_size or 0,
    )


def relu2_moe_parameters(config: Any, layer_index: int = 0) -> int:
    h, ffn, shared = _sizes(config)
    return h * config.num_experts + config.num_experts * 2 * h * ffn + 2 * h * shared


def relu2_moe_matmul_weights(config: Any, layer_index: int = 0) -> int:
    """Weights one token multiplies: the router, its top-k experts and the shared expert."""
    h, ffn, shared = _sizes(config)
    return h * config.num_experts + config.num_experts_per_tok * 2 * h * ffn + 2 * h * shared


def check_relu2_moe_tensor_parallel(config: Any, tp: int) -> None:
    """Experts split over etp (default: tp) by their FFN width; the shared expert over tp like a dense MLP."""
    _, ffn, shared = _sizes(config)
    if ffn % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the experts' moe_intermediate_size ({ffn})")
    if shared % tp:
        raise ValueError(f"tensor parallel size {tp} must divide shared_expert_intermediate_size ({shared})")


RELU2_MOE_MLP = PartSpec(
    name="moe_relu2",
    attribute="mlp",
    build=SquaredReluMoEMLP,
    parameters=relu2_moe_parameters,
    matmul_weights=relu2_moe_matmul_weights,
    check_tensor_parallel=check_relu2_moe_tensor_parallel,
)
