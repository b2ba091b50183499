"""Low-precision linear layers: ``y = x W^T + b`` with the three GEMMs in FP8 (or emulated MX/NV FP4).

:class:`LowPrecisionLinear` holds a :class:`Recipe` and its state (the amax histories of delayed scaling) and
is called like ``F.linear``. The weight is never modified: it is quantized on the fly each forward from the
high-precision (fp32 master / bf16 model) copy, and its gradient comes back in the weight's dtype.

Per GEMM, operands are quantized along the reduction dimension (see ``quantization.py``):

========  ========================  ==============================  ===========================  ===============
GEMM      A (row-major, along K)    B (row-major, along K)          fp8 formats                  block-wise
========  ========================  ==============================  ===========================  ===============
forward   x [M, K]                  W [N, K]                        e4m3, e4m3                   1x128, 128x128
dgrad     grad [M, N]               W^T [K, N]                      ``grad_format``, e4m3        1x128, 128x128
wgrad     grad^T [N, M]             x^T [K, M]                      ``grad_format``, e4m3        1x128, 1x128
========  ========================  ==============================  ===========================  ===============

Recipes: ``tensorwise`` (current scaling; x, W and grad quantized together with their transposes in one
pass, the fp8 transposes saved for backward), ``delayed`` (tensor-wise, scale from the max of the last
``amax_history_len`` amaxes), ``rowwise``, ``blockwise`` (DeepSeek-V3's tiles: activations and gradients in
1x128 tiles along the GEMM's reduction dimension, weights in 128x128 blocks; the weight gradient contracts over
tokens, so both its operands are 1x128 tiles along the tokens; e4m3 by default), the emulated ``mxfp8``,
``mxfp4``, ``nvfp4`` (quantize-dequantize, then a high-precision GEMM), and ``bitnet`` (BitNet b1.58:
ternary weights, int8 per-token activations, straight-through gradients; ``bitnet.py``).

Tensor parallelism: a rank holding a shard of a logical tensor must scale it like the whole tensor, or the
quantized values (and the training run) silently differ from a single process. ``sharded`` names the GEMM
dimension the layer splits (``"n"``: column-parallel, ``"k"``: row-parallel); ``amax_reduce(t)`` reduces an amax
in place over the ranks sharing the tensor (a MAX all-reduce over the TP group). Tensor-wise amaxes are reduced
for every sharded operand, row-wise ones when the reduction dimension is the sharded one; block scales never
span a shard boundary when the local dimensions are multiples of 128 (checked by :func:`recipe_shape_problem`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore.kernels.bitnet import bitnet_linear
from mcore.kernels.fp8_casts import quantize_dual
from mcore.kernels.fp8_delayed import OVERFLOWS, AmaxHistory
from mcore.kernels.fp8_gemm import scaled_matmul, shape_rule_violation
from mcore.kernels.fp8_weight_cache import WeightCastCache
from mcore.kernels.microscaling import MX_BLOCK, NVFP4_BLOCK, fake_quantize
from mcore.kernels.quantization import E4M3, Quantized, fp8_dtype
from mcore.kernels.wgrad_defer import Defer, now_or_deferred

FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
FP4_RECIPES = ("mxfp4", "nvfp4")
EMULATED_RECIPES = ("mxfp8",) + FP4_RECIPES
RECIPES = FP8_RECIPES + EMULATED_RECIPES + ("bitnet",)
# granularity of the A and B operands of each fp8 recipe's forward and dgrad GEMMs (wgrad: _WGRAD_GRANULARITY)
_GRANULARITY = {
    "tensorwise": ("tensor", "tensor"),
    "delayed": ("tensor", "tensor"),
    "rowwise": ("row", "row"),
    "blockwise": ("1x128", "128x128"),
}
_WGRAD_GRANULARITY = {**_GRANULARITY, "blockwise": ("1x128", "1x128")}
# the gradient format when Recipe.grad_format is None: e4m3 (Megatron's ``--fp8-format e4m3``, DeepSeek-V3's
# choice) wherever the scale comes from the tensor being cast, the "hybrid" e5m2 for delayed scaling, whose scale
# is a window of earlier amaxes and needs e5m2's range for a gradient that grew since. Tensor-wise current scaling
# maps each gradient's own amax onto 448, and e4m3 trained closer to bf16: 500 steps of the 110M Llama on real text
# on an H200, -0.51% with e4m3 gradients against +1.02% with e5m2 (docs/performance.md, low precision, session 8).
# cuBLAS's block-scaled GEMMs take e4m3 only; with e5m2 block-wise runs our Triton GEMM.
_DEFAULT_GRAD_FORMAT = {"delayed": "e5m2"}
_EMULATED_BLOCK = {"mxfp8": MX_BLOCK, "mxfp4": MX_BLOCK, "nvfp4": NVFP4_BLOCK}
AmaxReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Recipe:
    """How a linear's GEMMs are quantized.

    ``grad_format``: fp8 format of the gradient operands (``e5m2``: more range, the "hybrid" format; ``e4m3``:
    more precision; ``None``: e5m2 for delayed scaling, e4m3 otherwise; block-wise e5m2 runs our Triton
    block-scaled GEMM on CUDA, e4m3 cuBLAS's).
    ``amax_history_len`` / ``amax_compute`` (``max`` or ``most_recent``): delayed scaling.
    ``delayed_overflow`` (delayed scaling only; another recipe refuses ``recast``): ``saturate`` (a tensor whose
    own amax exceeds the history's saturates above the scale, Transformer Engine's behaviour) or ``recast`` (such a
    tensor is cast again with current scaling from its own amax, decided on the device: ``fp8_delayed``).
    ``quantize_grads`` (emulated recipes): also quantize the gradient operands of dgrad and wgrad.
    ``fast_accum``: the forward GEMM (tensor- and row-wise, CUDA) accumulates in the tensor cores' fast mode; the
    gradient GEMMs never do (torchao's defaults: the forward's short K tolerates it, the gradients' long M less).
    """

    name: str = "tensorwise"
    grad_format: str | None = None
    amax_history_len: int = 16
    amax_compute: str = "max"
    delayed_overflow: str = "saturate"
    quantize_grads: bool = True
    fast_accum: bool = True

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"Recipe.name must be one of {RECIPES}, got {self.name!r}")
        if self.grad_format is None:
            object.__setattr__(self, "grad_format", _DEFAULT_GRAD_FORMAT.get(self.name, "e4m3"))
        fp8_dtype(self.grad_format)  # raises naming the valid formats
        if self.amax_history_len < 1:
            raise ValueError(f"Recipe.amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"Recipe.amax_compute must be 'max' or 'most_recent', got {self.amax_compute!r}")
        if self.delayed_overflow not in OVERFLOWS:
            raise ValueError(f"Recipe.delayed_overflow must be one of {OVERFLOWS}, got {self.delayed_overflow!r}")
        if self.delayed_overflow == "recast" and self.name != "delayed":
            # only a delayed scale can be exceeded: a silent no-op would hide a mistyped recipe
            raise ValueError(
                f"Recipe.delayed_overflow='recast' applies to the 'delayed' recipe only, got name={self.name!r}: "
                "use delayed_overflow='saturate' (the default) or name='delayed'"
            )

    @property
    def emulated(self) -> bool:
        return self.name in EMULATED_RECIPES


def recipe_shape_problem(recipe: Recipe, out_features: int, in_features: int) -> str | None:
    """Why a linear with local weight ``[out_features, in_features]`` cannot run ``recipe``, or ``None``.

    The rules are the fp8 GEMM kernels' (K and N multiples of 16, of 128 block-wise: the same rules keep block
    scales inside tensor-parallel shards) and the block size of the emulated formats along K and N.
    """
    if recipe.name == "bitnet":
        return None
    if recipe.emulated:
        block = _EMULATED_BLOCK[recipe.name]
        for name, value in (("in_features (K)", in_features), ("out_features (N)", out_features)):
            if value % block:
                return f"{name}={value} must be a multiple of {block} for {recipe.name} blocks"
        return None
    return shape_rule_violation(_GRANULARITY[recipe.name][1], None, out_features, in_features)


class LowPrecisionLinear:
    """Callable ``(x, weight, bias) -> y`` running ``F.linear``'s GEMMs at the precision of ``recipe``."""

    def __init__(
        self,
        recipe: Recipe,
        *,
        sharded: str | None = None,
        amax_reduce: AmaxReduce | None = None,
        sum_reduce: AmaxReduce | None = None,
        name: str = "",
        backend: str | None = None,
        row_segments: torch.Tensor | None = None,
        weight_cache: WeightCastCache | None = None,
    ) -> None:
        if sharded not in (None, "n", "k"):
            raise ValueError(f"LowPrecisionLinear: sharded must be None, 'n' or 'k', got {sharded!r}")
        self.recipe, self.sharded, self.amax_reduce, self.name, self.backend = (
            recipe,
            sharded,
            amax_reduce,
            name,
            backend,
        )
        self.sum_reduce = sum_reduce  # BitNet's weight mean over the shards (a SUM all-reduce)
        self.row_segments = row_segments  # BitNet: one weight scale per fused projection (``bitnet.py``)
        self.weight_cache = weight_cache  # fp8 casts of the weight reused until the owner invalidates them
        self.histories = {
            op: AmaxHistory(recipe.amax_history_len, recipe.amax_compute, recipe.delayed_overflow)
            for op in ("x", "w", "g")
        }
        # fp8 recipes: ``wgrad_into(weight)`` -> ``(target, accumulate)`` or ``None``: where the weight-gradient
        # GEMM writes (DDP's main_grad, set by mcore.parallel.low_precision); ``None`` returns the gradient
        self.wgrad_into: Callable[[torch.Tensor], tuple[torch.Tensor, bool] | None] | None = None
        # ``weight_provider(weight, transposed)`` -> ``(W, W^T)`` in fp8 made elsewhere (the distributed optimizer's
        # fp8 parameter all-gather, ``mcore.parallel.fp8_param_gather``): then the high-precision weight may be
        # stale on this rank and is never cast here
        self.weight_provider: Callable[[torch.Tensor, bool], tuple[Quantized, Quantized | None]] | None = None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, defer: Defer | None = None
    ) -> torch.Tensor:
        """``x @ weight^T + bias`` at the recipe's precision. ``defer(param, compute) -> bool`` (optional; a
        zero-bubble schedule's ``WeightGradStore.defer``): asked in backward whether to queue the weight-gradient
        closure ``compute`` for later instead of running it now (then the weight's gradient is ``None`` for now);
        ``compute()`` returns the gradient or ``None`` when it went into ``wgrad_into``'s target
        (``wgrad_defer``)."""
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"LowPrecisionLinear {self.name}: input [..., {x.shape[-1]}] does not match weight "
                f"{tuple(weight.shape)}"
            )
        if self.recipe.name == "bitnet":
            sharded = self.sharded is not None
            return bitnet_linear(
                x,
                weight,
                bias,
                sum_reduce=self.sum_reduce if sharded else None,
                max_reduce=self.amax_reduce if self.sharded == "k" else None,
                row_segments=self.row_segments,
                defer=defer,
            )
        if self.recipe.emulated:
            return _EmulatedLinearFunction.apply(x, weight, bias, self, defer)
        return _Fp8LinearFunction.apply(x, weight, bias, self, torch.is_grad_enabled(), defer)

    def __repr__(self) -> str:
        return f"LowPrecisionLinear({self.recipe.name}, sharded={self.sharded}, name={self.name!r})"

    # ------------------------------------------------------------------------------------------ quantizing
    def _reduce_fn(self, tensor: str, dim: str, granularity: str) -> AmaxReduce | None:
        """The amax reduction an operand needs under tensor parallelism (see the module docstring)."""
        if self.sharded is None or self.amax_reduce is None:
            return None
        holds_shard = {"x": self.sharded == "k", "w": True, "g": self.sharded == "n"}[tensor]
        if granularity == "tensor" and holds_shard:
            return self.amax_reduce
        if granularity == "row" and dim == self.sharded:
            return self.amax_reduce
        return None

    def quantize_operands(
        self, t: torch.Tensor, tensor: str, dims: tuple[str, str], *, transposed: bool = True
    ) -> tuple[Quantized, Quantized | None]:
        """``t`` along its last dim (reducing over GEMM dim ``dims[0]``) and ``t^T`` along its first (``dims[1]``),
        both from the fused casts (``fp8_casts.quantize_dual``); ``transposed=False``: ``t^T`` is ``None``."""
        name = self.recipe.name
        # one granularity serves both of a tensor's GEMMs: x and grad are the A side (block-wise: 1x128 tiles,
        # along K / N and, transposed, along the tokens), W the B side (128x128 blocks, the same both ways)
        granularity = _GRANULARITY[name][1 if tensor == "w" else 0]
        dtype = fp8_dtype(self.recipe.grad_format) if tensor == "g" else E4M3
        reduce_q = self._reduce_fn(tensor, dims[0], granularity)
        reduce_t = self._reduce_fn(tensor, dims[1], granularity)
        backend = "reference" if self.backend == "reference" else None
        if name != "delayed":
            return quantize_dual(
                t, dtype, granularity, transposed=transposed, reduce_q=reduce_q, reduce_t=reduce_t, backend=backend
            )
        # delayed scaling: scaled by the history, this tensor's amax recorded in the same pass (the first use has no
        # history and measures first); a tensor-wise amax is one per tensor, so either reduction serves
        return self.histories[tensor].quantize(t, dtype, transposed=transposed, reduce=reduce_q or reduce_t,
                                               backend=backend)  # fmt: skip

    def weight_operands(self, weight: torch.Tensor, transposed: bool) -> tuple[Quantized, Quantized | None]:
        """``W`` along K and ``W^T`` along N: from the weight cast cache when this layer has one and the weight
        did not change since (a weight is cast once per optimizer step, not once per micro-batch), or from the
        ``weight_provider`` when one is set."""
        if self.weight_provider is not None:
            return self.weight_provider(weight, transposed)
        return self.cast_weight_operands(weight, transposed)

    def cast_weight_operands(self, weight: torch.Tensor, transposed: bool) -> tuple[Quantized, Quantized | None]:
        """This layer's own cast of ``weight`` (through its weight cast cache when it has one), provider or not: what
        a provider falls back to while the high-precision weight is complete."""
        make = lambda: self.quantize_operands(weight, "w", ("k", "n"), transposed=transposed)  # noqa: E731
        if self.weight_cache is None:
            return make()
        return self.weight_cache.get(self, weight, transposed, make)

    @property
    def weight_amax_reduce(self) -> AmaxReduce | None:
        """The reduction a tensor-wise weight amax needs (over the TP ranks holding its shards), or ``None``."""
        return self._reduce_fn("w", "k", "tensor")

    def matmul(
        self, a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False, out=None
    ) -> torch.Tensor:
        backend = "reference" if self.backend == "reference" else None
        return scaled_matmul(a, b, out_dtype=out_dtype, backend=backend, fast_accum=fast_accum, out=out)

    def weight_grad(self, weight: torch.Tensor, qg_t: Quantized, qx_t: Quantized) -> torch.Tensor | None:
        """``grad^T x`` from the fp8 operands, returned in the weight's dtype, or ``None`` when it went into the
        target of ``wgrad_into``: written by the GEMM in the target's dtype (fp32 main_grad: never rounded to
        bf16, 4 bytes per element instead of bf16 out + DDP's add, ~12) on the step's first micro-batch, the
        weight-dtype gradient added to it later (what DDP's hook would add, so those steps are bit-equal)."""
        into = self.wgrad_into(weight) if self.wgrad_into is not None else None
        if into is None:
            return self.matmul(qg_t, qx_t, weight.dtype)
        target, accumulate = into
        if accumulate:
            target.add_(self.matmul(qg_t, qx_t, weight.dtype))
        else:
            self.matmul(qg_t, qx_t, target.dtype, out=target)
        return None


