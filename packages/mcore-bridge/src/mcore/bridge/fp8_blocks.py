"""DeepSeek's block-wise FP8 checkpoints: ``<name>.weight`` in float8_e4m3fn with ``<name>.weight_scale_inv`` fp32,
one scale per ``weight_block_size`` block (128 x 128 in DeepSeek-V3; edge blocks are partial), announced by
``config.json``'s ``quantization_config`` (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size``).

Import dequantizes each such weight (``q x scale`` per block, in fp32, then the checkpoint's dtype: bf16 unless
``--dtype`` says otherwise) as it is read, one tensor at a time, and keeps the source's scales beside the mcore
checkpoint (``hf/fp8_scale_inv.safetensors``). Export writes bf16 (``quantization_config`` dropped), or with
``fp8_blocks`` the same format: the weights the source had quantized (else every linear projection) are quantized
again with the source's scale of each block when the block still fits it, and with ``amax / 448`` otherwise. With the
source's scales the round trip FP8 -> mcore -> FP8 gives back every byte: ``q x s`` rounded to bf16 or fp32 is within
a relative 2^-9 of ``q x s``, far inside half an e4m3 step, so dividing by ``s`` rounds back to ``q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mcore.bridge.errors import BridgeError
from mcore.bridge.safetensors_io import TensorEntry, TensorSpec, read_header, read_tensor
from mcore.train.checkpoint.safetensors_stream import SafetensorsStreamWriter

E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
SCALES_FILE = "fp8_scale_inv.safetensors"  # inside the mcore checkpoint's hf/ directory
# a bf16/fp32 round of q x s may push a block's largest value just past 448 x s: still that block's scale
_FIT = 1.0 + 2.0**-7

__all__ = ["BlockFormat", "Fp8Source", "block_format", "dequantize", "quantize_blocks", "without_quantization_config"]


@dataclass(frozen=True)
class BlockFormat:
    """Rows and columns of one scaled block."""

    rows: int
    cols: int

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return (math.ceil(shape[0] / self.rows), math.ceil(shape[1] / self.cols))


def block_format(config: dict[str, Any], where: str) -> BlockFormat | None:
    """The block format ``config.json``'s ``quantization_config`` announces (None: not quantized)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return None  # not this format (other methods are checked, or refused, by mcore.bridge.quantization)
    if q.get("fmt", "e4m3") != "e4m3":
        raise BridgeError(
            f"{where}: quantization_config {q!r} is not supported; the bridge reads DeepSeek's block-wise FP8 "
            "(quant_method 'fp8', fmt 'e4m3', weight_block_size [rows, cols])"
        )
    size = q.get("weight_block_size")
    if not (isinstance(size, list | tuple) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise BridgeError(f"{where}: quantization_config.weight_block_size must be [rows, cols] > 0, got {size!r}")
    return BlockFormat(*size)


def without_quantization_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` for unquantized weights (a bf16 export of an FP8 source)."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def _expand(scale: torch.Tensor, fmt: BlockFormat, shape: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(fmt.rows, 0).repeat_interleave(fmt.cols, 1)[: shape[0], : shape[1]]


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFormat, name: str = "weight") -> torch.Tensor:
    """``q [M, N]`` (e4m3) times its block's ``scale_inv [ceil(M/rows), ceil(N/cols)]``, in fp32."""
    if q.dim() != 2:
        raise BridgeError(f"{name}: block-wise FP8 weights are 2-D, got shape {list(q.shape)}")
    want = fmt.scale_shape(tuple(q.shape))
    if tuple(scale_inv.shape) != want:
        raise BridgeError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}, but {name} {list(q.shape)} in blocks of "
            f"{fmt.rows}x{fmt.cols} (quantization_config.weight_block_size) needs {list(want)}"
        )
    return q.float() * _expand(scale_inv.float(), fmt, tuple(q.shape))


def quantize_blocks(
    w: torch.Tensor, fmt: BlockFormat, scale_inv: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q e4m3, scale_inv fp32)`` of ``w [M, N]``: each block's ``scale_inv`` (when given, and the block fits it)
    or ``amax / 448`` (1 for an all-zero block)."""
    shape = tuple(w.shape)
    rows, cols = fmt.scale_shape(shape)
    padded = w.float().new_zeros(rows * fmt.rows, cols * fmt.cols)
    padded[: shape[0], : shape[1]] = w.float()
    amax = padded.view(rows, fmt.rows, cols, fmt.cols).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if scale_inv is not None:
        stored = scale_inv.float()
        scale = torch.where(amax <= E4M3_MAX * stored * _FIT, stored, scale)
    q = (w.float() / _expand(scale, fmt, shape)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Source:
    """The tensors of an FP8 block checkpoint as the import plan sees them: each quantized weight stands for its
    dequantized self (dtype bf16), its scale is consumed; :meth:`read` dequantizes while reading."""

    def __init__(self, tensors: dict[str, TensorEntry], fmt: BlockFormat, where: str) -> None:
        self.fmt = fmt
        scales = {n[: -len(SCALE_SUFFIX)]: e for n, e in tensors.items() if n.endswith(SCALE_SUFFIX)}
        quantized = [n for n, e in tensors.items() if e.dtype == torch.float8_e4m3fn]
        missing = [n for n in quantized if n not in scales]
        orphans = [n + SCALE_SUFFIX for n in scales if n not in tensors or tensors[n].dtype != torch.float8_e4m3fn]
        if missing or orphans:
            raise BridgeError(
                f"{where}: malformed FP8 block checkpoint: "
                + "; ".join(
                    part
                    for part in (
                        f"float8 weights without a {SCALE_SUFFIX}: {missing[:4]}" if missing else "",
                        f"scales without a float8 weight: {orphans[:4]}" if orphans else "",
                    )
                    if part
                )
            )
        for name in quantized:
            entry, scale = tensors[name], scales[name]
            want = fmt.scale_shape(entry.shape) if len(entry.shape) == 2 else None
            if want is None or scale.shape != want:
                raise BridgeError(
                    f"{where}: {name}{SCALE_SUFFIX} has shape {list(scale.shape)}, but {name} {list(entry.shape)} "
                    f"in blocks of {fmt.rows}x{fmt.cols} (quantization_config.weight_block_size) needs "
                    f"{list(want) if want else 'a 2-D weight'}"
                )
        self.quantized = {n: (tensors[n], scales[n]) for n in quantized}
        self.tensors = {
            n: (replace(e, dtype=torch.bfloat16) if n in self.quantized else e)
            for n, e in tensors.items()
            if not n.endswith(SCALE_SUFFIX)
        }

    def read(self, name: str, entry: TensorEntry) -> torch.Tensor:
        if name not in self.quantized:
            return read_tensor(entry)
        q, scale = self.quantized[name]
        return dequantize(read_tensor(q), read_tensor(scale), self.fmt, name)

    def scales(self) -> dict[str, torch.Tensor]:
        """The source's scales by their HF name (what the export reuses)."""
        return {n + SCALE_SUFFIX: read_tensor(s) for n, (_, s) in self.quantized.items()}


def save_scales(scales: dict[str, torch.Tensor], path: Path) -> None:
    """Write the source's scales (what :func:`load_scales` reads) as one safetensors file."""
    writer = SafetensorsStreamWriter(path, {n: (t.dtype, tuple(t.shape)) for n, t in scales.items()})
    try:
        for name in sorted(scales):  # the order the writer lays them out in
            writer.write(name, scales[name])
        writer.close()
    except BaseException:
        writer.abort()
        raise


def load_scales(assets: Path | None) -> dict[str, torch.Tensor]:
    """The scales an FP8 import kept in an mcore checkpoint's ``hf/`` (empty when there are none)."""
    if assets is None or not (assets / SCALES_FILE).is_file():
        return {}
    return {name: read_tensor(entry) for name, entry in read_header(assets / SCALES_FILE).tensors.items()}


def is_projection(name: str, shape: tuple[int, ...]) -> bool:
    """The weights DeepSeek quantizes: 2-D linear projections (``*_proj``, ``kv_a_proj_with_mqa``, experts)."""
    return len(shape) == 2 and name.endswith(".weight") and "proj" in name.split(".")[-2]


def fp8_specs(specs: list[TensorSpec], fmt: BlockFormat, chosen) -> list[TensorSpec]:
    """``specs`` with each chosen weight in e4m3 and followed by its fp32 scale."""
    out = []
    for spec in specs:
        if chosen(spec.name, spec.shape):
            out.append(TensorSpec(spec.name, torch.float8_e4m3fn, spec.shape))
            out.append(TensorSpec(spec.name + SCALE_SUFFIX, torch.float32, fmt.scale_shape(spec.shape)))
        else:
            out.append(spec)
    return out
