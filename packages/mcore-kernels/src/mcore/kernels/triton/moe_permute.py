"""Triton kernels of the MoE token permutation (``mcore.kernels.moe_permute``): each a single pass over the rows.

* ``permute_forward``: ``rows[s] = x[choice_of_slot[s] // k]`` (zeros where a slot holds padding);
* ``permute_backward``: ``dx[t] = sum_j drows[slot_of_choice[t, j]]`` over kept choices, fp32 sum;
* ``unpermute_forward``: ``out[t] = sum_j w[t, j] * y[slot_of_choice[t, j]]``, fp32 multiply-add: the gather and
  the routing-weight multiply in one pass, no ``[T, k, H]`` intermediate;
* ``unpermute_backward``: ``dy[slot] = w[t, j] * dout[t]`` and ``dw[t, j] = <y[slot], dout[t]>`` (fp32) in one
  pass per token: ``dout`` is read once, each kept slot's row of ``y`` once, and ``dy`` written once per slot
  (every slot belongs to at most one choice, so there are no atomics; rows no choice owns stay zero).

Gathers work in blocks of ``BLOCK_H`` hidden columns (grid: rows x column blocks); offsets are int64 (``rows x
hidden`` can pass 2**31). Math is fp32 in registers; results take the input's dtype (``dw`` fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton._common import next_power_of_2

MAX_BLOCK_H = 1024


@triton.jit
def _permute_fwd_kernel(X, ROWS, CHOICE_OF_SLOT, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    slot = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    choice = tl.load(CHOICE_OF_SLOT + slot)
    token = tl.maximum(choice, 0) // K
    # "this column, and the slot holds a choice" as one comparison (a scalar & vector mask trips the interpreter)
    values = tl.load(X + token * H + cols, mask=cols < tl.where(choice >= 0, H, 0), other=0.0)
    tl.store(ROWS + slot * H + cols, values, mask=in_row)


@triton.jit
def _permute_bwd_kernel(DROWS, DX, SLOT_OF_CHOICE, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(SLOT_OF_CHOICE + token * K + j)
        row = tl.load(DROWS + tl.maximum(slot, 0) * H + cols, mask=cols < tl.where(slot >= 0, H, 0), other=0.0)
        acc += row.to(tl.float32)
    tl.store(DX + token * H + cols, acc.to(DX.dtype.element_ty), mask=in_row)


@triton.jit
def _unpermute_fwd_kernel(Y, W, OUT, SLOT_OF_CHOICE, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(SLOT_OF_CHOICE + token * K + j)
        weight = tl.load(W + token * K + j).to(tl.float32)
        row = tl.load(Y + tl.maximum(slot, 0) * H + cols, mask=cols < tl.where(slot >= 0, H, 0), other=0.0)
        acc += row.to(tl.float32) * weight
    tl.store(OUT + token * H + cols, acc.to(OUT.dtype.element_ty), mask=in_row)


@triton.jit
def _unpermute_bwd_kernel(
    DOUT, Y, W, DY, DW, SLOT_OF_CHOICE, H, K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_H: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    choices = tl.arange(0, K_POW2)
    dots = tl.zeros([K_POW2], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        in_row = cols < H
        dout = tl.load(DOUT + token * H + cols, mask=in_row, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            slot = tl.load(SLOT_OF_CHOICE + token * K + j)
            kept = cols < tl.where(slot >= 0, H, 0)
            weight = tl.load(W + token * K + j).to(tl.float32)
            row = tl.maximum(slot, 0) * H + cols
            tl.store(DY + row, (dout * weight).to(DY.dtype.element_ty), mask=kept)
            y = tl.load(Y + row, mask=kept, other=0.0).to(tl.float32)
            dots += tl.where(choices == j, tl.sum(y * dout, axis=0), 0.0)
    tl.store(DW + token * K + choices, dots, mask=choices < K)


def _block_h(h: int) -> int:
    return min(MAX_BLOCK_H, next_power_of_2(h))


def _warps(block_h: int) -> int:
    return 4 if block_h >= 512 else 2


def permute_forward(x: torch.Tensor, choice_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    rows, h = choice_of_slot.shape[0], x.shape[1]
    out = torch.empty(rows, h, dtype=x.dtype, device=x.device)
    block = _block_h(h)
    if rows:
        grid = (rows, triton.cdiv(h, block))
        _permute_fwd_kernel[grid](x.contiguous(), out, choice_of_slot, h, K=k, BLOCK_H=block, num_warps=_warps(block))
    return out


def permute_backward(drows: torch.Tensor, slot_of_choice: torch.Tensor) -> torch.Tensor:
    tokens, k = slot_of_choice.shape
    h = drows.shape[1]
    dx = torch.empty(tokens, h, dtype=drows.dtype, device=drows.device)
    block = _block_h(h)
    if tokens:
        grid = (tokens, triton.cdiv(h, block))
        _permute_bwd_kernel[grid](
            drows.contiguous(), dx, slot_of_choice, h, K=k, BLOCK_H=block, num_warps=_warps(block)
        )
    return dx


def unpermute_forward(y: torch.Tensor, weights: torch.Tensor, slot_of_choice: torch.Tensor) -> torch.Tensor:
    tokens, k = slot_of_choice.shape
    h = y.shape[1]
    out = torch.empty(tokens, h, dtype=y.dtype, device=y.device)
    block = _block_h(h)
    if tokens:
        grid = (tokens, triton.cdiv(h, block))
        _unpermute_fwd_kernel[grid](
            y.contiguous(), weights.contiguous(), out, slot_of_choice, h, K=k, BLOCK_H=block, num_warps=_warps(block)
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
    block = _block_h(h)
    if tokens:
        _unpermute_bwd_kernel[(tokens,)](
            dout.contiguous(),
            y.contiguous(),
            weights.contiguous(),
            dy,
            dw,
            slot_of_choice,
            h,
            K=k,
            K_POW2=next_power_of_2(k),
            BLOCK_H=block,
            num_warps=_warps(block),
        )
    return dy, dw
