"""Operations for experts stored as stacked 3-D tensors in the Hub's files (GPT-OSS), each one HF tensor to one
mcore tensor and back, data movement only (bit-exact both ways):

* ``gate_up_interleaved``: HF ``gate_up_proj`` [E, H, 2I], gate and up in alternate columns (even / odd) ->
  our ``experts.gate_up`` [E, 2I, H] (each expert's ``[out, in]`` weight: gate rows then up rows);
* ``bias_interleaved``: HF ``gate_up_proj_bias`` [E, 2I] interleaved the same way -> ``[E, 2I]`` gate then up;
* ``transposed``: HF ``down_proj`` [E, I, H] (``x @ W``) -> our ``experts.down`` [E, H, I] (``[out, in]``).
"""

from __future__ import annotations

import torch

__all__ = ["STACKED_OPS", "hf_shape", "to_hf", "to_mcore"]

STACKED_OPS = ("gate_up_interleaved", "bias_interleaved", "transposed")


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    if t.shape[-1] % 2:
        raise ValueError(f"an interleaved gate/up tensor needs an even last dim, got shape {list(t.shape)}")
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _check_3d(op: str, t: torch.Tensor) -> None:
    if t.dim() != 3:
        raise ValueError(f"{op}: expected a stacked [experts, a, b] tensor, got shape {list(t.shape)}")


def to_mcore(op: str, tensor: torch.Tensor) -> torch.Tensor:
    if op == "bias_interleaved":
        return _deinterleave(tensor)
    _check_3d(op, tensor)
    if op == "gate_up_interleaved":
        return _deinterleave(tensor).transpose(1, 2).contiguous()
    return tensor.transpose(1, 2).contiguous()


def to_hf(op: str, tensor: torch.Tensor) -> torch.Tensor:
    if op == "bias_interleaved":
        return _interleave(tensor).contiguous()
    _check_3d(op, tensor)
    if op == "gate_up_interleaved":
        return _interleave(tensor.transpose(1, 2)).contiguous()
    return tensor.transpose(1, 2).contiguous()


def hf_shape(op: str, mcore_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for an mcore tensor of ``mcore_shape``."""
    if op == "bias_interleaved":
        return tuple(mcore_shape)
    return (mcore_shape[0], mcore_shape[2], mcore_shape[1])
