"""FP8 grouped GEMM for MoE experts with block-wise scales (DeepSeek-V3's recipe): ``fp8_grouped_gemm``'s contract.

``x`` [T, K] rows grouped by expert (``offsets`` [E] int32 cumulative segment ends), ``w`` [E, N, K], ``dy``
[T, N]; e4m3 throughout, each operand scaled along its GEMM's reduction dimension (``low_precision_linear``'s
"blockwise" granularities, per expert):

=======  ===========================================  ==============================================
GEMM     A                                            B
=======  ===========================================  ==============================================
forward  x [T, K]: 1x128 (per row and 128 of K)       w[e] [N, K]: 128x128 blocks
dgrad    dy [T, N]: 1x128 (per row and 128 of N)      w[e]^T [K, N]: the same blocks, transposed
wgrad    dy^T [N, T]: 1x128 along the tokens          x^T [K, T]: 1x128 along the tokens
=======  ===========================================  ==============================================

Every expert's row count must be a multiple of 128 (MoE layers with block-wise fp8 experts pad each expert's rows,
``align=128``), and K and N multiples of 128: then every 128-row tile and every 128-token scale block lies in one
expert, so the per-expert GEMMs are plain block-scaled GEMMs over whole tiles. Checking the row counts reads the
offsets on the host (one sync per call on CUDA: the price of refusing misaligned experts instead of mixing them).

Backends: ``"triton"`` (``triton/block_grouped_mm.py``: ``block_scaled_mm``'s kernel with each M tile's expert
read from the offsets on the device, and a weight-gradient grid over (expert, N tile, K tile); CUDA, or CPU under
``TRITON_INTERPRET=1``) and ``"reference"`` (per expert, the same fp8 values and scales dequantized and
multiplied in fp32). Both see identical quantized operands, so they differ only by accumulation order. Rows at or
past ``offsets[-1]`` belong to no expert: zero output, no gradient. ``wgrad_into`` and
:func:`fp8_block_grouped_gemm_of_activation` are as for ``fp8_grouped_gemm``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore.kernels import dispatch
from mcore.kernels.fp8_grouped_gemm import (
    Fp8ExpertOps,
    WgradInto,
    _cast_backend,
    _Fp8GroupedGemm,
    _segments,
    _store_weight_grad,
    apply_of_activation,
    reference_expert_wgrad,
)
from mcore.kernels.fp8_weight_cache import WeightCastCache
from mcore.kernels.grouped_gemm import _check, _tail
from mcore.kernels.quantization import BLOCK, E4M3, Quantized, quantize_fp8
from mcore.kernels.wgrad_defer import Defer

__all__ = ["ALIGN", "fp8_block_grouped_gemm", "fp8_block_grouped_gemm_of_activation"]

ALIGN = BLOCK  # rows per expert, K and N: whole 128-row tiles and 128 x 128 weight blocks per expert


def fp8_block_grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    backend: str | None = None,
    tail_rows: int | None = None,
    wgrad_into: WgradInto | None = None,
    defer: Defer | None = None,
    weight_casts: WeightCastCache | None = None,
) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e]^T`` with block-scaled fp8 operands: ``x`` [T, K], ``w`` [E, N, K] -> [T, N].

    ``backend``: ``"triton"``, ``"reference"`` or ``None`` (CUDA -> triton). ``tail_rows``, ``wgrad_into``, ``defer``,
    ``weight_casts``: ``fp8_grouped_gemm``'s contracts (a writer function is refused). Raises ``ValueError`` when K,
    N or an expert's row count is not a multiple of 128.
    """
    _check_blocks(x, w, offsets)
    tail = _tail(tail_rows, x.shape[0])
    chosen = _choose(x, w, backend)
    return _Fp8GroupedGemm.apply(x, w, offsets, BLOCKWISE, chosen, tail, wgrad_into, defer, weight_casts)


def fp8_block_grouped_gemm_of_activation(
    h: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    *,
    backend: str | None = None,
    tail_rows: int | None = None,
    wgrad_into: WgradInto | None = None,
    defer: Defer | None = None,
    weight_casts: WeightCastCache | None = None,
) -> torch.Tensor:
    """``fp8_block_grouped_gemm(activation(h), w, offsets)`` saving ``h``, not the activation's output (backward
    recomputes it): ``fp8_grouped_gemm_of_activation``'s contract with block-wise scales."""
    return apply_of_activation("fp8_block_grouped_gemm_of_activation", BLOCKWISE, _check_blocks, _choose, h, w,
                               offsets, activation, backend, tail_rows, wgrad_into, defer, weight_casts)  # fmt: skip


