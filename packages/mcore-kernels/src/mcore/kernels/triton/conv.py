"""Triton kernels of the document-aware causal depthwise conv1d + SiLU, forward and backward.

Layout: ``x`` is ``[batch, seqlen, channels]`` with unit channel stride and any batch / sequence strides, so the
mixer's ``[x | B | C]`` slice of the in_proj output is read in place (no transpose, no copy). Outputs are
contiguous. Every kernel works on ``rows x cols`` tiles (positions x channels; channel-contiguous vector
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
a register tile. That fused pass is here too (``BACKWARD = "fused"``: reads ``x`` with its 3-row halo behind and
``dy`` with its 3-row halo ahead, recomputes ``pre`` at the four shifts, writes ``dx`` and the same partials); which
of the two runs is a measurement's choice (``benchmarks/ssm_sweep.py``), not a guess.

Each kernel has its own tiles (:class:`ConvTile`, defaults the fastest measured; :data:`TILE_CANDIDATES` are what
the sweep tries, each default first): on the H200 the whole conv (forward + backward, GPU kernel time) went 0.482 ->
0.448 -> 0.290 ms over three tilings, against 2.41 ms for transformers' torch path (8.3x); the dpre kernel (0.160
ms, 1.6 TB/s) is what stands between it and the 10E floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

WIDTH = 4  # taps the kernels compute (the literal 4 in them); k < 4 gets zero taps in front, k > 4 uses torch


@dataclass(frozen=True)
class ConvTile:
    """One kernel's launch shape: ``rows x cols`` (positions x channels) register tiles at ``warps`` warps, and, for
    the kernels that reduce over positions (dpre, fused backward), ``tiles`` consecutive row tiles a program (fewer
    dw/dbias partials to sum). For the partial-summing dw kernel ``rows`` is the programs' partials read a step."""

    rows: int
    cols: int
    warps: int
    tiles: int = 1
    # dpre kernel only: keep the dw / dbias products as [rows, cols] register sums across the program's tiles and
    # reduce over positions once at its end (any layout; 5 extra tiles of registers), instead of once a tile (cheap
    # only when a thread holds every position of its channels: cols = 8 x 32 x warps)
    defer: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "cols", "warps", "tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or (name != "tiles" and value & (value - 1)):
                raise ValueError(f"ConvTile.{name}={value!r}: a positive int (rows, cols, warps: a power of two)")
        if not isinstance(self.defer, bool):
            raise ValueError(f"ConvTile.defer={self.defer!r}: a bool")

    @property
    def label(self) -> str:
        label = "x".join(map(str, (self.rows, self.cols, self.warps) + ((self.tiles,) if self.tiles > 1 else ())))
        return label + ("d" if self.defer else "")


# Defaults: the fastest of each kernel's candidates in one sweep on an H200 (2026-12-01, session 6, call 5:
# `benchmarks/results/s6-h200-2026-12-01/call5/`). The forward and dx kernels stream 16 x 256 tiles at 4 warps
# (0.071 / 0.049 ms; 32 x 128 measured the same, any 8-warp tiling twice as long).
FWD_TILE = ConvTile(16, 256, 4)
DX_TILE = ConvTile(16, 256, 4)
# The dpre kernel reduces dw / dbias over positions. With 32 x 128 tiles reduced once a tile it took 0.34 ms, 5x the
# forward kernel: each sum crossed warps through shared memory. One-warp-row-high tiles 1024 channels wide (a thread
# holds every position of its channels) made the sums register adds (0.18-0.19 ms); deferring the sums to the
# program's end on 8 x 128 tiles at 2 warps, 16 tiles a program, is faster still (0.160 ms).
DPRE_TILE = ConvTile(8, 128, 2, 16, True)
# The fused backward keeps the in-thread position axis (0.41 ms at best: the four recomputed sigmoids cost more than
# the 4E bytes they save).
FUSED_TILE = ConvTile(2, 512, 2, 32)
# The partial-summing kernel: 16 channels a program (one warp), 4 programs' partials a step (0.017 ms).
DW_TILE = ConvTile(4, 16, 1)
# "split": dpre kernel + dx kernel (10E bytes); "fused": one pass (6E bytes, 4x the sigmoids). Measured: split 0.290
# ms against fused 0.500 ms for the whole conv (forward + backward) at the tiles above.
BACKWARD = "split"
BACKWARDS = ("split", "fused")
# What benchmarks/ssm_sweep.py tries for each tile constant (the default first); the tests run every one.
_STREAM = ((16, 256, 4), (32, 128, 4), (32, 128, 8), (64, 128, 4), (32, 256, 8), (64, 64, 2), (8, 512, 4))
TILE_CANDIDATES: dict[str, tuple[ConvTile, ...]] = {
    "FWD_TILE": tuple(ConvTile(*t) for t in _STREAM),
    "DX_TILE": tuple(ConvTile(*t) for t in _STREAM),
    "DPRE_TILE": tuple(
        ConvTile(*t)
        for t in (
            # deferred reductions on the forward's streaming tiles (rows across threads and warps)
            (8, 128, 2, 16, True),
            (8, 128, 4, 16, True),
            (16, 128, 4, 8, True),
            (8, 256, 4, 16, True),
            (16, 128, 4, 16, True),
            # reduced once a tile, a thread holding every position of its channels
            (4, 1024, 4, 16),
            (4, 1024, 4, 8),
            (4, 1024, 4, 32),
            (4, 2048, 8, 16),
            (2, 1024, 4, 32),
            # not measured yet: with one or two tiles a program the loads are not serialised behind a loop (more
            # partials for the dw kernel to sum)
            (32, 128, 4, 1, True),
            (16, 256, 4, 1, True),
            (32, 128, 4, 2, True),
            (16, 128, 2, 2, True),
            (64, 128, 4, 1, True),
            (16, 128, 4, 1, True),
        )
    ),  # fmt: skip
    "FUSED_TILE": tuple(
        ConvTile(*t)
        for t in (
            (2, 512, 2, 32),
            (4, 512, 4, 16),
            (4, 1024, 4, 16),
            (4, 256, 2, 16),
            (4, 512, 4, 32),
            (8, 512, 8, 16),
            (2, 1024, 4, 32),
        )
    ),  # fmt: skip
    "DW_TILE": tuple(ConvTile(*t) for t in ((4, 16, 1), (8, 64, 4), (16, 32, 4), (8, 32, 2), (32, 64, 8))),
}


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
    part = PART + ((b * tl.num_programs(0) + pid_l) * 5) * D + offs_d
    tl.store(part, dw0, mask=mask_d)
    tl.store(part + D, dw1, mask=mask_d)
    tl.store(part + 2 * D, dw2, mask=mask_d)
    tl.store(part + 3 * D, dw3, mask=mask_d)
    tl.store(part + 4 * D, db, mask=mask_d)


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


