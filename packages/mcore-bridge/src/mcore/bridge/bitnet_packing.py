"""Hugging Face's packed BitNet b1.58 checkpoints (``quantization_config.quant_method: bitnet``, offline), both ways.

Format (transformers' ``integrations/bitnet.py``, ``BitLinear``): each quantized linear stores ``weight`` as uint8
``[out / 4, in]``, 2 bits per ternary value ``t + 1`` (``t`` in -1, 0, 1); row ``r`` of the ternary matrix is in
bits ``2 * (r // (out / 4))`` of packed row ``r % (out / 4)``; and ``weight_scale`` ``[1]``, the multiplier ``s``
with ``W = t / s`` (BitLinear computes ``x_q t^T / (s * input_scale)``). Every ``*_proj`` linear is packed;
embeddings, norms and ``lm_head`` are not.

mcore trains the latent high-precision weight and quantizes it online (``ternary_weight``: ``s = 1 / mean |W|``).
A packed tensor is imported as the latent weight ``t / (s * mean |t|)``: its mean magnitude is ``1 / s``, so the
online quantizer gives back exactly ``t`` and ``s``, and the model computes what the packed checkpoint computes;
exporting quantizes with the same ``s`` and packs the same ``t``, so packed -> mcore -> packed is bit-exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mcore.bridge.errors import BridgeError
from mcore.bridge.safetensors_io import TensorEntry, read_tensor

QUANT_METHOD = "bitnet"
VALUES_PER_BYTE = 4
EPS = 1e-5  # as mcore.kernels.bitnet and transformers' quantizers
OFFLINE_CONFIG = {"quant_method": QUANT_METHOD, "linear_class": "bitlinear", "quantization_mode": "offline"}
SCALE_SUFFIX = "_scale"  # "...q_proj.weight" -> "...q_proj.weight_scale"


def is_packed_config(hf_config: dict[str, Any] | None) -> bool:
    """Whether a ``config.json`` describes packed BitNet weights (offline ``bitlinear``)."""
    quant = (hf_config or {}).get("quantization_config") or {}
    return quant.get("quant_method") == QUANT_METHOD and quant.get("quantization_mode", "offline") == "offline"


def is_packed_name(name: str) -> bool:
    """The HF tensors a packed checkpoint stores packed: the weights of the ``*_proj`` linears."""
    return name.endswith("_proj.weight")


def pack_ternary(ternary: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` values in {-1, 0, 1} (rows a multiple of 4) -> uint8 ``[rows / 4, cols]``."""
    rows = ternary.shape[0]
    if rows % VALUES_PER_BYTE:
        raise BridgeError(f"packed BitNet weights need a row count divisible by 4, got {tuple(ternary.shape)}")
    codes = (ternary.to(torch.int16) + 1).to(torch.uint8).reshape(VALUES_PER_BYTE, rows // VALUES_PER_BYTE, -1)
    packed = torch.zeros(codes.shape[1:], dtype=torch.uint8)
    for i in range(VALUES_PER_BYTE):
        packed |= codes[i] << (2 * i)
    return packed


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[R, cols]`` -> int8 ``[4 R, cols]`` in {-1, 0, 1} (the inverse of :func:`pack_ternary`)."""
    if packed.dtype != torch.uint8:
        raise BridgeError(f"packed BitNet weights are uint8, got {packed.dtype}")
    parts = [((packed >> (2 * i)) & 3).to(torch.int8) - 1 for i in range(VALUES_PER_BYTE)]
    if any((p > 1).any() for p in parts):
        raise BridgeError("packed BitNet weights hold the code 3, which is no ternary value")
    return torch.cat(parts, dim=0)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8, weight_scale fp32 [1])`` of a latent weight, with the online quantizer's ``s``."""
    w = weight.float()
    scale = torch.ones((), dtype=torch.float32).div(w.abs().mean(dtype=torch.float64).float().clamp(min=EPS))
    ternary = (w * scale).round().clamp(-1, 1)
    return pack_ternary(ternary), scale.reshape(1)


def dequantize_weight(packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The latent weight ``t / (s * mean |t|)`` (see the module docstring) in ``dtype``."""
    ternary = unpack_ternary(packed).float()
    scale = weight_scale.float().reshape(())
    if not torch.isfinite(scale) or scale <= 0:
        raise BridgeError(f"weight_scale must be a positive finite number, got {scale.item()}")
    magnitude = ternary.abs().mean(dtype=torch.float64).float().clamp(min=EPS)
    return (ternary / (scale * magnitude)).to(dtype)


class PackedSources:
    """Import side: an HF checkpoint's tensors as the conversion plan sees them, packed linears unpacked.

    ``view`` replaces each packed ``X.weight`` (uint8) by an entry of its unpacked shape in the dtype of its
    ``X.weight_scale``, and drops the scales; :meth:`read` reads an entry of the view (decoding packed ones).
    """

    def __init__(self, tensors: dict[str, TensorEntry], where: str) -> None:
        self.packed: dict[str, tuple[TensorEntry, TensorEntry]] = {}
        self.view: dict[str, TensorEntry] = {}
        for name, entry in tensors.items():
            if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in tensors:
                continue
            if is_packed_name(name) and entry.dtype == torch.uint8:
                scale = tensors.get(name + SCALE_SUFFIX)
                if scale is None:
                    raise BridgeError(f"{where}: packed BitNet tensor {name} has no {name + SCALE_SUFFIX}")
                self.packed[name] = (entry, scale)
                shape = (entry.shape[0] * VALUES_PER_BYTE, *entry.shape[1:])
                nbytes = entry.nbytes * VALUES_PER_BYTE * scale.dtype.itemsize
                entry = dataclasses.replace(entry, dtype=scale.dtype, shape=shape, nbytes=nbytes)
            self.view[name] = entry
        if not self.packed:
            raise BridgeError(f"{where}: config.json says quant_method bitnet (packed) but no uint8 *_proj weights")

    def read(self, name: str, entry: TensorEntry) -> torch.Tensor:
        if name not in self.packed:
            return read_tensor(entry)
        packed, scale = self.packed[name]
        return dequantize_weight(read_tensor(packed), read_tensor(scale), entry.dtype)


def packed_outputs(outputs: list[tuple[str, torch.dtype, tuple[int, ...]]]):
    """Export side: the HF tensors written when packing (each ``*_proj`` weight packed, then its scale)."""
    out = []
    for name, dtype, shape in outputs:
        if is_packed_name(name):
            out.append((name, torch.uint8, (shape[0] // VALUES_PER_BYTE, *shape[1:])))
            out.append((name + SCALE_SUFFIX, dtype, (1,)))
        else:
            out.append((name, dtype, shape))
    return out
