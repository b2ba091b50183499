"""The ``moe_relu2`` MLP part: Nemotron-H's MoE layers (HF ``NemotronHMoE``, Megatron's ``E`` pattern symbol).

Routed experts are non-gated squared-ReLU MLPs, ``down(relu(up(x))^2)``, behind the ``moe`` part's router, dispatch
and expert / expert-tensor parallelism (``mcore.parallel.MoELayer``, through :class:`mcore.models.layers.moe.MoEMLP`);
the shared expert, when ``shared_expert_intermediate_size`` is set, is the same non-gated squared-ReLU MLP as
Nemotron-H's dense layers, added ungated. The routing is what the config's ``moe_router`` says; Nemotron-H's is
sigmoid scores with ``e_score_correction_bias`` (our ``expert_bias`` buffer) added for the choice only, group-limited
(``n_group`` / ``topk_group``), the top-k weights renormalised and times ``routed_scaling_factor``.

Parameters: ``router.weight`` [E, H], ``experts.up`` [E_local, F/etp, H], ``experts.down`` [E_local, H, F/etp]
(HF's merged ``experts.up_proj`` / ``experts.down_proj`` layouts), ``shared_expert.{up,down}.weight``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from mcore.kernels.moe import grouped_gemm, grouped_gemm_of_activation
from mcore.models.layers.moe import MoEMLP
from mcore.models.layers.relu2_mlp import SquaredReluMLP
from mcore.models.moe_fields import moe_layer_config
from mcore.models.parts.registry import PartContext, PartSpec
from mcore.parallel.expert_gemm import expert_bounds, per_expert_linear, per_expert_linear_of_activation
from mcore.parallel.expert_parallel import _expert_generators
from mcore.parallel.tensor_parallel import set_tensor_parallel_attributes


class SquaredReluExperts(nn.Module):
    """``E_local`` non-gated squared-ReLU experts, ``up`` [E_local, F/etp, H] and ``down`` [E_local, H, F/etp], one
    grouped GEMM each; the FFN width splits over etp like a column- then row-parallel pair."""

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        ffn_size: int,
        *,
        etp: int = 1,
        etp_rank: int = 0,
        first_expert: int = 0,
        init_std: float = 0.02,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        gemm: str = "grouped",
    ) -> None:
        super().__init__()
        local_ffn = ffn_size // etp
        self.gemm = gemm
        self.ffn_size, self.etp, self.etp_rank = ffn_size, etp, etp_rank
        self.first_expert, self.init_std = first_expert, init_std
        kw = dict(dtype=params_dtype, device=device)
        self.up = nn.Parameter(torch.empty(num_local_experts, local_ffn, hidden_size, **kw))
        self.down = nn.Parameter(torch.empty(num_local_experts, hidden_size, local_ffn, **kw))
        set_tensor_parallel_attributes(self.up, tensor_parallel=etp > 1, partition_dim=1)
        set_tensor_parallel_attributes(self.down, tensor_parallel=etp > 1, partition_dim=2)
        for p in (self.up, self.down):
            p.expert_parallel = True

    @torch.no_grad()
    def load_full_experts(self, up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy this rank's slice of its experts' full ``up`` [E_local, F, H] and ``down`` [E_local, H, F]."""
        fl = self.ffn_size // self.etp
        cols = slice(self.etp_rank * fl, (self.etp_rank + 1) * fl)
        self.up.copy_(up[:, cols])
        self.down.copy_(down[:, :, cols])

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) full experts, one generator per global expert (the same weights at any ep/etp)."""
        experts, h = self.up.shape[0], self.up.shape[2]
        gens = _expert_generators(generator, experts, self.first_expert)
        f, std = self.ffn_size, self.init_std
        up = torch.stack([torch.empty(f, h).normal_(0.0, std, generator=g) for g in gens])
        down = torch.stack([torch.empty(h, f).normal_(0.0, std, generator=g) for g in gens])
        self.load_full_experts(up, down)

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor, tail_rows: int | None = None) -> torch.Tensor:
        """The experts' contract of ``mcore.parallel.expert_dispatch`` (``tail_rows`` as in ``grouped_gemm``); the
        squared ReLU is recomputed in backward rather than kept, as the SwiGLU experts do."""
        rows = rows.to(self.up.dtype)
        if self.gemm == "per_expert":
            bounds = expert_bounds(offsets)
            return per_expert_linear_of_activation(per_expert_linear(rows, self.up, bounds), self.down, bounds, _relu2)
        h = grouped_gemm(rows, self.up, offsets, tail_rows=tail_rows)
        return grouped_gemm_of_activation(h, self.down, offsets, _relu2, tail_rows=tail_rows)


def _relu2(h: torch.Tensor) -> torch.Tensor:
    return torch.relu(h).square()


class SquaredReluMoEMLP(MoEMLP):
    """Routed squared-ReLU experts (+ an ungated squared-ReLU shared expert) on ``[s(/tp), b, h]``."""

    def __init__(self, config: Any, layer_index: int = 0, context: PartContext | None = None) -> None:
        if config.num_experts is None:
            raise ValueError("the 'moe_relu2' MLP part needs TransformerConfig.num_experts (and num_experts_per_tok)")
        if config.shared_expert_gate:
            raise ValueError("the 'moe_relu2' MLP part has an ungated shared expert; set shared_expert_gate=False")
        ctx = PartContext() if context is None else context
        # The parent builds the router, dispatcher and SwiGLU experts; the experts (empty, never initialised) are
        # replaced here, and the shared expert is ours, not its gated one.
        super().__init__(dataclasses.replace(config, shared_expert_intermediate_size=None), layer_index, ctx)
        gated = self.experts
        self.experts = SquaredReluExperts(
            self.num_local_experts,
            config.hidden_size,
            self.config.moe_intermediate_size,
            etp=self.etp,
            etp_rank=self.etp_rank,
            first_expert=gated.first_expert,
            init_std=gated.init_std,
            params_dtype=ctx.params_dtype,
            device=ctx.device,
            gemm=gated.gemm,
        )
        del gated
        if config.shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = SquaredReluMLP(shared, layer_index, ctx)

    @torch.no_grad()
    def load_full_weights(self, router: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy this rank's slices of the full ``router`` [E, H], ``up`` [E, F, H] and ``down`` [E, H, F]."""
        e0 = self.ep_rank * self.num_local_experts
        experts = slice(e0, e0 + self.num_local_experts)
        self.router.weight.copy_(router)
        self.experts.load_full_experts(up[experts], down[experts])


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
