"""FP8 grouped GEMM for MoE experts with row-wise scales: ``grouped_gemm``'s contract, all three GEMMs in fp8.

``x`` [T, K] rows grouped by expert (``offsets`` [E] int32 cumulative segment ends), ``w`` [E, N, K], ``dy``
[T, N]. Each operand is quantized (e4m3) along its GEMM's reduction dimension, one scale per row of it:

=======  ===================================  ======================================  ==========================
GEMM     A                                    B                                       ``torch._scaled_grouped_mm``
=======  ===================================  ======================================  ==========================
forward  x [T, K]: one scale per row          w[e] [N, K]: one per (e, n)             2-D x 3-D, offsets on T
dgrad    dy [T, N]: one scale per row         w[e]^T [K, N]: one per (e, k)           2-D x 3-D, offsets on T
wgrad    dy^T [N, T]: one per (e, n) over     x^T [K, T]: one per (e, k) over the     2-D x 2-D, offsets on T
         the expert's rows ("jagged")         expert's rows                           (the reduction dim)
=======  ===================================  ======================================  ==========================

Backends: ``"scaled_grouped_mm"`` (CUDA, sm90: ``torch._scaled_grouped_mm``, one launch per GEMM, offsets
read on the device; K and N multiples of 16 and every expert's row count a multiple of 16, which MoE layers
with fp8 experts guarantee by padding each expert's rows, ``align=16``) and ``"reference"`` (CPU: the same fp8
values and scales, dequantized and multiplied per expert in fp32; it reads the offsets on the host). Both see
identical quantized operands, so they differ only by accumulation order. Rows at or past ``offsets[-1]``
belong to no expert: zero output, no gradient.

``wgrad_into`` takes the weight gradient into the caller's tensor (a data-parallel ``main_grad``) as for
``grouped_gemm``, so the bf16 ``[E, N, K]`` gradient is neither returned nor zero-filled-then-added by DDP; the
quantization is the same either way. :func:`fp8_grouped_gemm_of_activation` keeps ``h`` instead of ``activation(h)``
(``grouped_gemm_of_activation``): the down projection of SwiGLU experts then keeps no ``rows x F`` activation.
``defer`` queues the weight gradient for later as for ``grouped_gemm``: its operands are cast when it runs (the
row-wise and block-wise casts keep no state, so the values are those of the undeferred run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore.kernels import dispatch
from mcore.kernels.fp8_weight_cache import WeightCastCache
from mcore.kernels.grouped_gemm import (
    WgradInto,
    _check,
    _store_weight_grad,
    _tail,
    _weight_grad_sink,
    _zero_unused_rows_,
)
from mcore.kernels.quantization import E4M3, FP8_MAX, Quantized, quantize_fp8, reference_cast, scale_from_amax
from mcore.kernels.wgrad_defer import Defer, now_or_deferred

__all__ = ["ALIGN", "SCALED_GROUPED_MM", "fp8_grouped_gemm", "fp8_grouped_gemm_of_activation"]

SCALED_GROUPED_MM = "scaled_grouped_mm"
ALIGN = 16  # rows per expert, K and N: multiples of this for torch's fp8 grouped kernel (16-byte fp8 rows)


def fp8_grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    backend: str | None = None,
    tail_rows: int | None = None,
    wgrad_into: WgradInto | None = None,
    defer: Defer | None = None,
    weight_casts: WeightCastCache | None = None,
) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e]^T`` with fp8 operands: ``x`` [T, K], ``w`` [E, N, K] -> [T, N].

    ``backend``: ``"scaled_grouped_mm"``, ``"reference"`` or ``None`` (CUDA -> scaled_grouped_mm).
    ``tail_rows``: at most that many last rows lie past ``offsets[-1]`` (``grouped_gemm``'s meaning): only those
    are zeroed in the outputs, not the whole tensor (``None``: any row may).
    ``wgrad_into``: ``grouped_gemm``'s contract, the writer form excepted: ``(target, accumulate)`` stores the weight
    gradient there (CUDA: the GEMM's bf16 product copied or added; the reference: each expert's fp32 product written
    or added; not accumulating, every expert is written, zeros for one without rows, and the target is not read)
    and returns none, ``None`` returns it. A writer function raises ``ValueError`` in backward: it would replace the
    fp8 weight-gradient GEMM by the caller's own high-precision GEMMs. ``defer``: ``grouped_gemm``'s.
    ``weight_casts``: ``w``'s fp8 casts (``w`` and ``w^T``) reused from this cache while ``w`` is unchanged (the
    micro-batches of a step and activation recompute cast the weights once; the owner invalidates it when the
    weights change, see ``fp8_weight_cache``).
    """
    _check(x, w, offsets)
    tail = _tail(tail_rows, x.shape[0])
    chosen = _choose(x, w, backend)
    return _Fp8GroupedGemm.apply(x, w, offsets, ROWWISE, chosen, tail, wgrad_into, defer, weight_casts)


