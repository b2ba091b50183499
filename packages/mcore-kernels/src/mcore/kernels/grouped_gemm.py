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

``wgrad_into`` (a function called once in backward) lets the caller take the weight gradient into a tensor of its
own (a data-parallel ``main_grad``, of any float dtype) instead of receiving it: it returns ``(target,
accumulate)`` or ``None`` (return the gradient as usual). ``accumulate=False`` (the step's first micro-batch:
nothing to add to) writes ``target`` without reading it, every expert included (zeros for one without rows), so the
``main_grad`` is neither zero-filled-then-added nor read; ``True`` adds. ``grouped_mm`` then copies (or adds) its
``w``-dtype gradient into the target (``torch._grouped_mm`` has no ``out=`` and, in torch 2.11, no fp32 output for
bf16 operands); the reference computes each expert's gradient in fp32 and writes it there. It may instead return a
function ``write(dy, x)`` that computes and stores the weight gradient itself from the output gradient and the
GEMM's input (the caller's own GEMMs: one per expert accumulating in fp32, say); the grouped weight-gradient GEMM is
then not run.

:func:`grouped_gemm_of_activation` is ``grouped_gemm(activation(h), w, offsets)`` that keeps ``h`` for backward
and recomputes ``activation(h)`` there instead of keeping it: for an MoE's SwiGLU experts the activation output is
``rows x F`` (half of ``h``), one elementwise pass to recompute, and it is live only inside the backward (until the
deferred weight gradient ran, when deferred).

``defer`` (a zero-bubble schedule's ``WeightGradStore.defer``, see ``wgrad_defer``): asked in backward whether to
queue the weight gradient for later; queued, ``wgrad_into`` is called when the queued work runs, not in backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore.kernels import dispatch
from mcore.kernels.wgrad_defer import Defer, now_or_deferred

__all__ = ["GROUPED_MM", "WgradInto", "WgradWriter", "grouped_gemm", "grouped_gemm_of_activation"]

GROUPED_MM = "grouped_mm"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# called once in backward: (target [E, M, K], accumulate) to take w's gradient there, a function write(dy, x) that
# takes it itself, or None to return it
WgradWriter = Callable[[torch.Tensor, torch.Tensor], None]
WgradInto = Callable[[], "tuple[torch.Tensor, bool] | WgradWriter | None"]


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    backend: str | None = None,
    tail_rows: int | None = None,
    wgrad_into: WgradInto | None = None,
    defer: Defer | None = None,
) -> torch.Tensor:
    """``x`` [N, K] rows grouped by expert, ``w`` [E, M, K] (each expert's ``[out, in]`` weight, as
    ``nn.Linear``), ``offsets`` [E] int32 cumulative segment ends (``offsets[-1] <= N``): returns [N, M].

    ``backend`` is ``"grouped_mm"``, ``"reference"`` or ``None`` (CUDA bf16 -> grouped_mm, else reference);
    ``MCORE_KERNELS_BACKEND=reference`` forces the loop. ``tail_rows``: at most that many last rows can lie past
    ``offsets[-1]`` (the caller's plan knows; ``None``: any row): only those are zeroed, not the whole output.
    ``wgrad_into``: where backward puts ``w``'s gradient; ``defer``: whether it does so later (the module docstring).
    """
    _check(x, w, offsets)
    chosen = _choose(x, w, backend)
    return _GroupedGemm.apply(x, w, offsets, chosen, _tail(tail_rows, x.shape[0]), wgrad_into, defer)


def _tail(tail_rows: int | None, rows: int) -> int:
    if tail_rows is None:
        return rows
    if isinstance(tail_rows, bool) or not isinstance(tail_rows, int) or tail_rows < 0:
        raise ValueError(f"grouped_gemm: tail_rows must be an int >= 0 or None, got {tail_rows!r}")
    return min(tail_rows, rows)


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


def _zero_unused_rows_(y: torch.Tensor, offsets: torch.Tensor, tail: int) -> torch.Tensor:
    """Zero the rows of ``y`` at or past ``offsets[-1]`` among its last ``tail`` rows, on the device (no sync)."""
    rows = y.shape[0]
    if tail:
        start = rows - tail
        used = (torch.arange(start, rows, device=offsets.device) < offsets[-1]).unsqueeze(1)
        y[start:].masked_fill_(~used, 0)
    return y


def _reference_forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, tail=None) -> torch.Tensor:
    # ``tail`` is unused: the output starts as zeros, so rows past offsets[-1] stay zero
    y = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for g, end in enumerate(offsets.tolist()):  # host sync: the reference only
        if end > start:
            y[start:end] = torch.mm(x[start:end].float(), w[g].float().t()).to(y.dtype)
        start = end
    return y


def _reference_dx(dy, x, w, offsets, tail=None):  # zero-initialised: no tail
    dx = torch.zeros_like(x)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            dx[start:end] = torch.mm(dy[start:end].float(), w[g].float()).to(x.dtype)
        start = end
    return dx


def _reference_dw(dy, x, w, offsets, into=None):
    """``w``'s gradient (zero-initialised: an expert without rows gets zeros), or ``None`` when ``into`` took it:
    ``(target, accumulate)`` to write the fp32 per-expert gradients into, or a writer given ``(dy, x)``."""
    if callable(into):
        into(dy, x)
        return None
    dw = torch.zeros_like(w) if into is None else None
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if dw is not None and end > start:
            dw[g] = torch.mm(dy[start:end].float().t(), x[start:end].float()).to(w.dtype)
        if into is not None:
            target, accumulate = into[0][g], into[1]
            grad = torch.mm(dy[start:end].float().t(), x[start:end].float())  # zeros for an expert without rows
            target.add_(grad) if accumulate else target.copy_(grad)
        start = end
    return dw


