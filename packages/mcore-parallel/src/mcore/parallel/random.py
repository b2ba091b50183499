"""Named random streams, so that dropout differs across tensor-parallel ranks where it must.

Activations inside a TP region (attention probabilities of a head shard, an MLP shard) are different
tensors on each TP rank and need independent dropout masks: they draw from the ``"tp"`` stream, seeded
per TP rank. Activations replicated across TP (the residual stream without sequence parallelism) must
be dropped identically on every TP rank: they draw from the default stream, seeded equally across TP.

``get_rng_tracker()`` returns the one process-wide tracker: this is the single piece of global state in
mcore.parallel (the RNG itself is process-global in torch, so the streams that swap into it are too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["TP_STREAM", "RNGStatesTracker", "get_rng_tracker", "model_parallel_seed"]

TP_STREAM = "tp"
# Offsets in the style of Megatron-Core: distinct stages and the TP stream must not share seeds.
_PP_SEED_STRIDE = 100
_TP_SEED_OFFSET = 2718


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _capture() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if _cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and _cuda_in_use():
        torch.cuda.set_rng_state(state["cuda"])


class RNGStatesTracker:
    """A set of named RNG states (CPU, and the current CUDA device when in use) to swap in and out."""

    def __init__(self) -> None:
        self._states: dict[str, dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        self._states.clear()

    def names(self) -> list[str]:
        return sorted(self._states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` without disturbing the current RNG state."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() before re-seeding")
        outside = _capture()
        try:
            # seed only the devices the stream tracks; torch.manual_seed would reseed every CUDA device
            torch.default_generator.manual_seed(seed)
            if _cuda_in_use():
                torch.cuda.manual_seed(seed)
            self._states[name] = _capture()
        finally:
            _restore(outside)

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is untouched by it."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} not added; known streams: {self.names()} (see model_parallel_seed)")
        outside = _capture()
        _restore(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _capture()
            _restore(outside)

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of every stream's state (for checkpoints)."""
        return {n: {k: v.clone() for k, v in s.items()} for n, s in self._states.items()}

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self._states = {n: {k: v.clone() for k, v in s.items()} for n, s in states.items()}


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (documented global state)."""
    return _TRACKER


def model_parallel_seed(seed: int, *, tp_rank: int = 0, pp_rank: int = 0) -> None:
    """Seed the default stream (equal across TP and DP ranks, distinct per pipeline stage) and the
    ``"tp"`` stream (distinct per TP rank)."""
    default_seed = seed + _PP_SEED_STRIDE * pp_rank
    torch.manual_seed(default_seed)
    _TRACKER.reset()
    _TRACKER.add(TP_STREAM, default_seed + _TP_SEED_OFFSET + tp_rank)
