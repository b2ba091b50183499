"""The gradient reductions that complete a training step's backward, in Megatron-Core's order."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mcore.parallel.comm import group_size
from mcore.parallel.data_parallel import DistributedDataParallel
from mcore.parallel.expert_parallel import update_expert_biases
from mcore.parallel.grid import ProcessGroups
from mcore.parallel.param_attrs import accumulated_grad, is_sequence_parallel, is_shared_embedding

__all__ = ["finalize_model_grads"]


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    # fully sharded (FSDP2): the local shard, the same slice on every rank it is summed with (same dp rank)
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _all_reduce_coalesced(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum ``grads`` over ``group`` with one collective per dtype."""
    if group_size(group) == 1:
        return
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _unique_params(chunks: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def finalize_model_grads(model_chunks: nn.Module | Sequence[nn.Module], groups: ProcessGroups | None = None) -> None:
    """Finish the data-parallel reduction, then all-reduce over TP the gradients of ``sequence_parallel``
    parameters and over the embedding group the gradients of ``shared_embedding`` parameters.

    Call it after the backward of the last micro-batch (and after ``WeightGradStore.flush()`` when weight
    gradients were deferred). Tied embeddings under pipeline parallelism: both copies (the first stage's
    embedding weight and the last stage's output weight) must carry ``shared_embedding=True``, as in
    Megatron-Core; the grad norm counts a ``shared_embedding`` parameter on the first stage only. Last, the MoE
    layers' aux-loss-free expert biases take their once-per-step update (``update_expert_biases``).
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    groups = groups or ProcessGroups.single()
    for chunk in chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.finish_grad_sync()
    params = _unique_params(chunks)
    sp = [g for p in params if is_sequence_parallel(p) and (g := _local(accumulated_grad(p))) is not None]
    if sp:
        _all_reduce_coalesced(sp, groups.tp)
    if groups.embedding is not None:
        tied = [g for p in params if is_shared_embedding(p) and (g := _local(accumulated_grad(p))) is not None]
        if tied:
            _all_reduce_coalesced(tied, groups.embedding)
    update_expert_biases(chunks, groups)
