"""The Triton kernels of the flash-attention backward (launched by :mod:`.flash_backward`, which explains them).

Statistics layout: the preprocess writes ``lse2 = lse * log2(e)`` (``+inf`` on rows that saw nothing, so that
their probabilities are 0) and ``delta`` head-major, ``[b, Hq, s]`` fp32, so the inner loops read them as
contiguous vectors instead of one float every ``Hq`` (the forward's ``[b, s, Hq]`` lse is the op's contract).

Blocks at a window's edge, on the causal diagonal and at a segment's ragged end are masked; interior blocks (all
rows valid, all pairs allowed) are not. ``ONE_LOOP`` walks a segment's blocks in one loop and masks where a block
needs it (``MASKED=2`` with a runtime ``edge``); otherwise three loops (edge, interior, diagonal; ``MASKED`` 1/0/1)
whose interior loads carry no masks at all, but which the sm90 compile keeps more registers live for.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mcore.kernels.triton.flash_attention import _allowed, _block_row, _load_rows

# dQ in the dK/dV kernel: not at all (the dQ kernel runs), by fp32 atomics, or stored (single-block documents).
DQ_SEPARATE, DQ_ATOMIC, DQ_STORE = 0, 1, 2
# Row statistics (lse2, delta): read from the preprocess pass's head-major buffers, or computed by the kernel from
# the output tile and the forward's lse (the dQ kernel, or the dK/dV kernel when it stores dQ: once per row).
STATS_LOAD, STATS_FUSED = 0, 1


@triton.jit
def _preprocess_kernel(
    OUT, DO, LSE, DLSE, DELTA, LSE2, stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
    s, n_heads, D_V, HAS_DLSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_DV)
    valid = tokens < s
    mask = valid[:, None] & (offs_d < D_V)[None, :]
    t64 = tokens.to(tl.int64)
    o = tl.load(OUT + row * stride_ob + head * stride_oh + t64[:, None] * stride_os + offs_d[None, :], mask=mask)
    do = tl.load(DO + row * stride_db + head * stride_dh + t64[:, None] * stride_ds + offs_d[None, :], mask=mask)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    token_major = (row * s + t64) * n_heads + head
    if HAS_DLSE:
        delta -= tl.load(DLSE + token_major, mask=valid, other=0.0)
    lse = tl.load(LSE + token_major, mask=valid, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    head_major = (row * n_heads + head) * s + t64
    tl.store(DELTA + head_major, delta, mask=valid)
    tl.store(LSE2 + head_major, lse2, mask=valid)


@triton.jit
def _visible_queries(k_first, k_last, q_len, q_pos, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Segment-local query ranges of a key block: [lo, hi) see some key of it, [full_lo, full_hi) see all."""
    lo = k_first * 0
    hi = lo + q_len
    full_lo = lo
    full_hi = hi
    if CAUSAL:
        lo = tl.maximum(lo, k_first - q_pos)
        full_lo = tl.maximum(full_lo, k_last - q_pos)
    if HAS_WINDOW:
        hi = tl.minimum(hi, k_last + window - q_pos)
        full_hi = tl.minimum(full_hi, k_first + window - q_pos)
    return lo, hi, full_lo, full_hi


@triton.jit
def _load_stats(LSE2, DELTA, stat_base, rows, rows_valid, MASKED: tl.constexpr):
    if MASKED:
        lse2 = tl.load(LSE2 + stat_base + rows, mask=rows_valid, other=float("inf"))
        delta = tl.load(DELTA + stat_base + rows, mask=rows_valid, other=0.0)
    else:
        lse2 = tl.load(LSE2 + stat_base + rows)
        delta = tl.load(DELTA + stat_base + rows)
    return lse2, delta


