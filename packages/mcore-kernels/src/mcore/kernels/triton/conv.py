"""Triton kernels of the document-aware causal depthwise conv1d + SiLU, forward and backward.

Layout: ``x`` is ``[batch, seqlen, channels]`` with unit channel stride and any batch / sequence strides, so the
mixer's ``[x | B | C]`` slice of the in_proj output is read in place (no transpose, no copy). Outputs are
contiguous. Every kernel works on ``BLOCK_L x BLOCK_D`` tiles (positions x channels; channel-contiguous vector
loads) and reads the ``WIDTH = 4`` shifted tiles of its input that the taps need; the shifted tiles overlap all but
three rows, so DRAM sees each byte about once and the repeats come from L1/L2. A narrower conv (k < 4) is run with
zero taps in front (``out[t] = sum_j w_j x[t - 3 + j]`` with the first ``4 - k`` weights 0): one set of kernels.
The weight ``[dim, k]`` is read in place through its strides (no padded copy: every extra launch costs host time
that a 0.1 ms op cannot hide). A tap whose source is before the row start or in another document (``seq_idx``
differs) reads 0. Math is fp32.

Byte floor (the reason for this design; ``E`` = elements of ``x``, bf16): forward reads ``x`` and writes ``y``
(4E bytes). Backward is two kernels: (1) ``dpre = dy * silu'(pre)`` with ``pre`` recomputed from ``x``, written
once in ``x``'s dtype (what autograd's SiLU backward would hand the conv), plus each program's ``dw`` / ``dbias``
partials (fp32): reads ``x``, ``dy``, writes ``dpre`` (6E); (2) ``dx[s] = sum_j w_j dpre[s + 3 - j]`` (same
document): reads ``dpre``, writes ``dx`` (4E); a third, small kernel sums the partials into the weight's and the
bias' dtypes (deterministic, no atomics). Backward moves 10E bytes (14E with forward: 0.146 ms for the
Nemotron-H-8B mixer at the measured 4.03 TB/s), against 6E for one fused backward pass (the 10E = 0.104 ms floor),
which would have to recompute the SiLU derivative at four shifts (4x the sigmoids) because a program cannot shift
a register tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WIDTH = 4  # taps the kernels compute (the literal 4 in them); k < 4 gets zero taps in front, k > 4 uses torch
# 4K-element tiles at 8 warps: 16 fp32 values a thread (_common.TILE_ELEMENTS, swept on an H200 for streaming
# kernels); the dpre kernel keeps four such tap tiles live across the SiLU derivative, more would spill.
BLOCK_L, BLOCK_D, NUM_WARPS = 32, 128, 8
# The dpre kernel reduces dw / dbias over positions. Measured on an H200 (2026-12-01) with the 32 x 128 tiles above
# it took 0.34 ms, 5x the forward kernel: its sums over the position axis crossed warps (through shared memory, five
# a tile). A tile one warp-row high and 1024 channels wide (8 per thread x 32 threads x 4 warps) keeps every
# position of a thread's channels in that thread, so the sums are register adds; 16 such tiles per program.
DPRE_BLOCK_L, DPRE_BLOCK_D, DPRE_WARPS, DPRE_TILES = 4, 1024, 4, 16


@triton.jit
def _rows(P, rows, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ: tl.constexpr):
    """Rows ``rows`` of ``P`` (fp32), 0 outside ``[0, L)`` or (with ``seq_idx``) outside document ``seq_out``."""
    valid = (rows >= 0) & (rows < L)
    if HAS_SEQ:
        valid = valid & (tl.load(SEQ + rows, mask=valid, other=-2) == seq_out)
    ptrs = P + rows.to(tl.int64)[:, None] * stride_l + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _tap_weight(W, offs_d, mask_d, j: tl.constexpr, stride_wd, stride_wk, K: tl.constexpr):
    """Weight ``j`` of the four (fp32 ``[1, BD]``): the conv's tap ``j - (4 - K)``, or 0 in front of a narrower conv."""
    if j >= 4 - K:
        w = tl.load(W + offs_d * stride_wd + (j - (4 - K)) * stride_wk, mask=mask_d, other=0.0).to(tl.float32)
    else:
        w = tl.zeros_like(offs_d).to(tl.float32)
    return w[None, :]


