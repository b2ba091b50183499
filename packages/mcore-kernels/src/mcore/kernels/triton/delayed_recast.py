"""Delayed scaling's ``overflow="recast"`` pass (``fp8_delayed``): on the dual cast's grid, each program returns at
once unless the recorded amax exceeds the window's, else casts its tile again from the recorded amax.

It runs after ``quant_fused.delayed_dual_cast`` and after the TP reduction of the recorded slot, with the same ring
arguments, and reads the window through ``quant_fused._scale_amax``, the function the cast itself scaled by.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton import quant_fused
from mcore.kernels.triton.quant_fused import _load_tile, _scale_amax
from mcore.kernels.triton.quantization import FP8_MAX, _round_to_fp8, multiplier_and_scale, rounding_bits


@triton.jit(do_not_specialize=["hist_len", "slot", "next_slot", "recent_slot"])
def _delayed_recast_kernel(
    X,
    AMAX,
    Y,
    YT,
    SCALE,
    n_rows,
    n_cols,
    stride_r,
    stride_c,
    hist_len,
    slot,
    next_slot,
    recent_slot,
    FMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    WRITE_YT: tl.constexpr,
    HISTORY: tl.constexpr,  # 1 or 2: the window of the dual cast's HISTORY
    HIST_P2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Delayed scaling's overflow recast, on the dual cast's grid: every program compares the recorded (reduced)
    amax ``AMAX[slot]`` with the window the cast was scaled by and, only when it is larger (or NaN: the torch
    path's NaN amax; this cast records NaN as inf), casts its tile again from it; program 0 writes the scale. The
    decision comes from the ring, which no program writes here, never from ``SCALE``, which one program rewrites."""
    own = tl.load(AMAX + slot)
    used = _scale_amax(AMAX, hist_len, slot, next_slot, recent_slot, HISTORY, HIST_P2)
    if (own > used) | (own != own):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        x, mask, rmask, r64 = _load_tile(X, rows, cols, n_rows, n_cols, stride_r, stride_c)
        mult, scale = multiplier_and_scale(own, FMAX)
        if (pid_r == 0) & (pid_c == 0):
            tl.store(SCALE, scale)
        c64 = cols.to(tl.int64)
        q = _round_to_fp8(x * mult, FMAX, MBITS, MIN_EXP).to(Y.dtype.element_ty)
        tl.store(Y + r64[:, None] * n_cols + c64[None, :], q, mask=mask)
        if WRITE_YT:
            mask_t = (cols < n_cols)[:, None] & rmask[None, :]
            tl.store(YT + c64[:, None] * n_rows + r64[None, :], tl.trans(q), mask=mask_t)


def delayed_recast(
    x: torch.Tensor,
    history: torch.Tensor,
    slot: int,
    next_slot: int,
    recent_slot: int,
    window_max: bool,
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> None:
    """Delayed scaling's ``overflow="recast"``, after :func:`delayed_dual_cast` (and the reduction of
    ``history[slot]``) with the same ring arguments: where the recorded ``history[slot]`` exceeds the amax that
    cast was scaled by, ``outputs`` ``(q, scale [1], q^T or None)`` are rewritten in place as the current-scaling
    cast from ``history[slot]``; otherwise nothing is written. No host sync: the programs decide on the device and
    return at once when there was no overflow (one more pass over ``x`` only when it clipped)."""
    y, scale, yt = outputs
    rows, cols = x.shape
    if not (rows and cols):
        return
    hist_len = history.numel()
    tile_r, tile_c, warps = quant_fused.CAST_TILE  # the dual cast's grid
    grid = (triton.cdiv(rows, tile_r), triton.cdiv(cols, tile_c))
    _delayed_recast_kernel[grid](
        x,
        history,
        y,
        yt if yt is not None else y,
        scale,
        rows,
        cols,
        x.stride(0),
        x.stride(1),
        hist_len,
        slot,
        next_slot,
        recent_slot,
        FMAX=FP8_MAX[y.dtype],
        **rounding_bits(y.dtype),
        WRITE_YT=yt is not None,
        HISTORY=1 if window_max else 2,
        HIST_P2=triton.next_power_of_2(hist_len),
        BLOCK_R=tile_r,
        BLOCK_C=tile_c,
        num_warps=warps,
    )
