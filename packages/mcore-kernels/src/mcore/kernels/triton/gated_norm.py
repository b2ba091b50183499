"""Triton kernels of the gated RMSNorm per group (Mamba-2's output norm), forward and backward.

``x``, ``z``: ``[rows, width]`` with unit column stride (any row stride), ``width = groups * group_size``; group
``g`` of a row is the columns ``g * group_size ...``. Each program normalizes ``BLOCK_M`` rows of one group in fp32
registers (grid: row blocks x groups) and saves one ``rstd`` per (row, group). Forward, with ``s = silu(z)``:
``norm_before_gate=False``: ``out = w * round(rms(x s))``; ``True``: ``out = w * round(rms(x) s)`` (``round``: to
``x``'s dtype, as transformers does). Backward recomputes ``x s`` or ``x`` normalized from ``rstd``; with ``u`` the
normalized value and ``du`` its gradient, ``d(pre) = rstd (du - u mean(du u))``. The weight's gradient is one
partial sum per program (row block, group), added up by torch: no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 8


@triton.jit
def _load_rows(X, Z, offs_m, cols, g, sx, sz, GS, mask, HAS_GATE: tl.constexpr):
    x = tl.load(X + offs_m[:, None] * sx + g * GS + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        z = tl.load(Z + offs_m[:, None] * sz + g * GS + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        z = x
    return x, z


@triton.jit
def _gated_norm_fwd_kernel(X, Z, W, OUT, RSTD, rows, G, GS, sx, sz, so, eps, HAS_GATE: tl.constexpr,
                           BEFORE_GATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    pid, g = tl.program_id(0), tl.program_id(1)
    offs_m = (pid * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.arange(0, BN)
    mask = (offs_m < rows)[:, None] & (cols < GS)[None, :]
    x, z = _load_rows(X, Z, offs_m, cols, g, sx, sz, GS, mask, HAS_GATE)
    h = x
    if HAS_GATE and not BEFORE_GATE:
        h = x * z * tl.sigmoid(z)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / GS + eps)
    u = h * rstd[:, None]
    if HAS_GATE and BEFORE_GATE:
        u = u * z * tl.sigmoid(z)
    w = tl.load(W + g * GS + cols, mask=cols < GS, other=0.0).to(tl.float32)
    out = w[None, :] * u.to(X.dtype.element_ty).to(tl.float32)
    tl.store(OUT + offs_m[:, None] * so + g * GS + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(RSTD + offs_m * G + g, rstd, mask=offs_m < rows)


@triton.jit
def _gated_norm_bwd_kernel(X, Z, W, DOUT, RSTD, DX, DZ, DW_PART, rows, G, GS, sx, sz, sd, eps,
                           HAS_GATE: tl.constexpr, BEFORE_GATE: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr):  # fmt: skip
    pid, g = tl.program_id(0), tl.program_id(1)
    offs_m = (pid * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.arange(0, BN)
    row_mask, col_mask = offs_m < rows, cols < GS
    mask = row_mask[:, None] & col_mask[None, :]
    x, z = _load_rows(X, Z, offs_m, cols, g, sx, sz, GS, mask, HAS_GATE)
    rstd = tl.load(RSTD + offs_m * G + g, mask=row_mask, other=0.0)
    dout = tl.load(DOUT + offs_m[:, None] * sd + g * GS + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + g * GS + cols, mask=col_mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    s = z * sig
    ds_dz = sig * (1.0 + z * (1.0 - sig))
    pre = x
    if HAS_GATE and not BEFORE_GATE:
        pre = x * s
    u = pre * rstd[:, None]
    final = u
    if HAS_GATE and BEFORE_GATE:
        final = u * s
    tl.store(DW_PART + (pid * G + g) * GS + cols, tl.sum(dout * final.to(X.dtype.element_ty).to(tl.float32), 0),
             mask=col_mask)  # fmt: skip
    dfinal = dout * w[None, :]
    du = dfinal
    if HAS_GATE and BEFORE_GATE:
        du = dfinal * s
    dpre = rstd[:, None] * (du - u * (tl.sum(du * u, axis=1) / GS)[:, None])
    if HAS_GATE and not BEFORE_GATE:
        dx = dpre * s
        dz = dpre * x * ds_dz
    else:
        dx = dpre
        dz = dfinal * u * ds_dz
    tl.store(DX + offs_m[:, None] * GS * G + g * GS + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_GATE:
        tl.store(DZ + offs_m[:, None] * GS * G + g * GS + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``[..., width]`` -> ``[rows, width]`` with unit column stride (a view when the layout allows)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_shape(rows: int, width: int, group_size: int) -> tuple[tuple[int, int], int]:
    return (triton.cdiv(rows, BLOCK_ROWS), width // group_size), max(16, triton.next_power_of_2(group_size))


def gated_norm_forward(x, z, weight, group_size: int, eps: float, before_gate: bool):
    """``(out [rows, width], rstd [rows, groups] fp32)`` for 2-D ``x`` / ``z`` (``z`` may be ``None``)."""
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(rows, width // group_size, dtype=torch.float32, device=x.device)
    grid, bn = _launch_shape(rows, width, group_size)
    zz = z if z is not None else x
    _gated_norm_fwd_kernel[grid](
        x, zz, weight, out, rstd, rows, width // group_size, group_size, x.stride(0), zz.stride(0), out.stride(0),
        eps, HAS_GATE=z is not None, BEFORE_GATE=before_gate, BM=BLOCK_ROWS, BN=bn,
    )  # fmt: skip
    return out, rstd


def gated_norm_backward(dout, x, z, weight, rstd, group_size: int, eps: float, before_gate: bool):
    """``(dx, dz or None, dweight)`` of :func:`gated_norm_forward` (contiguous 2-D gradients)."""
    rows, width = x.shape
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    grid, bn = _launch_shape(rows, width, group_size)
    dx = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    dz = torch.empty(rows, width, dtype=z.dtype, device=x.device) if z is not None else None
    dw_part = torch.empty(grid[0], width, dtype=torch.float32, device=x.device)
    zz = z if z is not None else x
    _gated_norm_bwd_kernel[grid](
        x, zz, weight, dout, rstd, dx, dz if dz is not None else dx, dw_part, rows, width // group_size, group_size,
        x.stride(0), zz.stride(0), dout.stride(0), eps, HAS_GATE=z is not None, BEFORE_GATE=before_gate,
        BM=BLOCK_ROWS, BN=bn,
    )  # fmt: skip
    return dx, dz, dw_part.sum(0).to(weight.dtype)