# the one step where the linears defer (a module global: tests count the weight gradients through it)
_now_or_deferred = now_or_deferred


class _Fp8LinearFunction(torch.autograd.Function):
    """The three GEMMs in fp8: each of x, W and grad quantized once for both GEMMs it takes part in; backward
    keeps only the fp8 ``x^T`` and ``W^T`` (not the high-precision tensors)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer: LowPrecisionLinear, grad_enabled: bool, defer: Defer | None = None):
        x2 = x.reshape(-1, x.shape[-1])
        need_x_t = grad_enabled and ctx.needs_input_grad[1]  # x^T: the weight gradient's operand
        need_w_t = grad_enabled and ctx.needs_input_grad[0]  # W^T: the input gradient's operand
        qx, qx_t = layer.quantize_operands(x2, "x", ("k", "m"), transposed=need_x_t)
        qw, qw_t = layer.weight_operands(weight, transposed=need_w_t)
        saved = [qx_t, qw_t]
        ctx.granularities = [q.granularity if q is not None else None for q in saved]
        ctx.save_for_backward(*(t for q in saved for t in ((q.data, q.scale) if q is not None else (None, None))))
        ctx.layer, ctx.has_bias, ctx.defer = layer, bias is not None, defer
        ctx.x_shape, ctx.param = x.shape, weight  # the Parameter: its main_grad may take the weight gradient
        y = layer.matmul(qx, qw, x.dtype, fast_accum=layer.recipe.fast_accum)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        layer: LowPrecisionLinear = ctx.layer
        xt_data, xt_scale, wt_data, wt_scale = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        qg, qg_t = layer.quantize_operands(g2, "g", ("n", "m"), transposed=ctx.needs_input_grad[1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            qw_t = Quantized(wt_data, wt_scale, ctx.granularities[1])
            grad_x = layer.matmul(qg, qw_t, grad_out.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # the kernels accumulate in fp32 whatever they write: main_grad's dtype or the weight's. Deferred, the
            # closure keeps the fp8 grad^T and x^T (already cast: grad's amax history advanced now, as undeferred)
            param, qx_t = ctx.param, Quantized(xt_data, xt_scale, ctx.granularities[0])
            grad_w = _now_or_deferred(ctx.defer, param, lambda: layer.weight_grad(param, qg_t, qx_t))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def _fake(layer: LowPrecisionLinear, fmt: str, t: torch.Tensor, tensor: str, dim: str, along_rows: bool):
    """``t`` fake-quantized in blocks along its last dim (``along_rows``) or its first dim; NVFP4's per-tensor
    amax is reduced over the ranks sharing ``tensor`` like a tensor-wise fp8 amax."""
    src = t if along_rows else t.t().contiguous()
    global_amax = None
    if fmt == "nvfp4":
        reduce = layer._reduce_fn(tensor, dim, "tensor")
        if reduce is not None:
            global_amax = src.abs().amax().to(torch.float32)
            reduce(global_amax)
    out = fake_quantize(src, fmt, global_amax)
    return out if along_rows else out.t()


class _EmulatedLinearFunction(torch.autograd.Function):
    """MXFP8 / MXFP4 / NVFP4 emulation: each operand fake-quantized along its GEMM's reduction dim, GEMMs in the
    input's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer: LowPrecisionLinear, defer: Defer | None = None):
        fmt = layer.recipe.name
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.layer, ctx.fmt, ctx.has_bias, ctx.x_shape, ctx.defer = layer, fmt, bias is not None, x.shape, defer
        ctx.param = weight  # the Parameter itself: a deferred gradient is given to its owner
        y = _fake(layer, fmt, x2, "x", "k", True) @ _fake(layer, fmt, weight, "w", "k", True).to(x.dtype).t()
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        layer, fmt = ctx.layer, ctx.fmt
        quantize_grads = layer.recipe.quantize_grads
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            g = _fake(layer, fmt, g2, "g", "n", True) if quantize_grads else g2
            grad_x = (g @ _fake(layer, fmt, weight, "w", "n", False).to(g2.dtype)).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # the operands are fake-quantized now (NVFP4's amax all-reduce stays in backward's order on every
            # rank); only the GEMM may be deferred
            g_t = _fake(layer, fmt, g2, "g", "m", False).t() if quantize_grads else g2.t()
            x_t = _fake(layer, fmt, x2, "x", "m", False)
            wdtype = weight.dtype
            grad_w = _now_or_deferred(ctx.defer, ctx.param, lambda: (g_t.float() @ x_t.float()).to(wdtype))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None
