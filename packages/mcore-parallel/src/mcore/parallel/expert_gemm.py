"""The experts' GEMMs as one cuBLAS GEMM per expert (``moe_router.expert_gemm: per_expert``), for a few large
experts (Mixtral: 8 experts of ~2k rows each), and where both GEMM modes put the experts' weight gradients.

Against ``torch._grouped_mm`` (``mcore.kernels.grouped_gemm``, the default) this trades one host sync per layer
forward (the experts' row offsets are needed on the host, **the one sync of this mode**, reused by backward) and
``3 x experts`` launches per layer for cuBLAS's dense GEMM kernels and a weight gradient that the GEMM writes in
fp32 straight into ``main_grad`` (``mm(out_dtype=float32)``; ``addmm`` on later micro-batches, as the dense linears
do: ``tensor_parallel.accumulate_weight_grad_``), with no bf16 ``[E, N, K]`` gradient written and added afterwards.
With many small experts (Qwen3-MoE: 128 of ~500 rows) the launches cost more than they win: keep ``grouped``.

The host offsets (:class:`HostOffsets`): the dispatcher starts their device-to-host copy (non-blocking, into pinned
memory) right after routing has planned the rows, before the permute kernels are queued, and the experts wait for
that copy only when their first GEMM needs it, so the GPU still has the permute to run while the host resumes
(the GPU idles only for what the copy's wait outlasts that queue). Under ep > 1 the all-to-all's split exchange
already brings every count to the host, and the local offsets are derived there: no second sync.

First micro-batch of a step (:func:`expert_wgrad_into`, both modes): DDP's ``zero_grad_buffer`` marks each
``main_grad`` as holding nothing yet, and FSDP2 at one rank creates the shard gradient at the step's first weight
gradient; the experts' first weight-gradient GEMM then **writes** the target (``beta = 0``; zeros for an expert
without rows) instead of adding to a zero-filled one, so the target is not read. Later micro-batches add. The
target's dtype is read from the target (fp32 ``main_grad``, or a bf16 one).

Rows at or past the last expert's end are zero in the outputs and get no gradient, as with ``grouped_gemm``.

Zero-bubble schedules: ``defer`` (the experts' ``WeightGradStore.defer``) may queue the per-expert weight-gradient
GEMMs for the W pass, as ``grouped_gemm``'s does; :func:`expert_wgrad_into` is then asked when they run, so the
step's first of them still overwrites ``main_grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore.kernels.fp8_weight_cache import WeightCastCache
from mcore.kernels.wgrad_defer import Defer, now_or_deferred
from mcore.parallel.param_attrs import mark_wgrad_in_main_grad, take_wgrad_target
from mcore.parallel.tensor_parallel import accumulate_weight_grad_, write_weight_grad_

__all__ = [
    "ExpertGemms",
    "HostOffsets",
    "expert_bounds",
    "expert_wgrad_into",
    "per_expert_linear",
    "per_expert_linear_of_activation",
]


@dataclass(frozen=True)
class ExpertGemms:
    """A grouped GEMM of the experts and its form that keeps the activation's input (``grouped_gemm`` and
    ``grouped_gemm_of_activation``'s signatures, ``tail_rows``, ``wgrad_into`` and ``defer`` included): what
    ``GroupedExperts.low_precision`` holds (``mcore.parallel.low_precision``'s fp8 GEMMs), ``None`` for bf16.
    ``weight_casts``: the cache both GEMMs reuse their weight casts from within a step (their ``weight_casts=``),
    ``None``: cast each call."""

    gemm: Callable[..., torch.Tensor]
    of_activation: Callable[..., torch.Tensor]
    weight_casts: WeightCastCache | None = None


def expert_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` row range of each expert from the cumulative ``offsets`` [E]: a device-to-host copy (the
    host sync of this mode, once per layer forward)."""
    return _bounds_of(offsets.tolist())


def _bounds_of(ends: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *ends[:-1]], ends))


