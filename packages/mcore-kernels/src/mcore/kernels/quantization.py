"""FP8 quantization: e4m3 / e5m2 casts with tensor-wise, row-wise and block-wise scales, fused with the transpose.

Every GEMM operand is quantized along its own reduction dimension: for ``C = A @ B^T`` both ``A [M, K]`` and
``B [N, K]`` are stored row-major with their scales grouped along ``K``. A linear layer's three GEMMs need
``x`` and ``W`` along ``K`` (forward), ``grad`` along ``N`` and ``W^T`` (input gradient), ``grad^T`` and ``x^T``
along ``M`` (weight gradient). ``transpose=True`` quantizes ``x^T`` straight from ``x``: the Triton kernels
read ``x`` once and write the transposed fp8 tensor, so no high-precision transpose is ever materialized.

Granularities (``scale`` is the fp32 *dequantization* multiplier, what ``torch._scaled_mm`` consumes):

==========  ======================================  =================================================
``tensor``  one scale                               ``scale`` shape ``[]``
``row``     one scale per row (along K)             ``[R, 1]``
``1x128``   one per row and 128 columns             ``[R, ceil(C/128)]`` (DeepSeek-V3 activations)
``128x128`` one per 128 x 128 block                 ``[ceil(R/128), ceil(C/128)]`` (weights)
==========  ======================================  =================================================

The scale of a group with absolute maximum ``amax`` maps ``amax`` onto the format's largest finite value
(448 for e4m3, 57344 for e5m2): ``q = cast(clamp(x * (fmax / amax), -fmax, fmax))`` with round-to-nearest-even,
``scale = 1 / (fmax / amax)``; an all-zero group gets scale 1. Values beyond the range saturate (no inf);
NaN stays NaN. Partial blocks at the edges are scaled by their own elements only.

``amax`` (tensor-wise) and ``amax_reduce`` (tensor- and row-wise) let a caller supply a delayed-scaling amax or
reduce the amax over the ranks that hold parts of the same logical tensor before the scales are derived.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore.kernels import dispatch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
GRANULARITIES = ("tensor", "row", "1x128", "128x128")
BLOCK = 128
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

AmaxReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Quantized:
    """An fp8 tensor ``data [R, C]`` (contiguous) with its dequantization ``scale`` at ``granularity``."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` (scales expanded over their groups) in ``dtype``."""
        return (self.data.to(torch.float32) * expand_scale(self.scale, self.granularity, self.data.shape)).to(dtype)


def fp8_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"e4m3"`` / ``"e5m2"`` (or the torch dtype itself) -> ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``."""
    if isinstance(name, torch.dtype) and name in FP8_MAX:
        return name
    if name not in FP8_FORMATS:
        raise ValueError(f"unknown fp8 format {name!r}; expected one of {sorted(FP8_FORMATS)}")
    return FP8_FORMATS[name]


def expand_scale(scale: torch.Tensor, granularity: str, shape: tuple[int, int]) -> torch.Tensor:
    """The per-element scale of a ``shape`` tensor from its per-group ``scale``."""
    rows, cols = shape
    if granularity in ("tensor", "row"):
        return scale
    if granularity == "1x128":
        return scale.repeat_interleave(BLOCK, dim=1)[:, :cols]
    return scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :cols]


def amax_floor(fmax: float) -> float:
    """The smallest amax a scale is derived from: ``fmax`` times the smallest normal fp32. Below it ``fmax / amax``
    would reach inf (from ``amax < fmax / FLT_MAX``), and a group of tiny values and zeros would quantize to
    ``0 * inf = NaN`` (a 500-step block-wise run on the H200 turned NaN at step 22 so); floored, the multiplier stays
    finite and the scale a normal number, and the group's values still fit (``|x| <= amax < floor``)."""
    return fmax * torch.finfo(torch.float32).tiny


