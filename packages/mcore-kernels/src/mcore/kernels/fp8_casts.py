"""A GEMM operand and its transpose in fp8 from the fewest passes: ``quantize_dual(x)`` -> ``(q, q_t)``.

``q`` is ``x [R, C]`` quantized along C (the operand of a GEMM reducing over C) and ``q_t`` is ``x^T [C, R]``
quantized along R (the operand of the GEMM reducing over R), both row-major. Every tensor of a linear is needed
both ways (``x``: forward along K, weight gradient along M; ``W``: K and N; ``grad``: N and M), so one call per
tensor gives all six GEMM operands of a linear from three calls. Granularities (see ``quantization.py``):

=========== ============================================ ===========================================
granularity ``q`` along C                                ``q_t`` along R
=========== ============================================ ===========================================
``tensor``  one scale ``[]``                             the same scale
``row``     ``[R, 1]`` (amax of each row)                ``[C, 1]`` (amax of each column of x)
``1x128``   ``[R, ceil(C/128)]``                         ``[C, ceil(R/128)]`` (128 x 1 groups of x)
``128x128`` ``[ceil(R/128), ceil(C/128)]``               its transpose (the same blocks)
=========== ============================================ ===========================================

Passes over ``x`` on CUDA (``triton/quant_fused.py``): tensor- and row-wise two (amax, then both casts with the
scales computed in the kernel), block-wise one; the results are bit-identical to ``quantize_fp8`` of ``x`` and of
``x^T`` (the CPU reference path computes exactly that). Where two single casts (``quantize_fp8`` of ``x`` and of
``x^T``, one read each) measured faster than the fused kernel, ``DUAL_PATH`` runs those instead: the same bits.

Tensor parallelism: ``reduce_q(t)`` / ``reduce_t(t)`` reduce in place the amaxes behind ``q``'s / ``q_t``'s
scales over the ranks holding parts of the same reduction dimension (row-wise: the row amaxes when C is
sharded, the column amaxes when R is); tensor-wise both scales are one amax, reduced by either. Delayed
scaling (tensor-wise): ``amax`` scales with a given amax, ``amax_out`` (one fp32 element) receives this rank's
measured ``max |x|``, unreduced, in the same pass.
"""

from __future__ import annotations

import torch

from mcore.kernels import dispatch
from mcore.kernels.quantization import (
    E4M3,
    FP8_MAX,
    AmaxReduce,
    Quantized,
    _check_input,
    abs_max,
    fp8_dtype,
    reference_cast,
    reference_quantize_blocks,
    scale_from_amax,
)

# The fused kernel or two single casts, per granularity, as measured on one H200 (torch 2.11, Triton 3.6; bf16
# [8192, 4096], benchmarks/fp8.py casts, session 5 call 3), ms, fused vs two single casts (CUDA-graph replay):
#   tensor 0.153 vs 0.519 | row 0.182 vs 0.866 | 1x128 0.171 vs 0.154 (0.144 vs 0.109) | 128x128 0.146 vs 0.163
# 1x128: the fused kernel reads each 128 x 128 tile once, but the two single casts (two reads, simpler programs)
# measured faster (why is not profiled: its column amaxes and fp8 transpose in one program are the suspects).
# Tensor- and row-wise need a global amax pass first, which the fused kernel shares. Both paths give the same bits.
# Since native rounding (session 9) 128x128's two single casts replay faster too (session 12: 0.078 vs 0.115 ms),
# but the 8b4l block-wise step with them was no faster (session 13: 1.164x vs 1.168x; the weights' 128x128 casts
# are few), so 128x128 stays fused until a step measures the difference.
DUAL_PATH = {"tensor": "fused", "row": "fused", "1x128": "two_casts", "128x128": "fused"}


