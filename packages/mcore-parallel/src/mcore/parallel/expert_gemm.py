"""The experts' GEMMs as one cuBLAS GEMM per expert (``moe_router.expert_gemm: per_expert``), for a few large
experts (Mixtral: 8 experts of ~2k rows each).

Against ``torch._grouped_mm`` (``mcore.kernels.grouped_gemm``, the default) this trades one host sync per layer
forward (the experts' row offsets are copied to the host, **the one sync of this mode**, reused by backward) and
``3 x experts`` launches per layer for cuBLAS's dense GEMM kernels and a weight gradient that accumulates in fp32
straight into ``main_grad`` inside the GEMM (``addmm(out_dtype=float32)``, as the dense linears do:
``tensor_parallel.accumulate_weight_grad_``), with no bf16 ``[E, N, K]`` gradient written and added afterwards.
With many small experts (Qwen3-MoE: 128 of ~500 rows) the launches cost more than they win: keep ``grouped``.

Rows at or past the last expert's end are zero in the outputs and get no gradient, as with ``grouped_gemm``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore.parallel.param_attrs import fused_wgrad_target, mark_wgrad_in_main_grad
from mcore.parallel.tensor_parallel import accumulate_weight_grad_

__all__ = ["expert_bounds", "per_expert_linear", "per_expert_linear_of_activation"]


def expert_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` row range of each expert from the cumulative ``offsets`` [E]: a device-to-host copy (the
    host sync of this mode, once per layer forward)."""
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))


def per_expert_linear(x: torch.Tensor, w: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g].T`` for ``x`` [N, K], ``w`` [E, M, K] (a parameter)."""
    return _PerExpertLinear.apply(x, w, bounds)


def per_expert_linear_of_activation(
    h: torch.Tensor, w: torch.Tensor, bounds: list[tuple[int, int]], activation: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``per_expert_linear(activation(h), w, bounds)`` keeping ``h``, not the activation: backward recomputes it
    (as ``grouped_gemm_of_activation``)."""
    return _PerExpertLinearOfActivation.apply(h, w, bounds, activation)


def _forward(a: torch.Tensor, w: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    y = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    for g, (lo, hi) in enumerate(bounds):
        if hi > lo:
            torch.mm(a[lo:hi], w[g].t(), out=y[lo:hi])
        else:
            y[lo:hi].zero_()
    y[bounds[-1][1] :].zero_()  # rows of no expert
    return y


def _backward(dy, a, w, bounds, need_da: bool, need_dw: bool):
    """(da, dw): ``dw`` is ``None`` when it went into ``w.main_grad`` (fp32, inside the GEMM)."""
    dy = dy.contiguous()
    # every row of an expert is written by its GEMM: only the rows of no expert (and the weight gradients of
    # experts without rows) are zero-filled, not the whole [rows, K] / [E, M, K] outputs
    da = torch.empty_like(a) if need_da else None
    if da is not None:
        da[bounds[-1][1] :].zero_()
    target = fused_wgrad_target(w) if need_dw else None
    dw = torch.empty_like(w) if need_dw and target is None else None
    for g, (lo, hi) in enumerate(bounds):
        if hi <= lo:
            if dw is not None:
                dw[g].zero_()
            continue
        if da is not None:
            torch.mm(dy[lo:hi], w[g], out=da[lo:hi])
        if target is not None:
            accumulate_weight_grad_(target[g], dy[lo:hi], a[lo:hi])
        elif dw is not None:
            torch.mm(dy[lo:hi].t(), a[lo:hi], out=dw[g])
    if target is not None:
        mark_wgrad_in_main_grad(w)
    return da, dw


class _PerExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bounds):
        ctx.save_for_backward(x, w)
        ctx.bounds = bounds
        return _forward(x, w, bounds)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = _backward(dy, x, w, ctx.bounds, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None


class _PerExpertLinearOfActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, bounds, activation):
        ctx.save_for_backward(h, w)
        ctx.bounds, ctx.activation = bounds, activation
        return _forward(activation(h), w, bounds)  # no graph inside forward: the activation's output is not kept

    @staticmethod
    def backward(ctx, dy):
        h, w = ctx.saved_tensors
        need_dh = ctx.needs_input_grad[0]
        with torch.enable_grad():
            h_leaf = h.detach().requires_grad_(need_dh)
            a = ctx.activation(h_leaf)
        da, dw = _backward(dy, a.detach(), w, ctx.bounds, need_dh, ctx.needs_input_grad[1])
        dh = torch.autograd.grad(a, h_leaf, da)[0] if need_dh else None
        return dh, dw, None, None