class HostOffsets:
    """The experts' cumulative row offsets on their way to the host. :meth:`start` queues the copy (CUDA:
    non-blocking into pinned memory, an event behind it; no wait); :meth:`bounds` waits for that copy alone and
    gives ``[(start, end)]`` per expert. :meth:`from_ends`: offsets already on the host (no copy, no wait)."""

    def __init__(self, host: torch.Tensor | list[int], event: torch.cuda.Event | None = None) -> None:
        self._host, self._event = host, event
        self._bounds: list[tuple[int, int]] | None = None

    @classmethod
    def start(cls, offsets: torch.Tensor) -> HostOffsets:
        """Queue the copy of ``offsets`` [E] (int32, on any device) to the host."""
        if not offsets.is_cuda:
            return cls(offsets)
        host = torch.empty(offsets.shape, dtype=offsets.dtype, pin_memory=True)
        host.copy_(offsets, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    @classmethod
    def from_ends(cls, ends: list[int]) -> HostOffsets:
        return cls([int(e) for e in ends])

    def bounds(self) -> list[tuple[int, int]]:
        if self._bounds is None:
            if self._event is not None:
                self._event.synchronize()  # the copy queued by start(), not the work queued since
            ends = self._host if isinstance(self._host, list) else self._host.tolist()
            self._bounds = _bounds_of(ends)
        return self._bounds


def expert_wgrad_into(w: torch.Tensor, host_offsets: HostOffsets | None = None):
    """``grouped_gemm``'s ``wgrad_into`` for expert weight ``w``: in backward, DDP's ``main_grad`` (or FSDP2's shard
    gradient at one rank) as ``(target, accumulate)``, ``accumulate=False`` on the step's first micro-batch
    (``param_attrs.take_wgrad_target``); ``None`` without a data-parallel wrapper (the gradient is returned). With
    ``host_offsets`` (``expert_gemm: grouped_fp32_wgrad``) a writer instead: one GEMM per expert accumulating in
    the target's dtype (fp32) inside the GEMM, from the offsets whose copy to the host started in forward (done by
    the time backward waits for it)."""

    def into():
        target, overwrite = take_wgrad_target(w)
        if target is None:
            return None
        mark_wgrad_in_main_grad(w)  # DDP's hook must not add a .grad: the gradient is in main_grad
        if host_offsets is None:
            return target, not overwrite
        return lambda dy, x: _per_expert_weight_grads_(target, not overwrite, host_offsets.bounds(), dy, x)

    return into


def _per_expert_weight_grads_(target, accumulate: bool, bounds, dy: torch.Tensor, x: torch.Tensor) -> None:
    """``target[g] (+)= dy[rows of g]^T @ x[rows of g]`` for each expert, accumulated in ``target``'s precision by
    the GEMM; written (zeros for an expert without rows, ``target`` not read) unless ``accumulate``."""
    write = accumulate_weight_grad_ if accumulate else write_weight_grad_
    for g, (lo, hi) in enumerate(bounds):
        if hi > lo:
            write(target[g], dy[lo:hi], x[lo:hi])
        elif not accumulate:
            target[g].zero_()


def per_expert_linear(
    x: torch.Tensor, w: torch.Tensor, bounds: list[tuple[int, int]], defer: Defer | None = None
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g].T`` for ``x`` [N, K], ``w`` [E, M, K] (a parameter); ``defer``: see the
    module docstring."""
    return _PerExpertLinear.apply(x, w, bounds, defer)


def per_expert_linear_of_activation(
    h: torch.Tensor,
    w: torch.Tensor,
    bounds: list[tuple[int, int]],
    activation: Callable[[torch.Tensor], torch.Tensor],
    defer: Defer | None = None,
) -> torch.Tensor:
    """``per_expert_linear(activation(h), w, bounds)`` keeping ``h``, not the activation: backward recomputes it
    (as ``grouped_gemm_of_activation``)."""
    return _PerExpertLinearOfActivation.apply(h, w, bounds, activation, defer)


def _forward(a: torch.Tensor, w: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    y = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    for g, (lo, hi) in enumerate(bounds):
        if hi > lo:
            torch.mm(a[lo:hi], w[g].t(), out=y[lo:hi])
        else:
            y[lo:hi].zero_()
    y[bounds[-1][1] :].zero_()  # rows of no expert
    return y


def _backward(ctx, dy, a, w, need_da: bool, need_dw: bool):
    """(da, dw): ``dw`` is ``None`` when it went into ``w``'s ``main_grad`` (``ctx.wgrad_into``: the forward's
    :func:`expert_wgrad_into` of the parameter itself; under non-reentrant recompute the saved ``w`` comes back as
    another tensor object, without the parameter's attributes) or ``ctx.defer`` queued it."""
    dy, bounds = dy.contiguous(), ctx.bounds
    # every row of an expert is written by its GEMM: only the rows of no expert (and the weight gradients of
    # experts without rows) are zero-filled, not the whole [rows, K] / [E, M, K] outputs
    da = None
    if need_da:
        da = torch.empty_like(a)
        da[bounds[-1][1] :].zero_()
        for g, (lo, hi) in enumerate(bounds):
            if hi > lo:
                torch.mm(dy[lo:hi], w[g], out=da[lo:hi])
    if not need_dw:
        return da, None
    wgrad_into = ctx.wgrad_into
    return da, now_or_deferred(ctx.defer, ctx.param, lambda: _weight_grads(dy, a, w, bounds, wgrad_into()))


def _weight_grads(dy, a, w, bounds, into) -> torch.Tensor | None:
    """Every expert's weight gradient (zeros for one without rows), or ``None`` when ``into`` took it."""
    if into is not None:
        _per_expert_weight_grads_(into[0], into[1], bounds, dy, a)
        return None
    dw = torch.empty_like(w)
    for g, (lo, hi) in enumerate(bounds):
        if hi > lo:
            torch.mm(dy[lo:hi].t(), a[lo:hi], out=dw[g])
        else:
            dw[g].zero_()
    return dw


class _PerExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bounds, defer=None):
        ctx.save_for_backward(x, w)
        ctx.bounds, ctx.wgrad_into, ctx.defer, ctx.param = bounds, expert_wgrad_into(w), defer, w
        return _forward(x, w, bounds)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = _backward(ctx, dy, x, w, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None, None


class _PerExpertLinearOfActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, bounds, activation, defer=None):
        ctx.save_for_backward(h, w)
        ctx.bounds, ctx.activation, ctx.wgrad_into = bounds, activation, expert_wgrad_into(w)
        ctx.defer, ctx.param = defer, w
        return _forward(activation(h), w, bounds)  # no graph inside forward: the activation's output is not kept

    @staticmethod
    def backward(ctx, dy):
        h, w = ctx.saved_tensors
        need_dh = ctx.needs_input_grad[0]
        with torch.enable_grad():
            h_leaf = h.detach().requires_grad_(need_dh)
            a = ctx.activation(h_leaf)
        da, dw = _backward(ctx, dy, a.detach(), w, need_dh, ctx.needs_input_grad[1])
        dh = torch.autograd.grad(a, h_leaf, da)[0] if need_dh else None
        return dh, dw, None, None, None