def fp8_grouped_gemm_of_activation(
    h: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    *,
    backend: str | None = None,
    tail_rows: int | None = None,
    wgrad_into: WgradInto | None = None,
    defer: Defer | None = None,
    weight_casts: WeightCastCache | None = None,
) -> torch.Tensor:
    """``fp8_grouped_gemm(activation(h), w, offsets)`` (same shapes, backends, ``tail_rows``, ``wgrad_into``,
    ``defer``, ``weight_casts``) saving
    ``h``, not the activation's output: backward recomputes it, for the weight gradient's fp8 operand and for the
    activation's own backward, which gives ``h``'s gradient (``grouped_gemm_of_activation``'s contract)."""
    return apply_of_activation("fp8_grouped_gemm_of_activation", ROWWISE, _check, _choose, h, w, offsets, activation,
                               backend, tail_rows, wgrad_into, defer, weight_casts)  # fmt: skip


def apply_of_activation(
    name, ops, check, choose, h, w, offsets, activation, backend, tail_rows, wgrad_into, defer, weight_casts=None
):
    """The ``*_of_activation`` entry of one scale layout ``ops``: ``h`` checked (``name`` in the message),
    ``activation(h)`` computed without a graph and checked by ``check``, the backend picked by ``choose``."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        got = getattr(h, "shape", h)
        raise ValueError(f"{name}: h must be a 2-D [rows, *] tensor, got {got}")
    with torch.no_grad():
        a = activation(h)  # quantized in forward, then dropped: only h is kept
    check(a, w, offsets)
    tail = _tail(tail_rows, h.shape[0])
    chosen = choose(a, w, backend)
    return _Fp8GroupedGemmOfActivation.apply(
        h, w, offsets, activation, ops, chosen, a, tail, wgrad_into, defer, weight_casts
    )


def _choose(x: torch.Tensor, w: torch.Tensor, backend: str | None) -> str:
    chosen = dispatch.choose("fp8_grouped_gemm", x, w, backend=backend, extra=(SCALED_GROUPED_MM,))
    if chosen == dispatch.TRITON:  # torch's kernel is the CUDA path
        chosen = SCALED_GROUPED_MM
    if chosen != SCALED_GROUPED_MM:
        return dispatch.REFERENCE
    if not x.is_cuda or not hasattr(torch, "_scaled_grouped_mm"):
        raise ValueError("fp8_grouped_gemm: backend 'scaled_grouped_mm' needs CUDA and torch._scaled_grouped_mm")
    for name, value in (("K", w.shape[2]), ("N", w.shape[1])):
        if value % ALIGN:
            raise ValueError(f"fp8_grouped_gemm: {name}={value} must be a multiple of {ALIGN} for fp8 expert GEMMs")
    return SCALED_GROUPED_MM


def _cast_backend(backend: str) -> str | None:
    return "reference" if backend == dispatch.REFERENCE else None


def quantize_expert_weights_dual(w: torch.Tensor, backend: str) -> tuple[Quantized, Quantized]:
    """Row-wise e4m3 ``w[e]`` (``[E, N, K]``, a scale per (e, n)) *and* ``w[e]^T`` (``[E, K, N]``, per (e, k)).

    CUDA: per expert one amax pass (its rows and columns) and one pass writing both, into the stacked outputs (no
    stacking copy); elsewhere the two single casts, the same bits (``fp8_casts``)."""
    if backend == dispatch.REFERENCE:
        return (quantize_expert_weights(w, transpose=False, backend=backend),
                quantize_expert_weights(w, transpose=True, backend=backend))  # fmt: skip
    from mcore.kernels.triton import quant_fused as tq

    experts, n, k = w.shape
    data = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    data_t = torch.empty(experts, k, n, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(experts, n, dtype=torch.float32, device=w.device)
    scale_t = torch.empty(experts, k, dtype=torch.float32, device=w.device)
    for e in range(experts):
        tq.dual_cast(w[e], torch.float8_e4m3fn, tq.amax(w[e], per_row_col=True), rowwise=True, write_t=True,
                     outputs=(data[e], scale[e], data_t[e], scale_t[e]))  # fmt: skip
    return Quantized(data, scale, "row"), Quantized(data_t, scale_t, "row")


def quantize_expert_weights(w: torch.Tensor, *, transpose: bool, backend: str) -> Quantized:
    """Row-wise e4m3 ``w[e]`` (``[E, N, K]``, a scale per (e, n)) or ``w[e]^T`` (``[E, K, N]``, per (e, k))."""
    experts = w.shape[0]
    if not transpose:
        q = quantize_fp8(w.reshape(-1, w.shape[2]), E4M3, "row", backend=_cast_backend(backend))
        return Quantized(q.data.view(w.shape), q.scale.view(experts, w.shape[1]), "row")
    # one transposing cast per expert: each reads w[e] once and writes w[e]^T in fp8
    parts = [quantize_fp8(w[e], E4M3, "row", transpose=True, backend=_cast_backend(backend)) for e in range(experts)]
    return Quantized(torch.stack([p.data for p in parts]), torch.stack([p.scale.reshape(-1) for p in parts]), "row")


def row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each row (int64 [rows]); ``E`` for rows at or past ``offsets[-1]``. On the device."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


def jagged_transpose_quantize(t: torch.Tensor, offsets: torch.Tensor, groups: torch.Tensor, backend: str):
    """``t^T`` [C, T] in e4m3 with one scale per (expert, column) over that expert's rows of ``t`` [T, C].

    Returns ``(data [C, T], scale [E + 1, C])``; row ``E`` of the scales belongs to the rows of no expert (scale 1).
    """
    experts, cols = offsets.shape[0], t.shape[1]
    if backend == dispatch.REFERENCE:
        # max |t| per (expert, column) from a max and a min (no |t| temporary), the rows of no expert left out
        index = groups.clamp(max=experts).unsqueeze(1).expand(-1, cols)
        high = t.new_zeros(experts + 1, cols).scatter_reduce_(0, index, t, "amax")
        low = t.new_zeros(experts + 1, cols).scatter_reduce_(0, index, t, "amin")
        amax = torch.maximum(high, -low).float()
        amax[experts] = 0.0
        multiplier, scale = scale_from_amax(amax, FP8_MAX[E4M3])
        return reference_cast(t, multiplier[groups], E4M3).t().contiguous(), scale
    from mcore.kernels.triton import quantization as tq

    # one pass over each expert's rows for the amax (the rows are sorted by expert), one cast pass
    multiplier, scale = scale_from_amax(tq.jagged_column_amax(t, offsets), FP8_MAX[E4M3])
    return tq.cast_grouped_columns(t, multiplier, groups, E4M3), scale


def _expert_rows(offsets: torch.Tensor):
    """``(expert, start, end)`` of every expert, those without rows included."""
    ends = offsets.tolist()  # host sync: the reference only
    return zip(range(len(ends)), [0, *ends[:-1]], ends)


def _segments(offsets: torch.Tensor):
    return ((expert, start, end) for expert, start, end in _expert_rows(offsets) if end > start)


def _deq(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Row-wise dequantization: ``data [..., R, C] * scale [..., R]`` in fp32."""
    return data.float() * scale.unsqueeze(-1)


