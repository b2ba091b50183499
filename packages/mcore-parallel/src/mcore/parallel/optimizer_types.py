"""What both optimizers (replicated and sharded) share: the step's result, the master-weight piece, and the
default parameter groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MasterPiece", "StepResult", "default_param_groups"]


@dataclass(frozen=True)
class StepResult:
    """Outcome of ``optimizer.step()``.

    ``finite``: the gradients were finite, so the parameters were updated (``False``: the update was skipped
    because a gradient was inf/nan; the trainer's ``StepOutput.finite`` is this flag). ``grad_norm``: fp32 0-d
    tensor, the global norm before clipping (unscaled); reading it synchronizes, so the caller decides when.
    ``loss_scale``: the scale to apply to the next loss (``None`` without a loss scaler).
    """

    finite: bool
    grad_norm: torch.Tensor
    loss_scale: float | None


def default_param_groups(model: nn.Module | Sequence[nn.Module], weight_decay: float) -> list[dict]:
    """Two groups: matrices with ``weight_decay``, vectors (norm weights, biases) without."""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    decay, no_decay, seen = [], [], set()
    for chunk in chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@dataclass(eq=False)
class MasterPiece:
    """A contiguous flat range ``[lo, hi)`` of one parameter, with its fp32 master and gradient."""

    param: nn.Parameter
    name: str
    lo: int
    hi: int
    master: torch.Tensor
    group_index: int
    aliased: bool = False  # master shares the parameter's storage (fp32, not sharded): no copy-back
    grad_view: torch.Tensor | None = None  # view into the DDP buffer; None: read param.grad each step