def _check_blocks(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    """``grouped_gemm``'s checks, then the 128-multiples: K, N and every expert's rows (the offsets, on the host)."""
    _check(x, w, offsets)
    for name, value in (("K", w.shape[2]), ("N", w.shape[1])):
        if value % ALIGN:
            raise ValueError(
                f"fp8_block_grouped_gemm: {name}={value} must be a multiple of {ALIGN} for block-wise fp8 expert "
                "GEMMs (pad the dimension or keep these experts in bf16)"
            )
    ends = offsets.tolist()
    counts = [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    if any(count % ALIGN for count in counts):
        raise ValueError(
            f"fp8_block_grouped_gemm: every expert's row count must be a multiple of {ALIGN}, got {counts} "
            f"(pad each expert's rows: the MoE layer's align={ALIGN})"
        )


def _choose(x: torch.Tensor, w: torch.Tensor, backend: str | None) -> str:
    return dispatch.choose("fp8_block_grouped_gemm", x, w, backend=backend)


def _block_weights(w: torch.Tensor, backend: str, need_t: bool) -> tuple[Quantized, Quantized | None]:
    """``w`` [E, N, K] in 128x128 blocks (scales [E, N/128, K/128]) and, when asked, ``w^T`` [E, K, N]: the same
    blocks transposed, the same bits as casting ``w[e]^T`` (a block's amax does not depend on its orientation)."""
    experts, n, k = w.shape
    # one cast of all experts: N is a multiple of 128, so no block spans two experts
    q = quantize_fp8(w.reshape(experts * n, k), E4M3, "128x128", backend=_cast_backend(backend))
    data, scale = q.data.view(experts, n, k), q.scale.reshape(experts, n // BLOCK, k // BLOCK)
    qw = Quantized(data, scale, "128x128")
    if not need_t:
        return qw, None
    return qw, Quantized(data.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous(), "128x128")


def _block_rows(t: torch.Tensor, backend: str) -> Quantized:
    return quantize_fp8(t, E4M3, "1x128", backend=_cast_backend(backend))


def _dot_operand(data: torch.Tensor) -> torch.Tensor:
    """``data`` for the Triton dot: fp16 stand-ins under the interpreter (its dot takes no fp8; fp16 is exact)."""
    return data.to(torch.float16) if not data.is_cuda else data


def _block_gemm(qa: Quantized, qb: Quantized, offsets: torch.Tensor, backend: str, tail: int) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]^T`` of 1x128 ``a`` [T, K] and 128x128 ``b`` [E, N, K]: [T, N] in fp32
    (bf16 from the CUDA kernel); rows of no expert are zero (whole tiles: ``tail`` needs no masking pass)."""
    rows = qa.data.shape[0]
    if backend == dispatch.TRITON:
        from mcore.kernels.triton.block_grouped_mm import block_grouped_mm

        starts = torch.arange(0, rows, BLOCK, device=offsets.device, dtype=offsets.dtype)
        tile_expert = torch.searchsorted(offsets, starts, right=True).to(torch.int32)
        out_dtype = torch.bfloat16 if qa.data.is_cuda else torch.float32
        a, b = _dot_operand(qa.data), _dot_operand(qb.data)
        return block_grouped_mm(a, b, qa.scale, qb.scale, tile_expert, out_dtype)
    out = torch.zeros(rows, qb.data.shape[1], dtype=torch.float32, device=qa.data.device)
    a = qa.dequantize(torch.float32)
    for expert, start, end in _segments(offsets):
        out[start:end] = a[start:end] @ Quantized(qb.data[expert], qb.scale[expert], "128x128").dequantize().t()
    return out


def _block_wgrad(dy, x, offsets, experts: int, backend: str, into=None) -> torch.Tensor | None:
    """``dw[e] = dy[rows of e]^T @ x[rows of e]`` of ``dy^T`` [N, T] and ``x^T`` [K, T] in 1x128 tiles along the
    tokens: [E, N, K] fp32, or ``None`` when ``into`` took it. The rows of no expert form token blocks of their
    own (``offsets[-1]`` is a multiple of 128), which no expert's GEMM reads."""
    qdy_t = quantize_fp8(dy, E4M3, "1x128", transpose=True, backend=_cast_backend(backend))
    qx_t = quantize_fp8(x, E4M3, "1x128", transpose=True, backend=_cast_backend(backend))
    if backend == dispatch.TRITON:
        from mcore.kernels.triton.block_grouped_mm import block_grouped_wgrad

        a, b = _dot_operand(qdy_t.data), _dot_operand(qx_t.data)
        return _store_weight_grad(block_grouped_wgrad(a, b, qdy_t.scale, qx_t.scale, offsets), into)
    return reference_expert_wgrad(qdy_t.dequantize(), qx_t.dequantize(), offsets, into)


BLOCKWISE = Fp8ExpertOps(_block_weights, _block_rows, _block_gemm, _block_wgrad, "128x128")
