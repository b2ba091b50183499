"""Triton kernels for gated activations ``act(gate) * up`` on ``x = cat([gate, up], -1)``, forward and backward.

``act`` is ``silu`` (SwiGLU), ``gelu_tanh`` or ``gelu`` (exact, erf-based) for GeGLU. Each program
handles a ``BLOCK_M x BLOCK_N`` tile of output columns; the backward reads ``x`` and ``dy`` once and
writes the gradient of the concatenated input (``[dgate, dup]``) in one pass. Math is fp32 in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton._common import as_rows, next_power_of_2, num_warps_for, rows_per_tile

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
# Widest column block; wider halves are split over the second grid axis.
MAX_BLOCK_COLS = 2048
# Globals read inside @triton.jit code must be constexpr.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _activation_and_grad(g, ACTIVATION: tl.constexpr):
    """``(act(g), act'(g))`` in fp32."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        act = g * s
        grad = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g)
        # tanh via sigmoid (libdevice tanh is unavailable in the interpreter); tanh is +-1 in fp32 beyond
        # |inner| = 10, and clamping keeps exp() in range for saturated gates.
        inner = tl.minimum(tl.maximum(inner, -10.0), 10.0)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        act = 0.5 * g * (1.0 + t)
        grad = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * g * g)
    else:
        cdf = 0.5 * (1.0 + tl.erf(g * _INV_SQRT_2))
        act = g * cdf
        grad = cdf + g * tl.exp(-0.5 * g * g) * _INV_SQRT_2PI
    return act, grad


@triton.jit
def _glu_fwd_kernel(
    X,
    Y,
    stride_x,
    stride_y,
    n_rows,
    n_cols,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)
    x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + n_cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation_and_grad(g, ACTIVATION)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    DY,
    X,
    DX,
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)
    x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + n_cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, grad = _activation_and_grad(g, ACTIVATION)
    dx_ptr = DX + rows64[:, None] * stride_dx + cols[None, :]
    tl.store(dx_ptr, (dy * u * grad).to(DX.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + n_cols, (dy * act).to(DX.dtype.element_ty), mask=mask)


def _launch_shape(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int, int]:
    block_n = min(next_power_of_2(n_cols), MAX_BLOCK_COLS)
    block_m = rows_per_tile(n_rows, block_n)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    return grid, block_m, block_n, num_warps_for(block_m * block_n)


def glu_forward(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x[..., :n]) * x[..., n:]`` for ``x [..., 2n]``; returns ``[..., n]`` in x's dtype."""
    n_cols = x.shape[-1] // 2
    x2 = as_rows(x, 2 * n_cols)
    y = torch.empty(x.shape[:-1] + (n_cols,), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    grid, block_m, block_n, num_warps = _launch_shape(x2.shape[0], n_cols)
    _glu_fwd_kernel[grid](
        x2,
        y,
        x2.stride(0),
        n_cols,
        x2.shape[0],
        n_cols,
        ACTIVATION=activation,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y


def glu_backward(dy: torch.Tensor, x: torch.Tensor, activation: str) -> torch.Tensor:
    """Gradient of the concatenated input ``[dgate, dup]``, shaped and typed like ``x``."""
    n_cols = x.shape[-1] // 2
    x2 = as_rows(x, 2 * n_cols)
    dy2 = as_rows(dy, n_cols)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    grid, block_m, block_n, num_warps = _launch_shape(x2.shape[0], n_cols)
    _glu_bwd_kernel[grid](
        dy2,
        x2,
        dx,
        dy2.stride(0),
        x2.stride(0),
        2 * n_cols,
        x2.shape[0],
        n_cols,
        ACTIVATION=activation,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return dx
