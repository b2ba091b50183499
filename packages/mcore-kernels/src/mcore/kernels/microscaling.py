"""Microscaling formats, exactly as defined, for emulation: MXFP8, MXFP4 (OCP MX v1.0) and NVFP4.

Hopper has no FP4 tensor cores, so these formats are used as emulation: quantize, dequantize, and run the
GEMM in high precision on the dequantized values. Getting the bits right here is what lets a recipe be
validated before Blackwell.

* **MX** (OCP Microscaling Formats v1.0): blocks of 32 consecutive elements along the last dimension share
  one E8M0 scale ``X = 2^e`` (stored as the unsigned byte ``e + 127``; ``0xFF`` is NaN) with
  ``e = floor(log2(amax)) - emax_elem`` (``emax_elem`` = exponent of the element format's largest normal: 8
  for E4M3, 15 for E5M2, 2 for E2M1), clamped to ``[-127, 127]``. Elements are ``x / X`` rounded to nearest
  even in the element format, saturating at its largest finite value. An all-zero block gets ``e = -127``.
* **NVFP4** (NVIDIA): blocks of 16 share an E4M3 scale, on top of one fp32 per-tensor scale
  ``g = amax(x) / (6 * 448)``: block scale ``s = e4m3(amax(block) / (6 * g))``, elements
  ``e2m1(x / (s * g))``; ``x ~ e2m1 * s * g``.

FP4 (E2M1) codes are 4 bits ``s e e m``: magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` for codes 0-7, bit 3 the
sign. Two codes are packed per byte, the element with the lower index in the low nibble (the layout of
``torch.float4_e2m1fn_x2`` and of MXFP4 checkpoints such as GPT-OSS's ``*_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore.kernels.quantization import E4M3, E5M2, FP8_MAX

MX_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255
# Magnitudes of the E2M1 codes 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MX_ELEMENTS = {"e4m3": (E4M3, 8), "e5m2": (E5M2, 15), "e2m1": (None, 2)}


@dataclass(frozen=True)
class MXTensor:
    """``elements`` (fp8 ``[..., n]``, or packed E2M1 codes ``uint8 [..., n/2]``) and E8M0 ``scales``
    (``uint8 [..., ceil(n/32)]``) of an MX tensor whose last dimension holds ``n`` values."""

    elements: torch.Tensor
    scales: torch.Tensor
    element_format: str
    n: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mx(self, dtype)


@dataclass(frozen=True)
class NVFP4Tensor:
    """Packed E2M1 ``codes`` (``uint8 [..., n/2]``), E4M3 ``block_scales`` (``[..., ceil(n/16)]``) and the fp32
    ``global_scale`` of an NVFP4 tensor whose last dimension holds ``n`` values."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor
    n: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(self, dtype)


# -------------------------------------------------------------------------------------------------- E2M1
def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """``v`` (fp32) rounded to the nearest E2M1 value, ties to even, saturating at +-6.

    The E2M1 grid is uniform within each binade: steps of 0.5 below 2, 1 in [2, 4), 2 in [4, 6]. Rounding
    ``|v| / step`` half to even picks the even code at every tie, because a code's lowest bit is its mantissa bit.
    """
    mag = v.abs().clamp(max=E2M1_MAX)
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(mag / step) * step, v)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (``uint8`` in 0..15) of fp32 ``v``: nearest value, ties to even, saturating at +-6."""
    r = e2m1_round(v).abs()
    # value -> code: 0, 0.5, 1, 1.5 -> 0..3 (2r); 2, 3 -> 4, 5 (r + 2); 4, 6 -> 6, 7 (r / 2 + 4)
    code = torch.where(r < 2.0, 2.0 * r, torch.where(r < 4.0, r + 2.0, r / 2.0 + 4.0)).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (``uint8`` in 0..15)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack_fp4(code: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte along the last dimension (even length), the lower index in the low nibble."""
    if code.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dimension must be even to pack two codes per byte, got {code.shape}")
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# --------------------------------------------------------------------------------------------------- MX
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [..., n]`` as fp32 ``[..., ceil(n/block), block]``, the partial last block padded with zeros."""
    n = x.shape[-1]
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, (-n) % block))
    return padded.reshape(*x.shape[:-1], -1, block)


def quantize_mx(x: torch.Tensor, element_format: str = "e2m1") -> MXTensor:
    """MX quantization of ``x [..., n]`` (blocks of 32 along the last dim); ``element_format`` e4m3/e5m2/e2m1."""
    if element_format not in MX_ELEMENTS:
        raise ValueError(f"quantize_mx: element_format must be one of {sorted(MX_ELEMENTS)}, got {element_format!r}")
    _check_float(x, "quantize_mx")
    n = x.shape[-1]
    if element_format == "e2m1" and n % 2:
        raise ValueError(f"quantize_mx: e2m1 packs two values per byte, so the last dim must be even, got {n}")
    elem_dtype, emax = MX_ELEMENTS[element_format]
    blocks = _blocks(x, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    e = _mx_exponents(amax, emax)
    scales = (e + E8M0_BIAS).to(torch.uint8)
    scales = torch.where(torch.isnan(amax), E8M0_NAN, scales).to(torch.uint8)
    scaled = torch.ldexp(blocks, -e.unsqueeze(-1).to(torch.float32))
    scaled = scaled.reshape(*x.shape[:-1], -1)[..., :n]
    if element_format == "e2m1":
        elements = pack_fp4(e2m1_encode(scaled.clamp(-E2M1_MAX, E2M1_MAX)))
    else:
        fmax = FP8_MAX[elem_dtype]
        elements = scaled.clamp(-fmax, fmax).to(elem_dtype)
    return MXTensor(elements, scales, element_format, n)


def _mx_exponents(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """The shared exponents ``floor(log2(amax)) - emax`` (int32), clamped to E8M0's range; -127 for zero blocks."""
    # frexp: amax = m * 2^k with m in [0.5, 1), so floor(log2(amax)) = k - 1 exactly (no log rounding)
    _, k = torch.frexp(amax)
    return torch.where(amax > 0, k - 1 - emax, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)


