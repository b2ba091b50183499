"""Backward of the flash-attention kernels: preprocess, dK/dV over query blocks, and dQ.

With ``P = exp(S - lse)`` recomputed from the forward's log-sum-exp (``lse`` stays the whole row's, so
the same kernels give the gradients of one key block of a ring step):

- preprocess: ``delta = rowsum(dO * O) - dlse`` per (token, head), fp32 (``dlse`` is the gradient reaching
  a returned log-sum-exp, zero otherwise);
- dK/dV: one program per (key/value head, key block) walks every query block that sees it, for all query
  heads of its GQA group: ``dV += P^T dO``, ``dS = P * (dO V^T - delta)``, ``dK += dS^T Q``. Each key block
  is owned by one program, so dK/dV need no atomics and the sum over the group's heads is in registers;
- dQ: ``dQ = dS K`` either in its own kernel over key blocks (deterministic: fixed summation order) or
  added by the dK/dV programs with fp32 atomics (faster, summation order varies between runs);
- sinks: ``d sink_h = -sum_i exp(sink_h - lse_i) * delta_i`` (the sink column has no value).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mcore.kernels.attention_layout import AttentionLayout
from mcore.kernels.dispatch import triton_interpreting
from mcore.kernels.triton.flash_attention import LOG2E, FlashConfig, _pad_dim, _visible_keys, precision_for
from mcore.kernels.triton.flash_schedule import device_blocks


@functools.cache
def backward_configs(head_dim_qk: int, head_dim_v: int, interpreting: bool) -> tuple[FlashConfig, FlashConfig]:
    """(dK/dV, dQ) tiles: the dK/dV program holds two fp32 [keys, D] accumulators, so its key block is half
    the forward's for D = 128 and a quarter of it for wider heads."""
    if interpreting:
        return FlashConfig(16, 16, 1, 1), FlashConfig(16, 16, 1, 1)
    widest = max(head_dim_qk, head_dim_v)
    if widest <= 64:
        return FlashConfig(128, 64, 8, 2), FlashConfig(128, 64, 4, 2)
    if widest <= 128:
        return FlashConfig(64, 64, 8, 2), FlashConfig(128, 64, 8, 2)
    return FlashConfig(64, 32, 8, 1), FlashConfig(64, 32, 8, 1)