def _grouped_2d_3d(qa: Quantized, qb: Quantized, offsets: torch.Tensor, backend: str, tail: int) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]^T`` of row-quantized ``a`` [T, K] and ``b`` [E, N, K]: [T, N] fp32
    (reference) or bf16 (CUDA); rows of no expert (among the last ``tail``) are zero."""
    rows = qa.data.shape[0]
    if backend == SCALED_GROUPED_MM:
        out = torch._scaled_grouped_mm(
            qa.data,
            qb.data.transpose(-2, -1),
            qa.scale.reshape(-1),
            qb.scale,
            offs=offsets,
            out_dtype=torch.bfloat16,
        )
        return _zero_unused_rows_(out, offsets, tail)
    out = torch.zeros(rows, qb.data.shape[1], dtype=torch.float32, device=qa.data.device)
    a = _deq(qa.data, qa.scale.reshape(-1))
    for expert, start, end in _segments(offsets):
        out[start:end] = a[start:end] @ _deq(qb.data[expert], qb.scale[expert]).t()
    return out


def _weight_grad(dy, x, offsets, experts: int, backend: str, into=None) -> torch.Tensor | None:
    """``dw[e] = dy[rows of e]^T @ x[rows of e]`` with jagged row-wise fp8 operands: [E, N, K] (bf16 on CUDA, fp32
    in the reference), or ``None`` when ``into`` (``(target, accumulate)``) took it."""
    groups = row_groups(offsets, x.shape[0])
    dy_t, dy_scale = jagged_transpose_quantize(dy, offsets, groups, backend)
    x_t, x_scale = jagged_transpose_quantize(x, offsets, groups, backend)
    if backend == SCALED_GROUPED_MM:  # dy_t [N, T16] and x_t [K, T16]: tokens padded to 16, past offsets[-1]
        scale_a, scale_b = dy_scale[:experts].reshape(-1), x_scale[:experts].reshape(-1)
        dw = torch._scaled_grouped_mm(dy_t, x_t.t(), scale_a, scale_b, offs=offsets, out_dtype=torch.bfloat16)
        return _store_weight_grad(dw, into)  # an expert without rows got zeros
    # dequantized with each column's expert scale (the rows of no expert: scale 1, never read)
    a_t = dy_t.float() * dy_scale[groups].t()
    b_t = x_t.float() * x_scale[groups].t()
    return reference_expert_wgrad(a_t, b_t, offsets, into)


def reference_expert_wgrad(a_t: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor, into=None):
    """``dw[e] = a_t[:, rows of e] @ b_t[:, rows of e]^T`` of dequantized ``a_t`` [N, T] and ``b_t`` [K, T] in fp32:
    ``[E, N, K]``, or ``None`` when ``into`` (``(target, accumulate)``) took it. Each expert's product goes straight
    where it belongs; not accumulating, an expert without rows gets zeros and the target is not read."""
    shape = (offsets.shape[0], a_t.shape[0], b_t.shape[0])
    target, accumulate = into or (torch.empty(shape, dtype=torch.float32, device=a_t.device), False)
    for expert, start, end in _expert_rows(offsets):
        if end == start:
            if not accumulate:
                target[expert].zero_()
            continue
        grad = a_t[:, start:end] @ b_t[:, start:end].t()
        target[expert].add_(grad) if accumulate else target[expert].copy_(grad)
    return None if into is not None else target


def _wgrad_sink(wgrad_into: WgradInto | None, w_shape):
    """``wgrad_into()`` checked: ``(target, accumulate)`` or ``None``; a writer is refused."""
    into = _weight_grad_sink(wgrad_into, True, w_shape, "fp8_grouped_gemm")
    if callable(into):
        raise ValueError(
            "fp8_grouped_gemm: wgrad_into gave a writer function, which would replace the fp8 weight-gradient GEMM "
            "by the caller's high-precision GEMMs; give (target, accumulate) or None (e.g. expert_wgrad_into(w) "
            "without host offsets)"
        )
    return into


@dataclass(frozen=True)
class Fp8ExpertOps:
    """One scale layout of the fp8 expert GEMMs: its casts and GEMMs, which :class:`_Fp8GroupedGemm` runs.

    ``weights(w, backend, need_t)`` -> ``(qw [E, N, K], qw_t [E, K, N] or None)``; ``rows(t, backend)``: ``t`` [T, C]
    quantized along C (``x`` forward, ``dy`` dgrad); ``gemm(qa, qb, offsets, backend, tail)``: the 2-D x 3-D
    grouped GEMM, rows of no expert zero; ``wgrad(dy, a, offsets, experts, backend, into)``: ``[E, N, K]`` or
    ``None`` when ``into`` took it. ``weight_granularity`` rebuilds the saved ``w^T`` cast in backward."""

    weights: Callable
    rows: Callable
    gemm: Callable
    wgrad: Callable
    weight_granularity: str


def _rowwise_weights(w: torch.Tensor, backend: str, need_t: bool) -> tuple[Quantized, Quantized | None]:
    if need_t:
        return quantize_expert_weights_dual(w, backend)
    return quantize_expert_weights(w, transpose=False, backend=backend), None


def _rowwise_rows(t: torch.Tensor, backend: str) -> Quantized:
    return quantize_fp8(t, E4M3, "row", backend=_cast_backend(backend))


ROWWISE = Fp8ExpertOps(_rowwise_weights, _rowwise_rows, _grouped_2d_3d, _weight_grad, "row")


def _forward(ctx, keep, a, w, offsets, ops, backend, tail, wgrad_into, defer, weight_casts) -> torch.Tensor:
    """The forward GEMM of ``a`` (the GEMM's input) and ``w``, saving ``keep`` (what ``a`` is, or is recomputed from),
    the offsets and ``w^T``'s cast for the input gradient (when ``keep`` needs a gradient); the weight casts from
    ``weight_casts`` when it holds them for this ``w``."""
    need_t = ctx.needs_input_grad[0]
    make = lambda: ops.weights(w, backend, need_t)  # noqa: E731
    qw, qw_t = make() if weight_casts is None else weight_casts.get_for(w, need_t, make)
    ctx.save_for_backward(keep, offsets, *((qw_t.data, qw_t.scale) if qw_t is not None else (None, None)))
    ctx.ops, ctx.backend, ctx.tail, ctx.w_shape, ctx.w_dtype = ops, backend, tail, w.shape, w.dtype
    ctx.wgrad_into, ctx.defer = wgrad_into, defer
    ctx.param = w  # the Parameter itself (a recompute's saved w is another tensor): a deferred gradient's owner
    return ops.gemm(ops.rows(a, backend), qw, offsets, backend, tail).to(a.dtype)


def _backward(ctx, dy, a, offsets, wt_data, wt_scale):
    """``(da, dw)`` of the GEMM whose input was ``a``; ``dw`` is ``None`` when ``wgrad_into`` took it or ``ctx.defer``
    queued it (the closure keeps ``dy`` and ``a``, casts them and asks ``wgrad_into`` where to write when it runs)."""
    ops, backend = ctx.ops, ctx.backend
    # rows past offsets[-1] need no masking here: their da rows are zeroed below and the weight gradient's
    # operands leave them out (row-wise: scale group E, past the GEMM's last offset; block-wise: own token blocks)
    dy = dy.contiguous()
    da = dw = None
    if ctx.needs_input_grad[0]:
        qw_t = Quantized(wt_data, wt_scale, ops.weight_granularity)
        da = ops.gemm(ops.rows(dy, backend), qw_t, offsets, backend, ctx.tail).to(a.dtype)
    if ctx.needs_input_grad[1]:
        wgrad_into, w_shape, w_dtype = ctx.wgrad_into, ctx.w_shape, ctx.w_dtype

        def compute() -> torch.Tensor | None:
            dw = ops.wgrad(dy, a, offsets, w_shape[0], backend, _wgrad_sink(wgrad_into, w_shape))
            return dw.to(w_dtype) if dw is not None else None

        dw = now_or_deferred(ctx.defer, ctx.param, compute)
    return da, dw


class _Fp8GroupedGemm(torch.autograd.Function):
    """Each operand cast once for the GEMMs it feeds: ``w`` and ``w^T`` in one pass per expert in forward (``w^T``
    kept for the input gradient instead of ``w``), ``dy`` row-wise and jagged-transposed in backward."""

    @staticmethod
    def forward(ctx, x, w, offsets, ops, backend, tail, wgrad_into, defer=None, weight_casts=None):
        return _forward(ctx, x, x, w, offsets, ops, backend, tail, wgrad_into, defer, weight_casts)

    @staticmethod
    def backward(ctx, dy):
        x, offsets, wt_data, wt_scale = ctx.saved_tensors
        dx, dw = _backward(ctx, dy, x, offsets, wt_data, wt_scale)
        return dx, dw, None, None, None, None, None, None, None


class _Fp8GroupedGemmOfActivation(torch.autograd.Function):
    """``_Fp8GroupedGemm`` of ``activation(h)`` keeping ``h``: backward recomputes the activation (one elementwise
    pass; bit-equal to forward's, so the same fp8 operand) and differentiates it for ``h``'s gradient."""

    @staticmethod
    def forward(ctx, h, w, offsets, activation, ops, backend, a, tail, wgrad_into, defer=None, weight_casts=None):
        ctx.activation = activation
        return _forward(ctx, h, a, w, offsets, ops, backend, tail, wgrad_into, defer, weight_casts)

    @staticmethod
    def backward(ctx, dy):
        h, offsets, wt_data, wt_scale = ctx.saved_tensors
        need_dh = ctx.needs_input_grad[0]
        with torch.enable_grad():
            h_leaf = h.detach().requires_grad_(need_dh)
            a = ctx.activation(h_leaf)
        da, dw = _backward(ctx, dy, a.detach(), offsets, wt_data, wt_scale)
        dh = torch.autograd.grad(a, h_leaf, da)[0] if need_dh else None
        return dh, dw, None, None, None, None, None, None, None, None, None
