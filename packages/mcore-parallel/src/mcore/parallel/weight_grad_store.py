"""Deferred weight gradients for zero-bubble pipeline schedules.

A :class:`WeightGradStore` belongs to one schedule (``ZeroBubbleH1`` makes its own), and
:func:`~mcore.parallel.tensor_parallel.attach_weight_grad_store` hands it to the tensor-parallel linears of the
schedule's model chunks. Inside ``with store.deferring():`` those linears compute only the input gradient in
backward (what the previous pipeline stage waits for) and queue the weight-gradient GEMM in the store. A later
``store.flush()`` runs the queued work: each weight gradient is accumulated into ``param.grad`` (or, for
parameters of a ``DistributedDataParallel``, straight into its ``main_grad``) and then the parameter's
grad-ready hook is called when it has one (the DDP wrapper sets it to the same hook autograd would have
triggered; see :mod:`mcore.parallel.param_attrs`).

The queue is per instance, so two schedules (or tests) never see each other's work; it is reached from the
layers through the reference they hold, not through global state, and so it also works from the autograd
worker threads that run CUDA backward.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch

from mcore.parallel.param_attrs import grad_ready_hook

__all__ = ["WeightGradStore"]


class WeightGradStore:
    """Queue of deferred weight-gradient computations, grouped by ``deferring()`` block (oldest first)."""

    def __init__(self) -> None:
        self._active = 0
        self._batches: deque[list[tuple[torch.nn.Parameter, Callable[[], torch.Tensor | None]]]] = deque()

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Queue the weight gradients of every backward run inside the block as one batch."""
        self._batches.append([])
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1

    def is_deferring(self) -> bool:
        return self._active > 0

    def put(self, param: torch.nn.Parameter, compute: Callable[[], torch.Tensor | None]) -> None:
        """Queue ``compute`` (returns the gradient of ``param``, or ``None`` when it accumulated it into
        ``param``'s ``main_grad`` itself) in the innermost open batch."""
        if not self._active:
            raise RuntimeError("WeightGradStore.put called outside WeightGradStore.deferring()")
        self._batches[-1].append((param, compute))

    def defer(self, param: torch.nn.Parameter, compute: Callable[[], torch.Tensor | None]) -> bool:
        """Queue ``compute`` (see :meth:`put`) when a ``deferring()`` block is open; return whether it was queued
        (``False``: the caller runs it now). The hook the kernels layer's linears take (``LowPrecisionLinear``'s
        ``defer``), which cannot import this class."""
        if not self._active:
            return False
        self.put(param, compute)
        return True

    def pending(self) -> int:
        """Number of queued batches (one per ``deferring()`` block)."""
        return len(self._batches)

    def flush(self, count: int | None = None) -> int:
        """Run the oldest ``count`` batches (all when ``None``); return how many ran."""
        if count is not None and count < 0:
            raise ValueError(f"WeightGradStore.flush: count must be >= 0 or None, got {count}")
        n = len(self._batches) if count is None else min(count, len(self._batches))
        for _ in range(n):
            batch = self._batches.popleft()
            with torch.no_grad():
                for param, compute in batch:
                    grad = compute()  # None: already accumulated into main_grad (DDP's fusion)
                    if grad is None:
                        pass
                    elif param.grad is None:
                        param.grad = grad
                    else:
                        param.grad.add_(grad)
                    hook = grad_ready_hook(param)
                    if hook is not None:
                        hook(param)
        return n

    def clear(self) -> None:
        """Drop every queued batch without running it."""
        self._batches.clear()
