"""Names of tensor dtypes in the three vocabularies the bridge speaks: torch, safetensors and ``--dtype``.

The safetensors table and the torch spelling come from mcore-train (:mod:`mcore.train.checkpoint.dtypes`),
the layer below, so that both packages read and write the same codes.
"""

from __future__ import annotations

import torch

from mcore.bridge.errors import BridgeError
from mcore.train.checkpoint.dtypes import SAFETENSORS_TO_TORCH, TORCH_TO_SAFETENSORS
from mcore.train.checkpoint.dtypes import dtype_name as torch_dtype_name

__all__ = [
    "DTYPE_CHOICES",
    "SAFETENSORS_TO_TORCH",
    "TORCH_TO_SAFETENSORS",
    "cast_dtype",
    "parse_dtype_choice",
    "parse_size",
    "torch_dtype_from_name",
    "torch_dtype_name",
]

# values of the --dtype option; "keep" writes every tensor in the dtype it was read in
DTYPE_CHOICES: dict[str, torch.dtype | None] = {
    "keep": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def torch_dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`torch_dtype_name`; raises BridgeError for a name torch does not know."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise BridgeError(f"unknown dtype name {name!r}; expected a torch dtype name such as 'bfloat16' or 'float32'")
    return dtype


def parse_dtype_choice(choice: str) -> torch.dtype | None:
    """Parse a ``--dtype`` value; ``None`` means keep each tensor's dtype."""
    if choice not in DTYPE_CHOICES:
        raise BridgeError(f"--dtype {choice!r} is not supported; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPE_CHOICES[choice]


def cast_dtype(source: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of dtype ``source`` is written in: only floating tensors follow ``--dtype``."""
    if target is None or not source.is_floating_point:
        return source
    return target


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, plain integers are bytes (as in HF)."""
    if isinstance(text, int):
        if text <= 0:
            raise BridgeError(f"shard size must be positive, got {text}")
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    raw = str(text).strip().upper()
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise BridgeError(
            f"cannot read size {text!r}; expected a positive number with a unit such as '5GB' or '500MiB'"
        )
    return int(value * units[unit])
