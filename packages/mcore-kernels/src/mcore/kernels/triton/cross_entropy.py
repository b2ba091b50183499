"""Triton kernels of the (vocab-parallel) cross entropy: row statistics in the forward, the gradient in the backward.

The forward is split in two phases around the cross-shard reductions so that the unsharded and the
vocab-sharded losses run the same kernels:

1. :func:`row_stats` reads each row of logits once, in column blocks, with an online max / rescaled
   sum-exp kept in fp32 registers, and picks the target logit when the target falls in this shard.
2. The caller all-reduces the per-row statistics (a few floats per token) and finishes the loss.

The backward (:func:`grad_logits`) recomputes ``softmax`` from the logits and the saved per-row
``logsumexp`` and writes ``((1 + 2 z lse) * softmax - onehot) * grad_loss`` in the logits' dtype, optionally
over the logits themselves. Recomputing costs one read of the logits; storing the gradient in the forward
(the other common layout) would cost a read and a write more for the same peak memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.dispatch import triton_interpreting

# Columns per program step. 8K bf16 values are 16 KB in flight per program: enough to saturate HBM with
# one program per row. The interpreter uses small blocks so the tests cross several block boundaries.
_BLOCK_GPU = 8192
_BLOCK_INTERPRETER = 256


def _block_size(n_cols: int) -> int:
    cap = _BLOCK_INTERPRETER if triton_interpreting() else _BLOCK_GPU
    return max(16, min(cap, triton.next_power_of_2(max(n_cols, 1))))


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    max_ptr,
    sumexp_ptr,
    target_logit_ptr,
    found_ptr,
    n_valid,
    vocab_start,
    ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    offsets = tl.arange(0, BLOCK)
    # Scalars seeded from a reduction so their type stays fixed across loop iterations.
    row_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    row_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, n_valid, BLOCK):
        cols = start + offsets
        x = tl.load(row_ptr + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        # The first block always holds a valid column, so new_max is finite unless the data holds -inf.
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max

    target = tl.load(target_ptr + row).to(tl.int64)
    local = target - vocab_start
    found = (target != ignore_index) & (local >= 0) & (local < n_valid)
    target_logit = tl.load(row_ptr + local, mask=found, other=0.0).to(tl.float32)

    tl.store(max_ptr + row, row_max)
    tl.store(sumexp_ptr + row, row_sum)
    tl.store(target_logit_ptr + row, target_logit)
    tl.store(found_ptr + row, found.to(tl.float32))


@triton.jit
def _grad_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    target_ptr,
    lse_ptr,
    grad_loss_ptr,
    n_cols,
    n_valid,
    vocab_start,
    ignore_index,
    two_z_loss_weight,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    target = tl.load(target_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    grad_loss = tl.load(grad_loss_ptr + row)
    valid = cols < n_valid
    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
    prob = tl.exp(x - lse)
    onehot = (cols == target - vocab_start).to(tl.float32)
    grad = (prob * (1.0 + two_z_loss_weight * lse) - onehot) * grad_loss
    # Padding columns and ignored tokens get an exact zero, even if the row holds inf or nan.
    keep = valid & (target != ignore_index)
    grad = tl.where(keep, grad, 0.0)
    tl.store(grad_ptr + row * grad_row_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


def row_stats(
    logits: torch.Tensor, target: torch.Tensor, *, n_valid: int, vocab_start: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(max, sumexp, target_logit, found)`` in fp32 over the first ``n_valid`` columns of ``logits``.

    ``sumexp`` is relative to this shard's ``max``; ``target_logit`` is 0 and ``found`` 0 where the target is
    ignored or outside ``[vocab_start, vocab_start + n_valid)``. ``logits`` must have a unit column stride.
    """
    n_rows = logits.shape[0]
    stats = torch.empty(4, n_rows, device=logits.device, dtype=torch.float32)
    row_max, sumexp, target_logit, found = stats.unbind(0)
    if n_rows > 0:
        _row_stats_kernel[(n_rows,)](
            logits,
            logits.stride(0),
            target,
            row_max,
            sumexp,
            target_logit,
            found,
            n_valid,
            vocab_start,
            ignore_index,
            BLOCK=_block_size(n_valid),
            num_warps=8,
        )
    return row_max, sumexp, target_logit, found


def grad_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    out: torch.Tensor,
    *,
    n_valid: int,
    vocab_start: int,
    ignore_index: int,
    z_loss_weight: float,
) -> torch.Tensor:
    """Write d(loss)/d(logits) into ``out`` (same shape, unit column stride; may be ``logits`` itself)."""
    n_rows, n_cols = logits.shape
    if n_rows > 0 and n_cols > 0:
        block = _block_size(n_cols)
        _grad_kernel[(n_rows, triton.cdiv(n_cols, block))](
            logits,
            logits.stride(0),
            out,
            out.stride(0),
            target,
            lse,
            grad_loss,
            n_cols,
            n_valid,
            vocab_start,
            ignore_index,
            2.0 * z_loss_weight,
            BLOCK=block,
            num_warps=8,
        )
    return out
