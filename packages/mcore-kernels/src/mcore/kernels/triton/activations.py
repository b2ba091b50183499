"""Triton kernels for gated activations ``act(gate) * up`` on ``x = cat([gate, up], -1)``, forward and backward.

``act`` is ``silu`` (SwiGLU), ``gelu_tanh`` or ``gelu`` (exact, erf-based) for GeGLU, or ``clamped_silu``:
GPT-OSS's clamped SwiGLU ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``
(``mcore.kernels.clamped_swiglu``), whose clamps also cut the gradients outside them. Each program handles a
``BLOCK_M x BLOCK_N`` tile of output columns; the backward reads ``x`` and ``dy`` once and writes the gradient of
the concatenated input (``[dgate, dup]``) in one pass. Math is fp32 in registers. ``ACTIVATION`` is a constexpr,
so each activation compiles to its own kernel and the others' code (the clamps included) is not in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton._common import as_rows, next_power_of_2, num_warps_for, rows_per_tile

CLAMPED_SILU = "clamped_silu"
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", CLAMPED_SILU)
# Widest column block; wider halves are split over the second grid axis.
MAX_BLOCK_COLS = 2048
# Globals read inside @triton.jit code must be constexpr.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _swish_and_grad(g, alpha):
    """``(g * sigmoid(alpha * g), its derivative)`` in fp32; SiLU is ``alpha = 1``."""
    s = tl.sigmoid(alpha * g)
    return g * s, s * (1.0 + alpha * g * (1.0 - s))


@triton.jit
def _glu_terms(g, u, alpha, limit, ACTIVATION: tl.constexpr):
    """``(act, act', up)`` in fp32 for gate ``g`` and up ``u``: ``y = act * up``, ``dgate = dy * up * act'``,
    ``dup = dy * act``. ``alpha`` and ``limit`` are read by ``clamped_silu`` only; where its clamps bite, the
    backward kernel zeroes the gradients (their masks need the unclamped inputs, which the caller holds)."""
    if ACTIVATION == "clamped_silu":
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        act, grad = _swish_and_grad(g, alpha)
    elif ACTIVATION == "silu":
        act, grad = _swish_and_grad(g, 1.0)
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
    return act, grad, u


@triton.jit
def _load_tile(X, stride_x, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: its rows (int64, for the offsets), columns and mask, and gate and up in fp32."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)
    x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + n_cols, mask=mask, other=0.0).to(tl.float32)
    return rows64, cols, mask, g, u


@triton.jit
def _glu_fwd_kernel(
    X,
    Y,
    stride_x,
    stride_y,
    n_rows,
    n_cols,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows64, cols, mask, g, u = _load_tile(X, stride_x, n_rows, n_cols, BLOCK_M, BLOCK_N)
    act, _, up = _glu_terms(g, u, alpha, limit, ACTIVATION)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], (act * up).to(Y.dtype.element_ty), mask=mask)


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
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows64, cols, mask, g, u = _load_tile(X, stride_x, n_rows, n_cols, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, grad, up = _glu_terms(g, u, alpha, limit, ACTIVATION)
    dgate = dy * up * grad
    dup = dy * act
    if ACTIVATION == "clamped_silu":
        # torch.clamp's rule (Hugging Face's experts): the gradient passes inside the bounds, bounds included.
        dgate = tl.where(g <= limit, dgate, 0.0)
        dup = tl.where((u >= -limit) & (u <= limit), dup, 0.0)
    dx_ptr = DX + rows64[:, None] * stride_dx + cols[None, :]
    tl.store(dx_ptr, dgate.to(DX.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + n_cols, dup.to(DX.dtype.element_ty), mask=mask)


def _launch_shape(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int, int]:
    block_n = min(next_power_of_2(n_cols), MAX_BLOCK_COLS)
    block_m = rows_per_tile(n_rows, block_n)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    return grid, block_m, block_n, num_warps_for(block_m * block_n)


def glu_forward(x: torch.Tensor, activation: str, alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    """``act(x[..., :n]) * x[..., n:]`` for ``x [..., 2n]``; returns ``[..., n]`` in x's dtype.

    ``alpha`` and ``limit`` are ``clamped_silu``'s (validated by ``mcore.kernels.clamped_swiglu``); the other
    activations ignore them.
    """
    n_cols = x.shape[-1] // 2
    x2 = as_rows(x, 2 * n_cols)
    y = torch.empty(x.shape[:-1] + (n_cols,), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    grid, block_m, block_n, num_warps = _launch_shape(x2.shape[0], n_cols)
    _glu_fwd_kernel[grid](
        x2, y, x2.stride(0), n_cols, x2.shape[0], n_cols, float(alpha), float(limit),
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return y


def glu_backward(
    dy: torch.Tensor, x: torch.Tensor, activation: str, alpha: float = 1.0, limit: float = 0.0
) -> torch.Tensor:
    """Gradient of the concatenated input ``[dgate, dup]``, shaped and typed like ``x``."""
    n_cols = x.shape[-1] // 2
    x2 = as_rows(x, 2 * n_cols)
    dy2 = as_rows(dy, n_cols)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    grid, block_m, block_n, num_warps = _launch_shape(x2.shape[0], n_cols)
    _glu_bwd_kernel[grid](
        dy2, x2, dx, dy2.stride(0), x2.stride(0), 2 * n_cols, x2.shape[0], n_cols, float(alpha), float(limit),
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return dx