@triton.jit
def _preprocess_kernel(
    OUT, DO, DLSE, DELTA, stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
    s, n_heads, D_V, HAS_DLSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (tokens < s)[:, None] & (offs_d < D_V)[None, :]
    t64 = tokens.to(tl.int64)
    o = tl.load(OUT + row * stride_ob + head * stride_oh + t64[:, None] * stride_os + offs_d[None, :], mask=mask)
    do = tl.load(DO + row * stride_db + head * stride_dh + t64[:, None] * stride_ds + offs_d[None, :], mask=mask)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    index = (row * s + t64) * n_heads + head
    if HAS_DLSE:
        delta -= tl.load(DLSE + index, mask=tokens < s, other=0.0)
    tl.store(DELTA + index, delta, mask=tokens < s)


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
def _bwd_kv_block(
    dk, dv, k, v, q_base, do_base, stat_base, LSE, DELTA, DQ, query, q_len, q_pos, k_rows_pos, k_valid,
    stride_qs, stride_ds, stride_dqs, n_heads, offs_m, offs_dqk, offs_dv, D_QK, D_V, scale, scale_log2, window,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    qm = query + offs_m
    q_valid = qm < q_len
    qm64 = qm.to(tl.int64)
    q = tl.load(
        q_base + qm64[:, None] * stride_qs + offs_dqk[None, :], mask=q_valid[:, None] & (offs_dqk < D_QK)[None, :]
    )
    do = tl.load(
        do_base + qm64[:, None] * stride_ds + offs_dv[None, :], mask=q_valid[:, None] & (offs_dv < D_V)[None, :]
    )
    # Rows outside the block, or that saw nothing in the forward (lse = -inf), get P = 0 from lse = +inf.
    lse = tl.load(LSE + stat_base + qm64 * n_heads, mask=q_valid, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + stat_base + qm64 * n_heads, mask=q_valid, other=0.0)
    scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
    p_t = tl.exp2(scores_t - lse[None, :])
    if MASKED:
        q_rows_pos = q_pos + qm
        allowed = q_valid[None, :] & k_valid[:, None]
        if CAUSAL:
            allowed = allowed & (k_rows_pos[:, None] <= q_rows_pos[None, :])
        if HAS_WINDOW:
            allowed = allowed & (k_rows_pos[:, None] > q_rows_pos[None, :] - window)
        p_t = tl.where(allowed, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=PRECISION) * scale
        tl.atomic_add(
            DQ + qm64[:, None] * stride_dqs + offs_dqk[None, :], dq, mask=q_valid[:, None] & (offs_dqk < D_QK)[None, :]
        )
    return dk, dv


@triton.jit
def _bwd_kv_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, BLOCKS, SEGS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    q_len_row, n_heads, group, scale, scale_log2, window, D_QK, D_V,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(BLOCKS + block * 6).to(tl.int64)
    k_start = tl.load(BLOCKS + block * 6 + 1)
    k_rows = tl.load(BLOCKS + block * 6 + 2)
    k_first = tl.load(BLOCKS + block * 6 + 3)
    seg_lo = tl.load(BLOCKS + block * 6 + 4)
    seg_hi = tl.load(BLOCKS + block * 6 + 5)
    k_last = k_first + k_rows - 1
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_valid = offs_n < k_rows
    k_tokens = (k_start + offs_n).to(tl.int64)
    kmask = k_valid[:, None] & (offs_dqk < D_QK)[None, :]
    vmask = k_valid[:, None] & (offs_dv < D_V)[None, :]
    k = tl.load(
        K + row * stride_kb + kv_head * stride_kh + k_tokens[:, None] * stride_ks + offs_dqk[None, :], mask=kmask
    )
    v = tl.load(
        V + row * stride_vb + kv_head * stride_vh + k_tokens[:, None] * stride_vs + offs_dv[None, :], mask=vmask
    )
    k_rows_pos = k_first + offs_n
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, group):
        head = kv_head * group + g
        for seg in range(seg_lo, seg_hi):
            q_start = tl.load(SEGS + seg * 3).to(tl.int64)
            q_len = tl.load(SEGS + seg * 3 + 1)
            q_pos = tl.load(SEGS + seg * 3 + 2)
            lo, hi, full_lo, full_hi = _visible_queries(k_first, k_last, q_len, q_pos, window, CAUSAL, HAS_WINDOW)
            # A ragged key block (fewer than BLOCK_N rows) always runs masked.
            full_hi = tl.where(k_rows < BLOCK_N, full_lo, full_hi)
            mid_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_M) * BLOCK_M
            mid_hi = mid_lo + (tl.maximum(full_hi - mid_lo, 0) // BLOCK_M) * BLOCK_M
            head_hi = tl.minimum(mid_lo, hi)
            q_base = Q + row * stride_qb + head * stride_qh + q_start * stride_qs
            do_base = DO + row * stride_db + head * stride_dh + q_start * stride_ds
            dq_base = DQ + row * stride_dqb + head * stride_dqh + q_start * stride_dqs
            stat_base = (row * q_len_row + q_start) * n_heads + head
            for query in range(lo, head_hi, BLOCK_M):
                dk, dv = _bwd_kv_block(
                    dk, dv, k, v, q_base, do_base, stat_base, LSE, DELTA, dq_base, query, q_len, q_pos, k_rows_pos,
                    k_valid, stride_qs, stride_ds, stride_dqs, n_heads, offs_m, offs_dqk, offs_dv, D_QK, D_V, scale,
                    scale_log2, window, True, CAUSAL, HAS_WINDOW, ATOMIC_DQ, PRECISION,
                )  # fmt: skip
            for query in range(mid_lo, mid_hi, BLOCK_M):
                dk, dv = _bwd_kv_block(
                    dk, dv, k, v, q_base, do_base, stat_base, LSE, DELTA, dq_base, query, q_len, q_pos, k_rows_pos,
                    k_valid, stride_qs, stride_ds, stride_dqs, n_heads, offs_m, offs_dqk, offs_dv, D_QK, D_V, scale,
                    scale_log2, window, False, CAUSAL, HAS_WINDOW, ATOMIC_DQ, PRECISION,
                )  # fmt: skip
            for query in range(tl.maximum(mid_hi, head_hi), hi, BLOCK_M):
                dk, dv = _bwd_kv_block(
                    dk, dv, k, v, q_base, do_base, stat_base, LSE, DELTA, dq_base, query, q_len, q_pos, k_rows_pos,
                    k_valid, stride_qs, stride_ds, stride_dqs, n_heads, offs_m, offs_dqk, offs_dv, D_QK, D_V, scale,
                    scale_log2, window, True, CAUSAL, HAS_WINDOW, ATOMIC_DQ, PRECISION,
                )  # fmt: skip
    dk_ptrs = DK + row * stride_dkb + kv_head * stride_dkh + k_tokens[:, None] * stride_dks + offs_dqk[None, :]
    dv_ptrs = DV + row * stride_dvb + kv_head * stride_dvh + k_tokens[:, None] * stride_dvs + offs_dv[None, :]
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=vmask)


