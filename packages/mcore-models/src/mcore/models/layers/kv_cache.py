"""A preallocated key/value cache for incremental decoding (one buffer pair per layer)."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of the tokens seen so far, ``[b, max_length, kv_heads_local, head_dim]`` per layer.

    A forward pass with the cache writes its new keys/values after the ``length`` cached ones; the model
    advances ``length`` once every layer has written (``advance``), so all layers of one pass see the same
    offset.
    """

    def __init__(
        self,
        layer_indices: list[int] | range,
        batch_size: int,
        max_length: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and max_length >= 1, got {batch_size} and {max_length}")
        shape = (batch_size, max_length, kv_heads, head_dim)
        self.keys = {i: torch.empty(shape, dtype=dtype, device=device) for i in layer_indices}
        self.values = {i: torch.empty(shape, dtype=dtype, device=device) for i in layer_indices}
        self.batch_size = batch_size
        self.max_length = max_length
        self.length = 0
        # Recurrent layers (mamba2: conv inputs and SSM state) keep their own per-layer state here.
        self.states: dict[int, tuple[torch.Tensor, ...]] = {}

    def update(self, layer_index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``[b, n, kv_heads, head_dim]`` after the cached tokens; return all keys/values so far."""
        if layer_index not in self.keys:
            raise ValueError(f"KVCache has no buffers for layer {layer_index}; it holds layers {sorted(self.keys)}")
        n = k.shape[1]
        end = self.length + n
        if k.shape[0] != self.batch_size or end > self.max_length:
            raise ValueError(
                f"KVCache holds batch {self.batch_size} x {self.max_length} tokens ({self.length} used); "
                f"cannot add keys of shape {tuple(k.shape)}"
            )
        self.keys[layer_index][:, self.length : end].copy_(k)
        self.values[layer_index][:, self.length : end].copy_(v)
        return self.keys[layer_index][:, :end], self.values[layer_index][:, :end]

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens as cached (after every layer has called ``update`` for them)."""
        if self.length + n > self.max_length:
            raise ValueError(f"KVCache overflow: {self.length} + {n} > max_length {self.max_length}")
        self.length += n
