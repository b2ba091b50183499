"""Flash attention (FA2-style) over segment-pair layouts: the forward kernel and the launchers.

The forward keeps, per query row, a running max ``m``, a running sum ``l`` and an fp32 accumulator, in
base-2 exponent units (``exp2`` with the scale pre-multiplied by ``log2(e)``), over the key blocks of the
segments its block is paired with (:mod:`.flash_schedule`). A segment's blocks are of three kinds: at the
window's lower edge (masked), seen whole by every row of the block (no mask arithmetic at all), and on the
causal diagonal (masked); by default one loop visits them all and masks only the edge kinds (three loops, one
per kind, keep more registers live on sm90; ``FlashConfig.one_loop=False`` selects them).

Learned sinks (GPT-OSS) join the denominator after the loop: ``l += exp(sink - m)``. The natural-log ``lse =
log(sum exp(scores) [+ e^sink])`` is stored per (token, head) in fp32 so that partial results over disjoint
key sets merge exactly and the backward (:mod:`.flash_backward`) recomputes the probabilities without storing
them.

GQA: the program of query head ``h`` reads key/value head ``h // group``; the grid puts the heads of one
query block next to each other so that a group's programs share K/V tiles through L2; with
``FlashConfig.pack_gqa`` one program takes the whole group, its tile rows being (query, head) pairs. The q/k
head dim may differ from the v head dim (MLA: 192 / 128); both are padded to powers of two inside the kernel only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.attention_layout import AttentionLayout
from mcore.kernels.dispatch import triton_interpreting
from mcore.kernels.triton.flash_configs import FlashConfig, gqa_pack, kernel_configs, longest_key_span
from mcore.kernels.triton.flash_schedule import device_blocks

LOG2E = 1.4426950408889634


def _pad_dim(d: int) -> int:
    """The power of two >= 16 a head dim is padded to in the kernels (plain Python: called on every launch)."""
    return max(16, 1 << (d - 1).bit_length())


def forward_config(head_dim_qk: int, head_dim_v: int, layout: AttentionLayout) -> FlashConfig:
    """The forward's tiles from :mod:`.flash_configs` (per head dim and longest document)."""
    return kernel_configs(head_dim_qk, head_dim_v, longest_key_span(layout), triton_interpreting()).forward


@triton.jit
def _load_rows(ptrs, rows_valid, offs_d, D, ROWS_MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, D] tile; masks the compiler cannot drop are left out where the caller knows they hold
    (interior blocks: every row valid; a head dim that is a power of two: every column valid)."""
    if ROWS_MASKED:
        if EVEN_D:
            tile = tl.load(ptrs, mask=rows_valid[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows_valid[:, None] & (offs_d < D)[None, :], other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    return tile


@triton.jit
def _block_row(BLOCKS, block):
    """One program's row of :func:`~mcore.kernels.triton.flash_schedule.build_blocks`' table: ``(batch row (int64),
    first token of the block in the packed tensor, its rows, its first position, segment range lo, hi)``."""
    base = BLOCKS + block * 6
    row = tl.load(base).to(tl.int64)
    return row, tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4), tl.load(base + 5)


@triton.jit
def _allowed(q_pos, k_pos, valid, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The causal/window rule on broadcast position tiles (either orientation: [q, k] or [k, q])."""
    allowed = valid
    if CAUSAL:
        allowed = allowed & (k_pos <= q_pos)
    if HAS_WINDOW:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