def _grouped_mm_forward(x, w, offsets, tail):
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    # rows past offsets[-1] are left uninitialised by the kernel; zero them on the device (no sync)
    return _zero_unused_rows_(y, offsets, tail)


def _grouped_mm_dx(dy, x, w, offsets, tail):
    # dy's rows past offsets[-1] belong to no group: neither GEMM reads them, so dy is used as it is (no copy)
    return _zero_unused_rows_(torch._grouped_mm(dy, w, offs=offsets), offsets, tail)


def _grouped_mm_dw(dy, x, w, offsets, into=None):
    if callable(into):
        into(dy, x)  # the caller's GEMMs take the weight gradient
        return None
    dw = torch._grouped_mm(dy.t(), x, offs=offsets)  # [E, M, K]; an expert without rows gets zeros
    return _store_weight_grad(dw, into)


def _store_weight_grad(dw: torch.Tensor, into: tuple[torch.Tensor, bool] | None) -> torch.Tensor | None:
    """``dw`` (every expert's, zeros for one without rows) copied into ``into``'s target (the target is not read) or
    added to it, then ``None``; ``dw`` itself without a target."""
    if into is None:
        return dw
    target, accumulate = into
    target.add_(dw) if accumulate else target.copy_(dw)
    return None


def _weight_grad_sink(wgrad_into: WgradInto | None, need_dw: bool, w_shape, caller: str = "grouped_gemm"):
    """``wgrad_into()`` checked (called only when ``w`` needs a gradient): a target tuple, a writer, or ``None``."""
    if wgrad_into is None or not need_dw:
        return None
    into = wgrad_into()
    if into is None or callable(into):
        return into
    target, accumulate = into
    shape = tuple(w_shape)
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != shape or not target.is_floating_point():
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"{caller}: wgrad_into must give a float tensor of w's shape {shape}, got {got}")
    return target, bool(accumulate)


def _backward(ctx, dy, x, w, offsets, need_dx: bool, need_dw: bool):
    """``(dx, dw)`` of the GEMM of input ``x``; ``dw`` is ``None`` when ``wgrad_into`` took it or ``ctx.defer``
    queued it (the queued closure keeps ``dy`` and ``x``, and asks ``wgrad_into`` where to write when it runs)."""
    grouped = ctx.backend == GROUPED_MM
    if grouped:
        dy = dy.contiguous()
    dx = (_grouped_mm_dx if grouped else _reference_dx)(dy, x, w, offsets, ctx.tail) if need_dx else None
    if not need_dw:
        return dx, None
    dw_fn, wgrad_into = (_grouped_mm_dw if grouped else _reference_dw), ctx.wgrad_into
    compute = lambda: dw_fn(dy, x, w, offsets, _weight_grad_sink(wgrad_into, True, w.shape))  # noqa: E731
    return dx, now_or_deferred(ctx.defer, ctx.param, compute)


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, backend, tail, wgrad_into, defer=None):
        ctx.save_for_backward(x, w, offsets)
        ctx.backend, ctx.tail, ctx.wgrad_into, ctx.defer = backend, tail, wgrad_into, defer
        ctx.param = w  # the Parameter itself (a recompute's saved w is another tensor): a deferred gradient's owner
        forward_fn = _grouped_mm_forward if backend == GROUPED_MM else _reference_forward
        return forward_fn(x, w, offsets, tail)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dx, dw = _backward(ctx, dy, x, w, offsets, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None, None, None, None, None


def grouped_gemm_of_activation(
    h: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    *,
    backend: str | None = None,
    tail_rows: int | None = None,
    wgrad_into: WgradInto | None = None,
    defer: Defer | None = None,
) -> torch.Tensor:
    """``grouped_gemm(activation(h), w, offsets)`` (same shapes and backends) saving ``h``, not the activation's
    output: backward recomputes it. ``activation`` is any differentiable ``[N, *] -> [N, K]`` row-wise function
    (e.g. :func:`mcore.kernels.swiglu`); its own backward gives ``h``'s gradient. ``tail_rows``, ``wgrad_into``,
    ``defer``: as in :func:`grouped_gemm`."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"grouped_gemm_of_activation: h must be a 2-D [rows, *] tensor, got {getattr(h, 'shape', h)}")
    with torch.no_grad():
        a = activation(h)
    _check(a, w, offsets)
    tail = _tail(tail_rows, h.shape[0])
    chosen = _choose(a, w, backend)
    return _GroupedGemmOfActivation.apply(h, w, offsets, activation, chosen, a, tail, wgrad_into, defer)


class _GroupedGemmOfActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, offsets, activation, backend, a, tail, wgrad_into, defer=None):
        ctx.save_for_backward(h, w, offsets)
        ctx.activation, ctx.backend, ctx.tail, ctx.wgrad_into, ctx.defer = activation, backend, tail, wgrad_into, defer
        ctx.param = w
        forward_fn = _grouped_mm_forward if backend == GROUPED_MM else _reference_forward
        return forward_fn(a, w, offsets, tail)

    @staticmethod
    def backward(ctx, dy):
        h, w, offsets = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.enable_grad():
            h_leaf = h.detach().requires_grad_(need_dh)
            a = ctx.activation(h_leaf)  # the recompute: one elementwise pass over h
        da, dw = _backward(ctx, dy, a.detach(), w, offsets, need_dh, need_dw)
        dh = torch.autograd.grad(a, h_leaf, da)[0] if need_dh else None
        return dh, dw, None, None, None, None, None, None, None
