"""GPT-OSS's MoE options on top of :class:`~mcore.parallel.expert_parallel.MoELayer`: a router with a bias, experts
with a bias on each projection, and the experts' clamped SwiGLU.

* :class:`BiasedRouter`: ``logits = x W^T + b`` (fp32), the bias a dense replicated parameter like the weight.
* :class:`BiasedGroupedExperts`: the grouped GEMMs of :class:`~mcore.parallel.expert_parallel.GroupedExperts`, then
  each row's expert bias, gathered by the expert that row belongs to (rows are expert-contiguous, so that is a
  search of the offsets, on the device). ``gate_up_bias`` [E_local, 2F/etp] splits over etp like ``gate_up``
  (gate block then up block); ``down_bias`` [E_local, H] follows the down projection, whose partial outputs the
  dispatcher sums over etp: only etp rank 0 adds it, while every etp rank gets its full gradient (the rows' output
  gradient is the same on each), so the replicas stay equal. A bias's gradient is one GEMM (one-hot rows^T @ dy).
  Every GEMM mode (``grouped``; ``per_expert``, or ``grouped_fp32_wgrad`` for the weight gradients alone: those
  accumulated in fp32 into ``main_grad``, see ``expert_gemm.py``) takes the biases the same way.
* :func:`use_gpt_oss_options` swaps them into a built layer (the ``moe`` MLP part calls it when a config asks).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from mcore.kernels import swiglu
from mcore.kernels.clamped_swiglu import clamped_swiglu
from mcore.kernels.moe import grouped_gemm, grouped_gemm_of_activation
from mcore.parallel.expert_gemm import (
    HostOffsets,
    expert_wgrad_into,
    per_expert_linear,
    per_expert_linear_of_activation,
)
from mcore.parallel.expert_parallel import GroupedExperts, MoELayer, Router, router_logits
from mcore.parallel.param_attrs import is_sequence_parallel, mark_sequence_parallel
from mcore.parallel.tensor_parallel import set_tensor_parallel_attributes

__all__ = ["BiasedGroupedExperts", "BiasedRouter", "use_gpt_oss_options"]


class BiasedRouter(Router):
    """A :class:`Router` with a ``bias`` [E] (both drawn from ``normal(0, init_std)``, as Hugging Face does)."""

    def __init__(self, hidden_size: int, num_experts: int, *, init_std: float = 0.02, params_dtype=None, device=None):
        super().__init__(hidden_size, num_experts, init_std=init_std, params_dtype=params_dtype, device=device)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=params_dtype, device=device))
        set_tensor_parallel_attributes(self.bias, tensor_parallel=False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        super().reset_parameters(generator)
        full = torch.empty(self.bias.shape, dtype=torch.float32).normal_(0.0, self.init_std, generator=generator)
        with torch.no_grad():
            self.bias.copy_(full)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return router_logits(tokens, self.weight) + self.bias.float()


class _AddExpertBias(torch.autograd.Function):
    """``y + bias[expert]`` (``expert`` == E: a row of no expert, nothing added) when ``add``, else ``y``; ``bias``'s
    gradient is the per-expert sum of ``dy`` on every rank either way (the etp rule in the module doc)."""

    @staticmethod
    def forward(ctx, y, bias, expert, add):
        ctx.save_for_backward(expert)
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        if not add:
            return y.clone()
        padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
        return y + padded[expert]

    @staticmethod
    def backward(ctx, dy):
        (expert,) = ctx.saved_tensors
        experts = ctx.bias_shape[0]
        # per-expert sums of dy as one GEMM (one-hot^T @ dy, fp32 accumulation): deterministic, no atomics
        one_hot = torch.nn.functional.one_hot(expert, experts + 1)[:, :experts].to(dy.dtype)
        dbias = torch.mm(one_hot.t(), dy)
        return dy, dbias.to(ctx.bias_dtype), None, None


def _row_experts(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Local expert of each row (int64 [rows]); ``E`` for rows past ``offsets[-1]``, which belong to none."""
    index = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, index, right=True)


