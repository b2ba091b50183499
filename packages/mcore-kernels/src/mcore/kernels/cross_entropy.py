"""Per-token cross entropy over (possibly vocab-sharded, possibly padded) logits, without an fp32 copy of them.

Math, per token with logits ``x`` over the valid columns and target ``t``::

    lse  = log(sum_j exp(x_j))
    loss = lse - x_t + z_loss_weight * lse**2                 (0 where t == ignore_index)
    d loss / d x_j = (1 + 2 z_loss_weight lse) softmax(x)_j - [j == t]

Both backends split the forward into the same two phases around the cross-shard reductions (see
:func:`_finish_forward`): per-row statistics of the local columns, then the loss from the reduced
statistics. Under vocab sharding the forward makes two ``reduce`` calls: ``"max"`` over a ``[N]`` tensor, then
``"sum"`` over a ``[3, N]`` tensor stacking the rescaled sum-exp, the target logit (non-zero on the shard
owning the target) and a found-flag (so a target outside the vocabulary is detected on every shard). The
backward needs no communication.

The backward recomputes the softmax from the saved logits and per-row logsumexp instead of storing the
gradient during the forward: one read and one write of a ``[N, V]`` buffer instead of two reads and two
writes, at the same peak memory. With ``inplace_backward=True`` that buffer is the logits themselves (the
gradient overwrites them); otherwise a new buffer of the logits' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mcore.kernels import dispatch

ReduceFn = Callable[[torch.Tensor, str], None]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_DTYPES = (torch.int64, torch.int32)
# fp32 elements the torch reference materializes at a time (128 MiB): rows are processed in chunks of
# this many values so the reference never holds an fp32 copy of the full logits.
_CHUNK_ELEMENTS = 1 << 25


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss_weight: float = 0.0,
    valid_vocab_size: int | None = None,
    vocab_start_index: int = 0,
    reduce: ReduceFn | None = None,
    inplace_backward: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy loss, fp32 ``[N]``, 0 where ``target == ignore_index``.

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32 (never copied to fp32). Under vocab sharding, the columns
            ``[vocab_start_index, vocab_start_index + V)`` of the full vocabulary.
        target: ``[N]`` int64/int32 global token ids, or ``ignore_index``.
        ignore_index: target value whose loss and gradient are 0.
        z_loss_weight: adds ``z_loss_weight * logsumexp**2`` per token (PaLM's z-loss).
        valid_vocab_size: global columns at or beyond it are vocabulary padding: excluded from the softmax
            and given a zero gradient. ``None``: every column is valid.
        vocab_start_index: global index of the first column of ``logits`` (vocab-sharded mode).
        reduce: ``reduce(tensor, op)`` with ``op`` in ``{"max", "sum"}`` all-reduces a small fp32 per-row
            tensor in place across the vocabulary shards; ``None`` when the logits hold the whole vocabulary.
        inplace_backward: let the backward write the gradient over ``logits`` (saves one ``[N, V]`` buffer;
            the logits must not be read after the backward, and the backward can run only once).
        backend: ``"triton"`` or ``"reference"``; ``None`` picks by device (see :mod:`mcore.kernels.dispatch`).

    A non-ignored target outside ``[0, valid vocabulary)`` raises ``ValueError`` for CPU tensors; on CUDA,
    where checking would synchronize the device, its loss is NaN instead.
    """
    _check_inputs(logits, target, ignore_index, z_loss_weight, valid_vocab_size, vocab_start_index, reduce)
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"cross_entropy: inplace_backward must be a bool, got {type(inplace_backward).__name__}")
    n_cols = logits.shape[1]
    global_valid = vocab_start_index + n_cols if valid_vocab_size is None else valid_vocab_size
    n_valid = max(0, min(n_cols, global_valid - vocab_start_index))
    if reduce is None and logits.device.type != "cuda":
        _check_targets_in_range(target, ignore_index, global_valid)
    name = dispatch.choose("cross_entropy", logits, target, backend=backend)
    return _CrossEntropy.apply(
        logits, target, ignore_index, float(z_loss_weight), n_valid, vocab_start_index, reduce, inplace_backward, name
    )


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        z_loss_weight: float,
        n_valid: int,
        vocab_start: int,
        reduce: ReduceFn | None,
        inplace_backward: bool,
        backend: str,
    ) -> torch.Tensor:
        if backend == dispatch.TRITON:
            from mcore.kernels.triton import cross_entropy as kernels

            if logits.shape[1] > 1 and logits.stride(1) != 1:
                logits = logits.contiguous()
            target = target.contiguous()
            stats = kernels.row_stats(
                logits, target, n_valid=n_valid, vocab_start=vocab_start, ignore_index=ignore_index
            )
        else:
            stats = _reference_row_stats(
                logits, target, n_valid=n_valid, vocab_start=vocab_start, ignore_index=ignore_index
            )
        loss, lse = _finish_forward(
            *stats, target=target, ignore_index=ignore_index, z_loss_weight=z_loss_weight, reduce=reduce
        )
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits, target, lse)
        ctx.options = dict(
            n_valid=n_valid, vocab_start=vocab_start, ignore_index=ignore_index, z_loss_weight=z_loss_weight
        )
        ctx.backend = backend
        ctx.inplace_backward = inplace_backward
        ctx.consumed = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.inplace_backward and ctx.consumed:
            raise RuntimeError(
                "cross_entropy: the backward of a loss built with inplace_backward=True can run only once "
                "(it overwrote the logits); pass inplace_backward=False to backpropagate twice"
            )
        logits, target, lse = ctx.saved_tensors
        grad_loss = grad_loss.to(torch.float32).contiguous()
        out = (
            logits.detach() if ctx.inplace_backward else torch.empty_like(logits, memory_format=torch.contiguous_format)
        )
        if ctx.backend == dispatch.TRITON:
            from mcore.kernels.triton import cross_entropy as kernels

            kernels.grad_logits(logits, target, lse, grad_loss, out, **ctx.options)
            if ctx.inplace_backward:
                # The kernel wrote through a raw pointer: tell autograd the saved logits changed.
                torch.autograd.graph.increment_version(out)
        else:
            _reference_grad(logits, target, lse, grad_loss, out, **ctx.options)
        ctx.consumed = True
        return out, None, None, None, None, None, None, None, None


