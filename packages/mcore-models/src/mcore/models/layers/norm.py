"""RMSNorm and LayerNorm modules over the last dim, computed by the mcore.kernels ops.

Under sequence parallelism (or for q/k norms whose heads are split over TP) each TP rank sees only part of
the tokens (or heads) a replicated weight is applied to, so its weight gradient is partial: the weight is
marked ``sequence_parallel = True`` and ``finalize_model_grads`` all-reduces it over TP.
"""

from __future__ import annotations

import torch
from torch import nn

from mcore.kernels import layer_norm, rms_norm
from mcore.models.config import TransformerConfig
from mcore.parallel.param_attrs import mark_sequence_parallel


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim (weight initialised to ones)."""

    def __init__(
        self,
        width: int,
        eps: float,
        *,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width, dtype=params_dtype, device=device))
        mark_sequence_parallel(self.weight, sequence_parallel)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Ones; ``generator`` is accepted for the common ``reset_parameters`` contract and not used."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """``(x - mean) / std(x) * weight + bias`` over the last dim (weight ones, bias zeros)."""

    def __init__(
        self,
        width: int,
        eps: float,
        *,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(width, dtype=params_dtype, device=device))
        for p in (self.weight, self.bias):
            mark_sequence_parallel(p, sequence_parallel)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Ones and zeros; ``generator`` is accepted for the common contract and not used."""
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(
    config: TransformerConfig,
    width: int,
    *,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> RMSNorm | LayerNorm:
    """The norm the config names (``config.normalization``) over ``width`` features, eps ``rms_norm_eps``."""
    cls = RMSNorm if config.normalization == "rmsnorm" else LayerNorm
    return cls(
        width, config.rms_norm_eps, sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device
    )
