"""Grouped GEMM for MoE experts: ``y[rows of g] = x[rows of g] @ w[g].T`` for each expert ``g``.

Backends:

* ``"grouped_mm"``: ``torch._grouped_mm`` (the kernel behind ``torch.nn.functional.grouped_mm``; present in
  torch >= 2.8): one launch for all experts, the offsets read on the device (no host sync). Chosen on CUDA for
  bf16 operands whose inner dims are multiples of 8 (16-byte rows, the kernel's alignment rule).
* ``"reference"``: a loop over experts with ``torch.mm`` in fp32 accumulation; it reads the offsets on the host
  (one sync), which is fine where it runs (CPU, odd shapes, fp32).

Both share one autograd function with a hand-written backward: ``dx = dy @ w[g]`` (a grouped GEMM of the same
kind) and ``dw[g] = dy[rows of g].T @ x[rows of g]`` (the 2-D x 2-D grouped form). Rows at or past
``offsets[-1]`` belong to no expert: their output is zero and they get no gradient.

:func:`grouped_gemm_of_activation` is ``grouped_gemm(activation(h), w, offsets)`` that keeps ``h`` for backward
and recomputes ``activation(h)`` there instead of keeping it: for an MoE's SwiGLU experts the activation output is
``rows x F`` (half of ``h``), one elementwise pass to recompute, and it is live only inside the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore.kernels import dispatch

__all__ = ["GROUPED_MM", "grouped_gemm", "grouped_gemm_of_activation"]

GROUPED_MM = "grouped_mm"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """``x`` [N, K] rows grouped by expert, ``w`` [E, M, K] (each expert's ``[out, in]`` weight, as
    ``nn.Linear``), ``offsets`` [E] int32 cumulative segment ends (``offsets[-1] <= N``): returns [N, M].

    ``backend`` is ``"grouped_mm"``, ``"reference"`` or ``None`` (CUDA bf16 -> grouped_mm, else reference);
    ``MCORE_KERNELS_BACKEND=reference`` forces the loop.
    """
    _check(x, w, offsets)
    chosen = _choose(x, w, backend)
    return _GroupedGemm.apply(x, w, offsets, chosen)


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"grouped_gemm: x must be [rows, K] and w [experts, M, K] with the same K, "
            f"got x {tuple(x.shape)} and w {tuple(w.shape)}"
        )
    if x.dtype not in _FLOAT_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"grouped_gemm: x and w must share a float16/bfloat16/float32 dtype, got {x.dtype}, {w.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0] or offsets.dtype != torch.int32:
        raise ValueError(
            f"grouped_gemm: offsets must be int32 [{w.shape[0]}] (cumulative end row of each expert), "
            f"got {offsets.dtype} {tuple(offsets.shape)}"
        )
    if x.device != w.device or offsets.device != x.device:
        raise ValueError(f"grouped_gemm: x, w, offsets on different devices: {x.device}, {w.device}, {offsets.device}")


def _choose(x: torch.Tensor, w: torch.Tensor, backend: str | None) -> str:
    chosen = dispatch.choose("grouped_gemm", x, w, backend=backend, extra=(GROUPED_MM,))
    if chosen == dispatch.TRITON:  # no Triton kernel: torch's grouped GEMM is the fast path on CUDA
        chosen = GROUPED_MM
    if chosen == GROUPED_MM and backend is None:
        fits = x.is_cuda and x.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0
        if not fits or not hasattr(torch, "_grouped_mm"):
            chosen = dispatch.REFERENCE
    return chosen


def _row_mask(rows: int, offsets: torch.Tensor) -> torch.Tensor:
    """[rows, 1] bool: the rows that belong to some expert (``row < offsets[-1]``), computed on the device."""
    return (torch.arange(rows, device=offsets.device) < offsets[-1]).unsqueeze(1)


def _reference_forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    y = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for g, end in enumerate(offsets.tolist()):  # host sync: the reference only
        if end > start:
            y[start:end] = torch.mm(x[start:end].float(), w[g].float().t()).to(y.dtype)
        start = end
    return y


def _reference_backward(dy, x, w, offsets, need_dx, need_dw):
    dx = torch.zeros_like(x) if need_dx else None
    dw = torch.zeros_like(w) if need_dw else None
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            dyg = dy[start:end].float()
            if need_dx:
                dx[start:end] = torch.mm(dyg, w[g].float()).to(x.dtype)
            if need_dw:
                dw[g] = torch.mm(dyg.t(), x[start:end].float()).to(w.dtype)
        start = end
    return dx, dw


def _grouped_mm_forward(x, w, offsets):
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    # rows past offsets[-1] are left uninitialised by the kernel; zero them on the device (no sync)
    return y.masked_fill_(~_row_mask(x.shape[0], offsets), 0)


def _grouped_mm_backward(dy, x, w, offsets, need_dx, need_dw):
    dy = dy.contiguous().masked_fill(~_row_mask(dy.shape[0], offsets), 0)
    dx = dw = None
    if need_dx:
        dx = torch._grouped_mm(dy, w, offs=offsets)
        dx.masked_fill_(~_row_mask(x.shape[0], offsets), 0)
    if need_dw:
        dw = torch._grouped_mm(dy.t(), x, offs=offsets)  # [E, M, K]; an expert without rows gets zeros
    return dx, dw


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, backend):
        ctx.save_for_backward(x, w, offsets)
        ctx.backend = backend
        if backend == GROUPED_MM:
            return _grouped_mm_forward(x, w, offsets)
        return _reference_forward(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        backward_fn = _grouped_mm_backward if ctx.backend == GROUPED_MM else _reference_backward
        dx, dw = backward_fn(dy, x, w, offsets, need_dx, need_dw)
        return dx, dw, None, None


def grouped_gemm_of_activation(
    h: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``grouped_gemm(activation(h), w, offsets)`` (same shapes and backends) saving ``h``, not the activation's
    output: backward recomputes it. ``activation`` is any differentiable ``[N, *] -> [N, K]`` row-wise function
    (e.g. :func:`mcore.kernels.swiglu`); its own backward gives ``h``'s gradient."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"grouped_gemm_of_activation: h must be a 2-D [rows, *] tensor, got {getattr(h, 'shape', h)}")
    with torch.no_grad():
        a = activation(h)
    _check(a, w, offsets)
    return _GroupedGemmOfActivation.apply(h, w, offsets, activation, _choose(a, w, backend), a)


class _GroupedGemmOfActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, offsets, activation, backend, a):
        ctx.save_for_backward(h, w, offsets)
        ctx.activation, ctx.backend = activation, backend
        if backend == GROUPED_MM:
            return _grouped_mm_forward(a, w, offsets)
        return _reference_forward(a, w, offsets)

    @staticmethod
    def backward(ctx, dy):
        h, w, offsets = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.enable_grad():
            h_leaf = h.detach().requires_grad_(need_dh)
            a = ctx.activation(h_leaf)  # the recompute: one elementwise pass over h
        backward_fn = _grouped_mm_backward if ctx.backend == GROUPED_MM else _reference_backward
        da, dw = backward_fn(dy, a.detach(), w, offsets, need_dh, need_dw)
        dh = torch.autograd.grad(a, h_leaf, da)[0] if need_dh else None
        return dh, dw, None, None, None, None
