"""RMSNorm over a whole tensor-parallel projection (OLMoE's q/k norms span every head of q, and of k).

Each tp rank holds the features of its own heads (and the matching slice of the weight, ``partition_dim`` 0), so
the mean square needs every rank's sum of squares: it is all-reduced over tp, with an all-reduce in backward too
(every rank's output depends on every rank's features through it).
"""

from __future__ import annotations

import torch
from torch import nn

from mcore.parallel.comm import copy_to_tp_region, group_rank, group_size, reduce_from_tp_region
from mcore.parallel.tensor_parallel import set_tensor_parallel_attributes


class ProjectionRMSNorm(nn.Module):
    """``x / rms(x over all tp ranks' features) * weight`` for ``x`` [..., width / tp] (fp32 statistics)."""

    def __init__(self, width: int, eps: float, *, tp_group=None, params_dtype=torch.float32, device=None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        if width % tp:
            raise ValueError(f"ProjectionRMSNorm: width {width} not divisible by tp={tp}")
        self.width, self.eps, self.tp_group = width, eps, tp_group
        self.weight = nn.Parameter(torch.ones(width // tp, dtype=params_dtype, device=device))
        set_tensor_parallel_attributes(self.weight, tensor_parallel=tp > 1, partition_dim=0)
        self._slice = slice(group_rank(tp_group) * (width // tp), (group_rank(tp_group) + 1) * (width // tp))

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Ones; ``generator`` is accepted for the common ``reset_parameters`` contract and not used."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        square_sum = xf.square().sum(-1, keepdim=True)
        square_sum = reduce_from_tp_region(copy_to_tp_region(square_sum, self.tp_group), self.tp_group)
        out = xf * torch.rsqrt(square_sum / self.width + self.eps) * self.weight.float()
        return out.to(x.dtype)
