"""GPT-OSS's clamped SwiGLU on a fused ``[gate, up]`` projection, forward and backward.

``x[..., :n]`` is the gate ``g`` and ``x[..., n:]`` the up projection ``u`` (mcore's ``gate_up`` layout; the
bridge de-interleaves Hugging Face's ``gate_up_proj`` columns into it). With ``alpha`` and ``limit``::

    g' = min(g, limit)            u' = clamp(u, -limit, limit)
    y  = (u' + 1) * g' * sigmoid(alpha * g')

The clamps pass the gradient where the input lies inside them, bounds included (``torch.clamp``'s rule, which is
what Hugging Face's eager experts differentiate). One ``torch.autograd.Function``: Triton on CUDA, a pure-torch
reference elsewhere, fp32 math in both; the backward recomputes from ``x`` (nothing else is saved). The Triton
kernels are SwiGLU's (``triton/activations.py``) with the clamps and ``alpha`` as a constexpr activation.
"""

from __future__ import annotations

import math

import torch

from mcore.kernels import dispatch
from mcore.kernels.activations import check_gate_up_input

__all__ = ["clamped_swiglu", "reference_backward", "reference_forward"]


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float, *, backend: str | None = None) -> torch.Tensor:
    """``(clamp(u) + 1) * g' * sigmoid(alpha * g')`` for ``x = cat([g, u], -1)`` ``[..., 2n]``; returns ``[..., n]``.

    ``alpha`` > 0 (GPT-OSS: 1.702) and ``limit`` > 0 (GPT-OSS: 7.0) are finite numbers; ``backend`` is
    ``"triton"``, ``"reference"`` or ``None`` (:func:`mcore.kernels.dispatch.choose` decides).
    """
    check_gate_up_input("clamped_swiglu", x)
    for name, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"clamped_swiglu: {name} must be a finite number > 0, got {value!r}")
    chosen = dispatch.choose("clamped_swiglu", x, backend=backend)
    return _ClampedSwiGLU.apply(x, float(alpha), float(limit), chosen)


def reference_forward(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Pure-torch forward (fp32 math, result in x's dtype)."""
    g, u = x.float().chunk(2, dim=-1)
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    return ((u + 1) * (g * torch.sigmoid(alpha * g))).to(x.dtype)  # Hugging Face's association, as the kernel


def reference_backward(dy: torch.Tensor, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Pure-torch gradient of the concatenated input ``[dg, du]``, written out (no autograd graph)."""
    g, u = x.float().chunk(2, dim=-1)
    dyf = dy.float()
    gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
    s = torch.sigmoid(alpha * gc)
    glu = gc * s
    dglu = s * (1 + alpha * gc * (1 - s))
    dg = torch.where(g <= limit, dyf * (uc + 1) * dglu, 0.0)
    du = torch.where((u >= -limit) & (u <= limit), dyf * glu, 0.0)
    return torch.cat((dg, du), dim=-1).to(x.dtype)


def _triton_forward(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    from mcore.kernels.triton.activations import CLAMPED_SILU, glu_forward

    return glu_forward(x, CLAMPED_SILU, alpha, limit)


def _triton_backward(dy: torch.Tensor, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    from mcore.kernels.triton.activations import CLAMPED_SILU, glu_backward

    return glu_backward(dy, x, CLAMPED_SILU, alpha, limit)


def _impl(backend: str):
    """(forward, backward) of ``backend``: the Triton ones are the gated-activation kernels' ``clamped_silu``."""
    if backend == dispatch.TRITON:
        return _triton_forward, _triton_backward
    return reference_forward, reference_backward


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, limit, backend):
        ctx.save_for_backward(x)
        ctx.args = (alpha, limit, backend)
        return _impl(backend)[0](x, alpha, limit)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        alpha, limit, backend = ctx.args
        return _impl(backend)[1](dy, x, alpha, limit), None, None, None
