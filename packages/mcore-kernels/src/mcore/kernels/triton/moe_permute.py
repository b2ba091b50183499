"""Triton kernels of the MoE token permutation (``mcore.kernels.moe_permute``): each a single pass over the rows.

* ``permute_forward``: ``rows[s] = x[choice_of_slot[s] // k]`` (zeros where a slot holds padding);
* ``permute_backward``: ``dx[t] = sum_j drows[slot_of_choice[t, j]]`` over kept choices, fp32 sum;
* ``unpermute_forward``: ``out[t] = sum_j w[t, j] * y[slot_of_choice[t, j]]``, fp32 multiply-add: the gather and
  the routing-weight multiply in one pass, no ``[T, k, H]`` intermediate;
* ``unpermute_backward``: ``dy[slot] = w[t, j] * dout[t]`` and ``dw[t, j] = <y[slot], dout[t]>`` (fp32) in one
  pass per token: ``dout`` is read once, each kept slot's row of ``y`` once, and ``dy`` written once per slot
  (every slot belongs to at most one choice, so there are no atomics; rows no choice owns stay zero).

Gathers work in tiles of ``BLOCK_R`` rows x ``BLOCK_H`` hidden columns (grid: row tiles x column blocks); offsets
are int64 (``rows x hidden`` can pass 2**31). Math is fp32 in registers; results take the input's dtype (``dw`` fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton._common import next_power_of_2

MAX_BLOCK_H = 1024
TILE = 4096  # elements per program: 8 KB of bf16 in flight per load (2 KB rows alone are too short for bandwidth)


@triton.jit
def _permute_fwd_kernel(
    X, ROWS, CHOICE_OF_SLOT, N_ROWS, H, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    slots = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = slots < N_ROWS
    choice = tl.load(CHOICE_OF_SLOT + slots, mask=in_rows, other=-1)
    tokens = tl.maximum(choice, 0) // K
    in_cols = cols[None, :] < H
    values = tl.load(X + tokens[:, None] * H + cols[None, :], mask=(choice >= 0)[:, None] & in_cols, other=0.0)
    tl.store(ROWS + slots.to(tl.int64)[:, None] * H + cols[None, :], values, mask=in_rows[:, None] & in_cols)


@triton.jit
def _permute_bwd_kernel(
    DROWS, DX, SLOT_OF_CHOICE, N_TOKENS, H, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = tokens < N_TOKENS
    in_cols = cols[None, :] < H
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(SLOT_OF_CHOICE + tokens.to(tl.int64) * K + j, mask=in_rows, other=-1)
        row = tl.load(
            DROWS + tl.maximum(slot, 0)[:, None] * H + cols[None, :], mask=(slot >= 0)[:, None] & in_cols, other=0.0
        )
        acc += row.to(tl.float32)
    out = DX + tokens.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(out, acc.to(DX.dtype.element_ty), mask=in_rows[:, None] & in_cols)


@triton.jit
def _unpermute_fwd_kernel(
    Y, W, OUT, SLOT_OF_CHOICE, N_TOKENS, H, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = tokens < N_TOKENS
    in_cols = cols[None, :] < H
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        choice = tokens.to(tl.int64) * K + j
        slot = tl.load(SLOT_OF_CHOICE + choice, mask=in_rows, other=-1)
        weight = tl.load(W + choice, mask=in_rows, other=0.0).to(tl.float32)
        row = tl.load(
            Y + tl.maximum(slot, 0)[:, None] * H + cols[None, :], mask=(slot >= 0)[:, None] & in_cols, other=0.0
        )
        acc += row.to(tl.float32) * weight[:, None]
    out = OUT + tokens.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=in_rows[:, None] & in_cols)


@triton.jit
def _unpermute_bwd_kernel(
    DOUT,
    Y,
    W,
    DY,
    DW,
    SLOT_OF_CHOICE,
    N_TOKENS,
    H,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = tokens < N_TOKENS
    base = tokens.to(tl.int64)
    choices = tl.arange(0, K_POW2)
    dots = tl.zeros([BLOCK_R, K_POW2], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        in_cols = cols[None, :] < H
        dout = tl.load(DOUT + base[:, None] * H + cols[None, :], mask=in_rows[:, None] & in_cols, other=0.0)
        dout = dout.to(tl.float32)
        for j in tl.static_range(K):
            slot = tl.load(SLOT_OF_CHOICE + base * K + j, mask=in_rows, other=-1)
            weight = tl.load(W + base * K + j, mask=in_rows, other=0.0).to(tl.float32)
            kept = (slot >= 0)[:, None] & in_cols
            rows = tl.maximum(slot, 0)[:, None] * H + cols[None, :]
            tl.store(DY + rows, (dout * weight[:, None]).to(DY.dtype.element_ty), mask=kept)
            y = tl.load(Y + rows, mask=kept, other=0.0).to(tl.float32)
            dots += tl.where(choices[None, :] == j, tl.sum(y * dout, axis=1)[:, None], 0.0)
    tl.store(DW + base[:, None] * K + choices[None, :], dots, mask=in_rows[:, None] & (choices[None, :] < K))


def _blocks(h: int, rows: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H): up to MAX_BLOCK_H columns, and rows enough for a tile of ``TILE`` elements."""
    block_h = min(MAX_BLOCK_H, next_power_of_2(h))
    return max(1, min(TILE // block_h, next_power_of_2(rows))), block_h


def _warps(block_r: int, block_h: int) -> int:
    return 8 if block_r * block_h >= 4096 else 4


def permute_forward(x: torch.Tensor, choice_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    rows, h = choice_of_slot.shape[0], x.shape[1]
    out = torch.empty(rows, h, dtype=x.dtype, device=x.device)
    br, bh = _blocks(h, rows)
    if rows:
        grid = (triton.cdiv(rows, br), triton.cdiv(h, bh))
        _permute_fwd_kernel[grid](
            x.contiguous(), out, choice_of_slot, rows, h, K=k, BLOCK_R=br, BLOCK_H=bh, num_warps=_warps(br, bh)
        )
    return out


def permute_backward(drows: torch.Tensor, slot_of_choice: torch.Tensor) -> torch.Tensor:
    tokens, k = slot_of_choice.shape
    h = drows.shape[1]
    dx = torch.empty(tokens, h, dtype=drows.dtype, device=drows.device)
    br, bh = _blocks(h, tokens)
    if tokens:
        grid = (triton.cdiv(tokens, br), triton.cdiv(h, bh))
        _permute_bwd_kernel[grid](
            drows.contiguous(), dx, slot_of_choice, tokens, h, K=k, BLOCK_R=br, BLOCK_H=bh, num_warps=_warps(br, bh)
        )
    return dx


def unpermute_forward(y: torch.Tensor, weights: torch.Tensor, slot_of_choice: torch.Tensor) -> torch.Tensor:
    tokens, k = slot_of_choice.shape
    h = y.shape[1]
    out = torch.empty(tokens, h, dtype=y.dtype, device=y.device)
    br, bh = _blocks(h, tokens)
    if tokens:
        grid = (triton.cdiv(tokens, br), triton.cdiv(h, bh))
        _unpermute_fwd_kernel[grid](
            y.contiguous(),
            weights.contiguous(),
            out,
            slot_of_choice,
            tokens,
            h,
            K=k,
            BLOCK_R=br,
            BLOCK_H=bh,
            num_warps=_warps(br, bh),
        )
    return out


def unpermute_backward(
    dout: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, slot_of_choice: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy [rows, H] in y's dtype, dweights [T, k] fp32)``."""
    tokens, k = slot_of_choice.shape
    h = y.shape[1]
    dy = torch.zeros_like(y)  # rows no kept choice owns (padding, dropped) get no store
    dw = torch.empty(tokens, k, dtype=torch.float32, device=y.device)
    br, bh = _blocks(h, tokens)
    if tokens:
        _unpermute_bwd_kernel[(triton.cdiv(tokens, br),)](
            dout.contiguous(),
            y.contiguous(),
            weights.contiguous(),
            dy,
            dw,
            slot_of_choice,
            tokens,
            h,
            K=k,
            K_POW2=next_power_of_2(k),
            BLOCK_R=br,
            BLOCK_H=bh,
            num_warps=_warps(br, bh),
        )
    return dy, dw
