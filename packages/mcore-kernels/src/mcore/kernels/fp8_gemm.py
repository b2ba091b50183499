"""FP8 GEMM ``a @ b^T`` of two operands quantized along their shared reduction dimension K.

On CUDA: ``torch._scaled_mm`` for tensor-wise and row-wise scales, and ``torch.nn.functional.scaled_mm`` for
``1x128`` (a) x ``128x128`` (b) block scales, the block-scaled path cuBLAS runs on sm90 (torch >= 2.10).
Elsewhere (and with ``backend="reference"``) the reference: dequantize both operands to fp32 and multiply.
Both see the same fp8 values and scales, so on CUDA they differ only by accumulation order.

Shape rules of the CUDA kernels (checked before any launch, with the rule in the message): K and N
multiples of 16 (tensor- and row-wise); K and N multiples of 128 for block-wise; the row- and block-wise
kernels write bf16 (other output dtypes are cast from it).
"""

from __future__ import annotations

import logging

import torch

from mcore.kernels import dispatch
from mcore.kernels.quantization import BLOCK, Quantized

logger = logging.getLogger("mcore.kernels")

PAIRS = {("tensor", "tensor"), ("row", "row"), ("1x128", "128x128")}
CUDA_BACKEND = "scaled_mm"


def scaled_matmul(
    a: Quantized, b: Quantized, *, out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None
) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T -> [M, N]`` in ``out_dtype`` from fp8 operands and their scales.

    ``backend``: ``"scaled_mm"`` (torch's fp8 kernels, CUDA only), ``"reference"`` or ``None`` (by device).
    """
    check_operands(a, b)
    chosen = _choose(a, backend)
    if chosen == dispatch.REFERENCE:
        return reference_scaled_matmul(a, b, out_dtype)
    check_cuda_shapes(a.granularity, a.shape[0], b.shape[0], a.shape[1])
    if a.granularity == "tensor":
        return torch._scaled_mm(a.data, b.data.t(), a.scale, b.scale, out_dtype=out_dtype)
    if a.granularity == "row":
        out = torch._scaled_mm(a.data, b.data.t(), a.scale, b.scale.reshape(1, -1), out_dtype=torch.bfloat16)
        return out.to(out_dtype)
    return _blockwise_cuda(a, b, out_dtype)


def reference_scaled_matmul(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)^T`` in fp32, cast to ``out_dtype``."""
    return (a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()).to(out_dtype)


def check_operands(a: Quantized, b: Quantized) -> None:
    if not isinstance(a, Quantized) or not isinstance(b, Quantized):
        raise TypeError(f"scaled_matmul: operands must be Quantized, got {type(a).__name__}, {type(b).__name__}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"scaled_matmul: a [M, K] and b [N, K] must share K, got a {tuple(a.shape)} and b {tuple(b.shape)}"
        )
    if (a.granularity, b.granularity) not in PAIRS:
        raise ValueError(
            f"scaled_matmul: unsupported scale pair ({a.granularity}, {b.granularity}); expected one of {sorted(PAIRS)}"
        )


def shape_rule_violation(granularity: str, m: int | None, n: int, k: int) -> str | None:
    """The rule the CUDA fp8 kernels need that ``[m, k] @ [n, k]^T`` breaks, or ``None`` (``m=None``: unchecked)."""
    multiple = BLOCK if granularity in ("1x128", "128x128") else 16
    for name, value in (("K", k), ("N", n)):
        if value % multiple:
            return f"{name}={value} must be a multiple of {multiple} for {granularity} fp8 GEMMs"
    if m is not None and m % 16:
        return f"M={m} must be a multiple of 16 for fp8 GEMMs (it is the weight gradient's K)"
    return None


def check_cuda_shapes(granularity: str, m: int, n: int, k: int) -> None:
    problem = shape_rule_violation(granularity, m, n, k)
    if problem is not None:
        raise ValueError(f"scaled_matmul: {problem} (pad the dimension or keep this GEMM in bf16)")


def _choose(a: Quantized, backend: str | None) -> str:
    if backend is not None and backend not in (CUDA_BACKEND, dispatch.REFERENCE):
        raise ValueError(f"scaled_matmul: unknown backend {backend!r}; expected {CUDA_BACKEND!r} or 'reference'")
    if backend == dispatch.REFERENCE or (backend is None and not a.data.is_cuda):
        return dispatch.REFERENCE
    if not a.data.is_cuda:
        raise ValueError("scaled_matmul: backend='scaled_mm' needs CUDA tensors (torch's fp8 GEMMs are GPU-only)")
    return CUDA_BACKEND


def _blockwise_cuda(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    from torch.nn.functional import ScalingType, scaled_mm

    # the layouts cuBLAS accepts: scale_a [M, K/128] M-major (strides (1, M)), scale_b [K/128, N/128] as the
    # transpose of the contiguous [N/128, K/128]
    scale_a = a.scale.t().contiguous().t()
    scale_b = b.scale.t()
    out = scaled_mm(
        a.data,
        b.data.t(),
        scale_a,
        ScalingType.BlockWise1x128,
        scale_b,
        ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,  # the output dtype measured on sm90; others are cast from it
    )
    return out.to(out_dtype)
