"""Cross entropy over vocab-sharded logits: the full ``[..., V]`` logits are never gathered.

Rank ``r`` of the TP group holds the vocabulary columns ``[r * V/tp, (r+1) * V/tp)``. The kernel
(``mcore.kernels.cross_entropy``) computes per-row statistics of the local shard and combines them across
the group with two small all-reduces (a max, then a sum); its backward needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import mcore.kernels as kernels
from mcore.parallel.comm import group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCE_OPS = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = -100,
    valid_vocab_size: int | None = None,
    z_loss_weight: float = 0.0,
) -> torch.Tensor:
    """Per-token loss, fp32 with ``target``'s shape, 0 where ``target == ignore_index``.

    ``logits`` is ``target.shape + (V_padded / tp,)``: this rank's vocabulary shard. ``target`` holds global
    token ids. Columns at global index ``>= valid_vocab_size`` are padding and excluded from the softmax.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(
            "vocab_parallel_cross_entropy: logits and target must be tensors, got "
            f"{type(logits).__name__} and {type(target).__name__}"
        )
    if logits.dim() < 1 or logits.shape[:-1] != target.shape:
        raise ValueError(
            "vocab_parallel_cross_entropy: logits must be target.shape + (vocab shard,), got logits "
            f"{tuple(logits.shape)} and target {tuple(target.shape)}"
        )
    tp = group_size(tp_group)
    shard = logits.shape[-1]
    if valid_vocab_size is not None and not 1 <= valid_vocab_size <= shard * tp:
        raise ValueError(
            f"vocab_parallel_cross_entropy: valid_vocab_size must be in [1, {shard * tp}] "
            f"(padded vocabulary = {shard} columns x tp {tp}), got {valid_vocab_size}"
        )
    reduce = None
    if tp > 1:

        def reduce(tensor: torch.Tensor, op: str) -> None:
            dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=tp_group)

    loss = kernels.cross_entropy(
        logits.reshape(-1, shard),
        target.reshape(-1),
        ignore_index=ignore_index,
        z_loss_weight=z_loss_weight,
        valid_vocab_size=valid_vocab_size,
        vocab_start_index=group_rank(tp_group) * shard,
        reduce=reduce,
    )
    return loss.view(target.shape)