@triton.jit
def _taps(X, W, SEQ, rows, offs_d, mask_d, stride_l, L, stride_wd, stride_wk, K: tl.constexpr,
          HAS_SEQ: tl.constexpr):  # fmt: skip
    """The four tap inputs ``x[t - 3 + j]`` of output rows ``t = rows`` (document-masked) and the weights ``w_j``."""
    seq_out = 0
    if HAS_SEQ:
        seq_out = tl.load(SEQ + rows, mask=rows < L, other=-1)
    x0 = _rows(X, rows - 3, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ)
    x1 = _rows(X, rows - 2, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ)
    x2 = _rows(X, rows - 1, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ)
    x3 = _rows(X, rows, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ)
    w0 = _tap_weight(W, offs_d, mask_d, 0, stride_wd, stride_wk, K)
    w1 = _tap_weight(W, offs_d, mask_d, 1, stride_wd, stride_wk, K)
    w2 = _tap_weight(W, offs_d, mask_d, 2, stride_wd, stride_wk, K)
    w3 = _tap_weight(W, offs_d, mask_d, 3, stride_wd, stride_wk, K)
    return x0, x1, x2, x3, w0, w1, w2, w3


@triton.jit
def _conv_fwd_kernel(X, W, BIAS, SEQ, OUT, L, D, stride_xb, stride_xl, stride_wd, stride_wk, K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr, BL: tl.constexpr,
                     BD: tl.constexpr):  # fmt: skip
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = pid_l * BL + tl.arange(0, BL)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    x0, x1, x2, x3, w0, w1, w2, w3 = _taps(X + b * stride_xb, W, SEQ + b * L, rows, offs_d, mask_d, stride_xl, L,
                                           stride_wd, stride_wk, K, HAS_SEQ)  # fmt: skip
    acc = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    ptrs = OUT + (b * L + rows.to(tl.int64))[:, None] * D + offs_d[None, :]
    tl.store(ptrs, acc.to(OUT.dtype.element_ty), mask=(rows < L)[:, None] & mask_d[None, :])