@triton.jit
def _fwd_block(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    key,
    k_len,
    k_pos,
    q_rows_pos,
    stride_ks,
    stride_vs,
    offs_n,
    offs_dqk,
    offs_dv,
    D_QK,
    D_V,
    scale_log2,
    window,
    edge,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    kn = key + offs_n
    k_valid = kn < k_len
    k = _load_rows(k_base + kn[:, None] * stride_ks + offs_dqk[None, :], k_valid, offs_dqk, D_QK, MASKED > 0, EVEN_D)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    # MASKED: 0 an interior block (no masks), 1 an edge block, 2 either (one loop): masked where `edge` says.
    if MASKED == 1:
        allowed = _allowed(q_rows_pos[:, None], (k_pos + kn)[None, :], k_valid[None, :], window, CAUSAL, HAS_WINDOW)
        scores = tl.where(allowed, scores, float("-inf"))
    if MASKED == 2:  # noqa: SIM102 (a constexpr test, then a runtime one: Triton needs them apart)
        if edge:
            allowed = _allowed(q_rows_pos[:, None], (k_pos + kn)[None, :], k_valid[None, :], window, CAUSAL, HAS_WINDOW)
            scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no key yet keeps m = -inf; shift it by 0 so that exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_base + kn[:, None] * stride_vs + offs_dv[None, :], k_valid, offs_dv, D_V, MASKED > 0, EVEN_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _visible_keys(q_first, q_last, k_len, k_pos, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Segment-local key ranges of a query block: [lo, hi) seen by some row, [full_lo, full_hi) by all rows."""
    lo = q_first * 0
    hi = lo + k_len
    full_lo = lo
    full_hi = hi
    if CAUSAL:
        hi = tl.minimum(hi, q_last - k_pos + 1)
        full_hi = tl.minimum(full_hi, q_first - k_pos + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, q_first - window + 1 - k_pos)
        full_lo = tl.maximum(full_lo, q_last - window + 1 - k_pos)
    return lo, hi, full_lo, full_hi


@triton.jit
def _fwd_kernel(
    Q, K, V, OUT, LSE, SINKS, BLOCKS, SEGS,  # fmt: skip
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    q_len_row, n_heads, group, scale_log2, window, D_QK, D_V,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr, ONE_LOOP: tl.constexpr, PACK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
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
    pack_row = offs_m // PACK  # tile row r: query pack_row[r] of the block, head `head + r % PACK`
    pack_head = offs_m % PACK
    m_valid = pack_row < q_rows
    q_tokens = (q_start + pack_row).to(tl.int64)
    q_rows_off = q_tokens * stride_qs + pack_head.to(tl.int64) * stride_qh
    q = _load_rows(Q + row * stride_qb + head * stride_qh + q_rows_off[:, None] + offs_dqk[None, :], m_valid,
                   offs_dqk, D_QK, True, EVEN_D)  # fmt: skip
    q_rows_pos = q_first + pack_row
    k_head = K + row * stride_kb + kv_head * stride_kh
    v_head = V + row * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for seg in range(seg_lo, seg_hi):
        k_start = tl.load(SEGS + seg * 3)
        k_len = tl.load(SEGS + seg * 3 + 1)
        k_pos = tl.load(SEGS + seg * 3 + 2)
        lo, hi, full_lo, full_hi = _visible_keys(q_first, q_last, k_len, k_pos, window, CAUSAL, HAS_WINDOW)
        # Blocks start at lo; the first ones straddle the window edge, then whole blocks, then the diagonal.
        mid_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N
        mid_hi = mid_lo + (tl.maximum(full_hi - mid_lo, 0) // BLOCK_N) * BLOCK_N
        head_hi = tl.minimum(mid_lo, hi)
        k_base = k_head + k_start.to(tl.int64) * stride_ks
        v_base = v_head + k_start.to(tl.int64) * stride_vs
        if ONE_LOOP:  # one loop, masks only on edge blocks: fewer live registers than three loops
            for key in range(lo, hi, BLOCK_N):
                acc, m_i, l_i = _fwd_block(
                    acc, m_i, l_i, q, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                    offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, (key < mid_lo) | (key >= mid_hi),
                    2, CAUSAL, HAS_WINDOW, PRECISION, EVEN_D,
                )  # fmt: skip
        else:
            for key in range(lo, head_hi, BLOCK_N):
                acc, m_i, l_i = _fwd_block(
                    acc, m_i, l_i, q, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                    offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, True, 1, CAUSAL, HAS_WINDOW,
                    PRECISION, EVEN_D,
                )  # fmt: skip
            for key in range(mid_lo, mid_hi, BLOCK_N):
                acc, m_i, l_i = _fwd_block(
                    acc, m_i, l_i, q, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                    offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, False, 0, CAUSAL, HAS_WINDOW,
                    PRECISION, EVEN_D,
                )  # fmt: skip
            for key in range(tl.maximum(mid_hi, head_hi), hi, BLOCK_N):
                acc, m_i, l_i = _fwd_block(
                    acc, m_i, l_i, q, k_base, v_base, key, k_len, k_pos, q_rows_pos, stride_ks, stride_vs,
                    offs_n, offs_dqk, offs_dv, D_QK, D_V, scale_log2, window, True, 1, CAUSAL, HAS_WINDOW,
                    PRECISION, EVEN_D,
                )  # fmt: skip

    if HAS_SINKS:
        sink = tl.load(SINKS + head + pack_head).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
        m_i = m_fin
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    out_rows_off = q_tokens * stride_os + pack_head.to(tl.int64) * stride_oh
    tl.store(
        OUT + row * stride_ob + head * stride_oh + out_rows_off[:, None] + offs_dv[None, :],
        out.to(OUT.dtype.element_ty),
        mask=m_valid[:, None] & (offs_dv < D_V)[None, :],
    )
    tl.store(LSE + (row * q_len_row + q_tokens) * n_heads + head + pack_head, lse, mask=m_valid)


def even_dims(d_qk: int, d_v: int) -> bool:
    """Both head dims are their padded block width: no column masks in the kernels."""
    return _pad_dim(d_qk) == d_qk and _pad_dim(d_v) == d_v


def precision_for(dtype: torch.dtype) -> str:
    """fp32/fp64 inputs (tests) multiply exactly; bf16/fp16 use the tensor cores' native products."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    softmax_scale: float,
    sinks: torch.Tensor | None,
    config: FlashConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, s, Hq, Dv], lse [b, s, Hq] fp32)`` of attention over ``layout``; inputs need a unit last stride.
    ``config`` overrides the tiles of :mod:`.flash_configs` (the benchmark's sweep)."""
    b, s, n_heads, d_qk = q.shape
    d_v = v.shape[-1]
    config = config or forward_config(d_qk, d_v, layout)
    pack = gqa_pack(config, n_heads // k.shape[2], config.block_m)
    blocks, segments = device_blocks(layout, "q", config.block_m // pack, q.device)
    covered = layout.covers_all("q")
    alloc = torch.empty if covered else torch.zeros
    out = alloc(b, s, n_heads, d_v, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, s, n_heads, device=q.device, dtype=torch.float32)
    if not covered:  # rows in no pair see nothing but the sink: output 0, lse = sink (or -inf)
        lse.copy_(sinks.float().expand_as(lse)) if sinks is not None else lse.fill_(float("-inf"))
    if blocks.shape[0] == 0:
        return out, lse
    grid = (n_heads // pack, blocks.shape[0])
    _fwd_kernel[grid](
        q, k, v, out, lse, sinks if sinks is not None else lse, blocks, segments,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        s, n_heads, n_heads // k.shape[2], softmax_scale * LOG2E, layout.window_size or 0, d_qk, d_v,
        CAUSAL=layout.causal, HAS_WINDOW=layout.window_size is not None, HAS_SINKS=sinks is not None,
        PRECISION=precision_for(q.dtype), EVEN_D=even_dims(d_qk, d_v), ONE_LOOP=config.one_loop,
        PACK=pack, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_DQK=_pad_dim(d_qk), BLOCK_DV=_pad_dim(d_v), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out, lse
