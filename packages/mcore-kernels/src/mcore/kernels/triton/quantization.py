"""Triton fp8 cast kernels, each reading its input once and writing fp8 in the layout the next GEMM wants.

* ``_tiled_cast_kernel``: scaled cast with a given multiplier (one value, or one per output row) writing ``q`` or
  ``q^T`` (tensor-wise and row-wise scaling, where the amax is known beforehand), tiled like the block kernel.
  It also casts the grouped weight gradient's operands with jagged row-wise scales (one multiplier per expert
  and column). The fused operand-and-transpose casts of the linears are in ``quant_fused.py``.
* ``_block_quant_kernel``: amax, scale and cast of ``1x128`` or ``128x128`` groups in one pass, reading the
  source transposed when the GEMM needs ``x^T`` (the tile is loaded along x's contiguous dimension and
  transposed in registers, so the global reads stay coalesced).

Math is fp32; the scale is ``div_rn(fmax, amax)`` (correctly rounded, like torch's division) so that the
kernels and the torch references give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels import dispatch

# The formats' constants (quantization.py has the same; importing it from here would make an import cycle).
BLOCK = 128
FP8_MAX = {dtype: float(torch.finfo(dtype).max) for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}

_BLOCK_ROWS_1X128 = 16
# (mantissa bits, exponent of the smallest normal) of each format, for the explicit rounding below.
_FORMAT_BITS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
# 1.5 * 2^23: adding it to an fp32 value of magnitude < 2^22 rounds that value to an integer (nearest even).
_RNE_MAGIC = tl.constexpr(12582912.0)


def rounding_bits(dtype: torch.dtype) -> dict[str, int]:
    """``MBITS`` / ``MIN_EXP`` of :func:`_round_to_fp8` for a launch: the format's mantissa bits and smallest normal
    exponent under the interpreter (its cast rounds ties away from zero, so the kernels round explicitly first), 0 / 0
    on a GPU, whose cast instruction (``cvt.rn.satfinite``) rounds to nearest even itself: the same bits, without ~20
    integer and float instructions per element (the fused casts ran at 21-36% of copy bandwidth with them)."""
    if dispatch.triton_interpreting():
        mbits, min_exp = _FORMAT_BITS[dtype]
        return {"MBITS": mbits, "MIN_EXP": min_exp}
    return {"MBITS": 0, "MIN_EXP": 0}


@triton.jit
def _round_to_fp8(v, FMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """``v`` saturated to ``+-FMAX`` and (``MBITS > 0``, the interpreter) rounded to the fp8 grid (nearest, ties to
    even), still in fp32; the caller's cast then gives torch's bits (``rounding_bits``).

    Rounding explicitly makes the final cast exact, so the result does not depend on the rounding the
    cast instruction (or the interpreter, which rounds ties away from zero) applies. ``MBITS == 0`` leaves the
    rounding to the GPU's cast, which rounds to nearest even.
    """
    if MBITS == 0:
        clamped = tl.minimum(tl.maximum(v, -FMAX), FMAX)
        return tl.where(v != v, v, clamped)  # NaN stays NaN (min/max would turn it into a bound)
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    ulp = ((exponent - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((MBITS - exponent + 127) << 23).to(tl.float32, bitcast=True)  # exact, unlike GPU division
    steps = (v * inv_ulp + _RNE_MAGIC) - _RNE_MAGIC
    saturated = tl.minimum(tl.maximum(steps * ulp, -FMAX), FMAX)
    saturated = tl.where(saturated == 0.0, v * 0.0, saturated)  # a negative value rounding to zero is -0, as torch's
    return tl.where(v != v, v, saturated)  # NaN stays NaN (min/max would turn it into a bound)


# fp32's smallest normal number (torch.finfo(torch.float32).tiny): the amax floor is FMAX times it
_FLT_TINY = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def multiplier_and_scale(amax, FMAX: tl.constexpr):
    """``(fmax / amax, amax / fmax)`` correctly rounded, the bits of ``quantization.scale_from_amax``: 1 for a zero,
    inf or NaN amax, a positive amax below ``quantization.amax_floor`` raised to it (``amax * 0`` would be NaN for an
    inf amax: the zeros come from ``zeros_like``)."""
    ok = (amax > 0.0) & (amax < float("inf"))
    zero = tl.zeros_like(amax)
    floored = tl.maximum(amax, zero + FMAX * _FLT_TINY)
    mult = tl.where(ok, tl.math.div_rn(zero + FMAX, tl.where(ok, floored, 1.0)), 1.0)
    return mult, tl.math.div_rn(zero + 1.0, mult)


@triton.jit
def _block_quant_kernel(
    X,
    Y,
    SCALE,
    n_rows,
    n_cols,
    stride_x0,
    stride_x1,
    stride_s0,
    stride_s1,
    FMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    TRANSPOSED: tl.constexpr,  # output (r, c) reads x[c, r]
    SQUARE: tl.constexpr,  # one scale per BLOCK_R x BLOCK_C tile (128x128) instead of one per row (1x128)
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    if TRANSPOSED:
        mask_t = (cols < n_cols)[:, None] & rmask[None, :]
        xt = tl.load(X + c64[:, None] * stride_x0 + r64[None, :] * stride_x1, mask=mask_t, other=0.0)
        x = tl.trans(xt).to(tl.float32)
    else:
        x = tl.load(X + r64[:, None] * stride_x0 + c64[None, :] * stride_x1, mask=mask, other=0.0).to(tl.float32)
    # NaN counts as an infinite amax, so its group keeps multiplier 1 like the reference (torch's amax propagates
    # NaN); the GPU's max instruction drops NaN and would scale the rest of the group by the finite values instead
    a = tl.where(x != x, float("inf"), tl.abs(x))
    if SQUARE:
        amax = tl.max(tl.max(a, axis=1), axis=0)
    else:
        amax = tl.max(a, axis=1)
    mult, scale = multiplier_and_scale(amax, FMAX)  # a scalar (128x128) or a vector (1x128), like amax
    if SQUARE:
        v = x * mult
        tl.store(SCALE + pid_r * stride_s0 + pid_c * stride_s1, scale)
    else:
        v = x * mult[:, None]
        tl.store(SCALE + r64 * stride_s0 + pid_c * stride_s1, scale, mask=rmask)
    v = _round_to_fp8(v, FMAX, MBITS, MIN_EXP)
    tl.store(Y + r64[:, None] * n_cols + c64[None, :], v.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _tiled_cast_kernel(
    X,
    MULT,
    GROUP,
    Y,
    n_rows,
    n_cols,
    stride_x0,
    stride_x1,
    stride_y,
    FMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    MULT_MODE: tl.constexpr,  # 0: one multiplier, 1: one per output row, 2: MULT[GROUP[out col], out row]
    TRANSPOSED: tl.constexpr,  # output (r, c) reads x[c, r]
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """A scaled cast with a given multiplier, tiled like ``_block_quant_kernel`` (16 x 128 output tiles; the
    transposed source tile loaded along x's contiguous dimension and transposed in registers)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    if TRANSPOSED:
        mask_t = (cols < n_cols)[:, None] & rmask[None, :]
        xt = tl.load(X + c64[:, None] * stride_x0 + r64[None, :] * stride_x1, mask=mask_t, other=0.0)
        x = tl.trans(xt).to(tl.float32)
    else:
        x = tl.load(X + r64[:, None] * stride_x0 + c64[None, :] * stride_x1, mask=mask, other=0.0).to(tl.float32)
    if MULT_MODE == 0:
        v = x * tl.load(MULT)
    elif MULT_MODE == 1:
        v = x * tl.load(MULT + rows, mask=rmask, other=1.0)[:, None]
    else:  # jagged: the group of each source row (an output column), MULT [groups, n_rows] row-major
        group = tl.load(GROUP + cols, mask=cols < n_cols, other=0).to(tl.int64)
        v = x * tl.load(MULT + group[None, :] * n_rows + r64[:, None], mask=mask, other=1.0)
    v = _round_to_fp8(v, FMAX, MBITS, MIN_EXP)
    tl.store(Y + r64[:, None] * stride_y + c64[None, :], v.to(Y.dtype.element_ty), mask=mask)


def cast_scaled(x: torch.Tensor, multiplier: torch.Tensor, dtype: torch.dtype, *, transpose: bool) -> torch.Tensor:
    """``cast(clamp(src * multiplier))`` of ``src = x`` or ``x^T``; ``multiplier`` is ``[]`` or one per src row."""
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    out = torch.empty((rows, cols), dtype=dtype, device=x.device)
    # [rows, 1] for row-wise scaling, [] for tensor-wise
    _launch_tiled_cast(x, multiplier, None, out, 1 if multiplier.dim() == 2 else 0, transpose)
    return out


def _launch_tiled_cast(x, multiplier, group, out, mode: int, transpose: bool) -> None:
    """``out`` (``[rows, cols]``, any row stride) = the cast of ``x`` or ``x^T``; see ``_tiled_cast_kernel``."""
    rows, cols = out.shape
    if rows == 0 or cols == 0:
        return
    multiplier = multiplier.to(torch.float32).reshape(-1).contiguous()
    grid = (triton.cdiv(rows, _BLOCK_ROWS_1X128), triton.cdiv(cols, BLOCK))
    _tiled_cast_kernel[grid](
        x,
        multiplier,
        group if group is not None else multiplier,
        out,
        rows,
        cols,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        FMAX=FP8_MAX[out.dtype],
        **rounding_bits(out.dtype),
        MULT_MODE=mode,
        TRANSPOSED=transpose,
        BLOCK_R=_BLOCK_ROWS_1X128,
        BLOCK_C=BLOCK,
        num_warps=4,
    )


def cast_grouped_columns(
    x: torch.Tensor, multiplier: torch.Tensor, group: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``cast(clamp(x * multiplier[group[r], c]))`` written transposed: ``[cols, round_up(rows, 16)]``, the
    padding columns zero (torch's fp8 grouped GEMM wants K, here the tokens, a multiple of 16): the jagged
    row-wise scales of the grouped weight gradient (one per expert and column, over that expert's rows)."""
    rows, cols = x.shape
    padded = -(-rows // 16) * 16  # torch's grouped kernel wants the token count (the GEMM's K) a multiple of 16
    out = torch.empty((cols, padded), dtype=dtype, device=x.device)
    out[:, rows:] = 0  # past offsets[-1]: never read, but defined
    _launch_tiled_cast(x, multiplier, group.to(torch.int32).contiguous(), out[:, :rows], 2, transpose=True)
    return out


def empty_block_scale(rows: int, cols: int, granularity: str, device: torch.device) -> torch.Tensor:
    """The scale tensor of a ``[rows, cols]`` operand in ``1x128`` or ``128x128`` groups, laid out the way cuBLAS's
    block-scaled GEMMs read it (``fp8_gemm.blockwise_scales`` then passes it without a copy):

    * ``1x128``: ``[rows, ceil(cols/128)]`` stored group-column by group-column (strides ``(1, rows)``);
    * ``128x128``: ``[ceil(rows/128), ceil(cols/128)]`` row-major with each row padded to a multiple of 4 groups
      (16 bytes), the padding set to 1 (a view of the padded buffer; no padding: a plain contiguous tensor).

    Before these layouts each block-scaled GEMM copied or padded both scales first (a few small kernels and ~20 us
    of host time per GEMM, three GEMMs per linear).
    """
    groups = triton.cdiv(cols, BLOCK)
    if granularity == "1x128":
        return torch.empty((groups, rows), dtype=torch.float32, device=device).t()
    block_rows, padded = triton.cdiv(rows, BLOCK), -(-groups // 4) * 4
    if padded == groups:
        return torch.empty((block_rows, groups), dtype=torch.float32, device=device)
    return torch.ones((block_rows, padded), dtype=torch.float32, device=device)[:, :groups]


def quantize_blocks(
    x: torch.Tensor, dtype: torch.dtype, granularity: str, *, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of ``x`` or ``x^T`` in ``1x128`` or ``128x128`` groups (see ``quantization.py``; the scale
    in :func:`empty_block_scale`'s layout)."""
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    square = granularity == "128x128"
    block_r = BLOCK if square else _BLOCK_ROWS_1X128
    scale_cols = triton.cdiv(cols, BLOCK)
    data = torch.empty((rows, cols), dtype=dtype, device=x.device)
    scale = empty_block_scale(rows, cols, granularity, x.device)
    if rows == 0 or cols == 0:
        return data, scale
    grid = (triton.cdiv(rows, block_r), scale_cols)
    _block_quant_kernel[grid](
        x,
        data,
        scale,
        rows,
        cols,
        x.stride(0),
        x.stride(1),
        scale.stride(0),
        scale.stride(1),
        FMAX=FP8_MAX[dtype],
        **rounding_bits(dtype),
        TRANSPOSED=transpose,
        SQUARE=square,
        BLOCK_R=block_r,
        BLOCK_C=BLOCK,
        num_warps=8 if square else 4,
    )
    return data, scale


@triton.jit
def _jagged_column_amax_kernel(X, ENDS, AMAX, n_cols, stride_xr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``AMAX[e, c] = max |X[r, c]|`` over expert ``e``'s rows ``[ENDS[e-1], ENDS[e])``: one program per (expert,
    column block), reading only that expert's rows (the rows are sorted by expert), no atomics."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < n_cols
    start = tl.load(ENDS + expert - 1, mask=expert > 0, other=0)
    end = tl.load(ENDS + expert)
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for row0 in range(start, end, BLOCK_R):
        rows = row0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & cmask[None, :]
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.where(x != x, float("inf"), tl.abs(x)), axis=0))
    tl.store(AMAX + expert.to(tl.int64) * n_cols + cols, amax, mask=cmask)


# (rows a step, columns a program, warps) of the jagged column amax; 128 x 64 over 4 warps keeps more bytes in flight
# per program than 32 x 128: mixtral2l's weight-gradient operands at 3.9-4.0 TB/s against 1.5-1.6 (session 14 sweep)
JAGGED_AMAX_TILE = (128, 64, 4)


def jagged_column_amax(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[E + 1, C]`` fp32: the column amax of each expert's rows of ``x`` [T, C] (row ``E``, no expert: zeros)."""
    rows, cols = x.shape
    experts = offsets.shape[0]
    out = torch.zeros((experts + 1, cols), dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0 or experts == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    block_r, block_c, warps = JAGGED_AMAX_TILE
    grid = (experts, triton.cdiv(cols, block_c))
    _jagged_column_amax_kernel[grid](x, offsets, out, cols, x.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
                                     num_warps=warps)  # fmt: skip
    return out
