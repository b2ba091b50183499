"""Triton kernels for RMSNorm and LayerNorm over the last dim, forward and backward.

Forward: each program normalizes a tile of whole rows held in registers (fp32), writes the output in
the input dtype and saves one ``rstd`` (and ``mean`` for LayerNorm) per row. Backward: a grid-stride
kernel with a few programs per SM; each walks its share of row tiles, writes ``dx`` per row and keeps
the per-column ``dweight``/``dbias`` partial sums in registers, stored once per program; the few
partial rows are then summed in torch. No atomics, one pass over ``x`` and ``dy``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton._common import (
    MAX_FUSED_COLUMNS,
    as_rows,
    next_power_of_2,
    num_warps_for,
    persistent_programs,
    rows_per_tile,
)

# Programs per SM in the backward kernel: more hides memory latency better, but each adds one fp32 row
# of partial dweight (and dbias) that the final reduction must read back. Swept 1/2/4 on an H200 (bf16,
# 16K rows): 2 was best or within 4% of best at hidden 128, 4096 and 8192.
BWD_PROGRAMS_PER_SM = 2


@triton.jit
def _norm_fwd_kernel(
    X,
    W,
    B,
    Y,
    Mean,
    Rstd,
    stride_x,
    stride_y,
    n_rows,
    n_cols,
    eps,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    # int64 row offsets: rows * stride can pass 2**31 on large activations.
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        # Padding columns must not contribute (x - mean) to the variance.
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(Mean + rows, mean, mask=row_mask)
    var = tl.sum(xc * xc, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(Rstd + rows, rstd, mask=row_mask)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    DY,
    X,
    W,
    Mean,
    Rstd,
    DX,
    DW_partial,
    DB_partial,
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    # Per-element accumulators, reduced over rows once at the end: a cross-warp reduction per tile
    # would put a barrier in every iteration.
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_tiles = tl.cdiv(n_rows, BLOCK_M)
    # Software pipelining by hand: the next tile's x and dy are loaded before this tile's reductions,
    # so their memory latency overlaps the compute.
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x_next = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(DY + rows.to(tl.int64)[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    for tile in range(pid, num_tiles, num_programs):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        next_rows = rows + num_programs * BLOCK_M
        next_mask = (next_rows < n_rows)[:, None] & col_mask[None, :]
        next64 = next_rows.to(tl.int64)
        x_next = tl.load(X + next64[:, None] * stride_x + cols[None, :], mask=next_mask, other=0.0)
        dy_next = tl.load(DY + next64[:, None] * stride_dy + cols[None, :], mask=next_mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        # dx = rstd * (w*dy - xhat * mean(w*dy*xhat) [- mean(w*dy) for LayerNorm])
        c1 = tl.sum(xhat * wdy, axis=1) / n_cols
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / n_cols
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        rows64 = rows.to(tl.int64)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_partial + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_partial + pid * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_mask)


def _check_width(op: str, n_cols: int) -> None:
    if n_cols > MAX_FUSED_COLUMNS:
        raise ValueError(
            f"{op}: the Triton kernel keeps a whole row in registers and supports a last dim up to "
            f"{MAX_FUSED_COLUMNS}, got {n_cols}; pass backend='reference' for wider rows"
        )


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    is_rms: bool,
    zero_centered_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Normalize the last dim of ``x``; returns ``(y, mean | None, rstd)``, the statistics fp32 ``x.shape[:-1]``."""
    n_cols = x.shape[-1]
    _check_width("rms_norm" if is_rms else "layer_norm", n_cols)
    x2 = as_rows(x, n_cols)
    n_rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    mean = None if is_rms else torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, mean, rstd
    block_n = next_power_of_2(n_cols)
    block_m = rows_per_tile(n_rows, block_n)
    grid = (triton.cdiv(n_rows, block_m),)
    _norm_fwd_kernel[grid](
        x2,
        weight,
        bias if bias is not None else weight,  # never read: HAS_BIAS is False
        y,
        mean if mean is not None else rstd,  # never written: IS_RMS is True
        rstd,
        x2.stride(0),
        n_cols,
        n_rows,
        n_cols,
        eps,
        IS_RMS=is_rms,
        HAS_BIAS=bias is not None,
        ZERO_CENTERED=zero_centered_weight,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps_for(block_m * n_cols),
    )
    return y, mean, rstd


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    is_rms: bool,
    zero_centered_weight: bool,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients ``(dx, dweight, dbias | None)``; ``dx`` in x's dtype, the parameter gradients fp32."""
    n_cols = x.shape[-1]
    x2 = as_rows(x, n_cols)
    dy2 = as_rows(dy, n_cols)
    n_rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        dw = torch.zeros(n_cols, dtype=torch.float32, device=x.device)
        return dx, dw, (torch.zeros_like(dw) if has_bias else None)
    block_n = next_power_of_2(n_cols)
    block_m = rows_per_tile(n_rows, block_n)
    programs = persistent_programs(x.device, triton.cdiv(n_rows, block_m), BWD_PROGRAMS_PER_SM)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    db_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device) if has_bias else None
    _norm_bwd_kernel[(programs,)](
        dy2,
        x2,
        weight,
        mean if mean is not None else rstd,  # never read: IS_RMS is True
        rstd,
        dx,
        dw_partial,
        db_partial if db_partial is not None else dw_partial,  # never written: HAS_BIAS is False
        dy2.stride(0),
        x2.stride(0),
        n_cols,
        n_rows,
        n_cols,
        IS_RMS=is_rms,
        HAS_BIAS=has_bias,
        ZERO_CENTERED=zero_centered_weight,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps_for(block_m * block_n),
    )
    dw = dw_partial.sum(dim=0)
    db = db_partial.sum(dim=0) if db_partial is not None else None
    return dx, dw, db