def e8m0_decode(scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(s - 127)`` of E8M0 bytes; 255 decodes to NaN."""
    value = torch.ldexp(torch.ones(scales.shape, device=scales.device), scales.to(torch.float32) - E8M0_BIAS)
    return torch.where(scales == E8M0_NAN, float("nan"), value)


def dequantize_mx(t: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if t.element_format == "e2m1":
        values = e2m1_decode(unpack_fp4(t.elements))
    else:
        values = t.elements.to(torch.float32)
    blocks = _blocks(values, MX_BLOCK) * e8m0_decode(t.scales).unsqueeze(-1)
    return blocks.reshape(*values.shape[:-1], -1)[..., : t.n].to(dtype)


# ------------------------------------------------------------------------------------------------ NVFP4
def quantize_nvfp4(x: torch.Tensor, global_amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """NVFP4 quantization of ``x [..., n]`` (``n`` even): 16-element E4M3 block scales under one fp32 scale.

    ``global_amax`` replaces ``amax(|x|)`` for the per-tensor level (e.g. reduced over tensor-parallel ranks).
    """
    _check_float(x, "quantize_nvfp4")
    n = x.shape[-1]
    if n % 2:
        raise ValueError(f"quantize_nvfp4: e2m1 packs two values per byte, so the last dim must be even, got {n}")
    blocks, block_scales, global_scale = _nvfp4_scales(x, global_amax)
    effective = block_scales.to(torch.float32) * global_scale
    safe = torch.where(effective > 0, effective, torch.ones_like(effective))
    scaled = torch.where(effective.unsqueeze(-1) > 0, blocks / safe.unsqueeze(-1), torch.zeros_like(blocks))
    scaled = scaled.reshape(*x.shape[:-1], -1)[..., :n]
    codes = pack_fp4(e2m1_encode(scaled.clamp(-E2M1_MAX, E2M1_MAX)))
    return NVFP4Tensor(codes, block_scales, global_scale, n)


def _nvfp4_scales(x: torch.Tensor, global_amax: torch.Tensor | None):
    """``(blocks fp32 [..., n/16, 16], block scales e4m3 [..., n/16], global scale fp32 [])`` of ``x``."""
    amax = x.abs().amax().to(torch.float32) if global_amax is None else global_amax.to(torch.float32).reshape(())
    fmax_e4m3 = FP8_MAX[E4M3]
    # tensor-by-tensor division: correctly rounded (division by a Python scalar multiplies by its reciprocal)
    global_scale = torch.where(amax > 0, amax.div(torch.full_like(amax, E2M1_MAX * fmax_e4m3)), torch.ones_like(amax))
    blocks = _blocks(x, NVFP4_BLOCK)
    wanted = blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale)
    return blocks, wanted.clamp(max=fmax_e4m3).to(E4M3), global_scale


def dequantize_nvfp4(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = e2m1_decode(unpack_fp4(t.codes))
    scale = t.block_scales.to(torch.float32) * t.global_scale
    blocks = _blocks(values, NVFP4_BLOCK) * scale.unsqueeze(-1)
    return blocks.reshape(*values.shape[:-1], -1)[..., : t.n].to(dtype)


def fake_quantize(x: torch.Tensor, fmt: str, global_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x's dtype for ``fmt`` in mxfp8 (e4m3), mxfp4, nvfp4 (emulated GEMMs);
    ``global_amax``: NVFP4's per-tensor amax (e.g. reduced over tensor-parallel ranks).

    Computes the same values as the round trip (tested bit for bit) without packing codes or building the
    scale encodings: the scales are applied as exact powers of two (MX) or fp32 products (NVFP4).
    """
    if fmt not in ("mxfp8", "mxfp4", "nvfp4"):
        raise ValueError(f"fake_quantize: format must be one of mxfp8, mxfp4, nvfp4, got {fmt!r}")
    _check_float(x, "fake_quantize")
    n = x.shape[-1]
    if fmt == "nvfp4":
        blocks, block_scales, global_scale = _nvfp4_scales(x, global_amax)
        scale = (block_scales.to(torch.float32) * global_scale).unsqueeze(-1)
        safe = torch.where(scale > 0, scale, 1.0)
        values = e2m1_round((blocks / safe).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    else:
        blocks = _blocks(x, MX_BLOCK)
        e = _mx_exponents(blocks.abs().amax(dim=-1), MX_ELEMENTS["e4m3" if fmt == "mxfp8" else "e2m1"][1])
        scaled = torch.ldexp(blocks, -e.unsqueeze(-1).to(torch.float32))
        if fmt == "mxfp8":
            scaled = scaled.clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3).to(torch.float32)
        else:
            scaled = e2m1_round(scaled.clamp(-E2M1_MAX, E2M1_MAX))
        values = scaled * torch.ldexp(torch.ones_like(scaled[..., :1]), e.unsqueeze(-1).to(torch.float32))
    return values.reshape(*x.shape[:-1], -1)[..., :n].to(x.dtype)


def _check_float(x, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() == 0:
        raise TypeError(
            f"{op}: x must be a float32/bfloat16/float16 tensor with >= 1 dim, got {x.dtype} {tuple(x.shape)}"
        )