@triton.jit
def _conv_dpre_kernel(X, W, BIAS, SEQ, DY, DPRE, PART, L, D, stride_xb, stride_xl, stride_yb, stride_yl, stride_wd,
                      stride_wk, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
                      BL: tl.constexpr, BD: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    """``dpre = dy * silu'(pre)`` over ``TILES`` consecutive row tiles, and this program's dw / dbias partials."""
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    x_b, seq_b, dy_b = X + b * stride_xb, SEQ + b * L, DY + b * stride_yb
    if HAS_BIAS:
        bias = tl.load(BIAS + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    dw0 = tl.zeros((BD,), dtype=tl.float32)
    dw1 = tl.zeros((BD,), dtype=tl.float32)
    dw2 = tl.zeros((BD,), dtype=tl.float32)
    dw3 = tl.zeros((BD,), dtype=tl.float32)
    db = tl.zeros((BD,), dtype=tl.float32)
    for i in range(TILES):
        rows = (pid_l * TILES + i) * BL + tl.arange(0, BL)
        in_row = (rows < L)[:, None] & mask_d[None, :]
        x0, x1, x2, x3, w0, w1, w2, w3 = _taps(x_b, W, seq_b, rows, offs_d, mask_d, stride_xl, L, stride_wd, stride_wk,
                                               K, HAS_SEQ)  # fmt: skip
        dy_ptrs = dy_b + rows.to(tl.int64)[:, None] * stride_yl + offs_d[None, :]
        dpre = tl.load(dy_ptrs, mask=in_row, other=0.0).to(tl.float32)
        if SILU:
            pre = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
            if HAS_BIAS:
                pre += bias
            sig = tl.sigmoid(pre)
            dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
        out_ptrs = DPRE + (b * L + rows.to(tl.int64))[:, None] * D + offs_d[None, :]
        tl.store(out_ptrs, dpre.to(DPRE.dtype.element_ty), mask=in_row)
        # The tap inputs are already 0 where a tap crosses a document or the row start: dw needs no other mask.
        # They are read again (L1 hits; the store above keeps the compiler from reusing the first loads), so that
        # four tap tiles need not stay live in registers across the SiLU derivative.
        x0, x1, x2, x3, w0, w1, w2, w3 = _taps(x_b, W, seq_b, rows, offs_d, mask_d, stride_xl, L, stride_wd, stride_wk,
                                               K, HAS_SEQ)  # fmt: skip
        dw0 += tl.sum(dpre * x0, axis=0)
        dw1 += tl.sum(dpre * x1, axis=0)
        dw2 += tl.sum(dpre * x2, axis=0)
        dw3 += tl.sum(dpre * x3, axis=0)
        db += tl.sum(dpre, axis=0)
    part = PART + ((b * tl.num_programs(0) + pid_l) * 5) * D + offs_d
    tl.store(part, dw0, mask=mask_d)
    tl.store(part + D, dw1, mask=mask_d)
    tl.store(part + 2 * D, dw2, mask=mask_d)
    tl.store(part + 3 * D, dw3, mask=mask_d)
    tl.store(part + 4 * D, db, mask=mask_d)


@triton.jit
def _conv_dx_kernel(DPRE, W, SEQ, DX, L, D, stride_wd, stride_wk, K: tl.constexpr, HAS_SEQ: tl.constexpr,
                    BL: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """``dx[s] = sum_j w_j dpre[s + 3 - j]``: position ``s`` feeds output ``s + 3 - j`` through tap ``j`` (same
    document)."""
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = pid_l * BL + tl.arange(0, BL)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    seq_b, dpre_b = SEQ + b * L, DPRE + b * L * D
    seq_here = 0
    if HAS_SEQ:
        seq_here = tl.load(seq_b + rows, mask=rows < L, other=-1)
    d3 = _rows(dpre_b, rows, offs_d, mask_d, D, L, seq_b, seq_here, HAS_SEQ)
    d2 = _rows(dpre_b, rows + 1, offs_d, mask_d, D, L, seq_b, seq_here, HAS_SEQ)
    d1 = _rows(dpre_b, rows + 2, offs_d, mask_d, D, L, seq_b, seq_here, HAS_SEQ)
    d0 = _rows(dpre_b, rows + 3, offs_d, mask_d, D, L, seq_b, seq_here, HAS_SEQ)
    w0 = _tap_weight(W, offs_d, mask_d, 0, stride_wd, stride_wk, K)
    w1 = _tap_weight(W, offs_d, mask_d, 1, stride_wd, stride_wk, K)
    w2 = _tap_weight(W, offs_d, mask_d, 2, stride_wd, stride_wk, K)
    w3 = _tap_weight(W, offs_d, mask_d, 3, stride_wd, stride_wk, K)
    dx = w3 * d3 + w2 * d2 + w1 * d1 + w0 * d0
    ptrs = DX + (b * L + rows.to(tl.int64))[:, None] * D + offs_d[None, :]
    tl.store(ptrs, dx.to(DX.dtype.element_ty), mask=(rows < L)[:, None] & mask_d[None, :])


@triton.jit
def _sum_partials(PART, row: tl.constexpr, P, D, offs_d, mask_d, BP: tl.constexpr):
    """Sum over the ``P`` programs' partials ``PART[p, row, offs_d]`` (fp32 ``[BD]``)."""
    acc = tl.zeros_like(offs_d).to(tl.float32)
    for p0 in range(0, P, BP):
        offs_p = p0 + tl.arange(0, BP)
        ptrs = PART + (offs_p[:, None] * 5 + row) * D + offs_d[None, :]
        acc += tl.sum(tl.load(ptrs, mask=(offs_p < P)[:, None] & mask_d[None, :], other=0.0), axis=0)
    return acc


@triton.jit
def _conv_dw_kernel(PART, DW, DB, P, D, stride_wd, stride_wk, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BD: tl.constexpr, BP: tl.constexpr):  # fmt: skip
    """dweight ``[D, K]`` and dbias in their dtypes from the dpre kernel's partials (one launch, no torch glue)."""
    offs_d = tl.program_id(0) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    for j in tl.static_range(4):
        if j >= 4 - K:
            dw = _sum_partials(PART, j, P, D, offs_d, mask_d, BP)
            tl.store(DW + offs_d * stride_wd + (j - (4 - K)) * stride_wk, dw.to(DW.dtype.element_ty), mask=mask_d)
    if HAS_BIAS:
        db = _sum_partials(PART, 4, P, D, offs_d, mask_d, BP)
        tl.store(DB + offs_d, db.to(DB.dtype.element_ty), mask=mask_d)


def _unit_channel_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(2) == 1 else t.contiguous()


def _grid(b: int, length: int, dim: int, rows: int, cols: int | None = None) -> tuple[int, int, int]:
    return (triton.cdiv(length, rows), triton.cdiv(dim, BLOCK_D if cols is None else cols), b)


def conv_forward(x, weight, bias, seq_idx, silu: bool) -> torch.Tensor:
    """``x`` ``[b, L, dim]`` (unit channel stride), ``weight`` ``[dim, k]`` -> contiguous ``[b, L, dim]``."""
    x = _unit_channel_stride(x)
    b, length, dim = x.shape
    out = torch.empty(b, length, dim, dtype=x.dtype, device=x.device)
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else out
    _conv_fwd_kernel[_grid(b, length, dim, BLOCK_L)](
        x, weight, bias if bias is not None else out, seq, out, length, dim, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), K=weight.shape[1], HAS_BIAS=bias is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, BL=BLOCK_L, BD=BLOCK_D, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def conv_backward(dy, x, weight, bias, seq_idx, silu: bool):
    """``(dx, dweight, dbias or None)`` in the dtypes of ``x``, ``weight`` and ``bias``; ``dx`` contiguous."""
    x, dy = _unit_channel_stride(x), _unit_channel_stride(dy)
    b, length, dim = x.shape
    k = weight.shape[1]
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else x
    dpre = torch.empty(b, length, dim, dtype=x.dtype, device=x.device)
    grid = _grid(b, length, dim, DPRE_BLOCK_L * DPRE_TILES, DPRE_BLOCK_D)
    part = torch.empty(b * grid[0], 5, dim, dtype=torch.float32, device=x.device)
    ws = weight.stride(0), weight.stride(1)
    _conv_dpre_kernel[grid](
        x, weight, bias if bias is not None else x, seq, dy, dpre, part, length, dim, x.stride(0), x.stride(1),
        dy.stride(0), dy.stride(1), *ws, K=k, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=silu,
        BL=DPRE_BLOCK_L, BD=DPRE_BLOCK_D, TILES=DPRE_TILES, num_warps=DPRE_WARPS,
    )  # fmt: skip
    dx = torch.empty_like(dpre)
    _conv_dx_kernel[_grid(b, length, dim, BLOCK_L)](
        dpre, weight, seq, dx, length, dim, *ws, K=k, HAS_SEQ=seq_idx is not None, BL=BLOCK_L, BD=BLOCK_D,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    dw = torch.empty(dim, k, dtype=weight.dtype, device=x.device)
    db = torch.empty_like(bias) if bias is not None else None
    _conv_dw_kernel[(triton.cdiv(dim, 64),)](
        part, dw, db if db is not None else dw, part.shape[0], dim, dw.stride(0), dw.stride(1), K=k,
        HAS_BIAS=bias is not None, BD=64, BP=8, num_warps=4,
    )  # fmt: skip
    return dx, dw, db
