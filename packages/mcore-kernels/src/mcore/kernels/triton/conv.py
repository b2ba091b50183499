"""Triton kernels of the document-aware causal depthwise conv1d + SiLU, forward and backward.

Layout: ``x`` is ``[batch, seqlen, channels]`` with unit channel stride and any batch / sequence strides, so the
mixer's ``[x | B | C]`` slice of the in_proj output is read in place (no transpose, no copy). Outputs are
contiguous. Every kernel works on ``rows x cols`` tiles (positions x channels; channel-contiguous vector loads). A
narrower conv (k < 4) is run with zero taps in front (``out[t] = sum_j w_j x[t - 3 + j]`` with the first ``4 - k``
weights 0): one set of kernels. The weight ``[dim, k]`` is read in place through its strides (no padded copy: every
extra launch costs host time that a 0.1 ms op cannot hide). A tap whose source is before the row start or in another
document (``seq_idx`` differs) reads 0. Math is fp32.

Two tile forms (:class:`ConvTile` ``phased``). *Shifted*: a kernel reads the ``WIDTH = 4`` shifted full tiles its
taps need (each input element 4 times through L1/L2). *Polyphase*: a tile is four ``rows/4``-high tiles of every
fourth position, and the taps read seven of those (7/4 times); Triton cannot shift a register tile, and this needs no
shift (see "Polyphase tiles" below). On the H200 polyphase made the forward 0.071 -> 0.054 ms.

Byte floor (``E`` = elements of ``x``, bf16): forward reads ``x`` and writes ``y`` (4E bytes). Backward, two paths
(``BACKWARD``): "split" is (1) ``dpre = dy * silu'(pre)`` with ``pre`` recomputed from ``x``, written once in
``x``'s dtype, plus each program's ``dw`` / ``dbias`` partials (fp32): 6E; (2) ``dx[s] = sum_j w_j dpre[s + 3 - j]``
(same document): 4E. "fused" is one pass that never writes ``dpre``: reads ``x`` and ``dy`` and writes ``dx`` (6E)
and the same partials; it needs ``dpre`` at the three positions after each of its own, so it recomputes them: 4x the
SiLU derivatives on shifted tiles (slower than split), 7/4x on polyphase tiles (faster: 0.152 ms against split's
0.178). A small kernel sums the partials into the weight's and the bias' dtypes (deterministic, no atomics). Which
path and which tiles run is a measurement's choice (``benchmarks/ssm_sweep.py``), not a guess.

Each kernel has its own tiles (defaults the fastest measured; :data:`TILE_CANDIDATES` are what the sweep tries, each
default first): on the H200 the whole conv (forward + backward, GPU kernel time) went 0.482 -> 0.448 -> 0.290 ->
0.221 ms over four rounds, against 2.40 ms for transformers' torch path (10.9x); the 10E floor at the measured
4.03 TB/s copy bandwidth is 0.104 ms.
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
    dw/dbias partials to sum). For the partial-summing dw kernel ``rows`` is the most programs' partials read a step."""

    rows: int
    cols: int
    warps: int
    tiles: int = 1
    # dpre kernel only: keep the dw / dbias products as [rows, cols] register sums across the program's tiles and
    # reduce over positions once at its end (any layout; 5 extra tiles of registers), instead of once a tile (cheap
    # only when a thread holds every position of its channels: cols = 8 x 32 x warps)
    defer: bool = False
    # forward, dpre and dx kernels: the polyphase form (see "Polyphase tiles" below): a rows-high tile is four
    # rows/4-high tiles of every fourth position, and the taps read 7 of those instead of 4 full shifted tiles
    phased: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "cols", "warps", "tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or (name != "tiles" and value & (value - 1)):
                raise ValueError(f"ConvTile.{name}={value!r}: a positive int (rows, cols, warps: a power of two)")
        for name in ("defer", "phased"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ConvTile.{name}={getattr(self, name)!r}: a bool")
        if self.phased and self.rows < 2 * WIDTH:
            raise ValueError(f"ConvTile.rows={self.rows} with phased=True: at least {2 * WIDTH} (rows/4 per phase)")

    @property
    def label(self) -> str:
        label = "x".join(map(str, (self.rows, self.cols, self.warps) + ((self.tiles,) if self.tiles > 1 else ())))
        return label + ("d" if self.defer else "") + ("p" if self.phased else "")


# Defaults: the fastest of each kernel's candidates in one sweep on an H200 (2026-12-02, session 7, call 3:
# `benchmarks/results/s7-h200-2026-12-02/call3/`; each sweep's full table is there and in earlier sessions' results).
# The forward and dx kernels on polyphase tiles, 32 x 128 at 4 warps: 0.054 / 0.041 ms (shifted full tiles: 0.071 /
# 0.050 ms; any 8-warp tiling about twice as long).
FWD_TILE = ConvTile(32, 128, 4, phased=True)
DX_TILE = ConvTile(32, 128, 4, phased=True)
# The dpre kernel reduces dw / dbias over positions: on the split path its time decides. Shifted 32 x 128 tiles
# reduced once a tile took 0.34 ms (each sum crossed warps through shared memory), deferred sums over 16 tiles of 8 x
# 128 at 2 warps 0.160; narrow polyphase tiles at 1-2 warps, one tile a program, are fastest: 64 x 16 at 1 warp 0.137
# (+0.0125 for the dw kernel's 64 partials). Every 4-warp one-tile program was 2-3x slower (not understood).
DPRE_TILE = ConvTile(64, 16, 1, phased=True)
# The fused backward on polyphase tiles: dpre at 7/4 of the positions, 6E bytes, dpre never written: 32 x 32 at 2
# warps, 0.152 ms (+ the dw kernel's 128 partials) against split's dpre + dx 0.178; the shifted fused kernel, which
# recomputes dpre at 4x the positions, took 0.41.
FUSED_TILE = ConvTile(32, 32, 2, phased=True)
# The partial-summing kernel: 16 channels a program (4 warps), up to 128 programs' partials a step (all of them here).
DW_TILE = ConvTile(128, 16, 4)
# "split": dpre kernel + dx kernel (10E bytes); "fused": one pass (6E bytes). Measured at the tiles above, the whole
# conv (forward + backward, GPU kernel time): fused 0.221 ms, split 0.241 ms; HF's torch path 2.404 ms (10.9x).
BACKWARD = "fused"
BACKWARDS = ("split", "fused")
# What benchmarks/ssm_sweep.py tries for each tile constant (the default first); the tests run every one. Pruned to
# those within about 1.5x of the best in the last sweep (and the shifted defaults of before, for comparison).
_PHASED = ((32, 128, 4), (32, 64, 2), (16, 128, 2), (16, 256, 4), (64, 128, 4), (32, 128, 2), (32, 256, 4))
_SHIFTED = ((16, 256, 4), (32, 128, 4), (8, 512, 4))
TILE_CANDIDATES: dict[str, tuple[ConvTile, ...]] = {
    "FWD_TILE": tuple(ConvTile(*t, phased=True) for t in _PHASED) + tuple(ConvTile(*t) for t in _SHIFTED),
    "DX_TILE": tuple(ConvTile(*t, phased=True) for t in _PHASED) + tuple(ConvTile(*t) for t in _SHIFTED),
    "DPRE_TILE": tuple(
        ConvTile(*t, phased=True)
        for t in (
            (64, 16, 1, 1),
            (64, 32, 2, 2),
            (32, 64, 2, 2),
            (32, 32, 2, 1),
            (64, 32, 1, 1),
            (64, 32, 2, 1),
            (128, 32, 2, 1),
            (32, 32, 1, 1),
            (64, 64, 2, 1),
            (32, 64, 2, 4),
        )
    )
    # shifted tiles: deferred sums across a 16-tile loop; reduced once a tile, a thread holding every position
    + (ConvTile(8, 128, 2, 16, True), ConvTile(16, 128, 4, 16, True), ConvTile(4, 1024, 4, 16)),
    "FUSED_TILE": tuple(
        ConvTile(*t, phased=True)
        for t in (
            (32, 32, 2, 1),
            (32, 64, 2, 4),
            (64, 32, 2, 2),
            (32, 64, 2, 2),
            (64, 16, 1, 1),
            (32, 32, 1, 1),
            # not measured yet: the default's shape over 2 and 4 tiles (fewer partials)
            (32, 32, 2, 2),
            (32, 32, 2, 4),
        )
    )
    + (ConvTile(2, 512, 2, 32),),  # the shifted fused kernel (dpre at 4x the positions)
    "DW_TILE": tuple(ConvTile(*t) for t in ((128, 16, 4), (128, 32, 8), (64, 16, 2), (32, 16, 1), (32, 32, 4),
                                            (4, 16, 1))),
}  # fmt: skip


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
def _store_partials(PART, b, pid_l, D, offs_d, mask_d, dw0, dw1, dw2, dw3, db):
    """This program's dw (four taps) and dbias partials: row ``b * programs + pid_l`` of ``PART [P, 5, D]``, which
    :func:`_conv_dw_kernel` sums."""
    part = PART + ((b * tl.num_programs(0) + pid_l) * 5) * D + offs_d
    tl.store(part, dw0, mask=mask_d)
    tl.store(part + D, dw1, mask=mask_d)
    tl.store(part + 2 * D, dw2, mask=mask_d)
    tl.store(part + 3 * D, dw3, mask=mask_d)
    tl.store(part + 4 * D, db, mask=mask_d)


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


# Polyphase tiles (``ConvTile.phased``). A program's positions ``r0 + 4 i + s`` (``i < rows / 4``, phase ``s < 4``) are
# held as four ``[rows / 4, cols]`` tiles, one a phase. Tap ``j`` of output phase ``s`` reads position
# ``r0 + 4 i + s - 3 + j``: with the seven source tiles ``src_k = in[r0 + 4 i - 3 + k]`` (``k < 7``; the first three
# are phases 1-3 of the row before) that is ``src_{s + j}``. So each input element is read 7/4 times through L1/L2
# instead of the 4 times of four shifted full tiles, for the same FMAs: Triton cannot shift a register tile, and
# this needs no shift. The price: a tap's document mask depends on the output phase (one ``where`` a tap with
# ``seq_idx``), and the stores of a phase are every fourth row (each row still ``cols`` contiguous channels).


@triton.jit
def _phase_seq(SEQ, rows, L, HAS_SEQ: tl.constexpr):
    """Document index of ``rows`` (-1 outside ``[0, L)``); 0 without ``seq_idx``."""
    q = 0
    if HAS_SEQ:
        q = tl.load(SEQ + rows, mask=(rows >= 0) & (rows < L), other=-1)
    return q


@triton.jit
def _same_doc(t, q_src, q_out, HAS_SEQ: tl.constexpr):
    """``t`` where its source row is in the output row's document, else 0 (rows outside ``[0, L)`` are 0 already)."""
    if HAS_SEQ:
        t = tl.where((q_src == q_out)[:, None], t, 0.0)
    return t


@triton.jit
def _phase_sources(P, SEQ, first, offs_d, mask_d, stride_l, L, BQ: tl.constexpr, HAS_SEQ: tl.constexpr):
    """The seven tiles ``P[first + 4 i + k]`` (``k < 7``; fp32 ``[BQ, BD]``, 0 outside ``[0, L)``) and their rows'
    document indices."""
    base = first + 4 * tl.arange(0, BQ)
    t0 = _rows(P, base, offs_d, mask_d, stride_l, L, SEQ, 0, False)
    t1 = _rows(P, base + 1, offs_d, mask_d, stride_l, L, SEQ, 0, False)
    t2 = _rows(P, base + 2, offs_d, mask_d, stride_l, L, SEQ, 0, False)
    t3 = _rows(P, base + 3, offs_d, mask_d, stride_l, L, SEQ, 0, False)
    t4 = _rows(P, base + 4, offs_d, mask_d, stride_l, L, SEQ, 0, False)
    t5 = _rows(P, base + 5, offs_d, mask_d, stride_l, L, SEQ, 0, False)
    t6 = _rows(P, base + 6, offs_d, mask_d, stride_l, L, SEQ, 0, False)
    q0 = _phase_seq(SEQ, base, L, HAS_SEQ)
    q1 = _phase_seq(SEQ, base + 1, L, HAS_SEQ)
    q2 = _phase_seq(SEQ, base + 2, L, HAS_SEQ)
    q3 = _phase_seq(SEQ, base + 3, L, HAS_SEQ)
    q4 = _phase_seq(SEQ, base + 4, L, HAS_SEQ)
    q5 = _phase_seq(SEQ, base + 5, L, HAS_SEQ)
    q6 = _phase_seq(SEQ, base + 6, L, HAS_SEQ)
    return t0, t1, t2, t3, t4, t5, t6, q0, q1, q2, q3, q4, q5, q6


@triton.jit
def _weights(W, offs_d, mask_d, stride_wd, stride_wk, K: tl.constexpr):
    w0 = _tap_weight(W, offs_d, mask_d, 0, stride_wd, stride_wk, K)
    w1 = _tap_weight(W, offs_d, mask_d, 1, stride_wd, stride_wk, K)
    w2 = _tap_weight(W, offs_d, mask_d, 2, stride_wd, stride_wk, K)
    w3 = _tap_weight(W, offs_d, mask_d, 3, stride_wd, stride_wk, K)
    return w0, w1, w2, w3


@triton.jit
def _phase_pre(t0, t1, t2, t3, q0, q1, q2, q3, w0, w1, w2, w3, bias, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr):
    """One output phase: the pre-activation from its four tap tiles (``t3`` is the output row itself, ``q3`` its
    document), and the three earlier taps document-masked (what dw multiplies)."""
    t0 = _same_doc(t0, q0, q3, HAS_SEQ)
    t1 = _same_doc(t1, q1, q3, HAS_SEQ)
    t2 = _same_doc(t2, q2, q3, HAS_SEQ)
    pre = w0 * t0 + w1 * t1 + w2 * t2 + w3 * t3
    if HAS_BIAS:
        pre += bias
    return pre, t0, t1, t2


@triton.jit
def _store_phase(OUT, rows, offs_d, mask_d, D, L, value):
    ptrs = OUT + rows.to(tl.int64)[:, None] * D + offs_d[None, :]
    tl.store(ptrs, value.to(OUT.dtype.element_ty), mask=(rows < L)[:, None] & mask_d[None, :])


@triton.jit
def _fwd_phase(OUT, rows, t0, t1, t2, t3, q0, q1, q2, q3, w0, w1, w2, w3, bias, offs_d, mask_d, D, L,
               HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    acc, _, _, _ = _phase_pre(t0, t1, t2, t3, q0, q1, q2, q3, w0, w1, w2, w3, bias, HAS_BIAS, HAS_SEQ)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    _store_phase(OUT, rows, offs_d, mask_d, D, L, acc)


@triton.jit
def _conv_fwd_phased_kernel(X, W, BIAS, SEQ, OUT, L, D, stride_xb, stride_xl, stride_wd, stride_wk, K: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr, BL: tl.constexpr,
                            BD: tl.constexpr):  # fmt: skip
    """The forward on polyphase tiles: output phase ``s`` from sources ``s .. s + 3``."""
    BQ: tl.constexpr = BL // 4
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    r0 = pid_l * BL
    t0, t1, t2, t3, t4, t5, t6, q0, q1, q2, q3, q4, q5, q6 = _phase_sources(
        X + b * stride_xb, SEQ + b * L, r0 - 3, offs_d, mask_d, stride_xl, L, BQ, HAS_SEQ
    )
    w0, w1, w2, w3, bias = _weights_and_bias(W, BIAS, offs_d, mask_d, stride_wd, stride_wk, K, HAS_BIAS, BD)
    out_b, rows = OUT + b * L * D, r0 + 4 * tl.arange(0, BQ)
    _fwd_phase(out_b, rows, t0, t1, t2, t3, q0, q1, q2, q3, w0, w1, w2, w3, bias, offs_d, mask_d, D, L, HAS_BIAS,
               HAS_SEQ, SILU)  # fmt: skip
    _fwd_phase(out_b, rows + 1, t1, t2, t3, t4, q1, q2, q3, q4, w0, w1, w2, w3, bias, offs_d, mask_d, D, L, HAS_BIAS,
               HAS_SEQ, SILU)  # fmt: skip
    _fwd_phase(out_b, rows + 2, t2, t3, t4, t5, q2, q3, q4, q5, w0, w1, w2, w3, bias, offs_d, mask_d, D, L, HAS_BIAS,
               HAS_SEQ, SILU)  # fmt: skip
    _fwd_phase(out_b, rows + 3, t3, t4, t5, t6, q3, q4, q5, q6, w0, w1, w2, w3, bias, offs_d, mask_d, D, L, HAS_BIAS,
               HAS_SEQ, SILU)  # fmt: skip


@triton.jit
def _dpre_row(DY, rows, t0, t1, t2, t3, q0, q1, q2, q3, w0, w1, w2, w3, bias, offs_d, mask_d, stride_yl, L,
              HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """``dpre`` (fp32, never stored) of the phase tile at ``rows`` from its four tap tiles, and those taps masked."""
    pre, t0, t1, t2 = _phase_pre(t0, t1, t2, t3, q0, q1, q2, q3, w0, w1, w2, w3, bias, HAS_BIAS, HAS_SEQ)
    in_row = (rows < L)[:, None] & mask_d[None, :]
    dpre = tl.load(DY + rows.to(tl.int64)[:, None] * stride_yl + offs_d[None, :], mask=in_row, other=0.0)
    dpre = dpre.to(tl.float32)
    if SILU:
        sig = tl.sigmoid(pre)
        dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
    return dpre, t0, t1, t2, t3


@triton.jit
def _accumulate(a0, a1, a2, a3, ab, dpre, m0, m1, m2, m3):
    return a0 + dpre * m0, a1 + dpre * m1, a2 + dpre * m2, a3 + dpre * m3, ab + dpre


@triton.jit
def _owned_phases(DY, DPRE, rows, t0, t1, t2, t3, t4, t5, t6, q0, q1, q2, q3, q4, q5, q6, w0, w1, w2, w3, bias,
                  offs_d, mask_d, stride_yl, D, L, a0, a1, a2, a3, ab, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
                  SILU: tl.constexpr, STORE: tl.constexpr):  # fmt: skip
    """``dpre`` at the program's four phases (phase ``s`` reads x sources ``s .. s + 3``; ``STORE``: written to
    ``DPRE``) and their dw / dbias products added to the running sums: the two polyphase backward kernels' common
    part."""
    d0, m0, m1, m2, m3 = _dpre_row(DY, rows, t0, t1, t2, t3, q0, q1, q2, q3, w0, w1, w2, w3, bias, offs_d, mask_d,
                                   stride_yl, L, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
    a0, a1, a2, a3, ab = _accumulate(a0, a1, a2, a3, ab, d0, m0, m1, m2, m3)
    d1, m0, m1, m2, m3 = _dpre_row(DY, rows + 1, t1, t2, t3, t4, q1, q2, q3, q4, w0, w1, w2, w3, bias, offs_d, mask_d,
                                   stride_yl, L, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
    a0, a1, a2, a3, ab = _accumulate(a0, a1, a2, a3, ab, d1, m0, m1, m2, m3)
    d2, m0, m1, m2, m3 = _dpre_row(DY, rows + 2, t2, t3, t4, t5, q2, q3, q4, q5, w0, w1, w2, w3, bias, offs_d, mask_d,
                                   stride_yl, L, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
    a0, a1, a2, a3, ab = _accumulate(a0, a1, a2, a3, ab, d2, m0, m1, m2, m3)
    d3, m0, m1, m2, m3 = _dpre_row(DY, rows + 3, t3, t4, t5, t6, q3, q4, q5, q6, w0, w1, w2, w3, bias, offs_d, mask_d,
                                   stride_yl, L, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
    a0, a1, a2, a3, ab = _accumulate(a0, a1, a2, a3, ab, d3, m0, m1, m2, m3)
    if STORE:
        _store_phase(DPRE, rows, offs_d, mask_d, D, L, d0)
        _store_phase(DPRE, rows + 1, offs_d, mask_d, D, L, d1)
        _store_phase(DPRE, rows + 2, offs_d, mask_d, D, L, d2)
        _store_phase(DPRE, rows + 3, offs_d, mask_d, D, L, d3)
    return d0, d1, d2, d3, a0, a1, a2, a3, ab


@triton.jit
def _weights_and_bias(W, BIAS, offs_d, mask_d, stride_wd, stride_wk, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BD: tl.constexpr):  # fmt: skip
    """The four tap weights (fp32 ``[1, BD]``) and the bias (0 without one)."""
    w0, w1, w2, w3 = _weights(W, offs_d, mask_d, stride_wd, stride_wk, K)
    bias = tl.zeros((1, BD), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return w0, w1, w2, w3, bias


@triton.jit
def _zero_sums(BQ: tl.constexpr, BD: tl.constexpr):
    """The five ``[BQ, BD]`` running sums of the dw (four taps) and dbias products."""
    z = tl.zeros((BQ, BD), dtype=tl.float32)
    return z, z, z, z, z


@triton.jit
def _conv_dpre_phased_kernel(X, W, BIAS, SEQ, DY, DPRE, PART, L, D, stride_xb, stride_xl, stride_yb, stride_yl,
                             stride_wd, stride_wk, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
                             SILU: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    """The dpre kernel on polyphase tiles over ``TILES`` consecutive row tiles; the dw / dbias products kept as
    ``[BL / 4, BD]`` sums and reduced over positions once, at the end."""
    BQ: tl.constexpr = BL // 4
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    x_b, seq_b, dy_b, dpre_b = X + b * stride_xb, SEQ + b * L, DY + b * stride_yb, DPRE + b * L * D
    w0, w1, w2, w3, bias = _weights_and_bias(W, BIAS, offs_d, mask_d, stride_wd, stride_wk, K, HAS_BIAS, BD)
    a0, a1, a2, a3, ab = _zero_sums(BQ, BD)
    for i in range(TILES):
        r0 = (pid_l * TILES + i) * BL
        t0, t1, t2, t3, t4, t5, t6, q0, q1, q2, q3, q4, q5, q6 = _phase_sources(
            x_b, seq_b, r0 - 3, offs_d, mask_d, stride_xl, L, BQ, HAS_SEQ
        )
        # The tap inputs are 0 before the row start and masked across documents, dpre is 0 past L: dw needs no other
        # mask.
        _, _, _, _, a0, a1, a2, a3, ab = _owned_phases(
            dy_b, dpre_b, r0 + 4 * tl.arange(0, BQ), t0, t1, t2, t3, t4, t5, t6, q0, q1, q2, q3, q4, q5, q6, w0, w1,
            w2, w3, bias, offs_d, mask_d, stride_yl, D, L, a0, a1, a2, a3, ab, HAS_BIAS, HAS_SEQ, SILU, True
        )  # fmt: skip
    _store_partials(PART, b, pid_l, D, offs_d, mask_d, tl.sum(a0, axis=0), tl.sum(a1, axis=0), tl.sum(a2, axis=0),
                    tl.sum(a3, axis=0), tl.sum(ab, axis=0))  # fmt: skip


@triton.jit
def _dx_phase(DX, rows, d3, d2, d1, d0, q3, q2, q1, q0, w0, w1, w2, w3, offs_d, mask_d, D, L,
              HAS_SEQ: tl.constexpr):  # fmt: skip
    """One output phase of dx: ``d3`` is dpre at the output row (its document ``q3``), ``d2 .. d0`` the rows 1-3
    after it, through taps 2-0."""
    d2 = _same_doc(d2, q2, q3, HAS_SEQ)
    d1 = _same_doc(d1, q1, q3, HAS_SEQ)
    d0 = _same_doc(d0, q0, q3, HAS_SEQ)
    _store_phase(DX, rows, offs_d, mask_d, D, L, w3 * d3 + w2 * d2 + w1 * d1 + w0 * d0)


@triton.jit
def _conv_dx_phased_kernel(DPRE, W, SEQ, DX, L, D, stride_wd, stride_wk, K: tl.constexpr, HAS_SEQ: tl.constexpr,
                           BL: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """dx on polyphase tiles: the sources are ``dpre[r0 + 4 i + k]`` (``k < 7``), output phase ``s`` reads ``s .. s +
    3`` (taps 3 .. 0)."""
    BQ: tl.constexpr = BL // 4
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    r0 = pid_l * BL
    t0, t1, t2, t3, t4, t5, t6, q0, q1, q2, q3, q4, q5, q6 = _phase_sources(
        DPRE + b * L * D, SEQ + b * L, r0, offs_d, mask_d, D, L, BQ, HAS_SEQ
    )
    w0, w1, w2, w3 = _weights(W, offs_d, mask_d, stride_wd, stride_wk, K)
    dx_b, rows = DX + b * L * D, r0 + 4 * tl.arange(0, BQ)
    _dx_phase(dx_b, rows, t0, t1, t2, t3, q0, q1, q2, q3, w0, w1, w2, w3, offs_d, mask_d, D, L, HAS_SEQ)
    _dx_phase(dx_b, rows + 1, t1, t2, t3, t4, q1, q2, q3, q4, w0, w1, w2, w3, offs_d, mask_d, D, L, HAS_SEQ)
    _dx_phase(dx_b, rows + 2, t2, t3, t4, t5, q2, q3, q4, q5, w0, w1, w2, w3, offs_d, mask_d, D, L, HAS_SEQ)
    _dx_phase(dx_b, rows + 3, t3, t4, t5, t6, q3, q4, q5, q6, w0, w1, w2, w3, offs_d, mask_d, D, L, HAS_SEQ)


@triton.jit
def _conv_bwd_fused_phased_kernel(X, W, BIAS, SEQ, DY, DX, PART, L, D, stride_xb, stride_xl, stride_yb, stride_yl,
                                  stride_wd, stride_wk, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  HAS_SEQ: tl.constexpr, SILU: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr,
                                  TILES: tl.constexpr):  # fmt: skip
    """The whole backward in one pass on polyphase tiles: ``dpre`` at the program's four phases and at the next
    three positions after each phase row (``r0 + 4 i + n``, ``n < 7``: 7/4 of the SiLU derivatives, not the shifted
    fused kernel's 4x), from the ten x tiles ``x[r0 + 4 i - 3 + k]``; dx from those seven, the dw / dbias products
    from the four owned (each position counted once). ``dpre`` is never written: 6E bytes for the backward."""
    BQ: tl.constexpr = BL // 4
    pid_l, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    x_b, seq_b, dy_b, dx_b = X + b * stride_xb, SEQ + b * L, DY + b * stride_yb, DX + b * L * D
    w0, w1, w2, w3, bias = _weights_and_bias(W, BIAS, offs_d, mask_d, stride_wd, stride_wk, K, HAS_BIAS, BD)
    a0, a1, a2, a3, ab = _zero_sums(BQ, BD)
    for i in range(TILES):
        r0 = (pid_l * TILES + i) * BL
        rows = r0 + 4 * tl.arange(0, BQ)
        # x sources k = 0..6 and 7..9 (positions r0 + 4i - 3 + k); q_k their documents
        t0, t1, t2, t3, t4, t5, t6, q0, q1, q2, q3, q4, q5, q6 = _phase_sources(
            x_b, seq_b, r0 - 3, offs_d, mask_d, stride_xl, L, BQ, HAS_SEQ
        )
        base = r0 + 4 + 4 * tl.arange(0, BQ)
        t7 = _rows(x_b, base, offs_d, mask_d, stride_xl, L, seq_b, 0, False)
        t8 = _rows(x_b, base + 1, offs_d, mask_d, stride_xl, L, seq_b, 0, False)
        t9 = _rows(x_b, base + 2, offs_d, mask_d, stride_xl, L, seq_b, 0, False)
        q7 = _phase_seq(seq_b, base, L, HAS_SEQ)
        q8 = _phase_seq(seq_b, base + 1, L, HAS_SEQ)
        q9 = _phase_seq(seq_b, base + 2, L, HAS_SEQ)
        # dpre at positions r0 + 4i + n reads x sources n .. n + 3; its document is q_{n + 3}
        d0, d1, d2, d3, a0, a1, a2, a3, ab = _owned_phases(
            dy_b, dx_b, rows, t0, t1, t2, t3, t4, t5, t6, q0, q1, q2, q3, q4, q5, q6, w0, w1, w2, w3, bias, offs_d,
            mask_d, stride_yl, D, L, a0, a1, a2, a3, ab, HAS_BIAS, HAS_SEQ, SILU, False
        )  # fmt: skip
        # the next three positions after each phase row: recomputed here, owned (and summed into dw) by the next row
        d4, _, _, _, _ = _dpre_row(dy_b, rows + 4, t4, t5, t6, t7, q4, q5, q6, q7, w0, w1, w2, w3, bias, offs_d,
                                   mask_d, stride_yl, L, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
        d5, _, _, _, _ = _dpre_row(dy_b, rows + 5, t5, t6, t7, t8, q5, q6, q7, q8, w0, w1, w2, w3, bias, offs_d,
                                   mask_d, stride_yl, L, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
        d6, _, _, _, _ = _dpre_row(dy_b, rows + 6, t6, t7, t8, t9, q6, q7, q8, q9, w0, w1, w2, w3, bias, offs_d,
                                   mask_d, stride_yl, L, HAS_BIAS, HAS_SEQ, SILU)  # fmt: skip
        # dx at phase s: dpre at s (tap 3) .. s + 3 (tap 0), each in the output's document (q_{s + 3})
        _dx_phase(dx_b, rows, d0, d1, d2, d3, q3, q4, q5, q6, w0, w1, w2, w3, offs_d, mask_d, D, L, HAS_SEQ)
        _dx_phase(dx_b, rows + 1, d1, d2, d3, d4, q4, q5, q6, q7, w0, w1, w2, w3, offs_d, mask_d, D, L, HAS_SEQ)
        _dx_phase(dx_b, rows + 2, d2, d3, d4, d5, q5, q6, q7, q8, w0, w1, w2, w3, offs_d, mask_d, D, L, HAS_SEQ)
        _dx_phase(dx_b, rows + 3, d3, d4, d5, d6, q6, q7, q8, q9, w0, w1, w2, w3, offs_d, mask_d, D, L, HAS_SEQ)
    _store_partials(PART, b, pid_l, D, offs_d, mask_d, tl.sum(a0, axis=0), tl.sum(a1, axis=0), tl.sum(a2, axis=0),
                    tl.sum(a3, axis=0), tl.sum(ab, axis=0))  # fmt: skip


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
    kernel = _conv_fwd_phased_kernel if tile.phased else _conv_fwd_kernel
    kernel[_grid(b, length, dim, tile)](
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
        kernel = _conv_bwd_fused_phased_kernel if tile.phased else _conv_bwd_fused_kernel
        kernel[grid](*args, dx, part, *sizes, **flags, **launch)
    else:
        dpre = torch.empty_like(dx)
        if tile.phased:
            _conv_dpre_phased_kernel[grid](*args, dpre, part, *sizes, **flags, **launch)
        else:
            _conv_dpre_kernel[grid](*args, dpre, part, *sizes, **flags, **launch, DEFER=tile.defer)
        dx_kernel = _conv_dx_phased_kernel if DX_TILE.phased else _conv_dx_kernel
        dx_kernel[_grid(b, length, dim, DX_TILE)](
            dpre, weight, seq, dx, length, dim, *ws, K=k, HAS_SEQ=seq_idx is not None, BL=DX_TILE.rows,
            BD=DX_TILE.cols, num_warps=DX_TILE.warps,
        )  # fmt: skip
    dw = torch.empty(dim, k, dtype=weight.dtype, device=x.device)
    db = torch.empty_like(bias) if bias is not None else None
    # One step for every partial when they fit the tile (a 1-tile dpre program leaves 128 a sequence of 4096).
    step = min(DW_TILE.rows, triton.next_power_of_2(part.shape[0]))
    _conv_dw_kernel[(triton.cdiv(dim, DW_TILE.cols),)](
        part, dw, db if db is not None else dw, part.shape[0], dim, dw.stride(0), dw.stride(1), K=k,
        HAS_BIAS=bias is not None, BD=DW_TILE.cols, BP=step, num_warps=DW_TILE.warps,
    )  # fmt: skip
    return dx, dw, db
