"""Triton kernels of GPT-OSS's clamped SwiGLU (``mcore.kernels.clamped_swiglu``), forward and backward.

Same tiling as ``triton/activations.py``: each program handles a ``BLOCK_M x BLOCK_N`` tile of output columns,
reads gate and up once, and (backward) writes ``[dgate, dup]`` in one pass; math in fp32 registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton._common import as_rows
from mcore.kernels.triton.activations import _launch_shape


@triton.jit
def _fwd_kernel(X, Y, stride_x, stride_y, n_rows, n_cols, alpha, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)
    x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
    g = tl.minimum(tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.load(x_ptr + n_cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = (u + 1.0) * g * tl.sigmoid(alpha * g)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(
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
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(alpha * gc)
    glu = gc * s
    dglu = s * (1.0 + alpha * gc * (1.0 - s))
    dg = tl.where(g <= limit, dy * (uc + 1.0) * dglu, 0.0)
    du = tl.where((u >= -limit) & (u <= limit), dy * glu, 0.0)
    dx_ptr = DX + rows64[:, None] * stride_dx + cols[None, :]
    tl.store(dx_ptr, dg.to(DX.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + n_cols, du.to(DX.dtype.element_ty), mask=mask)


def forward(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    n_cols = x.shape[-1] // 2
    x2 = as_rows(x, 2 * n_cols)
    y = torch.empty(x.shape[:-1] + (n_cols,), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    grid, block_m, block_n, num_warps = _launch_shape(x2.shape[0], n_cols)
    _fwd_kernel[grid](
        x2, y, x2.stride(0), n_cols, x2.shape[0], n_cols, alpha, limit,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return y


def backward(dy: torch.Tensor, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    n_cols = x.shape[-1] // 2
    x2 = as_rows(x, 2 * n_cols)
    dy2 = as_rows(dy, n_cols)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    grid, block_m, block_n, num_warps = _launch_shape(x2.shape[0], n_cols)
    _bwd_kernel[grid](
        dy2, x2, dx, dy2.stride(0), x2.stride(0), 2 * n_cols, x2.shape[0], n_cols, alpha, limit,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return dx
