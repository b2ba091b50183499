"""Triton kernels of the document-aware causal depthwise conv1d + SiLU, forward and backward.

``x`` is channels-last ``[batch, seqlen, dim]`` (contiguous), ``weight`` ``[dim, k]``. Each program handles a
``BLOCK_L x BLOCK_D`` tile (positions x channels) of one row; the ``k`` taps are a static loop, and a tap whose
source is before the row start or in another document (``seq_idx`` differs) reads 0. Math is fp32 in registers.

Backward is one pass: per tile, ``dx[s] = sum_j w[j] * dpre[s + k - 1 - j]`` (same document) with
``dpre = dy * silu'(pre)`` recomputed at each shifted position from ``x`` (its loads hit the cache: cheaper than
writing and re-reading an fp32 ``dpre``), and the tile's partial sums of ``dw`` and ``dbias``, which torch adds up
over tiles (deterministic: no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_L, BLOCK_D = 32, 64


@triton.jit
def _pre_activation(X, W, BIAS, SEQ, b, offs_l, offs_d, L, D, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
                    K: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    mask_l, mask_d = offs_l < L, offs_d < D
    acc = tl.zeros((BL, BD), dtype=tl.float32)
    if HAS_SEQ:
        seq_t = tl.load(SEQ + b * L + offs_l, mask=mask_l, other=-1)
    for j in tl.static_range(K):
        src = offs_l - (K - 1) + j
        valid = (src >= 0) & mask_l
        if HAS_SEQ:
            seq_s = tl.load(SEQ + b * L + src, mask=valid, other=-2)
            valid = valid & (seq_s == seq_t)
        xv = tl.load(X + (b * L + src[:, None]) * D + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
        w = tl.load(W + offs_d * K + j, mask=mask_d, other=0.0)
        acc += xv.to(tl.float32) * w.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(X, W, BIAS, SEQ, OUT, L, D, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
                     K: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    offs_l = tl.program_id(1) * BL + tl.arange(0, BL)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    acc = _pre_activation(X, W, BIAS, SEQ, b, offs_l, offs_d, L, D, HAS_BIAS, HAS_SEQ, K, BL, BD)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    mask = (offs_l < L)[:, None] & (offs_d < D)[None, :]
    tl.store(OUT + (b * L + offs_l[:, None]) * D + offs_d[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dpre(X, W, BIAS, SEQ, DY, b, offs_t, offs_d, L, D, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
          SILU: tl.constexpr, K: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """``dy * silu'(pre)`` (fp32) at positions ``offs_t`` (0 outside the row), the pre-activation recomputed."""
    mask = (offs_t < L)[:, None] & (offs_d < D)[None, :]
    dy = tl.load(DY + (b * L + offs_t[:, None]) * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre_activation(X, W, BIAS, SEQ, b, offs_t, offs_d, L, D, HAS_BIAS, HAS_SEQ, K, BL, BD)
        sig = tl.sigmoid(pre)
        dy = dy * sig * (1.0 + pre * (1.0 - sig))
    return dy


@triton.jit
def _conv_bwd_kernel(X, W, BIAS, SEQ, DY, DX, DW_PART, DB_PART, L, D, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
                     SILU: tl.constexpr, K: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    b, pid_l = tl.program_id(0), tl.program_id(1)
    offs_l = pid_l * BL + tl.arange(0, BL)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    mask_l, mask_d = offs_l < L, offs_d < D
    mask = mask_l[:, None] & mask_d[None, :]
    if HAS_SEQ:
        seq_here = tl.load(SEQ + b * L + offs_l, mask=mask_l, other=-1)
    dx = tl.zeros((BL, BD), dtype=tl.float32)
    dpre_here = _dpre(X, W, BIAS, SEQ, DY, b, offs_l, offs_d, L, D, HAS_BIAS, HAS_SEQ, SILU, K, BL, BD)
    part = (b * tl.num_programs(1) + pid_l) * K
    for j in tl.static_range(K):
        # dx: position s feeds output t = s + k - 1 - j through tap j (dpre at t recomputed: no fp32 round trip).
        t = offs_l + (K - 1) - j
        valid_t = (t < L) & mask_l
        # dw: output position t (this tile) reads source s = t - (k - 1) + j through tap j.
        s = offs_l - (K - 1) + j
        valid_s = (s >= 0) & mask_l
        if HAS_SEQ:
            valid_t = valid_t & (tl.load(SEQ + b * L + t, mask=valid_t, other=-2) == seq_here)
            valid_s = valid_s & (tl.load(SEQ + b * L + s, mask=valid_s, other=-2) == seq_here)
        if j == K - 1:
            dp = dpre_here
        else:
            dp = _dpre(X, W, BIAS, SEQ, DY, b, t, offs_d, L, D, HAS_BIAS, HAS_SEQ, SILU, K, BL, BD)
        w = tl.load(W + offs_d * K + j, mask=mask_d, other=0.0).to(tl.float32)
        dx += tl.where(valid_t[:, None], dp, 0.0) * w[None, :]
        xs = tl.load(X + (b * L + s[:, None]) * D + offs_d[None, :], mask=valid_s[:, None] & mask_d[None, :], other=0.0)
        tl.store(DW_PART + (part + j) * D + offs_d, tl.sum(dpre_here * xs.to(tl.float32), axis=0), mask=mask_d)
    tl.store(DB_PART + (b * tl.num_programs(1) + pid_l) * D + offs_d, tl.sum(dpre_here, axis=0), mask=mask_d)
    tl.store(DX + (b * L + offs_l[:, None]) * D + offs_d[None, :], dx.to(DX.dtype.element_ty), mask=mask)


def _grid(x: torch.Tensor) -> tuple[int, int, int]:
    b, length, dim = x.shape
    return (b, triton.cdiv(length, BLOCK_L), triton.cdiv(dim, BLOCK_D))


def conv_forward(x, weight, bias, seq_idx, silu: bool) -> torch.Tensor:
    b, length, dim = x.shape
    out = torch.empty_like(x)
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else x
    _conv_fwd_kernel[_grid(x)](
        x, weight, bias if bias is not None else weight, seq, out, length, dim,
        HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=silu, K=weight.shape[1], BL=BLOCK_L, BD=BLOCK_D,
    )  # fmt: skip
    return out


def conv_backward(dy, x, weight, bias, seq_idx, silu: bool):
    """``(dx, dweight, dbias or None)`` in the dtypes of ``x``, ``weight`` and ``bias``."""
    b, length, dim = x.shape
    k = weight.shape[1]
    grid = _grid(x)
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else x
    dx = torch.empty_like(x)
    dw_part = torch.empty(b * grid[1], k, dim, dtype=torch.float32, device=x.device)
    db_part = torch.empty(b * grid[1], dim, dtype=torch.float32, device=x.device)
    _conv_bwd_kernel[grid](
        x, weight, bias if bias is not None else weight, seq, dy.contiguous(), dx, dw_part, db_part, length, dim,
        HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=silu, K=k, BL=BLOCK_L, BD=BLOCK_D,
    )  # fmt: skip
    dw = dw_part.sum(0).t().to(weight.dtype)
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db