@triton.jit
def _row_stats(o_ptrs, do, lse_ptrs, dlse_ptrs, rows_valid, offs_dv, D_V, MASKED: tl.constexpr,
               EVEN_D: tl.constexpr, HAS_DLSE: tl.constexpr):  # fmt: skip
    """``(lse2, delta)`` of a tile's rows computed in place of the preprocess pass: ``delta = rowsum(dO * O)
    [- dlse]`` from the output tile, ``lse2`` from the forward's token-major lse (+inf where P must be 0)."""
    o = _load_rows(o_ptrs, rows_valid, offs_dv, D_V, MASKED, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptrs, mask=rows_valid, other=0.0)
    lse = tl.load(lse_ptrs, mask=rows_valid, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse2, delta


@triton.jit
def _kv_step_inputs(
    q_base, do_base, stat_base, LSE2, DELTA, query, q_len, stride_qs, stride_ds, pack_row, q_off, do_off, stat_off,
    offs_dqk, offs_dv, D_QK, D_V, o_base, lse_base, dlse_base, stride_os, o_off, stride_ls, lse_off,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, STATS: tl.constexpr, HAS_DLSE: tl.constexpr,
    STORE_DELTA: tl.constexpr,
):  # fmt: skip
    """Q, dO and the row statistics of one query step. Tile row r is query ``query + pack_row[r]`` of the head
    whose rows start ``q_off[r]`` after the base (the GQA heads packed into one tile, or all one head: 0)."""
    qm = query + pack_row
    q_valid = qm < q_len
    qm64 = qm.to(tl.int64)
    do_ptrs = do_base + (qm64 * stride_ds + do_off)[:, None] + offs_dv[None, :]
    do = _load_rows(do_ptrs, q_valid, offs_dv, D_V, MASKED, EVEN_D)
    if STATS == 0:  # STATS_LOAD
        lse2, delta = _load_stats(LSE2, DELTA, stat_base + stat_off, qm64, q_valid, MASKED)
    else:  # STATS_FUSED: this program is the only one that sees these (query, head) rows (single-block documents)
        o_ptrs = o_base + (qm64 * stride_os + o_off)[:, None] + offs_dv[None, :]
        stat_ptrs = qm64 * stride_ls + lse_off
        lse2, delta = _row_stats(o_ptrs, do, lse_base + stat_ptrs, dlse_base + stat_ptrs, q_valid, offs_dv, D_V,
                                 MASKED, EVEN_D, HAS_DLSE)  # fmt: skip
        if STORE_DELTA:  # the sinks' gradient reads it
            tl.store(DELTA + stat_base + stat_off + qm64, delta, mask=q_valid)
    # Q after the statistics: the output tile they read is dead by then (fewer live registers).
    q_ptrs = q_base + (qm64 * stride_qs + q_off)[:, None] + offs_dqk[None, :]
    q = _load_rows(q_ptrs, q_valid, offs_dqk, D_QK, MASKED, EVEN_D)
    return q, do, lse2, delta, qm, qm64, q_valid


@triton.jit
def _kv_step_grads(
    dk, dv, k, v, q, do, lse2, delta, qm, q_valid, q_pos, k_rows_pos, k_valid, scale_log2, window, edge,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dK/dV of one key tile from one query step; returns dS^T too (for dQ)."""
    scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
    p_t = tl.exp2(scores_t - lse2[None, :])
    if MASKED == 1:
        valid = q_valid[None, :] & k_valid[:, None]
        allowed = _allowed((q_pos + qm)[None, :], k_rows_pos[:, None], valid, window, CAUSAL, HAS_WINDOW)
        p_t = tl.where(allowed, p_t, 0.0)
    if MASKED == 2:  # noqa: SIM102 (a constexpr test, then a runtime one: Triton needs them apart)
        if edge:
            valid = q_valid[None, :] & k_valid[:, None]
            allowed = _allowed((q_pos + qm)[None, :], k_rows_pos[:, None], valid, window, CAUSAL, HAS_WINDOW)
            p_t = tl.where(allowed, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv, ds_t


@triton.jit
def _write_dq(dq, dq_base, qm64, q_valid, stride_dqs, dq_off, offs_dqk, D_QK, DQ_MODE: tl.constexpr):
    dq_ptrs = dq_base + (qm64 * stride_dqs + dq_off)[:, None] + offs_dqk[None, :]
    dq_mask = q_valid[:, None] & (offs_dqk < D_QK)[None, :]
    if DQ_MODE == 1:
        tl.atomic_add(dq_ptrs, dq, mask=dq_mask)
    else:  # the only program that sees these queries' keys: a plain store, exact and deterministic
        tl.store(dq_ptrs, dq.to(dq_base.dtype.element_ty), mask=dq_mask)


@triton.jit
def _bwd_kv_block(
    dk, dv, k, v, q_base, do_base, stat_base, LSE2, DELTA, dq_base, query, q_len, q_pos, k_rows_pos, k_valid,
    stride_qs, stride_ds, stride_dqs, pack_row, q_off, do_off, dq_off, stat_off, offs_dqk, offs_dv, D_QK, D_V,
    scale, scale_log2, window, edge, o_base, lse_base, dlse_base, stride_os, o_off, stride_ls, lse_off,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DQ_MODE: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    STATS: tl.constexpr, HAS_DLSE: tl.constexpr, STORE_DELTA: tl.constexpr,
):  # fmt: skip
    q, do, lse2, delta, qm, qm64, q_valid = _kv_step_inputs(
        q_base, do_base, stat_base, LSE2, DELTA, query, q_len, stride_qs, stride_ds, pack_row, q_off, do_off,
        stat_off, offs_dqk, offs_dv, D_QK, D_V, o_base, lse_base, dlse_base, stride_os, o_off, stride_ls, lse_off,
        MASKED > 0, EVEN_D, STATS, HAS_DLSE, STORE_DELTA,
    )  # fmt: skip
    dk, dv, ds_t = _kv_step_grads(
        dk, dv, k, v, q, do, lse2, delta, qm, q_valid, q_pos, k_rows_pos, k_valid, scale_log2, window, edge,
        MASKED, CAUSAL, HAS_WINDOW, PRECISION,
    )  # fmt: skip
    if DQ_MODE != 0:
        dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=PRECISION) * scale
        _write_dq(dq, dq_base, qm64, q_valid, stride_dqs, dq_off, offs_dqk, D_QK, DQ_MODE)
    return dk, dv


@triton.jit
def _bwd_kv_segment(
    dk, dv, k, v, q_base, do_base, stat_base, LSE2, DELTA, dq_base, q_len, q_pos, k_first, k_rows, k_rows_pos,
    k_valid, stride_qs, stride_ds, stride_dqs, pack_row, q_off, do_off, dq_off, stat_off, offs_dqk, offs_dv, D_QK,
    D_V, scale, scale_log2, window, o_base, lse_base, dlse_base, stride_os, o_off, stride_ls, lse_off,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DQ_MODE: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_D: tl.constexpr, ONE_LOOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STATS: tl.constexpr, HAS_DLSE: tl.constexpr, STORE_DELTA: tl.constexpr,
):  # fmt: skip
    """One key block against one query segment: the window-edge, interior and diagonal stretches."""
    k_last = k_first + k_rows - 1
    lo, hi, full_lo, full_hi = _visible_queries(k_first, k_last, q_len, q_pos, window, CAUSAL, HAS_WINDOW)
    # A ragged key block (fewer than BLOCK_N rows) always runs masked.
    full_hi = tl.where(k_rows < BLOCK_N, full_lo, full_hi)
    mid_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_M) * BLOCK_M
    mid_hi = mid_lo + (tl.maximum(full_hi - mid_lo, 0) // BLOCK_M) * BLOCK_M
    head_hi = tl.minimum(mid_lo, hi)
    if ONE_LOOP:
        for query in range(lo, hi, BLOCK_M):
            dk, dv = _bwd_kv_block(
                dk, dv, k, v, q_base, do_base, stat_base, LSE2, DELTA, dq_base, query, q_len, q_pos, k_rows_pos,
                k_valid, stride_qs, stride_ds, stride_dqs, pack_row, q_off, do_off, dq_off, stat_off, offs_dqk, offs_dv,
                D_QK, D_V, scale, scale_log2, window, (query < mid_lo) | (query >= mid_hi), o_base, lse_base, dlse_base,
                stride_os, o_off, stride_ls, lse_off, 2, CAUSAL, HAS_WINDOW, DQ_MODE, PRECISION, EVEN_D,
                STATS, HAS_DLSE, STORE_DELTA,
            )  # fmt: skip
    else:
        for query in range(lo, head_hi, BLOCK_M):
            dk, dv = _bwd_kv_block(
                dk, dv, k, v, q_base, do_base, stat_base, LSE2, DELTA, dq_base, query, q_len, q_pos, k_rows_pos,
                k_valid, stride_qs, stride_ds, stride_dqs, pack_row, q_off, do_off, dq_off, stat_off, offs_dqk, offs_dv,
                D_QK, D_V, scale, scale_log2, window, True, o_base, lse_base, dlse_base, stride_os, o_off,
                stride_ls, lse_off, 1, CAUSAL, HAS_WINDOW, DQ_MODE, PRECISION, EVEN_D, STATS, HAS_DLSE, STORE_DELTA,
            )  # fmt: skip
        for query in range(mid_lo, mid_hi, BLOCK_M):
            dk, dv = _bwd_kv_block(
                dk, dv, k, v, q_base, do_base, stat_base, LSE2, DELTA, dq_base, query, q_len, q_pos, k_rows_pos,
                k_valid, stride_qs, stride_ds, stride_dqs, pack_row, q_off, do_off, dq_off, stat_off, offs_dqk, offs_dv,
                D_QK, D_V, scale, scale_log2, window, False, o_base, lse_base, dlse_base, stride_os, o_off,
                stride_ls, lse_off, 0, CAUSAL, HAS_WINDOW, DQ_MODE, PRECISION, EVEN_D, STATS, HAS_DLSE, STORE_DELTA,
            )  # fmt: skip
        for query in range(tl.maximum(mid_hi, head_hi), hi, BLOCK_M):
            dk, dv = _bwd_kv_block(
                dk, dv, k, v, q_base, do_base, stat_base, LSE2, DELTA, dq_base, query, q_len, q_pos, k_rows_pos,
                k_valid, stride_qs, stride_ds, stride_dqs, pack_row, q_off, do_off, dq_off, stat_off, offs_dqk, offs_dv,
                D_QK, D_V, scale, scale_log2, window, True, o_base, lse_base, dlse_base, stride_os, o_off,
                stride_ls, lse_off, 1, CAUSAL, HAS_WINDOW, DQ_MODE, PRECISION, EVEN_D, STATS, HAS_DLSE, STORE_DELTA,
            )  # fmt: skip
    return dk, dv


@triton.jit
def _bwd_kv_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ, DK, DV, BLOCKS, SEGS, OUT, LSE, DLSE, stride_ob, stride_os, stride_oh,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    q_len_row, n_heads, group, scale, scale_log2, window, D_QK, D_V,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DQ_MODE: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr, ONE_LOOP: tl.constexpr, PACK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    STATS: tl.constexpr, HAS_DLSE: tl.constexpr, STORE_DELTA: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0)
    block = tl.program_id(1)
    row, k_start, k_rows, k_first, seg_lo, seg_hi = _block_row(BLOCKS, block)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_head = K + row * stride_kb + kv_head * stride_kh + k_start.to(tl.int64) * stride_ks
    v_head = V + row * stride_vb + kv_head * stride_vh + k_start.to(tl.int64) * stride_vs
    offs_n = tl.arange(0, BLOCK_N)
    k, v, k_valid = _load_kv(k_head, v_head, offs_n, k_rows, stride_ks, stride_vs, offs_dqk, offs_dv, D_QK, D_V, EVEN_D)
    k_rows_pos = k_first + offs_n
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # PACK > 1: a tile's rows are BLOCK_M // PACK queries x PACK heads of the group (one bigger product per step).
    pack_row = offs_m // PACK
    pack_head = (offs_m % PACK).to(tl.int64)
    q_off = pack_head * stride_qh
    do_off = pack_head * stride_dh
    dq_off = pack_head * stride_dqh
    stat_off = pack_head * q_len_row
    o_off = pack_head * stride_oh
    # The group's query heads share this K/V block: it stays in registers, dK/dV sum over them in place.
    for g in range(0, group, PACK):
        head = kv_head * group + g
        for seg in range(seg_lo, seg_hi):
            q_start = tl.load(SEGS + seg * 3).to(tl.int64)
            q_len = tl.load(SEGS + seg * 3 + 1)
            q_pos = tl.load(SEGS + seg * 3 + 2)
            token_major = (row * q_len_row + q_start) * n_heads + head  # the forward's [b, s, Hq] lse
            q_base = Q + row * stride_qb + head * stride_qh + q_start * stride_qs
            do_base = DO + row * stride_db + head * stride_dh + q_start * stride_ds
            stat_base = (row * n_heads + head) * q_len_row + q_start
            dq_base = DQ + row * stride_dqb + head * stride_dqh + q_start * stride_dqs
            o_base = OUT + row * stride_ob + head * stride_oh + q_start * stride_os
            dk, dv = _bwd_kv_segment(
                dk, dv, k, v, q_base, do_base, stat_base, LSE2, DELTA, dq_base,
                q_len, q_pos, k_first, k_rows, k_rows_pos, k_valid, stride_qs, stride_ds, stride_dqs,
                pack_row, q_off, do_off, dq_off, stat_off, offs_dqk, offs_dv, D_QK, D_V, scale, scale_log2,
                window, o_base, LSE + token_major, DLSE + token_major, stride_os, o_off, n_heads, pack_head,
                CAUSAL, HAS_WINDOW, DQ_MODE, PRECISION, EVEN_D, ONE_LOOP, BLOCK_M // PACK, BLOCK_N,
                STATS, HAS_DLSE, STORE_DELTA,
            )  # fmt: skip
    dk_head = DK + row * stride_dkb + kv_head * stride_dkh + k_start.to(tl.int64) * stride_dks
    dv_head = DV + row * stride_dvb + kv_head * stride_dvh + k_start.to(tl.int64) * stride_dvs
    _store_kv(dk_head, dv_head, dk * scale, dv, offs_n, k_valid, stride_dks, stride_dvs, offs_dqk, offs_dv, D_QK, D_V)


@triton.jit
def _load_kv(k_head, v_head, rows, k_rows, stride_ks, stride_vs, offs_dqk, offs_dv, D_QK, D_V, EVEN_D: tl.constexpr):
    """K and V rows ``rows`` of a key block (valid below ``k_rows``)."""
    valid = rows < k_rows
    rows64 = rows.to(tl.int64)
    k = _load_rows(k_head + rows64[:, None] * stride_ks + offs_dqk[None, :], valid, offs_dqk, D_QK, True, EVEN_D)
    v = _load_rows(v_head + rows64[:, None] * stride_vs + offs_dv[None, :], valid, offs_dv, D_V, True, EVEN_D)
    return k, v, valid


@triton.jit
def _store_kv(dk_head, dv_head, dk, dv, rows, valid, stride_dks, stride_dvs, offs_dqk, offs_dv, D_QK, D_V):
    rows64 = rows.to(tl.int64)
    kmask = valid[:, None] & (offs_dqk < D_QK)[None, :]
    vmask = valid[:, None] & (offs_dv < D_V)[None, :]
    tl.store(dk_head + rows64[:, None] * stride_dks + offs_dqk[None, :], dk.to(dk_head.dtype.element_ty), mask=kmask)
    tl.store(dv_head + rows64[:, None] * stride_dvs + offs_dv[None, :], dv.to(dv_head.dtype.element_ty), mask=vmask)
