"""Gated RMSNorm per group (Mamba-2's output norm): fp32 compute, output in ``x``'s dtype.

``norm_before_gate=False`` (Mamba-2, Nemotron-H, Falcon-H1 in HF): ``rms_g(x * silu(z)) * weight``;
``norm_before_gate=True``: ``rms_g(x) * weight * silu(z)``. ``rms_g`` normalises each group of ``group_size``
consecutive features on its own, so a tensor-parallel rank holding whole groups needs no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    group_size: int,
    eps: float = 1e-6,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """``x``, ``gate``: ``[..., width]``; ``weight``: ``[width]``; ``group_size`` must divide ``width``."""
    width = x.shape[-1]
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate must be shaped like x {tuple(x.shape)}, got {tuple(gate.shape)}")
    if tuple(weight.shape) != (width,):
        raise ValueError(f"gated_rms_norm: weight must be [{width}], got {tuple(weight.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or width % group_size:
        raise ValueError(f"gated_rms_norm: group_size must be an int dividing the width {width}, got {group_size!r}")
    h = x.float()
    z = None if gate is None else F.silu(gate.float())
    if z is not None and not norm_before_gate:
        h = h * z
    groups = h.view(*h.shape[:-1], width // group_size, group_size)
    h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    if z is not None and norm_before_gate:
        h = h * z
    # HF rounds to the input dtype before scaling by the weight; so do we (identical in fp32).
    return weight * h.to(x.dtype)