def _grid(b: int, length: int, dim: int, tile: ConvTile) -> tuple[int, int, int]:
    return (triton.cdiv(length, tile.rows * tile.tiles), triton.cdiv(dim, tile.cols), b)


def conv_forward(x, weight, bias, seq_idx, silu: bool) -> torch.Tensor:
    """``x`` ``[b, L, dim]`` (unit channel stride), ``weight`` ``[dim, k]`` -> contiguous ``[b, L, dim]``."""
    x = _unit_channel_stride(x)
    b, length, dim = x.shape
    out = torch.empty(b, length, dim, dtype=x.dtype, device=x.device)
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else out
    tile = FWD_TILE
    _conv_fwd_kernel[_grid(b, length, dim, tile)](
        x, weight, bias if bias is not None else out, seq, out, length, dim, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), K=weight.shape[1], HAS_BIAS=bias is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, BL=tile.rows, BD=tile.cols, num_warps=tile.warps,
    )  # fmt: skip
    return out


def conv_backward(dy, x, weight, bias, seq_idx, silu: bool):
    """``(dx, dweight, dbias or None)`` in the dtypes of ``x``, ``weight`` and ``bias``; ``dx`` contiguous. Runs the
    :data:`BACKWARD` path, then the partial-summing kernel."""
    if BACKWARD not in BACKWARDS:
        raise ValueError(f"mcore.kernels.triton.conv.BACKWARD={BACKWARD!r}: must be one of {BACKWARDS}")
    x, dy = _unit_channel_stride(x), _unit_channel_stride(dy)
    b, length, dim = x.shape
    k = weight.shape[1]
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else x
    dx = torch.empty(b, length, dim, dtype=x.dtype, device=x.device)
    tile = FUSED_TILE if BACKWARD == "fused" else DPRE_TILE
    grid = _grid(b, length, dim, tile)
    part = torch.empty(b * grid[0], 5, dim, dtype=torch.float32, device=x.device)
    ws = weight.stride(0), weight.stride(1)
    args = (x, weight, bias if bias is not None else x, seq, dy)
    sizes = (length, dim, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), *ws)
    flags = dict(K=k, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=silu)
    launch = dict(BL=tile.rows, BD=tile.cols, TILES=tile.tiles, num_warps=tile.warps)
    if BACKWARD == "fused":
        _conv_bwd_fused_kernel[grid](*args, dx, part, *sizes, **flags, **launch)
    else:
        dpre = torch.empty_like(dx)
        _conv_dpre_kernel[grid](*args, dpre, part, *sizes, **flags, **launch, DEFER=tile.defer)
        _conv_dx_kernel[_grid(b, length, dim, DX_TILE)](
            dpre, weight, seq, dx, length, dim, *ws, K=k, HAS_SEQ=seq_idx is not None, BL=DX_TILE.rows,
            BD=DX_TILE.cols, num_warps=DX_TILE.warps,
        )  # fmt: skip
    dw = torch.empty(dim, k, dtype=weight.dtype, device=x.device)
    db = torch.empty_like(bias) if bias is not None else None
    _conv_dw_kernel[(triton.cdiv(dim, DW_TILE.cols),)](
        part, dw, db if db is not None else dw, part.shape[0], dim, dw.stride(0), dw.stride(1), K=k,
        HAS_BIAS=bias is not None, BD=DW_TILE.cols, BP=DW_TILE.rows, num_warps=DW_TILE.warps,
    )  # fmt: skip
    return dx, dw, db
