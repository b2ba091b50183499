"""The dQ kernel of the flash-attention backward (launched by :mod:`.flash_backward`, which explains it): one
program per (query block, head or packed GQA heads) walks the key blocks its queries see, in a fixed order
(deterministic). Run before the dK/dV kernel, it also computes the row statistics (lse2, delta) and stores them
for that kernel (``STATS=1``)."""

from __future__ import annotations

import triton
import triton.language as tl

from mcore.kernels.triton.flash_attention import _allowed, _block_row, _load_rows, _visible_keys
from mcore.kernels.triton.flash_backward_kernels import _load_stats, _row_stats


@triton.jit
def _bwd_q_block(
    dq, q, do, lse2, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
    offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, edge,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    kn = key + offs_n
    k_valid = kn < k_len
    k = _load_rows(k_base + kn[:, None] * stride_ks + offs_dqk[None, :], k_valid, offs_dqk, D_QK, MASKED > 0, EVEN_D)
    v = _load_rows(v_base + kn[:, None] * stride_vs + offs_dv[None, :], k_valid, offs_dv, D_V, MASKED > 0, EVEN_D)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    p = tl.exp2(scores - lse2[:, None])
    if MASKED == 1:
        p = tl.where(_allowed(q_rows_pos[:, None], (k_pos + kn)[None, :], k_valid[None, :], window, CAUSAL,
                              HAS_WINDOW), p, 0.0)  # fmt: skip
    if MASKED == 2:  # noqa: SIM102 (a constexpr test, then a runtime one: Triton needs them apart)
        if edge:
            allowed = _allowed(q_rows_pos[:, None], (k_pos + kn)[None, :], k_valid[None, :], window, CAUSAL, HAS_WINDOW)
            p = tl.where(allowed, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)


@triton.jit
def _bwd_q_segment(
    dq, q, do, lse2, delta, k_base, v_base, k_len, k_pos, q_first, q_last, q_rows_pos, stride_ks, stride_vs,
    offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    ONE_LOOP: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One query block against one key segment: the window-edge, interior and diagonal stretches."""
    lo, hi, full_lo, full_hi = _visible_keys(q_first, q_last, k_len, k_pos, window, CAUSAL, HAS_WINDOW)
    mid_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N
    mid_hi = mid_lo + (tl.maximum(full_hi - mid_lo, 0) // BLOCK_N) * BLOCK_N
    head_hi = tl.minimum(mid_lo, hi)
    if ONE_LOOP:
        for key in range(lo, hi, BLOCK_N):
            dq = _bwd_q_block(
                dq, q, do, lse2, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, (key < mid_lo) | (key >= mid_hi), 2,
                CAUSAL, HAS_WINDOW, PRECISION, EVEN_D,
            )  # fmt: skip
    else:
        for key in range(lo, head_hi, BLOCK_N):
            dq = _bwd_q_block(
                dq, q, do, lse2, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, True, 1, CAUSAL, HAS_WINDOW,
                PRECISION, EVEN_D,
            )  # fmt: skip
        for key in range(mid_lo, mid_hi, BLOCK_N):
            dq = _bwd_q_block(
                dq, q, do, lse2, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, False, 0, CAUSAL, HAS_WINDOW,
                PRECISION, EVEN_D,
            )  # fmt: skip
        for key in range(tl.maximum(mid_hi, head_hi), hi, BLOCK_N):
            dq = _bwd_q_block(
                dq, q, do, lse2, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, True, 1, CAUSAL, HAS_WINDOW,
                PRECISION, EVEN_D,
            )  # fmt: skip
    return dq


@triton.jit
def _bwd_q_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ, BLOCKS, SEGS, OUT, LSE, DLSE, stride_ob, stride_os, stride_oh,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
    q_len_row, n_heads, group, scale, scale_log2, window, D_QK, D_V,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    ONE_LOOP: tl.constexpr, PACK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    STATS: tl.constexpr, HAS_DLSE: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0) * PACK  # the first of PACK heads (of one GQA group) whose rows share the tile
    block = tl.program_id(1)
    kv_head = head // group
    row, q_start, q_rows, q_first, seg_lo, seg_hi = _block_row(BLOCKS, block)
    q_last = q_first + q_rows - 1
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    pack_row = offs_m // PACK  # tile row r: query pack_row[r] of the block, head head + r % PACK
    pack_head = (offs_m % PACK).to(tl.int64)
    m_valid = pack_row < q_rows
    q_tokens = (q_start + pack_row).to(tl.int64)
    q_rows_off = q_tokens * stride_qs + pack_head * stride_qh
    do_rows_off = q_tokens * stride_ds + pack_head * stride_dh
    do = _load_rows(DO + row * stride_db + head * stride_dh + do_rows_off[:, None] + offs_dv[None, :], m_valid,
                    offs_dv, D_V, True, EVEN_D)  # fmt: skip
    stat_base = (row * n_heads + head) * q_len_row + pack_head * q_len_row
    if STATS == 0:  # STATS_LOAD
        lse2, delta = _load_stats(LSE2, DELTA, stat_base, q_tokens, m_valid, True)
    else:  # STATS_FUSED: computed here, once per (query, head), and stored for the dK/dV kernel that runs next
        o_rows_off = q_tokens * stride_os + pack_head * stride_oh
        o_ptrs = OUT + row * stride_ob + head * stride_oh + o_rows_off[:, None] + offs_dv[None, :]
        token_major = (row * q_len_row + q_tokens) * n_heads + head + pack_head
        lse2, delta = _row_stats(o_ptrs, do, LSE + token_major, DLSE + token_major, m_valid, offs_dv, D_V, True,
                                 EVEN_D, HAS_DLSE)  # fmt: skip
        tl.store(LSE2 + stat_base + q_tokens, lse2, mask=m_valid)
        tl.store(DELTA + stat_base + q_tokens, delta, mask=m_valid)
    # Q after the statistics: the output tile they read is dead by then (fewer live registers).
    q = _load_rows(Q + row * stride_qb + head * stride_qh + q_rows_off[:, None] + offs_dqk[None, :], m_valid,
                   offs_dqk, D_QK, True, EVEN_D)  # fmt: skip
    q_rows_pos = q_first + pack_row
    k_head = K + row * stride_kb + kv_head * stride_kh
    v_head = V + row * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
    for seg in range(seg_lo, seg_hi):
        k_start = tl.load(SEGS + seg * 3).to(tl.int64)
        k_len = tl.load(SEGS + seg * 3 + 1)
        k_pos = tl.load(SEGS + seg * 3 + 2)
        dq = _bwd_q_segment(
            dq, q, do, lse2, delta, k_head + k_start * stride_ks, v_head + k_start * stride_vs, k_len, k_pos,
            q_first, q_last, q_rows_pos, stride_ks, stride_vs, offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2,
            window, CAUSAL, HAS_WINDOW, PRECISION, EVEN_D, ONE_LOOP, BLOCK_N,
        )  # fmt: skip
    qmask = m_valid[:, None] & (offs_dqk < D_QK)[None, :]
    dq_rows_off = q_tokens * stride_dqs + pack_head * stride_dqh
    dq_ptrs = DQ + row * stride_dqb + head * stride_dqh + dq_rows_off[:, None] + offs_dqk[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=qmask)
