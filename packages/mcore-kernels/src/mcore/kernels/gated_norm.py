"""Gated RMSNorm per group (Mamba-2's output norm): fp32 compute, output in ``x``'s dtype.

``norm_before_gate=False`` (Mamba-2, Nemotron-H, Falcon-H1 in HF): ``rms_g(x * silu(z)) * weight``;
``norm_before_gate=True``: ``rms_g(x) * weight * silu(z)``. ``rms_g`` normalises each group of ``group_size``
consecutive features on its own, so a tensor-parallel rank holding whole groups needs no communication.

Two backends (:mod:`mcore.kernels.dispatch`: Triton on CUDA): the kernels of :mod:`mcore.kernels.triton.gated_norm`
(one pass forward, one backward, fp32 ``rstd`` saved) and the torch reference below (autograd's backward, which
keeps several fp32 copies of the activation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore.kernels import dispatch


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    group_size: int,
    eps: float = 1e-6,
    norm_before_gate: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """``x``, ``gate``: ``[..., width]``; ``weight``: ``[width]``; ``group_size`` must divide ``width``."""
    width = x.shape[-1]
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate must be shaped like x {tuple(x.shape)}, got {tuple(gate.shape)}")
    if tuple(weight.shape) != (width,):
        raise ValueError(f"gated_rms_norm: weight must be [{width}], got {tuple(weight.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or width % group_size:
        raise ValueError(f"gated_rms_norm: group_size must be an int dividing the width {width}, got {group_size!r}")
    tensors = [t for t in (x, gate, weight) if t is not None]
    if dispatch.choose("gated_rms_norm", *tensors, backend=backend) == dispatch.TRITON:
        out = _TritonGatedNorm.apply(x, gate, weight, group_size, eps, norm_before_gate)
        return out.view(*x.shape[:-1], width)
    return reference_gated_rms_norm(x, gate, weight, group_size, eps, norm_before_gate)


class _TritonGatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, group_size, eps, before_gate):
        from mcore.kernels.triton.gated_norm import gated_norm_forward, rows_view

        x2 = rows_view(x)
        z2 = None if gate is None else rows_view(gate)
        out, rstd = gated_norm_forward(x2, z2, weight, group_size, eps, before_gate)
        ctx.save_for_backward(x2, z2, weight, rstd)
        ctx.args = (group_size, eps, before_gate, x.shape, None if gate is None else gate.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        from mcore.kernels.triton.gated_norm import gated_norm_backward

        x2, z2, weight, rstd = ctx.saved_tensors
        group_size, eps, before_gate, x_shape, z_shape = ctx.args
        dx, dz, dw = gated_norm_backward(dout, x2, z2, weight, rstd, group_size, eps, before_gate)
        return dx.view(x_shape), None if dz is None else dz.view(z_shape), dw, None, None, None


def reference_gated_rms_norm(x, gate, weight, group_size, eps, norm_before_gate) -> torch.Tensor:
    """The torch backend of :func:`gated_rms_norm` (arguments already checked)."""
    width = x.shape[-1]
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
