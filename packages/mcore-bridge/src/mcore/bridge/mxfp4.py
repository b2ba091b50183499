"""MXFP4 checkpoints (GPT-OSS's released files): read dequantized, written back on request, bit for bit.

The files hold each expert weight ``W`` (Hugging Face's ``[E, in, out]`` parameter) as ``W_blocks`` uint8
``[E, out, in/32, 16]`` (two E2M1 codes per byte, the lower index in the low nibble) and ``W_scales`` uint8
``[E, out, in/32]`` (E8M0: ``2^(s - 127)``, 255 is NaN), one scale per 32 consecutive inputs (OCP MX v1.0), and say
so in ``config.json``: ``quantization_config: {"quant_method": "mxfp4", ...}``. A quantization config no reader
handles is refused before anything is written (``mcore.bridge.quantization``).

* Import: :func:`dequantized_view` replaces each ``_blocks`` / ``_scales`` pair by an entry that reads as the bf16
  tensor ``W`` (exact: every E2M1 value times a power of two is a bf16 number), expert by expert, so a conversion
  still holds about one tensor at a time. The original scales are kept beside the mcore checkpoint
  (``hf/mxfp4_scales.safetensors``, 1/64 of the bf16 size).
* Export with ``quantize="mxfp4"``: the expert weights are encoded again; a 32-block whose values its kept scale
  represents exactly keeps that scale (so an untouched MXFP4 source comes back bit-exact), any other block gets
  the OCP scale ``floor(log2(amax)) - 2`` with round-to-nearest-even codes (``mcore.kernels.microscaling``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore.bridge.errors import BridgeError
from mcore.bridge.quantization import QUANT_KEY, quant_method
from mcore.bridge.safetensors_io import DerivedEntry, TensorEntry, read_header, read_tensor
from mcore.kernels.microscaling import (
    MXTensor,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    pack_fp4,
    quantize_mx,
    unpack_fp4,
)
from mcore.train.checkpoint.safetensors_stream import SafetensorsStreamWriter

__all__ = [
    "METHOD",
    "SCALES_FILE",
    "MXFP4Entry",
    "dequantize",
    "dequantized_view",
    "encoder",
    "quantization_method",
    "quantized_outputs",
    "set_quantization_config",
    "write_scales",
]

METHOD = "mxfp4"
SCALES_FILE = "mxfp4_scales.safetensors"
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32
# What an MXFP4 export quantizes (as the released checkpoints do): the experts' two weights.
QUANTIZED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
DEFAULT_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],  # fmt: skip
    "quant_method": METHOD,
}


def quantization_method(config: dict[str, Any], where: str) -> str | None:
    """``config.json``'s ``quant_method`` (``None`` when plain); BridgeError for one the bridge cannot read
    (``mcore.bridge.quantization``)."""
    return quant_method(config, where)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., G, 16]`` packed codes and ``[..., G]`` E8M0 scales -> ``[..., G * 32]`` values in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise BridgeError(
            f"MXFP4 blocks {blocks.dtype} {list(blocks.shape)} and scales {scales.dtype} {list(scales.shape)} must "
            "be uint8 [..., G, 16] and [..., G]"
        )
    n = blocks.shape[-2] * BLOCK
    return MXTensor(blocks.reshape(*scales.shape[:-1], n // 2), scales, "e2m1", n).dequantize(dtype)


@dataclass(frozen=True)
class MXFP4Entry(DerivedEntry):
    """The bf16 tensor ``W`` [E, in, out] of an MXFP4 pair, dequantized expert by expert when read."""

    blocks: TensorEntry | None = None
    scales: TensorEntry | None = None

    def read(self) -> torch.Tensor:
        blocks, scales = read_tensor(self.blocks), read_tensor(self.scales)
        out = torch.empty((self.shape[0], self.shape[2], self.shape[1]), dtype=self.dtype)
        for e in range(self.shape[0]):
            out[e] = dequantize(blocks[e], scales[e], self.dtype)
        return out.transpose(1, 2)


def dequantized_view(tensors: dict[str, TensorEntry], config: dict[str, Any], where: str) -> dict[str, TensorEntry]:
    """``tensors`` with each ``W_blocks`` + ``W_scales`` pair replaced by an :class:`MXFP4Entry` named ``W``, when
    ``config`` says MXFP4 (unchanged when it says nothing; BridgeError for another quantization or a lone half)."""
    if quantization_method(config, where) != METHOD:
        return tensors
    out: dict[str, TensorEntry] = {}
    for name, entry in tensors.items():
        if name.endswith(SCALES) and name[: -len(SCALES)] + BLOCKS in tensors:
            continue
        if not name.endswith(BLOCKS):
            if name.endswith(SCALES):
                raise BridgeError(f"{where}: MXFP4 scales {name} have no {name[: -len(SCALES)] + BLOCKS}")
            out[name] = entry
            continue
        base = name[: -len(BLOCKS)]
        scales = tensors.get(base + SCALES)
        if scales is None:
            raise BridgeError(f"{where}: MXFP4 blocks {name} have no {base + SCALES}")
        if len(entry.shape) != 4 or entry.shape[-1] != 16 or tuple(scales.shape) != tuple(entry.shape[:-1]):
            raise BridgeError(
                f"{where}: MXFP4 {name} {list(entry.shape)} / {base + SCALES} {list(scales.shape)} must be "
                "[E, out, in/32, 16] / [E, out, in/32]"
            )
        e, rows, groups = scales.shape
        shape = (e, groups * BLOCK, rows)
        nbytes = e * groups * BLOCK * rows * 2
        out[base] = MXFP4Entry(base, torch.bfloat16, shape, entry.path, entry.offset, nbytes, entry, scales)
    return out


def write_scales(tensors: dict[str, TensorEntry], directory: Path) -> None:
    """Keep the scales of the MXFP4 entries of ``tensors`` in ``directory / SCALES_FILE`` (nothing without any)."""
    pairs = {e.scales.name: e.scales for e in tensors.values() if isinstance(e, MXFP4Entry)}
    if not pairs:
        return
    writer = SafetensorsStreamWriter(directory / SCALES_FILE, {n: (torch.uint8, s.shape) for n, s in pairs.items()})
    try:
        for name, entry in pairs.items():
            writer.write(name, read_tensor(entry))
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _encode(w: torch.Tensor, kept: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``w`` [R, n] -> (blocks uint8 [R, n/32, 16], scales uint8 [R, n/32]); see the module doc."""
    rows, n = w.shape
    fresh = quantize_mx(w, "e2m1")
    codes = unpack_fp4(fresh.elements).view(rows, n // BLOCK, BLOCK)
    scales = fresh.scales
    if kept is not None:
        blocks = w.float().view(rows, n // BLOCK, BLOCK)
        scale = e8m0_decode(kept).unsqueeze(-1)
        kept_codes = e2m1_encode(blocks / scale)
        exact = (e2m1_decode(kept_codes) * scale == blocks).all(-1)
        codes = torch.where(exact.unsqueeze(-1), kept_codes, codes)
        scales = torch.where(exact, kept, scales)
    return pack_fp4(codes).view(rows, n // BLOCK, BLOCK // 2), scales


def encoder(scales_file: Path | None) -> Callable[[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]:
    """``encode(name, tensor)``: the HF tensors to write for ``name`` (MXFP4 pairs for :data:`QUANTIZED` weights,
    the tensor itself otherwise), using the scales kept in ``scales_file`` where they still fit."""
    kept = read_header(scales_file).tensors if scales_file is not None and scales_file.is_file() else {}

    def encode(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not name.endswith(QUANTIZED):
            yield name, tensor
            return
        w = tensor.transpose(1, 2)  # [E, out, in]
        e, rows, n = w.shape
        ref = kept.get(name + SCALES)
        ref_scales = read_tensor(ref) if ref is not None and tuple(ref.shape) == (e, rows, n // BLOCK) else None
        blocks = torch.empty((e, rows, n // BLOCK, BLOCK // 2), dtype=torch.uint8)
        scales = torch.empty((e, rows, n // BLOCK), dtype=torch.uint8)
        for i in range(e):
            blocks[i], scales[i] = _encode(w[i], None if ref_scales is None else ref_scales[i])
        yield name + BLOCKS, blocks
        yield name + SCALES, scales

    return encode


def quantized_outputs(
    outputs: list[tuple[str, torch.dtype, tuple[int, ...]]], where: str
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """An export plan's ``(name, dtype, shape)`` list with the :data:`QUANTIZED` weights as MXFP4 pairs."""
    out, found = [], False
    for name, dtype, shape in outputs:
        if not name.endswith(QUANTIZED):
            out.append((name, dtype, shape))
            continue
        e, n, rows = shape
        if n % BLOCK:
            raise BridgeError(f"{where}: {name} {list(shape)} cannot be stored in MXFP4: its {n} inputs are not a "
                              f"multiple of {BLOCK}")  # fmt: skip
        out += [(name + BLOCKS, torch.uint8, (e, rows, n // BLOCK, BLOCK // 2)),
                (name + SCALES, torch.uint8, (e, rows, n // BLOCK))]  # fmt: skip
        found = True
    if not found:
        raise BridgeError(f"{where}: --quantize {METHOD} applies to GPT-OSS experts; this model has none")
    return out


def set_quantization_config(hf_config: dict[str, Any], method: str | None, original: dict | None) -> dict[str, Any]:
    """``hf_config`` saying what the written weights are: an MXFP4 ``quantization_config`` (the original's, or the
    released checkpoints') when ``method`` is MXFP4, none carried over from an MXFP4 source otherwise (another
    method's config is left to its own writer)."""
    carried = hf_config.get(QUANT_KEY)
    was_mxfp4 = isinstance(carried, dict) and carried.get("quant_method") == METHOD
    out = {k: v for k, v in hf_config.items() if not (k == QUANT_KEY and was_mxfp4)}
    if method == METHOD:
        source = (original or {}).get(QUANT_KEY)
        ours = isinstance(source, dict) and source.get("quant_method") == METHOD
        out[QUANT_KEY] = copy.deepcopy(source if ours else DEFAULT_CONFIG)
    return out