@triton.jit
def _bwd_q_block(
    dq, q, do, lse, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
    offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    kn = key + offs_n
    k_valid = kn < k_len
    k = tl.load(
        k_base + kn[:, None] * stride_ks + offs_dqk[None, :], mask=k_valid[:, None] & (offs_dqk < D_QK)[None, :]
    )
    v = tl.load(v_base + kn[:, None] * stride_vs + offs_dv[None, :], mask=k_valid[:, None] & (offs_dv < D_V)[None, :])
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    p = tl.exp2(scores - lse[:, None])
    if MASKED:
        k_rows_pos = k_pos + kn
        allowed = k_valid[None, :]
        if CAUSAL:
            allowed = allowed & (k_rows_pos[None, :] <= q_rows_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (k_rows_pos[None, :] > q_rows_pos[:, None] - window)
        p = tl.where(allowed, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)


@triton.jit
def _bwd_q_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, BLOCKS, SEGS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
    q_len_row, n_heads, group, scale, scale_log2, window, D_QK, D_V,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    block = tl.program_id(1)
    kv_head = head // group
    row = tl.load(BLOCKS + block * 6).to(tl.int64)
    q_start = tl.load(BLOCKS + block * 6 + 1)
    q_rows = tl.load(BLOCKS + block * 6 + 2)
    q_first = tl.load(BLOCKS + block * 6 + 3)
    seg_lo = tl.load(BLOCKS + block * 6 + 4)
    seg_hi = tl.load(BLOCKS + block * 6 + 5)
    q_last = q_first + q_rows - 1
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < q_rows
    q_tokens = (q_start + offs_m).to(tl.int64)
    qmask = m_valid[:, None] & (offs_dqk < D_QK)[None, :]
    q = tl.load(Q + row * stride_qb + head * stride_qh + q_tokens[:, None] * stride_qs + offs_dqk[None, :], mask=qmask)
    do = tl.load(
        DO + row * stride_db + head * stride_dh + q_tokens[:, None] * stride_ds + offs_dv[None, :],
        mask=m_valid[:, None] & (offs_dv < D_V)[None, :],
    )
    stats = (row * q_len_row + q_tokens) * n_heads + head
    lse = tl.load(LSE + stats, mask=m_valid, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + stats, mask=m_valid, other=0.0)
    q_rows_pos = q_first + offs_m
    k_head = K + row * stride_kb + kv_head * stride_kh
    v_head = V + row * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
    for seg in range(seg_lo, seg_hi):
        k_start = tl.load(SEGS + seg * 3).to(tl.int64)
        k_len = tl.load(SEGS + seg * 3 + 1)
        k_pos = tl.load(SEGS + seg * 3 + 2)
        lo, hi, full_lo, full_hi = _visible_keys(q_first, q_last, k_len, k_pos, window, CAUSAL, HAS_WINDOW)
        mid_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N
        mid_hi = mid_lo + (tl.maximum(full_hi - mid_lo, 0) // BLOCK_N) * BLOCK_N
        head_hi = tl.minimum(mid_lo, hi)
        k_base = k_head + k_start * stride_ks
        v_base = v_head + k_start * stride_vs
        for key in range(lo, head_hi, BLOCK_N):
            dq = _bwd_q_block(
                dq, q, do, lse, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, True, CAUSAL, HAS_WINDOW, PRECISION,
            )  # fmt: skip
        for key in range(mid_lo, mid_hi, BLOCK_N):
            dq = _bwd_q_block(
                dq, q, do, lse, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, False, CAUSAL, HAS_WINDOW, PRECISION,
            )  # fmt: skip
        for key in range(tl.maximum(mid_hi, head_hi), hi, BLOCK_N):
            dq = _bwd_q_block(
                dq, q, do, lse, delta, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, True, CAUSAL, HAS_WINDOW, PRECISION,
            )  # fmt: skip
    dq_ptrs = DQ + row * stride_dqb + head * stride_dqh + q_tokens[:, None] * stride_dqs + offs_dqk[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=qmask)


def _delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    b, s, n_heads, d_v = out.shape
    delta = torch.empty(b, s, n_heads, device=out.device, dtype=torch.float32)
    block_t = 16 if triton_interpreting() else 64
    grid = (n_heads, triton.cdiv(s, block_t), b)
    _preprocess_kernel[grid](
        out, dout, dlse if dlse is not None else delta, delta, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), s, n_heads, d_v,
        HAS_DLSE=dlse is not None, BLOCK_T=block_t, BLOCK_DV=_pad_dim(d_v),
    )  # fmt: skip
    return delta


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [stride for t in tensors for stride in t.stride()[:3]]


def flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    layout: AttentionLayout,
    softmax_scale: float,
    sinks: torch.Tensor | None,
    *,
    dlse: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dsinks)`` of :func:`~.flash_attention.flash_forward`; ``lse`` is the row's full one."""
    b, s, n_heads, d_qk = q.shape
    n_kv, d_v = k.shape[2], v.shape[-1]
    kv_config, q_config = backward_configs(d_qk, d_v, triton_interpreting())
    delta = _delta(out, dout, None if dlse is None else dlse.contiguous())
    alloc_k = torch.empty if layout.covers_all("k") else torch.zeros
    dk, dv = alloc_k(k.shape, device=q.device, dtype=k.dtype), alloc_k(v.shape, device=q.device, dtype=v.dtype)
    if deterministic:
        dq = (torch.empty if layout.covers_all("q") else torch.zeros)(q.shape, device=q.device, dtype=q.dtype)
    else:
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    common = dict(
        CAUSAL=layout.causal, HAS_WINDOW=layout.window_size is not None, PRECISION=precision_for(q.dtype),
        BLOCK_DQK=_pad_dim(d_qk), BLOCK_DV=_pad_dim(d_v),
    )  # fmt: skip
    scalars = (s, n_heads, n_heads // n_kv, softmax_scale, softmax_scale * LOG2E, layout.window_size or 0, d_qk, d_v)
    blocks, segments = device_blocks(layout, "k", kv_config.block_m, q.device)
    if blocks.shape[0]:
        _bwd_kv_kernel[(n_kv, blocks.shape[0])](
            q, k, v, dout, lse, delta, dq, dk, dv, blocks, segments, *_strides(q, k, v, dout, dq, dk, dv), *scalars,
            ATOMIC_DQ=not deterministic, BLOCK_M=kv_config.block_n, BLOCK_N=kv_config.block_m,
            num_warps=kv_config.num_warps, num_stages=kv_config.num_stages, **common,
        )  # fmt: skip
    if deterministic:
        blocks, segments = device_blocks(layout, "q", q_config.block_m, q.device)
        if blocks.shape[0]:
            _bwd_q_kernel[(n_heads, blocks.shape[0])](
                q, k, v, dout, lse, delta, dq, blocks, segments, *_strides(q, k, v, dout, dq), *scalars,
                BLOCK_M=q_config.block_m, BLOCK_N=q_config.block_n,
                num_warps=q_config.num_warps, num_stages=q_config.num_stages, **common,
            )  # fmt: skip
    dsinks = None
    if sinks is not None:
        # Rows in no pair kept lse = -inf (and delta = 0): their sink probability is taken as 0.
        p_sink = torch.exp(sinks.float()[None, None, :] - lse.clamp_min(torch.finfo(torch.float32).min))
        dsinks = (-(p_sink * delta).sum(dim=(0, 1))).to(sinks.dtype)
    return dq.to(q.dtype), dk, dv, dsinks
