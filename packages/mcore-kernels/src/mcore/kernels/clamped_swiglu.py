"""GPT-OSS's clamped SwiGLU on a fused ``[gate, up]`` projection, forward and backward.

``x[..., :n]`` is the gate ``g`` and ``x[..., n:]`` the up projection ``u`` (mcore's ``gate_up`` layout; the
bridge de-interleaves Hugging Face's ``gate_up_proj`` columns into it). With ``alpha`` and ``limit``::

    g' = min(g, limit)            u' = clamp(u, -limit, limit)
    y  = (u' + 1) * g' * sigmoid(alpha * g')

The clamps pass the gradient where the input lies inside them, bounds included (``torch.clamp``'s rule, which is
what Hugging Face's eager experts differentiate). One ``torch.autograd.Function``: Triton on CUDA, a pure-torch
reference elsewhere, fp32 math in both; the backward recomputes from ``x`` (nothing else is saved).
"""

from __future__ import annotations

import math

import torch

from mcore.kernels import dispatch

__all__ = ["clamped_swiglu", "reference_backward", "reference_forward"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float, *, backend: str | None = None) -> torch.Tensor:
    """``(clamp(u) + 1) * g' * sigmoid(alpha * g')`` for ``x = cat([g, u], -1)`` ``[..., 2n]``; returns ``[..., n]``.

    ``alpha`` > 0 (GPT-OSS: 1.702) and ``limit`` > 0 (GPT-OSS: 7.0) are finite numbers; ``backend`` is
    ``"triton"``, ``"reference"`` or ``None`` (:func:`mcore.kernels.dispatch.choose` decides).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"clamped_swiglu: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"clamped_swiglu: x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"clamped_swiglu: x must be [..., 2n] (gate and up concatenated on the last dim), got {tuple(x.shape)}"
        )
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
    return ((u + 1) * g * torch.sigmoid(alpha * g)).to(x.dtype)


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


def _impl(backend: str):
    if backend == dispatch.TRITON:
        from mcore.kernels.triton import clamped_swiglu as triton_impl

        return triton_impl.forward, triton_impl.backward
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