class BiasedGroupedExperts(GroupedExperts):
    """:class:`GroupedExperts` with optional per-expert biases and the clamped SwiGLU (``activation`` =
    ``(alpha, limit)``; ``None``: plain SwiGLU). Biases start at zero (Hugging Face's init)."""

    def __init__(self, *args, biases: bool = True, activation: tuple[float, float] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.activation = activation
        self.gate_up_bias = self.down_bias = None
        if biases:
            experts, local_2f, hidden = self.gate_up.shape
            kw = dict(dtype=self.gate_up.dtype, device=self.gate_up.device)
            self.gate_up_bias = nn.Parameter(torch.zeros(experts, local_2f, **kw))
            self.down_bias = nn.Parameter(torch.zeros(experts, hidden, **kw))
            set_tensor_parallel_attributes(
                self.gate_up_bias,
                tensor_parallel=self.etp > 1,
                partition_dim=1,
                partition_blocks=(self.ffn_size, self.ffn_size),
            )
            set_tensor_parallel_attributes(self.down_bias, tensor_parallel=False)
            for p in (self.gate_up_bias, self.down_bias):
                p.expert_parallel = True

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        super().reset_parameters(generator)
        with torch.no_grad():
            for p in (self.gate_up_bias, self.down_bias):
                if p is not None:
                    p.zero_()

    def forward(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        tail_rows: int | None = None,
        host_offsets: HostOffsets | None = None,
    ) -> torch.Tensor:
        """``tail_rows``: at most that many last rows lie past ``offsets[-1]`` (see ``grouped_gemm``); such rows
        get no bias. ``host_offsets``: as in :meth:`GroupedExperts.forward`."""
        x = rows.to(self.gate_up.dtype)
        fp8 = self.low_precision  # fp8 experts (mcore.parallel.low_precision): both GEMMs quantized
        defer = self.defer  # the GEMMs' weight gradients may wait for a zero-bubble W pass (the biases' do not)
        bounds = host = None
        if self.wants_host_offsets:
            host = host_offsets or HostOffsets.start(offsets)
            if self.gemm == "per_expert":
                bounds = host.bounds()  # the host sync of this mode
        if fp8 is not None:  # fp8 grouped GEMMs whatever expert_gemm says: the weight gradients as in grouped
            into = expert_wgrad_into(self.gate_up)
            h = fp8.gemm(x, self.gate_up, offsets, tail_rows=tail_rows, wgrad_into=into, defer=defer,
                         weight_casts=fp8.weight_casts)  # fmt: skip
        elif bounds is not None:
            h = per_expert_linear(x, self.gate_up, bounds, defer)
        else:  # grouped_fp32_wgrad: the weight gradients per expert from ``host`` in backward
            into = expert_wgrad_into(self.gate_up, host)
            h = grouped_gemm(x, self.gate_up, offsets, tail_rows=tail_rows, wgrad_into=into, defer=defer)
        if self.gate_up_bias is not None:
            expert = _row_experts(offsets, x.shape[0])
            h = _AddExpertBias.apply(h, self.gate_up_bias, expert, True)
        activation = swiglu if self.activation is None else partial(clamped_swiglu, alpha=self.activation[0],
                                                                        limit=self.activation[1])  # fmt: skip
        if fp8 is not None:
            into = expert_wgrad_into(self.down)
            y = fp8.of_activation(h, self.down, offsets, activation, tail_rows=tail_rows, wgrad_into=into, defer=defer,
                                  weight_casts=fp8.weight_casts)  # fmt: skip
        elif bounds is not None:  # the activation's output ([rows, F/etp]) is recomputed in backward, not kept
            y = per_expert_linear_of_activation(h, self.down, bounds, activation, defer)
        else:
            into = expert_wgrad_into(self.down, host)
            y = grouped_gemm_of_activation(h, self.down, offsets, activation, tail_rows=tail_rows, wgrad_into=into,
                                           defer=defer)  # fmt: skip
        if self.down_bias is not None:
            y = _AddExpertBias.apply(y, self.down_bias, expert, self.etp_rank == 0)
        return y


def use_gpt_oss_options(
    layer: MoELayer, *, router_bias: bool, expert_biases: bool, activation: tuple[float, float] | None
) -> None:
    """Replace ``layer``'s router and experts by the biased / clamped ones the options ask for (same weights'
    shapes, attributes and initialisation otherwise); a no-op when none is asked."""
    if router_bias:
        old = layer.router
        hidden = old.weight.shape[1]
        layer.router = BiasedRouter(
            hidden, old.weight.shape[0], init_std=old.init_std, params_dtype=old.weight.dtype, device=old.weight.device
        )
        mark_sequence_parallel(layer.router.weight, is_sequence_parallel(old.weight))
        mark_sequence_parallel(layer.router.bias, is_sequence_parallel(old.weight))
    if expert_biases or activation is not None:
        old = layer.experts
        if not old.gated:
            raise ValueError(
                f"GPT-OSS's expert biases and clamped SwiGLU need gated SwiGLU experts, not {old.activation_name!r} "
                "ones; set expert_biases=false and swiglu_alpha/swiglu_limit to null"
            )
        layer.experts = BiasedGroupedExperts(
            old.gate_up.shape[0],
            old.gate_up.shape[2],
            old.ffn_size,
            etp=old.etp,
            etp_rank=old.etp_rank,
            first_expert=old.first_expert,
            init_std=old.init_std,
            params_dtype=old.gate_up.dtype,
            device=old.gate_up.device,
            gemm=old.gemm,
            biases=expert_biases,
            activation=activation,
        )
