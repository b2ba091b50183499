"""Weight casts reused across micro-batches: a weight changes only at the optimizer step, so its fp8 copies
(``W`` along K and ``W^T`` along N, with their scales) are computed by the first micro-batch of a step and reused
by the others (and by activation recompute) instead of being cast again in every forward.

The owner of the weights says when they change: :meth:`WeightCastCache.invalidate` (the trainer calls it once per
optimizer step, before the update, which also frees the copies before the optimizer's own memory peak). As a
guard, an entry is also dropped when the weight tensor is not the one it was made from (storage, shape, dtype)
or autograd's version counter moved (an in-place torch op on it); writes that bypass the counter (Triton
kernels, ``.data``) are covered by ``invalidate`` only, so a cache must not be shared with code that updates
weights without calling it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class WeightCastCache:
    """fp8 casts of weights, one entry per layer (keyed weakly by the layer object)."""

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[Any, tuple[tuple, Any]] = weakref.WeakKeyDictionary()
        self.hits = 0
        self.misses = 0

    def get(self, owner: Any, weight: torch.Tensor, transposed: bool, make: Callable[[], Any]) -> Any:
        """``owner``'s cached casts of ``weight`` if still valid (and holding the transpose when ``transposed``
        asks for it), else ``make()``, stored."""
        stamp = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device)
        entry = self._entries.get(owner)
        if entry is not None and entry[0] == stamp and (entry[1][1] is not None or not transposed):
            self.hits += 1
            return entry[1]
        self.misses += 1
        value = make()
        self._entries[owner] = (stamp, value)
        return value

    def get_for(self, weight: torch.Tensor, transposed: bool, make: Callable[[], Any]) -> Any:
        """:meth:`get` keyed by ``weight`` itself (for callers without a layer object: the experts' grouped GEMMs)."""
        return self.get(_owner_of(weight), weight, transposed, make)

    def invalidate(self) -> None:
        """Forget every cast (the weights are about to change)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _WeightKey:
    """A weakly referenced stand-in for a weight as a cache key: a tensor cannot be one (its ``==`` is elementwise,
    which a dictionary lookup would call); held by the weight, it lives as long as the weight does."""

    __slots__ = ("__weakref__",)


def _owner_of(weight: torch.Tensor) -> _WeightKey:
    key = getattr(weight, "_mcore_weight_cast_key", None)
    if key is None:
        key = _WeightKey()
        weight._mcore_weight_cast_key = key
    return key
