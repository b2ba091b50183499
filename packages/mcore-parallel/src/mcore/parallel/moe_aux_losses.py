"""An MoE layer's differentiable auxiliary losses: the load-balancing loss (micro-batch or sequence-wise) and the
router z-loss, over the tokens of every rank that splits the same sequences, padding tokens left out."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore.kernels.moe import Routing, load_balancing_loss_from_stats, load_balancing_stats, z_loss
from mcore.parallel.comm import group_size, reduce_from_tp_region

__all__ = ["moe_aux_losses"]


def moe_aux_losses(
    config: Any,
    logits: torch.Tensor,
    routing: Routing,
    shape: torch.Size,
    split_group: dist.ProcessGroup | None = None,
    padding_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The ``aux_loss`` / ``z_loss`` whose coefficients ``config`` (an ``MoEConfig``) sets, for the routed tokens of
    hidden states ``shape`` (``[s, b, h]`` for the sequence-wise loss).

    With ``split_group`` (the tp x cp ranks splitting one sequence), both are those of the whole group's tokens: the
    load-balancing sums are all-reduced over it (the probabilities' with an identity backward, so each rank's gradient
    reaches its own tokens) and the z-loss mean is divided by its size; every rank attaches them. ``padding_mask``
    [T] bool: those tokens add to no statistic and the means are over the real tokens, counted over the same group.
    """
    out: dict[str, torch.Tensor] = {}
    split = group_size(split_group)
    if config.aux_loss_coef:
        probs, indices, mask, seq = routing.probs, routing.indices, padding_mask, None
        if config.aux_loss_type == "sequence" and len(shape) == 3:
            s, b = shape[0], shape[1]  # [s, b, h]: regroup the tokens sequence by sequence
            probs = probs.view(s, b, -1).transpose(0, 1).reshape(s * b, -1)
            indices = indices.view(s, b, -1).transpose(0, 1).reshape(s * b, -1)
            mask = None if mask is None else mask.view(s, b).t().reshape(-1)
            seq = s
        counts, prob_sums = load_balancing_stats(probs, indices, sequence_length=seq, padding_mask=mask)
        if split > 1:
            dist.all_reduce(counts, group=split_group)
            prob_sums = reduce_from_tp_region(prob_sums, split_group)
        if mask is None:
            tokens = (probs.shape[0] if seq is None else seq) * split
        else:  # each group's real tokens, over the ranks splitting it
            tokens = _summed((~mask).view(counts.shape[0], -1).sum(1).float(), split_group)
        out["aux_loss"] = load_balancing_loss_from_stats(counts, prob_sums, tokens, config.topk)
    if config.z_loss_coef:
        if padding_mask is None:
            out["z_loss"] = z_loss(logits) / split
        else:
            out["z_loss"] = z_loss(logits, padding_mask, _summed((~padding_mask).sum().float(), split_group))
    return out


def _summed(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``value`` summed over ``group`` (itself without one)."""
    if group_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value
