"""The conv kernels on polyphase tiles (:mod:`mcore.kernels.triton.conv`, ``ConvTile.phased``)."""

from __future__ import annotations

import triton
import triton.language as tl

from mcore.kernels.triton.conv_common import _rows, _store_partials, _tap_weight

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
