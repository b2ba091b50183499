"""Triton kernel applying rotate-half rotary embeddings to q and k in one launch, forward and backward.

Each program takes a block of tokens (the leading dims of q, viewed as ``[A, B]`` and flattened): it
loads their cos/sin rows once and rotates every q head and every k head with them, in head blocks. Inputs, outputs
and cos/sin are addressed through their strides, so ``[s, b, H, D]`` tensors passed as
``transpose(0, 1)`` views and heads sliced out of a fused QKV projection need no copy; only the last
dim must be contiguous.

With ``x = [x1, x2]`` (halves), ``cos = [c1, c2]`` and ``sin = [s1, s2]`` the forward computes
``[x1*c1 - x2*s1, x2*c2 + x1*s2]`` (``x*cos + rotate_half(x)*sin``). Its transpose, the backward, is
``[g1*c1 + g2*s2, g2*c2 - g1*s1]``: the same kernel with ``(s1, s2)`` replaced by ``(-s2, -s1)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton._common import next_power_of_2, num_warps_for, rows_per_tile

# q (or k) values one program rotates per step, both halves counted. Swept 2K-16K on an H200: small
# tiles (16 heads of 128 per step, 4 warps) win, 83% of copy bandwidth at Llama-8B shapes.
ROTARY_TILE_ELEMENTS = 2048


@triton.jit
def _rotate_heads(
    X,
    OUT,
    x_offsets,
    out_offsets,
    token_mask,
    stride_xh,
    stride_oh,
    n_heads,
    half,
    c1,
    c2,
    sa,
    sb,
    BLOCK_H: tl.constexpr,
    BLOCK_D2: tl.constexpr,
):
    """Rotate ``[tokens, heads, D]``: tiles are ``[BLOCK_T, BLOCK_H, BLOCK_D2]`` for each half of D."""
    d = tl.arange(0, BLOCK_D2)
    d_mask = d < half
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = token_mask[:, None, None] & (h < n_heads)[None, :, None] & d_mask[None, None, :]
        x_ptr = X + x_offsets[:, None, None] + h[None, :, None] * stride_xh + d[None, None, :]
        o_ptr = OUT + out_offsets[:, None, None] + h[None, :, None] * stride_oh + d[None, None, :]
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c1[:, None, :] - x2 * sa[:, None, :]
        y2 = x2 * c2[:, None, :] + x1 * sb[:, None, :]
        tl.store(o_ptr, y1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_ptr + half, y2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,
    K,
    COS,
    SIN,
    QO,
    KO,
    n_tokens,
    size_b,
    stride_qa,
    stride_qb,
    stride_qh,
    stride_ka,
    stride_kb,
    stride_kh,
    stride_ca,
    stride_cb,
    stride_sa,
    stride_sb,
    stride_qoa,
    stride_qob,
    stride_qoh,
    stride_koa,
    stride_kob,
    stride_koh,
    n_heads_q,
    n_heads_k,
    half,
    BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D2: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens
    a = tokens // size_b
    b = tokens % size_b
    d = tl.arange(0, BLOCK_D2)
    table_mask = token_mask[:, None] & (d < half)[None, :]
    cos_ptr = COS + (a * stride_ca + b * stride_cb)[:, None] + d[None, :]
    sin_ptr = SIN + (a * stride_sa + b * stride_sb)[:, None] + d[None, :]
    c1 = tl.load(cos_ptr, mask=table_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + half, mask=table_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr, mask=table_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + half, mask=table_mask, other=0.0).to(tl.float32)
    if BACKWARD:
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2
    _rotate_heads(
        Q,
        QO,
        a * stride_qa + b * stride_qb,
        a * stride_qoa + b * stride_qob,
        token_mask,
        stride_qh,
        stride_qoh,
        n_heads_q,
        half,
        c1,
        c2,
        sa,
        sb,
        BLOCK_H=BLOCK_HQ,
        BLOCK_D2=BLOCK_D2,
    )
    _rotate_heads(
        K,
        KO,
        a * stride_ka + b * stride_kb,
        a * stride_koa + b * stride_kob,
        token_mask,
        stride_kh,
        stride_koh,
        n_heads_k,
        half,
        c1,
        c2,
        sa,
        sb,
        BLOCK_H=BLOCK_HK,
        BLOCK_D2=BLOCK_D2,
    )


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _with_two_leading_dims(t: torch.Tensor, n_leading: int) -> torch.Tensor:
    """View ``t`` (``n_leading`` leading dims, then its own trailing dims) with exactly two leading dims."""
    if n_leading <= 2:
        return t.reshape((1,) * (2 - n_leading) + tuple(t.shape))
    return t.reshape((-1,) + tuple(t.shape[n_leading - 1 :]))


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [..., Hq, D]`` and ``k [..., Hk, D]`` by ``cos``/``sin`` (already broadcastable to ``[..., D]``).

    ``backward=True`` applies the transposed (inverse) rotation, which maps output gradients to input
    gradients. Returns new tensors in q's and k's dtypes.
    """
    leading = tuple(q.shape[:-2])
    n_leading = len(leading)
    head_dim = q.shape[-1]
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    cos = _unit_last_stride(cos.expand(leading + (head_dim,)))
    sin = _unit_last_stride(sin.expand(leading + (head_dim,)))
    if n_leading <= 2:
        # Reshapes below only add unit dims, so these stay views of outputs laid out like the inputs.
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    q4, k4 = _with_two_leading_dims(q, n_leading), _with_two_leading_dims(k, n_leading)
    qo4, ko4 = _with_two_leading_dims(q_out, n_leading), _with_two_leading_dims(k_out, n_leading)
    cos3, sin3 = _with_two_leading_dims(cos, n_leading), _with_two_leading_dims(sin, n_leading)
    size_a, size_b, n_heads_q, _ = q4.shape
    n_heads_k = k4.shape[2]
    half = head_dim // 2
    block_d2 = next_power_of_2(half)
    head_block_cap = max(1, ROTARY_TILE_ELEMENTS // (2 * block_d2))
    block_hq = min(next_power_of_2(n_heads_q), head_block_cap)
    block_hk = min(next_power_of_2(n_heads_k), head_block_cap)
    n_tokens = size_a * size_b
    block_t = rows_per_tile(n_tokens, 2 * block_d2 * max(block_hq, block_hk), ROTARY_TILE_ELEMENTS)
    grid = (triton.cdiv(n_tokens, block_t),)
    _rotary_kernel[grid](
        q4,
        k4,
        cos3,
        sin3,
        qo4,
        ko4,
        n_tokens,
        size_b,
        q4.stride(0),
        q4.stride(1),
        q4.stride(2),
        k4.stride(0),
        k4.stride(1),
        k4.stride(2),
        cos3.stride(0),
        cos3.stride(1),
        sin3.stride(0),
        sin3.stride(1),
        qo4.stride(0),
        qo4.stride(1),
        qo4.stride(2),
        ko4.stride(0),
        ko4.stride(1),
        ko4.stride(2),
        n_heads_q,
        n_heads_k,
        half,
        BACKWARD=backward,
        BLOCK_T=block_t,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_D2=block_d2,
        num_warps=num_warps_for(2 * block_t * max(block_hq, block_hk) * block_d2),
    )
    return q_out, k_out
