"""Deferring a weight gradient: the hook the kernels' autograd functions take from a zero-bubble schedule.

A zero-bubble schedule (``mcore.parallel``'s ``WeightGradStore``) splits a layer's backward into the input gradient,
which the previous pipeline stage waits for, and the weight gradient, which it runs later in a bubble. The kernels
cannot import that store (``mcore.kernels`` sits below ``mcore.parallel``), so the layers built on them pass its
``defer`` method down: ``defer(param, compute) -> bool`` queues ``compute`` for ``param`` when the store is
deferring and says whether it did. ``compute()`` returns ``param``'s gradient, or ``None`` when it put the gradient
where the caller's ``wgrad_into`` asked (DDP's ``main_grad``); the store then gives a returned gradient to
``param.grad`` and calls the parameter's grad-ready hook, as autograd would have.

Whatever ``compute`` reads to decide *where* the gradient goes (``wgrad_into``: DDP's "first writer of the step
overwrites" mark) must be read inside ``compute``, at the time the gradient is really written, so a deferred
gradient lands in the same place with the same values as an undeferred one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Defer", "now_or_deferred"]

# ``defer(param, compute) -> bool``: queue ``compute`` (the weight gradient of ``param``) for later, or say no
Defer = Callable[[torch.Tensor, Callable[[], "torch.Tensor | None"]], bool]


def now_or_deferred(
    defer: Defer | None, param: torch.Tensor, compute: Callable[[], torch.Tensor | None]
) -> torch.Tensor | None:
    """The weight gradient for autograd: ``compute()`` now, or ``None`` when ``defer`` queued ``compute`` (it then
    puts the gradient where this return would have: returned to the queue's owner, or into ``wgrad_into``'s
    target)."""
    if defer is not None and defer(param, compute):
        return None
    return compute()
