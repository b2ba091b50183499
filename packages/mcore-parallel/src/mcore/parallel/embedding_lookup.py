"""The embedding lookup whose weight gradient goes straight into ``main_grad``, row by row.

``F.embedding``'s backward writes a dense ``[V, h]`` gradient in the weight's dtype (zero-filled, the looked-up rows
summed in), which DDP's hook then adds into the fp32 ``main_grad``: for Llama-3-8B's 128,256 x 4,096 table at 8,192
tokens a step that is 1 GB of bf16 zeros written, 1 GB read back and 2 GB of fp32 read and written, for at most
8,192 rows that changed. Here, while a ``DistributedDataParallel`` wrapper lends its buffer
(:func:`~mcore.parallel.param_attrs.fused_wgrad_target`), backward adds the output gradient's rows into
``main_grad`` at the looked-up rows (``index_put_`` with ``accumulate``: sorted by row and summed in the target's
precision, fp32, so repeated ids sum in a deterministic order) and tells DDP's hook the gradient is there. Without
such a wrapper the gradient is ``F.embedding``'s own (``embedding_dense_backward``), bit for bit.

``outside`` (tensor parallelism: ids outside this rank's vocabulary slice, looked up as row 0) zeroes those
tokens' outputs and keeps their gradients out of the table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore.parallel.param_attrs import fused_wgrad_target, mark_wgrad_in_main_grad

__all__ = ["embedding_lookup"]


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor, outside: torch.Tensor | None = None) -> torch.Tensor:
    """``weight[ids]`` (``ids.shape + (h,)``), zero where ``outside``; see the module docstring for the gradient."""
    return _EmbeddingLookup.apply(ids, weight, outside)


class _EmbeddingLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, outside):
        ctx.save_for_backward(ids, outside)
        ctx.param, ctx.rows = weight, weight.shape[0]  # the Parameter itself: its main_grad and DDP's flags
        out = F.embedding(ids, weight)
        return out if outside is None else out.masked_fill(outside.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:
            return None, None, None
        ids, outside = ctx.saved_tensors
        if outside is not None:
            grad_out = grad_out.masked_fill(outside.unsqueeze(-1), 0.0)
        target = fused_wgrad_target(ctx.param)
        if target is None:
            return None, torch.ops.aten.embedding_dense_backward(grad_out, ids, ctx.rows, -1, False), None
        rows = grad_out.reshape(-1, grad_out.shape[-1]).to(target.dtype)
        target.index_put_((ids.reshape(-1),), rows, accumulate=True)
        mark_wgrad_in_main_grad(ctx.param)
        return None, None, None
