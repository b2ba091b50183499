"""Deferred weight gradients for zero-bubble pipeline schedules.

Inside ``with WeightGradStore.deferring():`` the tensor-parallel linears compute only the input gradient in backward
(what the previous pipeline stage waits for) and queue the weight-gradient GEMM. A later ``WeightGradStore.flush()``
runs the queued work: each weight gradient is accumulated into ``param.grad`` (or, for parameters of a
``DistributedDataParallel``, straight into ``param.main_grad``) and then ``param.mcore_grad_ready_hook(param)`` is
called when the parameter has one (the DDP wrapper sets it to the same hook autograd would have triggered).

The queue is class-level state (the schedule and the layers meet only through it); it is documented in
docs/architecture.md. It is deliberately not thread-local: CUDA backward runs on autograd worker threads.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch

__all__ = ["WeightGradStore"]


class WeightGradStore:
    """Queue of deferred weight-gradient computations, grouped by ``deferring()`` block (oldest first)."""

    _active: int = 0
    _batches: deque[list[tuple[torch.nn.Parameter, Callable[[], torch.Tensor | None]]]] = deque()

    @classmethod
    @contextlib.contextmanager
    def deferring(cls) -> Iterator[None]:
        """Queue the weight gradients of every backward run inside the block as one batch."""
        cls._batches.append([])
        cls._active += 1
        try:
            yield
        finally:
            cls._active -= 1

    @classmethod
    def is_deferring(cls) -> bool:
        return cls._active > 0

    @classmethod
    def put(cls, param: torch.nn.Parameter, compute: Callable[[], torch.Tensor | None]) -> None:
        """Queue ``compute`` (returns the gradient of ``param``, or ``None`` when it accumulated it into
        ``param.main_grad`` itself) in the innermost open batch."""
        if not cls._active:
            raise RuntimeError("WeightGradStore.put called outside WeightGradStore.deferring()")
        cls._batches[-1].append((param, compute))

    @classmethod
    def pending(cls) -> int:
        """Number of queued batches (one per ``deferring()`` block)."""
        return len(cls._batches)

    @classmethod
    def flush(cls, count: int | None = None) -> int:
        """Run the oldest ``count`` batches (all when ``None``); return how many ran."""
        if count is not None and count < 0:
            raise ValueError(f"WeightGradStore.flush: count must be >= 0 or None, got {count}")
        n = len(cls._batches) if count is None else min(count, len(cls._batches))
        for _ in range(n):
            batch = cls._batches.popleft()
            with torch.no_grad():
                for param, compute in batch:
                    grad = compute()  # None: already accumulated into param.main_grad (DDP's fusion)
                    if grad is None:
                        pass
                    elif param.grad is None:
                        param.grad = grad
                    else:
                        param.grad.add_(grad)
                    hook = getattr(param, "mcore_grad_ready_hook", None)
                    if hook is not None:
                        hook(param)
        return n

    @classmethod
    def clear(cls) -> None:
        """Drop every queued batch without running it."""
        cls._batches.clear()
