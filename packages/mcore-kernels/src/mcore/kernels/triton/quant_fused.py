"""Fused fp8 casts: each GEMM operand *and* its transpose from the fewest reads of the high-precision tensor.

A linear needs every tensor twice: ``x`` along K (forward) and ``x^T`` along M (weight gradient), ``W`` along K
and ``W^T`` along N, ``grad`` along N and ``grad^T`` along M. These kernels write both fp8 tensors, with their
scales, from one read of the source per pass:

* ``_amax_kernel``: the absolute maximum of the whole tensor (delayed scaling's first call; tensor-wise current
  scaling takes torch's infinity norm, which costs the host less), or of every row *and* every column at once (the
  row-wise scales of ``q`` and of ``q^T``), one read; partial maxima meet through atomic max (non-negative
  values: NaN is counted as inf, so its group keeps multiplier 1 like the torch reference).
* ``_dual_cast_kernel``: the multipliers computed in the kernel from those amaxes (no torch ops in between),
  ``q = x * m_row`` and ``q^T = (x * m_col)^T`` written from the same tile; tensor-wise both use one multiplier.
  With a given amax it also measures this tensor's amax in the same pass; delayed scaling's ring of past amaxes
  (``fp8_delayed``) is read, recorded into and advanced inside it as well (``HISTORY``).
* delayed scaling's ``overflow="recast"`` pass lives beside, in ``delayed_recast.py`` (it reads the ring through
  :func:`_scale_amax`, as the dual cast does).
* ``_block_dual_kernel``: block-wise needs no global pass: one 128 x 128 tile gives the ``1x128`` scales of its
  rows (``q``) and of its columns (``q^T``, the 1x128 groups of the transposed tensor), or the one ``128x128``
  scale both share; amax, scales and both casts from one read of the tile from memory (swept twice, the second
  time from L2).

The transposes are taken on the fp8 values (one byte per element through shared memory, not four).
So tensor- and row-wise move 2 + 2 + 1 + 1 = 6 bytes per bf16 element (two reads, two fp8 writes) and
block-wise 4, the copy's count. Math is fp32; scales are ``div_rn(fmax, amax)`` and ``div_rn(1, multiplier)``,
the bits of ``quantization.scale_from_amax``; rounding is ``quantization``'s explicit round-to-nearest-even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton.quantization import (
    FP8_MAX,
    _round_to_fp8,
    empty_block_scale,
    multiplier_and_scale,
    rounding_bits,
)

BLOCK = 128
# Launch shapes (module constants so that ``benchmarks/fp8.py --sweep-casts`` can time the alternatives in
# :data:`TILE_CANDIDATES`, each default first; the defaults are the ones measured in session 5 on the H200).
# amax pass: (rows a program, rows a step, columns, warps): each program reduces 256 x 64 in 32-row steps over 2
# warps, so the column atomics number C * R / 256 and the row atomics R * C / 64, a few percent of the elements;
# fastest of the candidates on the 8b4l activations (session 13: 0.228 vs 0.269 ms for 256 x 128 over 4 warps) and
# on the mixtral2l expert weights (session 14: the gate_up weights' amax + dual cast 2.20 vs 2.84 ms)
AMAX_TILE = (256, 32, 64, 2)
# dual cast (rows, columns, warps): 64 x 64 over 8 warps, 16 elements per thread, keep it near 100 registers (64 x 128
# over 4 warps needed 255 and spilled: too few warps per SM to keep the memory busy)
CAST_TILE = (64, 64, 8)
# block dual cast (rows a step of its 128 x 128 tile, warps)
BLOCK_TILE = (32, 8)
TILE_CANDIDATES = {
    "AMAX_TILE": ((256, 32, 64, 2), (256, 32, 128, 4), (512, 32, 128, 4), (256, 64, 128, 8), (128, 32, 256, 4),
                  (256, 16, 256, 4), (1024, 32, 128, 4), (512, 32, 64, 2), (256, 16, 64, 2)),
    "CAST_TILE": ((64, 64, 8), (64, 64, 4), (128, 64, 8), (64, 128, 8), (32, 128, 4), (128, 128, 8), (32, 64, 4),
                  (128, 32, 4)),
    "BLOCK_TILE": ((32, 8), (16, 4), (32, 4), (64, 8), (16, 8), (8, 4), (64, 16)),
}  # fmt: skip


@triton.jit
def _load_tile(X, rows, cols, n_rows, n_cols, stride_r, stride_c):
    """``x[rows, cols]`` in fp32 (zeros outside the tensor), its mask, row mask and int64 row indices."""
    rmask = rows < n_rows
    r64 = rows.to(tl.int64)
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    ptrs = X + r64[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), mask, rmask, r64


@triton.jit
def _amax_kernel(
    X,
    AMAX,
    ROW_AMAX,
    COL_AMAX,
    n_rows,
    n_cols,
    stride_r,
    stride_c,
    PER_ROW_COL: tl.constexpr,  # False: one amax into AMAX[0]; True: ROW_AMAX[r] and COL_AMAX[c]
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < n_cols
    col_max = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for step in range(ROWS // BLOCK_R):
        rows = tl.program_id(0) * ROWS + step * BLOCK_R + tl.arange(0, BLOCK_R)
        x, mask, rmask, r64 = _load_tile(X, rows, cols, n_rows, n_cols, stride_r, stride_c)
        a = tl.where(x != x, float("inf"), tl.abs(x))
        col_max = tl.maximum(col_max, tl.max(a, axis=0))
        if PER_ROW_COL:
            tl.atomic_max(ROW_AMAX + rows, tl.max(a, axis=1), mask=rmask)
    if PER_ROW_COL:
        tl.atomic_max(COL_AMAX + cols, col_max, mask=cmask)
    else:
        tl.atomic_max(AMAX, tl.max(col_max, axis=0))


@triton.jit
def _scale_amax(AMAX, hist_len, slot, next_slot, recent_slot, HISTORY: tl.constexpr, HIST_P2: tl.constexpr):
    """The amax a tensor-wise cast scales by: ``AMAX[0]`` (``HISTORY`` 0), or from delayed scaling's ring
    ``AMAX[:hist_len]``: 1 the max of every slot but ``slot`` and ``next_slot``, 2 the most recent,
    ``AMAX[recent_slot]`` (the cast and its recast read the same window through this)."""
    if HISTORY == 1:
        idx = tl.arange(0, HIST_P2)
        window = (idx < hist_len) & (idx != slot) & (idx != next_slot)
        amax = tl.max(tl.load(AMAX + idx, mask=window, other=0.0), axis=0)
    elif HISTORY == 2:
        amax = tl.load(AMAX + recent_slot)
    else:
        amax = tl.load(AMAX)
    return amax


# the history slots change every call: specializing on them (== 1, multiples of 16) would compile variants
@triton.jit(do_not_specialize=["hist_len", "slot", "next_slot", "recent_slot"])
def _dual_cast_kernel(
    X,
    AMAX,
    ROW_AMAX,
    COL_AMAX,
    Y,
    YT,
    SCALE,
    SCALE_T,
    AMAX_OUT,
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
    ROWWISE: tl.constexpr,  # multipliers from ROW_AMAX (q) and COL_AMAX (q^T); else one from AMAX[0]
    WRITE_YT: tl.constexpr,
    RECORD_AMAX: tl.constexpr,  # max |x| into AMAX_OUT[slot] in the same pass (delayed scaling)
    # 0: the amax is AMAX[0]; delayed scaling from the ring AMAX[:hist_len] (``fp8_delayed``): 1 the max of every
    # slot but ``slot`` and ``next_slot``, 2 the most recent, AMAX[recent_slot]; program 0 zeroes AMAX[next_slot]
    HISTORY: tl.constexpr,
    HIST_P2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < n_cols
    c64 = cols.to(tl.int64)
    x, mask, rmask, r64 = _load_tile(X, rows, cols, n_rows, n_cols, stride_r, stride_c)
    if RECORD_AMAX:
        tl.atomic_max(AMAX_OUT + slot, tl.max(tl.max(tl.where(x != x, float("inf"), tl.abs(x)), axis=1), axis=0))
    if ROWWISE:
        mult_r, scale_r = multiplier_and_scale(tl.load(ROW_AMAX + rows, mask=rmask, other=1.0), FMAX)
        mult_c, scale_c = multiplier_and_scale(tl.load(COL_AMAX + cols, mask=cmask, other=1.0), FMAX)
        if pid_c == 0:
            tl.store(SCALE + rows, scale_r, mask=rmask)
        if WRITE_YT and pid_r == 0:
            tl.store(SCALE_T + cols, scale_c, mask=cmask)
        v = x * mult_r[:, None]
        vt = x * mult_c[None, :]
    else:
        amax = _scale_amax(AMAX, hist_len, slot, next_slot, recent_slot, HISTORY, HIST_P2)
        mult, scale = multiplier_and_scale(amax, FMAX)
        if (pid_r == 0) & (pid_c == 0):
            tl.store(SCALE, scale)
            if HISTORY != 0:
                tl.store(AMAX + next_slot, 0.0)
        v = x * mult
        vt = v
    q = _round_to_fp8(v, FMAX, MBITS, MIN_EXP).to(Y.dtype.element_ty)  # exact: already on the fp8 grid
    tl.store(Y + r64[:, None] * n_cols + c64[None, :], q, mask=mask)
    if WRITE_YT:
        if ROWWISE:
            qt = tl.trans(_round_to_fp8(vt, FMAX, MBITS, MIN_EXP).to(YT.dtype.element_ty))
        else:
            qt = tl.trans(q)
        mask_t = cmask[:, None] & rmask[None, :]
        tl.store(YT + c64[:, None] * n_rows + r64[None, :], qt, mask=mask_t)


@triton.jit
def _block_dual_kernel(
    X,
    Y,
    YT,
    SCALE,
    SCALE_T,
    n_rows,
    n_cols,
    stride_r,
    stride_c,
    stride_s0,
    stride_s1,
    stride_t0,
    stride_t1,
    FMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    SQUARE: tl.constexpr,  # one 128x128 scale per tile (shared by q and q^T); else 1x128 rows and columns
    WRITE_YT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    CHUNK_R: tl.constexpr,
):
    """One BLOCK_T x BLOCK_T tile in CHUNK_R-row chunks (few registers per thread): the first sweep measures the
    amaxes (1x128: also casts ``q``, its rows' scales known), the second re-reads the tile, which the first has
    just brought into L2, and writes what needed the whole tile's amaxes (``q^T``; 128x128: ``q`` too)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * BLOCK_T + tl.arange(0, BLOCK_T)
    cmask = cols < n_cols
    c64 = cols.to(tl.int64)
    col_max = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for i in range(BLOCK_T // CHUNK_R):
        rows = pid_r * BLOCK_T + i * CHUNK_R + tl.arange(0, CHUNK_R)
        x, mask, rmask, r64 = _load_tile(X, rows, cols, n_rows, n_cols, stride_r, stride_c)
        a = tl.where(x != x, float("inf"), tl.abs(x))
        col_max = tl.maximum(col_max, tl.max(a, axis=0))
        if not SQUARE:
            mult_r, scale_r = multiplier_and_scale(tl.max(a, axis=1), FMAX)
            tl.store(SCALE + r64 * stride_s0 + pid_c * stride_s1, scale_r, mask=rmask)
            q = _round_to_fp8(x * mult_r[:, None], FMAX, MBITS, MIN_EXP).to(Y.dtype.element_ty)
            tl.store(Y + r64[:, None] * n_cols + c64[None, :], q, mask=mask)
    if SQUARE:
        mult, scale = multiplier_and_scale(tl.max(col_max, axis=0), FMAX)
        tl.store(SCALE + pid_r * stride_s0 + pid_c * stride_s1, scale)
        if WRITE_YT:
            tl.store(SCALE_T + pid_c * stride_t0 + pid_r * stride_t1, scale)
        for i in range(BLOCK_T // CHUNK_R):
            rows = pid_r * BLOCK_T + i * CHUNK_R + tl.arange(0, CHUNK_R)
            x, mask, rmask, r64 = _load_tile(X, rows, cols, n_rows, n_cols, stride_r, stride_c)
            q = _round_to_fp8(x * mult, FMAX, MBITS, MIN_EXP).to(Y.dtype.element_ty)
            tl.store(Y + r64[:, None] * n_cols + c64[None, :], q, mask=mask)
            if WRITE_YT:
                tl.store(YT + c64[:, None] * n_rows + r64[None, :], tl.trans(q), mask=cmask[:, None] & rmask[None, :])
    elif WRITE_YT:
        mult_c, scale_c = multiplier_and_scale(col_max, FMAX)
        tl.store(SCALE_T + c64 * stride_t0 + pid_r * stride_t1, scale_c, mask=cmask)
        for i in range(BLOCK_T // CHUNK_R):
            rows = pid_r * BLOCK_T + i * CHUNK_R + tl.arange(0, CHUNK_R)
            x, mask, rmask, r64 = _load_tile(X, rows, cols, n_rows, n_cols, stride_r, stride_c)
            qt = tl.trans(_round_to_fp8(x * mult_c[None, :], FMAX, MBITS, MIN_EXP).to(YT.dtype.element_ty))
            tl.store(YT + c64[:, None] * n_rows + r64[None, :], qt, mask=cmask[:, None] & rmask[None, :])


def amax(x: torch.Tensor, per_row_col: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax [1], unused)`` or ``(row amax [R], column amax [C])`` of the 2-D ``x`` in fp32, one read."""
    rows, cols = x.shape
    if per_row_col:
        out = torch.zeros(rows + cols, dtype=torch.float32, device=x.device)  # one fill for both
        row_amax, col_amax = out[:rows], out[rows:]
    else:
        row_amax = col_amax = out = torch.zeros(1, dtype=torch.float32, device=x.device)
    if rows and cols:
        per_program, step, width, warps = AMAX_TILE
        grid = (triton.cdiv(rows, per_program), triton.cdiv(cols, width))
        _amax_kernel[grid](
            x,
            out,
            row_amax,
            col_amax,
            rows,
            cols,
            x.stride(0),
            x.stride(1),
            PER_ROW_COL=per_row_col,
            ROWS=per_program,
            BLOCK_R=step,
            BLOCK_C=width,
            num_warps=warps,
        )
    return (row_amax, col_amax) if per_row_col else (out, out)


def dual_cast(
    x: torch.Tensor,
    dtype: torch.dtype,
    amaxes: tuple[torch.Tensor, torch.Tensor],
    *,
    rowwise: bool,
    write_t: bool,
    amax_out: torch.Tensor | None = None,
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(q [R, C], scale, q^T [C, R] or None, scale of q^T or None)`` from the amaxes ``amax()`` gave (tensor-wise:
    both the same one-element tensor). Row-wise scales come out ``[R]`` and ``[C]``; tensor-wise one ``[1]``.
    ``outputs``: those four written in place (contiguous, of those shapes; views into stacked tensors, say)."""
    return _launch_dual(x, dtype, amaxes, rowwise=rowwise, write_t=write_t, amax_out=amax_out, history=None,
                        outputs=outputs)  # fmt: skip


def delayed_dual_cast(
    x: torch.Tensor,
    dtype: torch.dtype,
    history: torch.Tensor,
    slot: int,
    next_slot: int,
    recent_slot: int,
    window_max: bool,
    *,
    write_t: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Tensor-wise ``(q, scale [1], q^T or None)`` scaled from the amax ring ``history`` (``fp8_delayed``): the max of
    its slots but ``slot`` and ``next_slot`` (``window_max``) or ``history[recent_slot]``; this tensor's amax is
    max-ed into ``history[slot]`` (zero before the call) and ``history[next_slot]`` zeroed, all in the one pass."""
    y, scale, yt, _ = _launch_dual(x, dtype, (history, history), rowwise=False, write_t=write_t, amax_out=history,
                                   history=(slot, next_slot, recent_slot, 1 if window_max else 2))  # fmt: skip
    return y, scale, yt


def _launch_dual(x, dtype, amaxes, *, rowwise, write_t, amax_out, history, outputs=None):
    rows, cols = x.shape
    if outputs is not None:
        y, scale, yt, scale_t = outputs
        _check_outputs(outputs, rows, cols, dtype, rowwise, write_t)
    else:
        device = x.device
        y = torch.empty((rows, cols), dtype=dtype, device=device)
        yt = torch.empty((cols, rows), dtype=dtype, device=device) if write_t else None
        scale = torch.empty(rows if rowwise else 1, dtype=torch.float32, device=device)
        scale_t = torch.empty(cols, dtype=torch.float32, device=device) if rowwise and write_t else None
    slot, next_slot, recent_slot, mode = history if history is not None else (0, 0, 0, 0)
    hist_len = amaxes[0].numel()
    if rows and cols:
        tile_r, tile_c, warps = CAST_TILE
        grid = (triton.cdiv(rows, tile_r), triton.cdiv(cols, tile_c))
        _dual_cast_kernel[grid](
            x,
            amaxes[0],
            amaxes[0],
            amaxes[1],
            y,
            yt if yt is not None else y,
            scale,
            scale_t if scale_t is not None else scale,
            amax_out if amax_out is not None else scale,
            rows,
            cols,
            x.stride(0),
            x.stride(1),
            hist_len,
            slot,
            next_slot,
            recent_slot,
            FMAX=FP8_MAX[dtype],
            **rounding_bits(dtype),
            ROWWISE=rowwise,
            WRITE_YT=write_t,
            RECORD_AMAX=amax_out is not None,
            HISTORY=mode,
            HIST_P2=triton.next_power_of_2(hist_len),
            BLOCK_R=tile_r,
            BLOCK_C=tile_c,
            num_warps=warps,
        )
    else:  # nothing to scale: the multipliers of empty groups are 1
        scale.fill_(1.0)
        if scale_t is not None:
            scale_t.fill_(1.0)
    return y, scale, yt, scale_t if rowwise else (scale if write_t else None)


def _check_outputs(outputs, rows, cols, dtype, rowwise, write_t) -> None:
    y, scale, yt, scale_t = outputs
    want = [("q", y, (rows, cols), dtype), ("scale", scale, (rows if rowwise else 1,), torch.float32)]
    if write_t:
        want.append(("q^T", yt, (cols, rows), dtype))
    if rowwise and write_t:
        want.append(("scale of q^T", scale_t, (cols,), torch.float32))
    for name, t, shape, dt in want:
        if t is None or tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous():
            got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()}"
            raise ValueError(f"dual_cast: outputs' {name} must be a contiguous {dt} {shape}, got {got}")


def block_dual(
    x: torch.Tensor, dtype: torch.dtype, square: bool, *, write_t: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(q, scale, q^T, scale of q^T)`` of ``x`` in ``128x128`` (``square``) or ``1x128`` groups, one read.

    ``1x128``: ``scale [R, ceil(C/128)]`` and ``scale_t [C, ceil(R/128)]`` (the groups of ``x^T`` along R);
    ``128x128``: ``scale [ceil(R/128), ceil(C/128)]`` and its transpose; both in ``empty_block_scale``'s layouts.
    """
    rows, cols = x.shape
    device = x.device
    br, bc = triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK)
    granularity = "128x128" if square else "1x128"
    y = torch.empty((rows, cols), dtype=dtype, device=device)
    scale = empty_block_scale(rows, cols, granularity, device)
    yt = scale_t = None
    if write_t:
        yt = torch.empty((cols, rows), dtype=dtype, device=device)
        scale_t = empty_block_scale(cols, rows, granularity, device)
    if rows and cols:
        _block_dual_kernel[(br, bc)](
            x,
            y,
            yt if yt is not None else y,
            scale,
            scale_t if scale_t is not None else scale,
            rows,
            cols,
            x.stride(0),
            x.stride(1),
            *scale.stride(),
            *(scale_t.stride() if scale_t is not None else scale.stride()),
            FMAX=FP8_MAX[dtype],
            **rounding_bits(dtype),
            SQUARE=square,
            WRITE_YT=write_t,
            BLOCK_T=BLOCK,
            CHUNK_R=BLOCK_TILE[0],
            num_warps=BLOCK_TILE[1],
        )
    return y, scale, yt, scale_t
