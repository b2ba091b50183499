"""Deferred weight gradients for zero-bubble pipeline schedules.

A :class:`WeightGradStore` belongs to one schedule (``ZeroBubbleH1`` makes its own), and
:func:`attach_weight_grad_store` hands it to the layers of the schedule's model chunks that can defer
(:class:`DefersWeightGrads`: the tensor-parallel linears, bf16 and fp8 / emulated / BitNet, and the MoE experts'
grouped or per-expert GEMMs, bf16 and fp8). Inside ``with store.deferring():`` those layers compute only the input
gradient in backward (what the previous pipeline stage waits for) and queue the weight-gradient GEMM in the store. A
later ``store.flush()`` runs the queued work: each weight gradient is accumulated into ``param.grad`` (or, for
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
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from mcore.parallel.param_attrs import grad_ready_hook

__all__ = ["DefersWeightGrads", "WeightGradStore", "attach_weight_grad_store"]


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


class DefersWeightGrads:
    """Mixin of the modules whose backward can queue their weight-gradient GEMMs in an attached store (a class, not
    a list of module types here: the layers live in modules that build on this one)."""

    # set by attach_weight_grad_store (a zero-bubble schedule's queue of deferred weight gradients)
    weight_grad_store: WeightGradStore | None = None

    @property
    def defer(self) -> Callable[[torch.Tensor, Callable[[], torch.Tensor | None]], bool] | None:
        """The ``defer`` hook the kernels take (``mcore.kernels.wgrad_defer``), ``None`` without a store."""
        return self.weight_grad_store.defer if self.weight_grad_store is not None else None


def attach_weight_grad_store(modules: Sequence[nn.Module], store: WeightGradStore | None) -> int:
    """Let every :class:`DefersWeightGrads` module inside ``modules`` (the tensor-parallel linears, the MoE layers'
    experts) queue its weight gradients in ``store`` while that is deferring (``None`` detaches); returns how many
    modules were attached."""
    count = 0
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, DefersWeightGrads):
                sub.weight_grad_store = store
                count += 1
    return count
