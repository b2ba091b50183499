"""Collectives of expert parallelism as autograd functions (variable row counts per rank).

* ``all_to_all_rows(x, output_splits, input_splits, group)``: rows ``x`` split by ``input_splits`` go to the
  ranks of ``group``; backward sends the gradients back with the splits swapped.
* ``gather_rows(x, sizes, group)``: every rank's rows (``sizes[i]`` rows on rank i) concatenated in rank
  order; backward sums the gradients over the group and keeps this rank's rows (reduce-scatter).
* ``reduce_scatter_rows(x, sizes, group)``: the adjoint of ``gather_rows``: the sum over the group of ``x``,
  this rank's ``sizes[rank]`` rows.

Split sizes are host integers: the caller exchanged them once (the dispatcher's single host sync). Variable
sizes are padded to the largest so that the fixed-size NCCL / gloo collectives carry them. ``group=None``
(one rank) makes every function the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore.parallel.comm import all_gather_into, group_rank, group_size, reduce_scatter_into

__all__ = ["all_to_all_rows", "gather_rows", "reduce_scatter_rows"]


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _gather(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    n, largest = len(sizes), max(sizes)
    padded = x.new_zeros((largest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    gathered = x.new_empty((n * largest,) + tuple(x.shape[1:]))
    all_gather_into(gathered, padded, group)
    return torch.cat([gathered[i * largest : i * largest + s] for i, s in enumerate(sizes)])


def _reduce_scatter(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    n, largest, rank = len(sizes), max(sizes), group_rank(group)
    padded = x.new_zeros((n * largest,) + tuple(x.shape[1:]))
    start = 0
    for i, s in enumerate(sizes):
        padded[i * largest : i * largest + s] = x[start : start + s]
        start += s
    out = x.new_empty((largest,) + tuple(x.shape[1:]))
    reduce_scatter_into(out, padded.contiguous(), group)
    return out[: sizes[rank]]


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.sizes, ctx.group), None, None


def _check_sizes(what: str, x: torch.Tensor, sizes: Sequence[int], group, own: int | None) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != group_size(group):
        raise ValueError(f"{what}: {len(sizes)} sizes for a group of {group_size(group)} ranks")
    if own is not None and x.shape[0] != own:
        raise ValueError(f"{what}: x has {x.shape[0]} rows, the sizes say {own}")
    return sizes


def all_to_all_rows(x: torch.Tensor, output_splits, input_splits, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send ``x``'s rows (``input_splits[i]`` of them to rank i) and receive ``output_splits[i]`` from rank i."""
    input_splits = _check_sizes("all_to_all_rows", x, input_splits, group, None)
    output_splits = _check_sizes("all_to_all_rows", x, output_splits, group, None)
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"all_to_all_rows: input_splits {input_splits} do not add up to the {x.shape[0]} rows")
    if group_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, output_splits, input_splits, group)


def gather_rows(x: torch.Tensor, sizes, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's rows in rank order (``sizes[i]`` rows from rank i)."""
    if group_size(group) == 1:
        return x
    sizes = _check_sizes("gather_rows", x, sizes, group, None)
    _check_sizes("gather_rows", x, sizes, group, sizes[group_rank(group)])
    return _GatherRows.apply(x, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, sizes, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's ``sizes[rank]`` rows (rank i's rows follow rank i-1's)."""
    if group_size(group) == 1:
        return x
    sizes = _check_sizes("reduce_scatter_rows", x, sizes, group, sum(int(s) for s in sizes))
    return _ReduceScatterRows.apply(x, sizes, group)
