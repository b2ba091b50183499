"""FP8 GEMM ``a @ b^T`` of two operands quantized along their shared reduction dimension K.

On CUDA: ``torch._scaled_mm`` for tensor-wise and row-wise scales, and ``torch.nn.functional.scaled_mm`` for
the block-scaled pairs cuBLAS runs on sm90 (torch >= 2.10): ``1x128`` x ``128x128`` (DeepSeek-V3's forward and
input-gradient GEMMs: activation or gradient tiles times weight blocks) and ``1x128`` x ``1x128`` (the weight
gradient, both operands tiled along the tokens it contracts over). Elsewhere (and with ``backend="reference"``)
the reference: dequantize both operands to fp32 and multiply. Both see the same fp8 values and scales, so on
CUDA they differ only by accumulation order.

Shape rules of the CUDA kernels (checked before any launch, with the rule in the message): K and N
multiples of 16 (tensor- and row-wise); K and N multiples of 128 for block-wise; the row- and block-wise
kernels write bf16 (other output dtypes are cast from it), except fp32 (the weight gradient written straight
into ``main_grad``), which they are asked for directly (torch >= 2.9 with cuBLAS >= 12.9 on sm90; a refusal is
remembered and the result cast from bf16 from then on). cuBLAS's block-scaled kernels take e4m3 operands only,
and want the scales in the layouts :func:`blockwise_scales` builds (measured on an H200 with torch 2.11; the
rules are torch's ``_scaled_mm_v2`` checks); a block pair with an e5m2 operand (gradients in e5m2) runs our
Triton block-scaled GEMM (``triton/block_scaled_mm.py``) instead.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from mcore.kernels import dispatch
from mcore.kernels.quantization import BLOCK, Quantized

logger = logging.getLogger("mcore.kernels")

PAIRS = {("tensor", "tensor"), ("row", "row"), ("1x128", "128x128"), ("1x128", "1x128")}
CUDA_BACKEND = "scaled_mm"


def scaled_matmul(
    a: Quantized,
    b: Quantized,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    fast_accum: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T -> [M, N]`` in ``out_dtype`` from fp8 operands and their scales.

    ``backend``: ``"scaled_mm"`` (torch's fp8 kernels, CUDA only), ``"triton"`` (our block-scaled GEMM, block
    pairs only; also under the Triton interpreter), ``"reference"`` or ``None`` (by device: on CUDA torch's
    kernels, and ours for a block pair with an e5m2 operand, which cuBLAS refuses).
    ``fast_accum``: tensor- and row-wise on CUDA, let the tensor cores accumulate without the periodic fp32
    promotion (faster, less exact over long K; torchao's choice for the forward GEMM); ignored elsewhere.
    ``out``: a contiguous ``[M, N]`` tensor written with the product (its dtype is the output dtype; it is not
    read, so it may hold anything); tensor-wise ``torch._scaled_mm`` writes it directly, in fp32 too.
    """
    check_operands(a, b)
    if out is not None:
        _check_out(out, a, b)
        out_dtype = out.dtype
    chosen = _choose(a, b, backend)
    if chosen == dispatch.REFERENCE:
        return _into(out, reference_scaled_matmul(a, b, out_dtype))
    if chosen == dispatch.TRITON:
        return _into(out, _blockwise_triton(a, b, out_dtype))
    check_cuda_shapes(a.granularity, a.shape[0], b.shape[0], a.shape[1])
    if a.granularity == "tensor":
        kwargs = {} if out is None else {"out": out}
        return torch._scaled_mm(
            a.data, b.data.t(), a.scale, b.scale, out_dtype=out_dtype, use_fast_accum=fast_accum, **kwargs
        )
    if a.granularity == "row":
        return _rowwise_cuda(a, b, out_dtype, fast_accum, out)
    pair = (a.granularity, b.granularity)
    if backend is None and pair in _CUBLAS_REFUSED:
        return _into(out, _blockwise_triton(a, b, out_dtype))
    try:
        return _blockwise_cuda(a, b, out_dtype, out)
    except (RuntimeError, ValueError) as exc:  # this torch / cuBLAS lacks the pair: ours runs it, logged once
        if backend is not None:
            raise
        _CUBLAS_REFUSED.add(pair)
        logger.warning("scaled_matmul: torch refused block pair %s (%s); using mcore's Triton GEMM", pair, exc)
        return _into(out, _blockwise_triton(a, b, out_dtype))


