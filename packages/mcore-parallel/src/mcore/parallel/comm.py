"""Collectives of the tensor- and sequence-parallel regions as autograd functions.

Each function pairs a forward collective with its adjoint in backward:

- ``copy_to_tp_region``: identity / all-reduce;
- ``reduce_from_tp_region``: all-reduce / identity;
- ``scatter_to_tp_region``: keep own slice of the last dim / all-gather the last dim;
- ``gather_from_tp_region``: all-gather the last dim / keep own slice;
- ``scatter_to_sequence_parallel_region``: keep own slice of dim 0 / all-gather dim 0;
- ``gather_from_sequence_parallel_region``: all-gather dim 0 / reduce-scatter dim 0 (or keep own slice);
- ``reduce_scatter_to_sequence_parallel_region``: reduce-scatter dim 0 / all-gather dim 0.

``group=None`` (or a group of one rank) makes every function the identity. Collectives never write into
their input: autograd may hand the same gradient tensor to several consumers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_into",
    "copy_to_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "group_rank",
    "group_size",
    "reduce_from_tp_region",
    "reduce_scatter_into",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
]

# torch 2.13 renamed the tensor-in/tensor-out collectives; torch 2.11 (the GPU image) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, async_op=False):
    """``output`` (dim 0 = size * shard dim 0) receives every rank's ``shard`` in rank order."""
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None, async_op=False):
    """``output`` receives this rank's slice (dim 0) of the sum of every rank's ``full``."""
    return _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def _check_divisible(x: torch.Tensor, dim: int, size: int, what: str) -> int:
    if x.dim() == 0:
        raise ValueError(f"{what}: expected a tensor with at least one dim, got a scalar")
    n = x.shape[dim]
    if n % size != 0:
        raise ValueError(
            f"{what}: dim {dim} of shape {tuple(x.shape)} is {n}, not divisible by the group size {size}; "
            f"pad it to a multiple of {size}"
        )
    return n // size


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = _check_divisible(x, -1, group_size(group), "split along the last dim")
    return x.narrow(-1, group_rank(group) * n, n).contiguous()


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    # gloo accepts only the concatenated output form, so gather along dim 0 and view it as stacked
    buf = x.new_empty((size * x.shape[0], *x.shape[1:]))
    all_gather_into(buf, x.contiguous(), group)
    # [size, ..., n] -> [..., size, n] -> [..., size * n]: rank r's columns land at r * n
    return buf.view(size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def _split_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = _check_divisible(x, 0, group_size(group), "split along dim 0")
    return x.narrow(0, group_rank(group) * n, n).contiguous()


def _gather_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x.contiguous(), group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = _check_divisible(x, 0, group_size(group), "reduce-scatter along dim 0")
    out = x.new_empty((n, *x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        # a TP-sharded consumer leaves a partial sum on each rank; a replicated one leaves the full gradient
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def _trivial(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``group`` in backward."""
    return x if _trivial(group) else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward; identity backward."""
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; all-gather the gradient in backward."""
    return x if _trivial(group) else _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along the last dim (rank order); keep this rank's slice of the gradient in backward."""
    return x if _trivial(group) else _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's slice of dim 0 (the sequence of ``[s, b, h]``); all-gather in backward."""
    return x if _trivial(group) else _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, *, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather along dim 0. Backward reduce-scatters the gradient (it feeds a TP-sharded op that leaves
    partial sums) or, with ``tensor_parallel_output_grad=False``, keeps this rank's slice of it."""
    return x if _trivial(group) else _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's slice of dim 0; all-gather the gradient in backward."""
    return x if _trivial(group) else _ReduceScatterToSP.apply(x, group)
