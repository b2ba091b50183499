"""BitNet b1.58 quantization-aware linears: ternary absmean weights and per-token int8 activations.

As in "The Era of 1-bit LLMs" (Ma et al., 2024) and Hugging Face's online ``AutoBitLinear``:

* weights: ``s = 1 / max(mean(|W|), 1e-5)`` over the whole tensor, ``W_q = clamp(round(W * s), -1, 1) / s``;
* activations, per token (last dim): ``s = 127 / max(max(|x|), 1e-5)``, ``x_q = clamp(round(x * s), -128, 127) / s``;
* ``y = x_q W_q^T``; the backward passes the gradient straight through both quantizers (STE):
  ``dx = dy W_q``, ``dW = dy^T x_q``. The high-precision weight stays the trained parameter.

Math in fp32 (``round`` is half to even, like torch's), the weight's absolute sum in fp64. Under tensor
parallelism the weight's mean is over the full tensor (``sum_reduce`` adds ``[sum |W|, numel]`` over the
ranks) and a token's absmax is over its full hidden vector when the input is sharded along it (``max_reduce``).
``row_segments`` (int64, one id per weight row) gives each segment of a fused weight its own mean, as the
separate projections it fuses have (q, k, v in a fused qkv; gate and up): ``[sum |W|, numel]`` per segment.
``defer`` (a zero-bubble schedule's, ``wgrad_defer``) may queue the weight-gradient GEMM ``dy^T x_q`` for later.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore.kernels.wgrad_defer import Defer, now_or_deferred

EPS = 1e-5
Reduce = Callable[[torch.Tensor], None]


def ternary_weight(
    weight: torch.Tensor, *, sum_reduce: Reduce | None = None, row_segments: torch.Tensor | None = None
) -> torch.Tensor:
    """``W_q`` (fp32, values in ``{-1, 0, 1} / s``) of ``weight``; ``sum_reduce`` sums over the shards' ranks;
    ``row_segments`` (one int64 id per row, ids ``0..S-1``) gives each segment its own scale."""
    w = weight.float()
    # the sum in float64, so that summing per shard and then over the ranks gives the same fp32 mean as one
    # sum over the whole tensor (ternary rounding turns the last bit of the scale into flipped weights)
    if row_segments is None:
        totals = w.abs().sum(dtype=torch.float64).reshape(1)
        counts = torch.full((1,), float(w.numel()), dtype=torch.float64, device=w.device)
    else:
        if row_segments.shape != (w.shape[0],):
            raise ValueError(f"ternary_weight: row_segments must be [{w.shape[0]}], got {tuple(row_segments.shape)}")
        # one slot per row bounds the number of segments without reading the ids on the host (no sync)
        rows = w.abs().sum(dim=1, dtype=torch.float64)
        totals = torch.zeros_like(rows).index_add_(0, row_segments, rows)
        counts = torch.zeros_like(rows).index_add_(0, row_segments, torch.full_like(rows, float(w.shape[1])))
    stats = torch.stack((totals, counts))
    if sum_reduce is not None:
        sum_reduce(stats)
    mean = (stats[0] / stats[1].clamp(min=1.0)).float()  # unused segment slots: 0 / 1
    scale = torch.ones_like(mean).div(mean.clamp(min=EPS))
    scale = scale.reshape(()) if row_segments is None else scale[row_segments].unsqueeze(1)
    return (w * scale).round().clamp(-1, 1) / scale


def int8_per_token(x: torch.Tensor, *, max_reduce: Reduce | None = None) -> torch.Tensor:
    """``x_q`` (fp32) with one int8 scale per token (row of the last dim); ``max_reduce`` over the shards' ranks."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if max_reduce is not None:
        max_reduce(amax)
    scale = torch.full_like(amax, 127.0).div(amax.clamp(min=EPS))
    return (xf * scale).round().clamp(-128, 127) / scale


class BitNetLinearFunction(torch.autograd.Function):
    """``y = int8_per_token(x) @ ternary_weight(W)^T + b`` with straight-through gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, sum_reduce, max_reduce, row_segments=None, defer: Defer | None = None):
        x_q = int8_per_token(x, max_reduce=max_reduce)
        w_q = ternary_weight(weight, sum_reduce=sum_reduce, row_segments=row_segments)
        ctx.save_for_backward(x_q, w_q)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.has_bias = bias is not None
        ctx.param, ctx.defer = weight, defer  # the Parameter itself: a deferred gradient is given to its owner
        y = (x_q @ w_q.t()).to(x.dtype)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad_out):
        x_q, w_q = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g = grad_out.float()
        grad_x = (g @ w_q).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            # deferred, the closure keeps the output gradient as it came (its fp32 copy is made again then: the
            # same values) and the int8-rounded input that forward saved
            def compute() -> torch.Tensor:
                g = grad_out.float()
                return (g.reshape(-1, g.shape[-1]).t() @ x_q.reshape(-1, x_q.shape[-1])).to(w_dtype)

            grad_w = now_or_deferred(ctx.defer, ctx.param, compute)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None


def bitnet_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    sum_reduce: Reduce | None = None,
    max_reduce: Reduce | None = None,
    row_segments: torch.Tensor | None = None,
    defer: Defer | None = None,
) -> torch.Tensor:
    """BitNet b1.58 ``F.linear``: ternary weight (one scale per ``row_segments`` segment, or one), int8 per-token
    activations, straight-through gradients; ``defer``: asked in backward whether to queue the weight gradient
    (``wgrad_defer``)."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"bitnet_linear: input [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)}")
    return BitNetLinearFunction.apply(x, weight, bias, sum_reduce, max_reduce, row_segments, defer)
