"""The conv kernels on shifted tiles (:mod:`mcore.kernels.triton.conv`): each reads the four shifted full tiles
of its input that the taps need."""

from __future__ import annotations

import triton
import triton.language as tl

from mcore.kernels.triton.conv_common import _rows, _store_partials, _tap_weight, _taps


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
                      BL: tl.constexpr, BD: tl.constexpr, TILES: tl.constexpr, DEFER: tl.constexpr):  # fmt: skip
    """``dpre = dy * silu'(pre)`` over ``TILES`` consecutive row tiles, and this program's dw / dbias partials
    (``DEFER``: summed over positions once, after the last tile; else once a tile)."""
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    x_b, seq_b, dy_b = X + b * stride_xb, SEQ + b * L, DY + b * stride_yb
    if HAS_BIAS:
        bias = tl.load(BIAS + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if DEFER:
        acc0 = tl.zeros((BL, BD), dtype=tl.float32)
        acc1 = tl.zeros((BL, BD), dtype=tl.float32)
        acc2 = tl.zeros((BL, BD), dtype=tl.float32)
        acc3 = tl.zeros((BL, BD), dtype=tl.float32)
        accb = tl.zeros((BL, BD), dtype=tl.float32)
    else:
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
        if DEFER:
            # The tap tiles stay live (few values a thread on these tiles); no cross-thread sum in the loop.
            acc0 += dpre * x0
            acc1 += dpre * x1
            acc2 += dpre * x2
            acc3 += dpre * x3
            accb += dpre
        else:
            # Read again (L1 hits; the store above keeps the compiler from reusing the first loads), so that four
            # wide tap tiles need not stay live in registers across the SiLU derivative.
            x0, x1, x2, x3, w0, w1, w2, w3 = _taps(x_b, W, seq_b, rows, offs_d, mask_d, stride_xl, L, stride_wd,
                                                   stride_wk, K, HAS_SEQ)  # fmt: skip
            dw0 += tl.sum(dpre * x0, axis=0)
            dw1 += tl.sum(dpre * x1, axis=0)
            dw2 += tl.sum(dpre * x2, axis=0)
            dw3 += tl.sum(dpre * x3, axis=0)
            db += tl.sum(dpre, axis=0)
    if DEFER:
        dw0 = tl.sum(acc0, axis=0)
        dw1 = tl.sum(acc1, axis=0)
        dw2 = tl.sum(acc2, axis=0)
        dw3 = tl.sum(acc3, axis=0)
        db = tl.sum(accb, axis=0)
    _store_partials(PART, b, pid_l, D, offs_d, mask_d, dw0, dw1, dw2, dw3, db)


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
def _dpre_at(X, W, SEQ, DY, rows, shift: tl.constexpr, seq_here, bias, offs_d, mask_d, stride_xl, stride_yl, L,
             stride_wd, stride_wk, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
             SILU: tl.constexpr):  # fmt: skip
    """``dpre`` at rows ``rows + shift`` (fp32, recomputed from ``x`` and ``dy``), 0 where that row is past ``L`` or
    (with ``seq_idx``) in another document than ``rows``; and the four tap inputs of those rows."""
    src = rows + shift
    x0, x1, x2, x3, w0, w1, w2, w3 = _taps(X, W, SEQ, src, offs_d, mask_d, stride_xl, L, stride_wd, stride_wk, K,
                                           HAS_SEQ)  # fmt: skip
    valid = src < L
    if HAS_SEQ:
        valid = valid & (tl.load(SEQ + src, mask=valid, other=-2) == seq_here)
    ptrs = DY + src.to(tl.int64)[:, None] * stride_yl + offs_d[None, :]
    dpre = tl.load(ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    if SILU:
        pre = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
        if HAS_BIAS:
            pre += bias
        sig = tl.sigmoid(pre)
        dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
    return dpre, x0, x1, x2, x3


@triton.jit
def _conv_bwd_fused_kernel(X, W, BIAS, SEQ, DY, DX, PART, L, D, stride_xb, stride_xl, stride_yb, stride_yl,
                           stride_wd, stride_wk, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
                           SILU: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    """The whole backward in one pass over ``TILES`` consecutive row tiles: ``dx[s] = sum_j w_j dpre[s + 3 - j]`` with
    ``dpre`` recomputed at the four shifts (never written), and this program's dw / dbias partials from the shift-0
    ``dpre`` (each position counted by the one program that owns it)."""
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    x_b, seq_b, dy_b = X + b * stride_xb, SEQ + b * L, DY + b * stride_yb
    bias = tl.zeros((1, BD), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    w3 = _tap_weight(W, offs_d, mask_d, 3, stride_wd, stride_wk, K)
    dw0 = tl.zeros((BD,), dtype=tl.float32)
    dw1 = tl.zeros((BD,), dtype=tl.float32)
    dw2 = tl.zeros((BD,), dtype=tl.float32)
    dw3 = tl.zeros((BD,), dtype=tl.float32)
    db = tl.zeros((BD,), dtype=tl.float32)
    for i in range(TILES):
        rows = (pid_l * TILES + i) * BL + tl.arange(0, BL)
        seq_here = 0
        if HAS_SEQ:
            seq_here = tl.load(seq_b + rows, mask=rows < L, other=-1)
        d, x0, x1, x2, x3 = _dpre_at(x_b, W, seq_b, dy_b, rows, 0, seq_here, bias, offs_d, mask_d, stride_xl,
                                     stride_yl, L, stride_wd, stride_wk, K, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
        # The taps are 0 across a document start or before row 0, and d is 0 past L: dw needs no other mask.
        dw0 += tl.sum(d * x0, axis=0)
        dw1 += tl.sum(d * x1, axis=0)
        dw2 += tl.sum(d * x2, axis=0)
        dw3 += tl.sum(d * x3, axis=0)
        db += tl.sum(d, axis=0)
        dx = w3 * d
        # Row s feeds output s + 3 - j through tap j: the later rows' dpre, recomputed here (L1 hits on x and dy).
        for shift in tl.static_range(1, 4):
            d, x0, x1, x2, x3 = _dpre_at(x_b, W, seq_b, dy_b, rows, shift, seq_here, bias, offs_d, mask_d, stride_xl,
                                         stride_yl, L, stride_wd, stride_wk, K, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
            dx += _tap_weight(W, offs_d, mask_d, 3 - shift, stride_wd, stride_wk, K) * d
        ptrs = DX + (b * L + rows.to(tl.int64))[:, None] * D + offs_d[None, :]
        tl.store(ptrs, dx.to(DX.dtype.element_ty), mask=(rows < L)[:, None] & mask_d[None, :])
    _store_partials(PART, b, pid_l, D, offs_d, mask_d, dw0, dw1, dw2, dw3, db)
