"""Layout-independent initialization.

Every parameter has one full (unsharded) tensor defined by the model seed and the parameter's global
name: ``seeded_generator(seed, name)`` seeds a generator from a stable hash of both, the full tensor is
drawn from it, and each rank keeps its slice (``partition_slice``). The same seed therefore gives the
same full weights at any tensor- or pipeline-parallel size.

An init method is a callable ``init_method(full_tensor, generator)`` that fills ``full_tensor`` in place.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "InitMethod",
    "constant_init",
    "normal_init",
    "partition_slice",
    "scaled_normal_init",
    "seeded_generator",
]

InitMethod = Callable[[torch.Tensor, "torch.Generator | None"], None]


def seeded_generator(seed: int, name: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded by ``(seed, name)`` through SHA-256, stable across processes and runs.

    Python's ``hash`` is salted per process, so it would give each rank different weights.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (the parameter's global name), got {type(name).__name__}")
    digest = hashlib.sha256(f"{seed}\x00{name}".encode()).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


def normal_init(std: float = 0.02, mean: float = 0.0) -> InitMethod:
    """Draw from ``N(mean, std^2)``."""
    if not std > 0:
        raise ValueError(f"normal_init: std must be > 0, got {std}")

    def init(tensor: torch.Tensor, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            tensor.normal_(mean, std, generator=generator)

    return init


def scaled_normal_init(std: float, num_layers: int) -> InitMethod:
    """``N(0, (std / sqrt(2 * num_layers))^2)``: the usual init of output projections feeding a residual."""
    if not (isinstance(num_layers, int) and num_layers >= 1):
        raise ValueError(f"scaled_normal_init: num_layers must be a positive int, got {num_layers!r}")
    return normal_init(std / math.sqrt(2.0 * num_layers))


def constant_init(value: float) -> InitMethod:
    """Fill with ``value`` (norm weights: 1, biases: 0)."""

    def init(tensor: torch.Tensor, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            tensor.fill_(value)

    return init


def partition_slice(
    full: torch.Tensor,
    partition_dim: int,
    rank: int,
    size: int,
    partition_blocks: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` when it is sharded ``size`` ways along ``partition_dim``.

    With ``partition_blocks`` the full tensor is the concatenation of those blocks along the dim and each
    block is split evenly (a fused ``[gate; up]`` weight keeps ``[gate_r; up_r]`` on rank ``r``).
    Returns a new contiguous tensor.
    """
    if not 0 <= rank < size:
        raise ValueError(f"partition_slice: rank must be in [0, {size}), got {rank}")
    n = full.shape[partition_dim]
    blocks = [n] if partition_blocks is None else [int(b) for b in partition_blocks]
    if sum(blocks) != n:
        raise ValueError(
            f"partition_slice: partition_blocks {tuple(blocks)} sum to {sum(blocks)}, "
            f"but dim {partition_dim} of shape {tuple(full.shape)} is {n}"
        )
    pieces = []
    start = 0
    for b in blocks:
        if b % size != 0:
            raise ValueError(
                f"partition_slice: block of {b} along dim {partition_dim} not divisible by {size} ranks "
                f"(blocks {tuple(blocks)}, shape {tuple(full.shape)})"
            )
        part = b // size
        pieces.append(full.narrow(partition_dim, start + rank * part, part))
        start += b
    return torch.cat(pieces, dim=partition_dim) if len(pieces) > 1 else pieces[0].contiguous().clone()