def quantize_dual(
    x: torch.Tensor,
    dtype: str | torch.dtype,
    granularity: str,
    *,
    transposed: bool = True,
    reduce_q: AmaxReduce | None = None,
    reduce_t: AmaxReduce | None = None,
    amax: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[Quantized, Quantized | None]:
    """``(q, q_t)`` of the 2-D ``x`` (see the module docstring); ``transposed=False`` skips ``q_t`` (``None``)."""
    dtype = fp8_dtype(dtype)
    _check_input(x, granularity, amax, None)
    if (reduce_q or reduce_t) is not None and granularity not in ("tensor", "row"):
        raise ValueError(
            f"quantize_dual: amax reductions apply to granularity 'tensor' or 'row', not {granularity!r} (block "
            "scales must not span ranks: shard on block boundaries instead)"
        )
    if amax_out is not None and (granularity != "tensor" or amax_out.numel() != 1):
        raise ValueError(f"quantize_dual: amax_out is one element for granularity 'tensor', got {granularity!r}")
    if dispatch.choose("quantize_fp8", x, backend=backend) == dispatch.TRITON:
        return _triton_dual(x, dtype, granularity, transposed, reduce_q, reduce_t, amax, amax_out)
    return _reference_dual(x, dtype, granularity, transposed, reduce_q, reduce_t, amax, amax_out)


def quantize_fp8_pair(
    x: torch.Tensor,
    dtype: str | torch.dtype = E4M3,
    *,
    amax: torch.Tensor | None = None,
    amax_reduce: AmaxReduce | None = None,
    amax_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[Quantized, Quantized]:
    """Tensor-wise ``x`` and ``x^T`` with one shared scale (``fp8_casts.quantize_dual`` at ``tensor``).

    ``amax_out`` (an fp32 tensor of one element) receives ``max |x|`` of this rank's ``x``, unreduced: with a
    given ``amax`` (delayed scaling) the Triton kernel measures it in the cast's own pass.
    """
    return quantize_dual(x, dtype, "tensor", reduce_q=amax_reduce, amax=amax, amax_out=amax_out, backend=backend)


def _triton_dual(x, dtype, granularity, transposed, reduce_q, reduce_t, amax, amax_out):
    from mcore.kernels.triton import quant_fused as tq

    if granularity in ("1x128", "128x128") and DUAL_PATH[granularity] == "two_casts":
        from mcore.kernels.triton.quantization import quantize_blocks  # quantize_fp8's single block cast

        q = Quantized(*quantize_blocks(x, dtype, granularity, transpose=False), granularity)
        q_t = Quantized(*quantize_blocks(x, dtype, granularity, transpose=True), granularity) if transposed else None
        return q, q_t
    if granularity in ("1x128", "128x128"):
        data, scale, data_t, scale_t = tq.block_dual(x, dtype, granularity == "128x128", write_t=transposed)
        q_t = Quantized(data_t, scale_t, granularity) if transposed else None
        return Quantized(data, scale, granularity), q_t
    rowwise = granularity == "row"
    if amax is None and not rowwise and amax_out is None:
        # tensor-wise current scaling: torch's fused infinity norm (one read, no |x| temporary) costs the host a
        # fraction of a zero-filled buffer plus a Triton launch (measured on an H200: ~1.4 ms of host time per fp8
        # linear forward + backward, which left the 8b4l step's GPU idle), the same amax bits; a NaN amax gives
        # multiplier 1 like the Triton pass's inf
        amaxes = (abs_max(x).reshape(1),) * 2
        _reduce(reduce_q or reduce_t, amaxes[0])
        recorded = None
    elif amax is None:
        amaxes = tq.amax(x, per_row_col=rowwise)
        if rowwise:
            _reduce(reduce_q, amaxes[0])
            _reduce(reduce_t, amaxes[1])
        else:
            _reduce(reduce_q or reduce_t, amaxes[0])
        if amax_out is not None:
            amax_out.copy_(amaxes[0].reshape(()))  # measured before the reduction: this rank's own
        recorded = None
    else:
        amaxes = (amax.to(torch.float32).reshape(1),) * 2
        recorded = amax_out
        if recorded is not None:
            recorded.zero_()
    data, scale, data_t, scale_t = tq.dual_cast(
        x, dtype, amaxes, rowwise=rowwise, write_t=transposed, amax_out=recorded
    )
    if rowwise:
        q = Quantized(data, scale.reshape(-1, 1), "row")
        return q, Quantized(data_t, scale_t.reshape(-1, 1), "row") if transposed else None
    scale = scale.reshape(())
    return Quantized(data, scale, "tensor"), Quantized(data_t, scale, "tensor") if transposed else None


def _reduce(fn: AmaxReduce | None, t: torch.Tensor) -> None:
    if fn is not None:
        fn(t)


def _reference_dual(x, dtype, granularity, transposed, reduce_q, reduce_t, amax, amax_out):
    """The same values in torch: ``quantize_fp8`` of ``x`` and of ``x^T`` (the reductions applied alike)."""
    fmax = FP8_MAX[dtype]
    if granularity == "1x128":
        q_t = reference_quantize_blocks(x.t(), dtype, granularity) if transposed else None
        return reference_quantize_blocks(x, dtype, granularity), q_t
    if granularity == "128x128":
        q = reference_quantize_blocks(x, dtype, granularity)
        q_t = Quantized(q.data.t().contiguous(), q.scale.t().contiguous(), granularity) if transposed else None
        return q, q_t
    if granularity == "row":
        row_amax, col_amax = abs_max(x, 1), abs_max(x, 0).reshape(-1, 1)
        _reduce(reduce_q, row_amax)
        _reduce(reduce_t, col_amax)
        mult, scale = scale_from_amax(row_amax, fmax)
        q = Quantized(reference_cast(x, mult, dtype), scale, "row")
        if not transposed:
            return q, None
        mult_t, scale_t = scale_from_amax(col_amax, fmax)
        return q, Quantized(reference_cast(x.t(), mult_t, dtype), scale_t, "row")
    measured = abs_max(x)
    if amax_out is not None:
        amax_out.copy_(measured)
    if amax is None:
        amax = measured.clone()
        _reduce(reduce_q or reduce_t, amax)
    mult, scale = scale_from_amax(amax.reshape(()), fmax)
    data = reference_cast(x, mult, dtype)
    q_t = Quantized(data.t().contiguous(), scale, "tensor") if transposed else None
    return Quantized(data, scale, "tensor"), q_t
