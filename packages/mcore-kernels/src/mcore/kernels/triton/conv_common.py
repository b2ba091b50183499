"""What the shifted and the polyphase conv kernels share (:mod:`mcore.kernels.triton.conv` explains both): masked
row loads, the tap weights, the dw / dbias partials each backward program writes, and the kernel that sums them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(P, rows, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ: tl.constexpr):
    """Rows ``rows`` of ``P`` (fp32), 0 outside ``[0, L)`` or (with ``seq_idx``) outside document ``seq_out``."""
    valid = (rows >= 0) & (rows < L)
    if HAS_SEQ:
        valid = valid & (tl.load(SEQ + rows, mask=valid, other=-2) == seq_out)
    ptrs = P + rows.to(tl.int64)[:, None] * stride_l + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _tap_weight(W, offs_d, mask_d, j: tl.constexpr, stride_wd, stride_wk, K: tl.constexpr):
    """Weight ``j`` of the four (fp32 ``[1, BD]``): the conv's tap ``j - (4 - K)``, or 0 in front of a narrower conv."""
    if j >= 4 - K:
        w = tl.load(W + offs_d * stride_wd + (j - (4 - K)) * stride_wk, mask=mask_d, other=0.0).to(tl.float32)
    else:
        w = tl.zeros_like(offs_d).to(tl.float32)
    return w[None, :]


@triton.jit
def _taps(X, W, SEQ, rows, offs_d, mask_d, stride_l, L, stride_wd, stride_wk, K: tl.constexpr,
          HAS_SEQ: tl.constexpr):  # fmt: skip
    """The four tap inputs ``x[t - 3 + j]`` of output rows ``t = rows`` (document-masked) and the weights ``w_j``."""
    seq_out = 0
    if HAS_SEQ:
        seq_out = tl.load(SEQ + rows, mask=rows < L, other=-1)
    x0 = _rows(X, rows - 3, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ)
    x1 = _rows(X, rows - 2, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ)
    x2 = _rows(X, rows - 1, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ)
    x3 = _rows(X, rows, offs_d, mask_d, stride_l, L, SEQ, seq_out, HAS_SEQ)
    w0 = _tap_weight(W, offs_d, mask_d, 0, stride_wd, stride_wk, K)
    w1 = _tap_weight(W, offs_d, mask_d, 1, stride_wd, stride_wk, K)
    w2 = _tap_weight(W, offs_d, mask_d, 2, stride_wd, stride_wk, K)
    w3 = _tap_weight(W, offs_d, mask_d, 3, stride_wd, stride_wk, K)
    return x0, x1, x2, x3, w0, w1, w2, w3


@triton.jit
def _store_partials(PART, b, pid_l, D, offs_d, mask_d, dw0, dw1, dw2, dw3, db):
    """This program's dw (four taps) and dbias partials: row ``b * programs + pid_l`` of ``PART [P, 5, D]``, which
    :func:`_conv_dw_kernel` sums."""
    part = PART + ((b * tl.num_programs(0) + pid_l) * 5) * D + offs_d
    tl.store(part, dw0, mask=mask_d)
    tl.store(part + D, dw1, mask=mask_d)
    tl.store(part + 2 * D, dw2, mask=mask_d)
    tl.store(part + 3 * D, dw3, mask=mask_d)
    tl.store(part + 4 * D, db, mask=mask_d)


@triton.jit
def _sum_partials(PART, row: tl.constexpr, P, D, offs_d, mask_d, BP: tl.constexpr):
    """Sum over the ``P`` programs' partials ``PART[p, row, offs_d]`` (fp32 ``[BD]``)."""
    acc = tl.zeros_like(offs_d).to(tl.float32)
    for p0 in range(0, P, BP):
        offs_p = p0 + tl.arange(0, BP)
        ptrs = PART + (offs_p[:, None] * 5 + row) * D + offs_d[None, :]
        acc += tl.sum(tl.load(ptrs, mask=(offs_p < P)[:, None] & mask_d[None, :], other=0.0), axis=0)
    return acc


@triton.jit
def _conv_dw_kernel(PART, DW, DB, P, D, stride_wd, stride_wk, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BD: tl.constexpr, BP: tl.constexpr):  # fmt: skip
    """dweight ``[D, K]`` and dbias in their dtypes from the dpre kernel's partials (one launch, no torch glue)."""
    offs_d = tl.program_id(0) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    for j in tl.static_range(4):
        if j >= 4 - K:
            dw = _sum_partials(PART, j, P, D, offs_d, mask_d, BP)
            tl.store(DW + offs_d * stride_wd + (j - (4 - K)) * stride_wk, dw.to(DW.dtype.element_ty), mask=mask_d)
    if HAS_BIAS:
        db = _sum_partials(PART, 4, P, D, offs_d, mask_d, BP)
        tl.store(DB + offs_d, db.to(DB.dtype.element_ty), mask=mask_d)
