"""Rotary position tables shared by the layers of one forward pass.

The model computes the cos/sin tables once per forward from the tokens' positions and hands the same
:class:`RopeTables` to every layer's mixer; a mixer without RoPE ignores them, one with another rotary width (MLA's
decoupled key) can build its own from ``position_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore.kernels import rope_cos_sin, rope_inv_freq
from mcore.models.config import TransformerConfig


@dataclass(frozen=True)
class RopeTables:
    """``cos``/``sin`` ``[s, b, 1, head_dim]`` fp32 (broadcast over the KV groups of the attention views) and the
    ``position_ids [b, s]`` they were built from."""

    position_ids: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class RotaryTables:
    """Builds :class:`RopeTables` for ``config``'s head_dim, theta and scaling; inverse frequencies are cached per
    device (no parameters, nothing in the state dict)."""

    def __init__(self, config: TransformerConfig) -> None:
        self.config = config
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._attention_factor = 1.0

    def __call__(self, position_ids: torch.Tensor) -> RopeTables:
        device = position_ids.device
        if device not in self._inv_freq:
            c = self.config
            inv_freq, self._attention_factor = rope_inv_freq(
                c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
            )
            self._inv_freq[device] = inv_freq.to(device)
        # Built from [s, b] positions so the tables are contiguous [s, b, D]: expanded over the KV groups they
        # still flatten to rows without a copy inside apply_rotary.
        cos, sin = rope_cos_sin(self._inv_freq[device], position_ids.t(), self._attention_factor)
        return RopeTables(position_ids, cos.unsqueeze(2), sin.unsqueeze(2))
