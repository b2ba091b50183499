"""Tensor dtype names: safetensors header codes and the torch spelling of mcore metadata.

The one table of both: mcore-train's checkpoint writer and reader use it, and mcore-bridge (the layer above)
imports it rather than keeping its own.
"""

from __future__ import annotations

import torch

# safetensors header codes (https://github.com/huggingface/safetensors, format section)
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of mcore metadata and of HF ``torch_dtype``)."""
    return str(dtype).removeprefix("torch.")