def scale_from_amax(amax: torch.Tensor, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(multiplier, dequantization scale)`` in fp32 from an amax tensor: ``fmax / amax`` and its reciprocal.

    A zero (or non-finite) amax gives multiplier 1, so an all-zero group quantizes to zeros and a NaN in the
    data stays visible as NaN instead of poisoning the scale of its neighbours with inf. A positive amax below
    :func:`amax_floor` is raised to it.
    """
    amax = amax.to(torch.float32)
    ok = (amax > 0) & torch.isfinite(amax)
    floored = amax.clamp(min=amax_floor(fmax))
    # torch.div of two tensors is correctly rounded; ``fmax / tensor`` is not (it multiplies by a reciprocal)
    multiplier = torch.where(ok, torch.full_like(amax, fmax).div(torch.where(ok, floored, 1.0)), 1.0)
    return multiplier, torch.ones_like(multiplier).div(multiplier)


def quantize_fp8(
    x: torch.Tensor,
    dtype: str | torch.dtype = E4M3,
    granularity: str = "tensor",
    *,
    transpose: bool = False,
    amax: torch.Tensor | None = None,
    amax_reduce: AmaxReduce | None = None,
    backend: str | None = None,
) -> Quantized:
    """Quantize the 2-D ``x`` (or ``x^T`` with ``transpose=True``) to fp8 along its last dimension.

    ``amax`` (tensor granularity only) replaces the measured absolute maximum (delayed scaling);
    ``amax_reduce(t)`` reduces the measured amax in place (a max over the tensor-parallel group) before the
    scales are derived (tensor and row granularity; block scales never span ranks).
    """
    dtype = fp8_dtype(dtype)
    _check_input(x, granularity, amax, amax_reduce)
    chosen = dispatch.choose("quantize_fp8", x, backend=backend)
    source = x.t() if transpose else x
    if granularity in ("tensor", "row"):
        if amax is None:
            amax = abs_max(source, None if granularity == "tensor" else 1)
            if amax_reduce is not None:
                amax_reduce(amax)
        multiplier, scale = scale_from_amax(amax, FP8_MAX[dtype])
        if chosen == dispatch.TRITON:
            from mcore.kernels.triton import quantization as tq

            data = tq.cast_scaled(x, multiplier, dtype, transpose=transpose)
        else:
            data = reference_cast(source, multiplier, dtype)
        return Quantized(data, scale if granularity == "row" else scale.reshape(()), granularity)
    if chosen == dispatch.TRITON:
        from mcore.kernels.triton import quantization as tq

        data, scale = tq.quantize_blocks(x, dtype, granularity, transpose=transpose)
        return Quantized(data, scale, granularity)
    return reference_quantize_blocks(source, dtype, granularity)


def abs_max(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``max |x|`` in fp32 (over ``dim``, kept) without the ``|x|`` temporary ``x.abs().amax()`` writes and reads
    back: the infinity norm is one fused reduction, and asked for in fp32 it upcasts as it loads (one launch, where
    a bf16 result then cast to fp32 took two). Exact (a max: the same bits either way), and NaN propagates as with
    ``amax``."""
    if dim is None:
        return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    return torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)


def _check_input(x, granularity, amax, amax_reduce) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_fp8: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8: x must be 2-D [rows, cols] (reshape first), got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"quantize_fp8: x must be float32, bfloat16 or float16, got {x.dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize_fp8: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if amax is not None and (granularity != "tensor" or amax.numel() != 1):
        raise ValueError(
            f"quantize_fp8: amax= is a single value for granularity 'tensor' (delayed scaling), got "
            f"granularity {granularity!r} and amax of shape {tuple(amax.shape)}"
        )
    if amax_reduce is not None and granularity not in ("tensor", "row"):
        raise ValueError(
            f"quantize_fp8: amax_reduce applies to granularity 'tensor' or 'row', not {granularity!r} (block scales "
            "must not span ranks: shard on block boundaries instead)"
        )


# --------------------------------------------------------------------------------------------- references
def reference_cast(x: torch.Tensor, multiplier: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cast(clamp(x * multiplier, -fmax, fmax))`` in fp32 math; the result is contiguous."""
    fmax = FP8_MAX[dtype]
    return (x.to(torch.float32) * multiplier).clamp(-fmax, fmax).to(dtype).contiguous()


def block_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """Absolute maximum of each ``1x128`` or ``128x128`` group of the 2-D ``x`` (edges padded with zeros)."""
    rows, cols = x.shape
    block_rows = 1 if granularity == "1x128" else BLOCK
    pad_r, pad_c = (-rows) % block_rows, (-cols) % BLOCK
    a = torch.nn.functional.pad(x.abs().to(torch.float32), (0, pad_c, 0, pad_r))
    a = a.reshape(a.shape[0] // block_rows, block_rows, a.shape[1] // BLOCK, BLOCK)
    return a.amax(dim=(1, 3))


def reference_quantize_blocks(x: torch.Tensor, dtype: torch.dtype, granularity: str) -> Quantized:
    """Block-wise quantization in plain torch (the CPU path and the Triton kernels' reference)."""
    multiplier, scale = scale_from_amax(block_amax(x, granularity), FP8_MAX[dtype])
    data = reference_cast(x, expand_scale(multiplier, granularity, x.shape), dtype)
    return Quantized(data, scale, granularity)
