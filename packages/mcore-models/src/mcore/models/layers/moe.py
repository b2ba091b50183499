"""The ``moe`` MLP part: a routed mixture of SwiGLU experts, optionally plus a shared expert (Qwen2-MoE, with its
sigmoid gate), registered in the MLP slot.

The routing, dispatch (ep / etp) and grouped experts are ``mcore.parallel.MoELayer``; this module adds the shared
expert and reads the layer's sizes from ``TransformerConfig`` (HF names: ``num_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``norm_topk_prob``, ``shared_expert_intermediate_size``, ``router_aux_loss_coef``).
Training knobs that HF configs do not have live in ``moe_router`` (keys: ``mcore.models.moe_fields.ROUTER_KNOBS``).
Parameters: ``router.weight`` [E, H], ``experts.gate_up`` [E_local, 2F/etp, H], ``experts.down`` [E_local, H, F/etp],
``shared_expert.{gate_up,down}.weight``, ``shared_expert_gate.weight`` [1, H].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from mcore.models.gpt_oss_fields import expert_activation, expert_bias_parameters
from mcore.models.layers.mlp import GatedMLP
from mcore.models.moe_fields import moe_layer_config
from mcore.models.parts.registry import PartContext, PartSpec
from mcore.models.recompute import checkpoint_region
from mcore.parallel.comm import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from mcore.parallel.expert_biases import use_gpt_oss_options
from mcore.parallel.expert_parallel import MoELayer
from mcore.parallel.tensor_parallel import set_tensor_parallel_attributes


class _SharedExpertGate(nn.Module):
    """``sigmoid(x @ w.T)`` [.., 1] scaling the shared expert's output (Qwen2-MoE)."""

    def __init__(self, hidden_size: int, init_std: float, params_dtype, device, sequence_parallel: bool) -> None:
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=params_dtype, device=device))
        # replicated; under sequence parallelism the tokens differ per tp rank, so its grads are summed over tp
        set_tensor_parallel_attributes(self.weight, tensor_parallel=False, sequence_parallel=sequence_parallel)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        full = torch.empty(self.weight.shape).normal_(0.0, self.init_std, generator=generator)
        with torch.no_grad():
            self.weight.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.nn.functional.linear(x, self.weight))


class MoEMLP(MoELayer):
    """Routed experts (+ optional shared expert) on ``[s(/tp), b, h]``; see the module docstring."""

    def __init__(
        self, config: Any, layer_index: int = 0, context: PartContext | None = None, *, activation: str = "swiglu"
    ) -> None:
        """``activation``: the routed experts' (``mcore.parallel.expert_parallel.EXPERT_ACTIVATIONS``; the
        ``moe_relu2`` part passes ``"relu2"``)."""
        ctx = PartContext() if context is None else context
        super().__init__(
            dataclasses.replace(moe_layer_config(config), activation=activation),
            groups=ctx.groups,
            init_std=config.initializer_range,
            token_split_group=ctx.tp_group if ctx.tp_size > 1 else None,  # each tp rank routes part of the sequence
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        # Each tp rank must route its own tokens (the experts' etp group sums over them): under sequence parallelism
        # they already are; without it the layer takes this rank's slice of the sequence and gathers the output.
        self.tp_group = ctx.tp_group
        self.split_sequence = ctx.tp_size > 1 and not ctx.sequence_parallel
        self.router.weight.sequence_parallel = ctx.tp_size > 1  # tokens differ per tp rank: grads summed over tp
        # GPT-OSS: router bias, expert biases, clamped SwiGLU (mcore.parallel.expert_biases)
        options = dict(router_bias=config.router_bias, expert_biases=config.expert_biases)
        use_gpt_oss_options(self, **options, activation=expert_activation(config))
        self.shared_expert = self.shared_expert_gate = None
        self.recompute_shared_expert = ctx.recomputes("shared_experts")
        if config.shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = GatedMLP(shared, layer_index, ctx)
            if config.shared_expert_gate:
                self.shared_expert_gate = _SharedExpertGate(
                    config.hidden_size, config.initializer_range, ctx.params_dtype, ctx.device, ctx.sequence_parallel
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_sequence:
            routed = super().forward(scatter_to_sequence_parallel_region(x, self.tp_group))
            # the output is replicated over tp: its gradient is too, so backward keeps this rank's slice
            out = gather_from_sequence_parallel_region(routed, self.tp_group, tensor_parallel_output_grad=False)
        else:
            out = super().forward(x)
        if self.shared_expert is not None:
            recompute = self.recompute_shared_expert  # recompute_modules' shared_experts
            shared = checkpoint_region(self.shared_expert, x) if recompute else self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = self.shared_expert_gate(x) * shared
            out = out + shared
        return out


def moe_parameters(config: Any, layer_index: int = 0) -> int:
    h, e = config.hidden_size, config.num_experts
    ffn = moe_layer_config(config).moe_intermediate_size
    shared = config.shared_expert_intermediate_size or 0
    total = h * e + e * 3 * h * ffn + 3 * h * shared + (h if config.shared_expert_gate else 0)
    return total + expert_bias_parameters(config)


def moe_matmul_weights(config: Any, layer_index: int = 0) -> int:
    """Weights one token multiplies: the router, its top-k experts and the shared expert (+ gate)."""
    h, e, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
    ffn = moe_layer_config(config).moe_intermediate_size
    shared = config.shared_expert_intermediate_size or 0
    return h * e + k * 3 * h * ffn + 3 * h * shared + (h if config.shared_expert_gate else 0)


def check_moe_tensor_parallel(config: Any, tp: int) -> None:
    """Experts split over etp (default: tp) by their FFN width; the shared expert over tp like a dense MLP."""
    ffn = moe_layer_config(config).moe_intermediate_size
    if ffn % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the experts' moe_intermediate_size ({ffn})")
    shared = config.shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ValueError(f"tensor parallel size {tp} must divide shared_expert_intermediate_size ({shared})")


MOE_MLP = PartSpec(
    name="moe",
    attribute="mlp",
    build=MoEMLP,
    parameters=moe_parameters,
    matmul_weights=moe_matmul_weights,
    check_tensor_parallel=check_moe_tensor_parallel,
)