def _finish_forward(
    row_max: torch.Tensor,
    sumexp: torch.Tensor,
    target_logit: torch.Tensor,
    found: torch.Tensor,
    *,
    target: torch.Tensor,
    ignore_index: int,
    z_loss_weight: float,
    reduce: ReduceFn | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2, shared by both backends: reduce the per-row statistics across shards, then the loss and lse."""
    if reduce is not None:
        global_max = row_max.clone()
        reduce(global_max, "max")
        # A shard with no valid column has sumexp 0 and max -inf: keep its share at 0 instead of 0 * nan.
        scale = torch.exp(row_max - global_max)
        sums = torch.stack([torch.where(sumexp > 0, sumexp * scale, 0.0), target_logit, found])
        reduce(sums, "sum")
        row_max, (sumexp, target_logit, found) = global_max, sums.unbind(0)
    lse = row_max + torch.log(sumexp)
    loss = lse - target_logit
    if z_loss_weight:
        loss = loss + z_loss_weight * lse.square()
    ignored = target == ignore_index
    missing = (found == 0) & ~ignored
    if reduce is not None and target.device.type != "cuda" and bool(missing.any()):
        row = int(missing.nonzero()[0, 0])
        raise ValueError(
            f"cross_entropy: target[{row}] = {int(target[row])} is outside the valid vocabulary of every shard "
            f"(and is not ignore_index={ignore_index})"
        )
    loss = torch.where(ignored, 0.0, torch.where(missing, math.nan, loss))
    return loss, lse


def _rows_per_chunk(n_cols: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, n_cols))


def _reference_row_stats(
    logits: torch.Tensor, target: torch.Tensor, *, n_valid: int, vocab_start: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n_rows = logits.shape[0]
    row_max = torch.full((n_rows,), -math.inf, device=logits.device, dtype=torch.float32)
    sumexp = torch.zeros(n_rows, device=logits.device, dtype=torch.float32)
    if n_valid > 0:
        step = _rows_per_chunk(n_valid)
        for r0 in range(0, n_rows, step):
            x = logits[r0 : r0 + step, :n_valid].to(torch.float32, copy=True)
            m = x.amax(dim=1)
            row_max[r0 : r0 + step] = m
            # In place on a copy (fp32 logits included): one fp32 chunk is the only temporary.
            sumexp[r0 : r0 + step] = x.sub_(m[:, None]).exp_().sum(dim=1)
            del x  # before the next chunk is allocated
    local = target.long() - vocab_start
    # An ignored target never counts as found, even when ignore_index is a valid column id.
    found = (local >= 0) & (local < n_valid) & (target != ignore_index)
    if logits.shape[1] > 0:
        picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0].float()
    else:
        picked = torch.zeros(n_rows, device=logits.device)
    target_logit = torch.where(found, picked, 0.0)
    return row_max, sumexp, target_logit, found.float()


def _reference_grad(
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
) -> None:
    n_rows, n_cols = logits.shape
    row_scale = torch.where(target == ignore_index, 0.0, grad_loss)
    local = target.long() - vocab_start
    has_target = (local >= 0) & (local < n_valid) & (target != ignore_index)
    step = _rows_per_chunk(n_cols)
    for r0 in range(0, n_rows, step):
        rows = slice(r0, r0 + step)
        lse_c = lse[rows, None]
        # In place on one fp32 copy of the chunk: softmax, z-loss factor, minus the one-hot, times d(loss).
        grad = logits[rows].to(torch.float32, copy=True).sub_(lse_c).exp_().mul_(1.0 + 2.0 * z_loss_weight * lse_c)
        hit = has_target[rows].nonzero()[:, 0]
        grad[hit, local[rows][hit]] -= 1.0
        grad.mul_(row_scale[rows, None])
        grad[:, n_valid:] = 0.0
        grad.masked_fill_((target[rows] == ignore_index)[:, None], 0.0)
        out[rows] = grad
        del grad  # before the next chunk is allocated


def _check_inputs(
    logits: object,
    target: object,
    ignore_index: object,
    z_loss_weight: object,
    valid_vocab_size: object,
    vocab_start_index: object,
    reduce: object,
) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(
            f"cross_entropy: logits and target must be tensors, got {type(logits).__name__} and {type(target).__name__}"
        )
    if logits.dim() != 2:
        raise ValueError(
            f"cross_entropy: logits must be 2-D [N, V], got shape {tuple(logits.shape)}; "
            "flatten the leading dims with logits.reshape(-1, V)"
        )
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"cross_entropy: logits dtype must be one of {_LOGIT_DTYPES}, got {logits.dtype}")
    if target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"cross_entropy: target dtype must be one of {_TARGET_DTYPES}, got {target.dtype}")
    if target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy: target must have shape [N] = {tuple(logits.shape[:1])} to match logits "
            f"{tuple(logits.shape)}, got {tuple(target.shape)}"
        )
    if target.device != logits.device:
        raise ValueError(
            f"cross_entropy: logits and target must be on one device, got {logits.device} and {target.device}"
        )
    if logits.shape[1] == 0:
        raise ValueError(f"cross_entropy: logits must have at least one column, got shape {tuple(logits.shape)}")
    for field, value in (("ignore_index", ignore_index), ("vocab_start_index", vocab_start_index)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"cross_entropy: {field} must be an int, got {value!r}")
    if vocab_start_index < 0:
        raise ValueError(f"cross_entropy: vocab_start_index must be >= 0, got {vocab_start_index}")
    if (
        not isinstance(z_loss_weight, int | float)
        or isinstance(z_loss_weight, bool)
        or not math.isfinite(z_loss_weight)
        or z_loss_weight < 0
    ):
        raise ValueError(f"cross_entropy: z_loss_weight must be a finite float >= 0, got {z_loss_weight!r}")
    if valid_vocab_size is not None:
        if not isinstance(valid_vocab_size, int) or isinstance(valid_vocab_size, bool) or valid_vocab_size < 1:
            raise ValueError(f"cross_entropy: valid_vocab_size must be None or an int >= 1, got {valid_vocab_size!r}")
        if reduce is None and valid_vocab_size > logits.shape[1]:
            raise ValueError(
                f"cross_entropy: valid_vocab_size={valid_vocab_size} exceeds the {logits.shape[1]} columns of the "
                "unsharded logits"
            )
    if reduce is None and vocab_start_index != 0:
        raise ValueError(
            f"cross_entropy: vocab_start_index={vocab_start_index} describes a vocabulary shard, which needs "
            "reduce(tensor, op) to combine the shards; pass reduce or vocab_start_index=0"
        )
    if reduce is not None and not callable(reduce):
        raise TypeError(f"cross_entropy: reduce must be callable as reduce(tensor, op) or None, got {reduce!r}")


def _check_targets_in_range(target: torch.Tensor, ignore_index: int, vocab: int) -> None:
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"cross_entropy: target[{row}] = {int(target[row])} is outside the valid vocabulary [0, {vocab}) "
            f"and is not ignore_index={ignore_index}"
        )