def _check_out(out: torch.Tensor, a: Quantized, b: Quantized) -> None:
    shape = (a.shape[0], b.shape[0])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or not out.is_contiguous():
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"scaled_matmul: out must be a contiguous tensor of shape {shape} (a @ b^T), got {got}")
    if out.device != a.data.device:
        raise ValueError(f"scaled_matmul: out is on {out.device}, the operands on {a.data.device}")


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None or result is out:
        return result
    return out.copy_(result)


# output dtypes the running torch refused for a scale pair (row-wise or block-wise fp32 out, before cuBLAS 12.9):
# the GEMM writes bf16 from then on and the result is cast (one warning)
_OUT_DTYPE_REFUSED: set[tuple[str, torch.dtype]] = set()


def _native_out_dtype(granularity: str, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the row- or block-wise CUDA kernel is asked for: fp32 when wanted and not refused, else bf16."""
    if out_dtype == torch.float32 and (granularity, out_dtype) not in _OUT_DTYPE_REFUSED:
        return out_dtype
    return torch.bfloat16


def _native_or_bf16(
    granularity: str,
    out_dtype: torch.dtype,
    run: Callable[[torch.dtype, torch.Tensor | None], torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``run(dtype, target)`` of a row- or block-wise CUDA GEMM, asked for :func:`_native_out_dtype`; a refused
    fp32 output is remembered (one warning) and the GEMM run again in bf16. ``target`` is ``out`` when the kernel
    writes ``out``'s dtype itself (the fp32 weight gradient straight into main_grad: no product temporary and no
    copy, which were ~2.7 ms of device-to-device copies per 8b4l block-wise step), else ``None``; the result is
    cast to ``out_dtype`` (and copied into ``out``) where it is not already there."""
    native = _native_out_dtype(granularity, out_dtype)
    try:
        result = run(native, _target(out, native))
    except (RuntimeError, ValueError) as exc:
        if native == torch.bfloat16:
            raise
        _OUT_DTYPE_REFUSED.add((granularity, native))
        logger.warning("scaled_matmul: %s GEMM refused %s output (%s); writing bf16, cast", granularity, native, exc)
        result = run(torch.bfloat16, _target(out, torch.bfloat16))
    if out is not None:
        return _into(out, result)
    return result.to(out_dtype)


def _target(out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``out`` where a kernel asked for ``dtype`` can write it itself, else ``None``."""
    return out if out is not None and out.dtype == dtype else None


def _rowwise_cuda(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    scale_b = b.scale.reshape(1, -1)

    def run(dtype: torch.dtype, target: torch.Tensor | None) -> torch.Tensor:
        kwargs = {} if target is None else {"out": target}
        return torch._scaled_mm(
            a.data, b.data.t(), a.scale, scale_b, out_dtype=dtype, use_fast_accum=fast_accum, **kwargs
        )

    return _native_or_bf16("row", out_dtype, run, out)


# block pairs the running torch refused (its CUDA build's cuBLAS lacks them): the Triton GEMM takes them instead
_CUBLAS_REFUSED: set[tuple[str, str]] = set()


def _blockwise_triton(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    from mcore.kernels.triton.block_scaled_mm import block_scaled_mm

    return block_scaled_mm(a.data, b.data, a.scale, b.scale, b.granularity == "128x128", out_dtype)


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


def _choose(a: Quantized, b: Quantized, backend: str | None) -> str:
    allowed = (CUDA_BACKEND, dispatch.TRITON, dispatch.REFERENCE)
    if backend is not None and backend not in allowed:
        raise ValueError(f"scaled_matmul: unknown backend {backend!r}; expected one of {allowed}")
    block = a.granularity == "1x128"
    if backend == dispatch.TRITON:
        if not block:
            raise ValueError(f"scaled_matmul: backend 'triton' runs block-scaled pairs only, got {a.granularity!r}")
        if not (a.data.is_cuda or dispatch.triton_interpreting()):
            raise ValueError("scaled_matmul: backend 'triton' needs CUDA tensors or TRITON_INTERPRET=1")
        return dispatch.TRITON
    if backend == dispatch.REFERENCE or (backend is None and not a.data.is_cuda):
        return dispatch.REFERENCE
    if not a.data.is_cuda:
        raise ValueError("scaled_matmul: backend='scaled_mm' needs CUDA tensors (torch's fp8 GEMMs are GPU-only)")
    if backend is None and block and torch.float8_e5m2 in (a.data.dtype, b.data.dtype):
        return dispatch.TRITON  # cuBLAS's block-scaled GEMMs take e4m3 only
    return CUDA_BACKEND


def blockwise_scales(a: Quantized, b: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale_a, scale_b)`` in the layouts torch's block-scaled ``scaled_mm`` accepts for ``a @ b^T``.

    ``1x128`` scales ``[R, K/128]`` go in as R-major (strides ``(1, R)``); ``128x128`` scales of ``b`` go in as
    ``[round_up(K/128, 4), N/128]`` with strides ``(1, round_up(K/128, 4))``: each column of K blocks padded to
    16 bytes (the padding is never read as a scale of real data). Scales from our Triton casts are already
    stored so (``triton.quantization.empty_block_scale``) and pass as views; others (the torch reference's) are
    copied.
    """
    return _r_major(a.scale), (_r_major(b.scale) if b.granularity == "1x128" else _padded_blocks_t(b.scale))


def _r_major(scale: torch.Tensor) -> torch.Tensor:
    rows, groups = scale.shape
    if scale.stride(0) == 1 and (scale.stride(1) == rows or groups == 1):
        return scale
    return scale.t().contiguous().t()


def _padded_blocks_t(scale: torch.Tensor) -> torch.Tensor:
    n_blocks, k_blocks = scale.shape
    padded = -(-k_blocks // 4) * 4
    if scale.stride() == (padded, 1):
        # a view of a padded row-major buffer: its padding (set to 1 when allocated) is read as the extra rows
        storage = scale.untyped_storage().nbytes() // scale.element_size()
        if storage >= scale.storage_offset() + n_blocks * padded:
            return scale.as_strided((padded, n_blocks), (1, padded))
    buffer = torch.ones(n_blocks, padded, dtype=torch.float32, device=scale.device)
    buffer[:, :k_blocks] = scale
    return buffer.t()


@functools.cache
def _scaled_mm_v2_overloads():
    """``(default, out)`` of ``aten._scaled_mm_v2`` (``out`` is ``None`` on a torch without it), looked up once."""
    op = torch.ops.aten._scaled_mm_v2
    return op.default, (op.out if "out" in op.overloads() else None)


def _blockwise_cuda(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    from torch.nn.functional import ScalingType

    for name, q in (("a", a), ("b", b)):
        if q.data.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"scaled_matmul: cuBLAS's block-scaled fp8 GEMMs take e4m3 operands only, got {name} in "
                f"{q.data.dtype}: use backend='triton' (or None) or quantize gradients in e4m3"
            )
    recipe = {"1x128": ScalingType.BlockWise1x128.value, "128x128": ScalingType.BlockWise128x128.value}
    scale_a, scale_b = blockwise_scales(a, b)
    # torch.nn.functional.scaled_mm's call, spelled out for the ``out`` overload it does not expose
    args = (a.data, b.data.t(), [scale_a], [recipe[a.granularity]], [], [scale_b], [recipe[b.granularity]], [], None)

    def run(dtype: torch.dtype, target: torch.Tensor | None) -> torch.Tensor:
        default, out_variant = _scaled_mm_v2_overloads()
        if target is not None and out_variant is not None:
            return out_variant(*args, dtype, [], False, out=target)
        return default(*args, dtype, [], False)

    # bf16 output measured on sm90; fp32 (the weight gradient into main_grad) tried, bf16 if refused
    return _native_or_bf16(a.granularity + b.granularity, out_dtype, run, out)
