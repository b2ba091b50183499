"""FP8 parameter all-gather for the distributed optimizer (Megatron's ``--fp8-param-gather``).

With ZeRO-1 each dp rank updates its shard of every bucket and the shards are all-gathered before the next
forward, in the parameters' dtype (bf16: 2 bytes per element). The weights of fp8 linears are only ever read as
their fp8 casts, so for them :class:`Fp8GatherBuffer` all-gathers the fp8 cast instead: 1 byte per element, and
each rank casts only its shard (``1/dp`` of the cast work) instead of the whole weight.

After the optimizer step, per buffer:

1. each rank takes ``max |w|`` of its shard of every weight (block-wise: of every 128x128 block its shard
   touches); one MAX all-reduce over dp of all of them (then, per tensor, each layer's TP reduction) gives every
   rank the amaxes the layer would measure on the gathered weight;
2. tensor-wise and block-wise: the scales come from them; delayed: from the layer's weight amax history, which
   records the amax (and, with ``delayed_overflow: recast``, from the amax itself when it exceeds the history's),
   as the layer's own cast;
3. each rank casts its shard (``cast(clamp(w * 448 / amax))``, elementwise, with its block's amax block-wise) and
   the fp8 bytes are all-gathered, bucket by bucket (asynchronously with ``overlap_param_gather``);
4. on arrival the fp8 ``W`` (a view of the gathered bytes) and ``W^T`` (transposed once, when the backward first
   asks) are handed to the layer through ``LowPrecisionLinear.weight_provider``.

Since the cast is elementwise and the amaxes are the whole weight's, the fp8 operands are bit for bit those the
layer casts from the bf16 weight after the ordinary gather (tested), so training is unchanged.

Recipes: ``tensorwise``, ``delayed`` (one scale serves ``W`` and ``W^T``) and ``blockwise`` (128x128 blocks: ``W^T``
has the same blocks, transposed), so one fp8 copy is gathered. Row-wise scales differ between ``W`` (per row) and
``W^T`` (per column): two fp8 copies would be as many bytes as the bf16 weight, so it is refused.

The bf16 weights of these layers are then current on each rank only in its own shard. Whatever reads them outside
the fp8 forward must first call ``DistributedDataParallel.finish_param_sync()``, which all-gathers them in bf16
(checkpoints do: the optimizer's and the trainer's state dicts call it), and whatever writes them outside the
optimizer (loading a checkpoint) must call ``params_replaced()``: the fp8 copies are then cast afresh from the
bf16 weights at their next use, as the layer would without this buffer. A weight shared with another module (a
tied output layer) is gathered in bf16 as before: the other module reads it in high precision.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mcore.kernels.low_precision_linear import FP8_RECIPES, LowPrecisionLinear
from mcore.kernels.quantization import (
    BLOCK,
    E4M3,
    FP8_MAX,
    Quantized,
    abs_max,
    block_amax,
    expand_scale,
    reference_cast,
    scale_from_amax,
)
from mcore.parallel.comm import all_gather_into
from mcore.parallel.grad_buffer import Bucket, GradBuffer

__all__ = ["GATHERED_RECIPES", "Fp8GatherBuffer", "fp8_gathered_layers"]

logger = logging.getLogger("mcore.parallel")
GATHERED_RECIPES = ("tensorwise", "delayed", "blockwise")


def fp8_gathered_layers(module: nn.Module) -> dict[nn.Parameter, LowPrecisionLinear]:
    """The weights under ``module`` whose fp8 cast can be all-gathered, each with the fp8 linear that reads it.

    Raises ``ValueError`` for an fp8 linear whose recipe is row-wise. A weight that another module also holds (tied)
    is left out, with a log line; so is a whole module without fp8 linears (a pipeline stage holding only the
    output layer, kept in bf16: legitimate, so not an error; ``enable_low_precision`` must run first)."""
    holders = Counter(id(p) for m in module.modules() for p in m.parameters(recurse=False))
    out: dict[nn.Parameter, LowPrecisionLinear] = {}
    for name, m in module.named_modules():
        layer = getattr(m, "low_precision", None)
        if not isinstance(layer, LowPrecisionLinear) or layer.recipe.name not in FP8_RECIPES:
            continue
        if layer.recipe.name not in GATHERED_RECIPES:
            raise ValueError(
                f"fp8 parameter all-gather: layer {name!r} runs the fp8 recipe {layer.recipe.name!r}; the recipes "
                f"{GATHERED_RECIPES} gather one fp8 copy that serves W and W^T, row-wise would need two (one scale "
                "per row for W, per column for W^T: as many bytes as bf16): turn fp8 parameter all-gather off"
            )
        weight = m.weight
        if not weight.requires_grad:
            continue
        if holders[id(weight)] > 1:
            logger.info("fp8 parameter all-gather: %s.weight is shared with another module: gathered in bf16", name)
            continue
        out[weight] = layer
    if not out:
        logger.info("fp8 parameter all-gather: no fp8 linear here: every parameter is gathered in its own dtype")
    return out


def _block_grid(p: nn.Parameter) -> tuple[int, int]:
    return -(-p.shape[0] // BLOCK), -(-p.shape[1] // BLOCK)


class Fp8GatherBuffer(GradBuffer):
    """A ``GradBuffer`` of fp8 linears' weights whose parameter all-gather moves their fp8 casts (see the module
    docstring). ``layers``: each parameter's ``LowPrecisionLinear`` (from :func:`fp8_gathered_layers`)."""

    def __init__(
        self, params: Sequence[nn.Parameter], *, layers: dict[nn.Parameter, LowPrecisionLinear], **kwargs
    ) -> None:
        super().__init__(params, use_distributed_optimizer=True, **kwargs)
        missing = [tuple(p.shape) for p in self.ranges if p not in layers]
        if missing:
            raise ValueError(f"Fp8GatherBuffer: parameters of shapes {missing} have no fp8 linear in layers")
        self.layers = {p: layers[p] for p in self.ranges}
        # the gathered fp8 bytes, laid out as param_data (uint8: every backend all-gathers bytes)
        self.fp8_data = torch.zeros(self.numel, dtype=torch.uint8, device=self.device)
        # id(param) -> [W, W^T or None, the weight's version when cast locally (None: gathered)]
        self._operands: dict[int, list] = {}
        self._scales: dict[int, torch.Tensor] = {}  # id(param) -> dequantization scale of its fp8 copy
        self._multipliers: dict[int, torch.Tensor] = {}  # and the multiplier it was cast with
        # False after an fp8 gather: param_data is then current only in this rank's shards
        self.high_precision_complete = True
        for p, layer in self.layers.items():
            layer.weight_provider = self._provider(p)

    # ---- the gather -----------------------------------------------------------------------------------------
    def start_param_gather(self) -> None:
        self.finish_param_gather()
        self._operands.clear()  # the weights changed: a cast made before the step is stale
        if self.dp_size == 1:
            return  # every rank updated whole weights: the layers cast them at their next use, as without this
        self.high_precision_complete = False
        self._set_scales()
        fp8 = self.fp8_data.view(E4M3)
        for bucket in reversed(self.buckets):  # forward order, as the bf16 gather
            for p in bucket.params:
                a, b = self._shard_part(p, bucket)
                if a >= b:
                    continue
                # torch's cast: the bits of the Triton casts (native rounding), on 1/dp of the weight
                multiplier = self._multipliers[id(p)]
                if multiplier.dim() == 0:
                    fp8[a:b].copy_(reference_cast(self.param_data[a:b], multiplier, E4M3))
                else:  # 128x128 blocks: the block rows this shard touches, each element by its block's multiplier
                    top, start, tile = self._shard_tile(p, a, b)
                    rows = multiplier[top // BLOCK : top // BLOCK + -(-tile.shape[0] // BLOCK)]
                    cast = reference_cast(tile, expand_scale(rows, "128x128", tile.shape), E4M3)
                    fp8[a:b].copy_(cast.view(-1)[start : start + b - a])
            full = self.fp8_data[bucket.start : bucket.end]
            bucket.param_handle = all_gather_into(
                full, self.shard_view(self.fp8_data, bucket), self.dp_group, async_op=True
            )

    def _shard_part(self, p: nn.Parameter, bucket: Bucket) -> tuple[int, int]:
        lo, hi = self.ranges[p]
        return max(lo, bucket.shard_start), min(hi, bucket.shard_end)

    def _shard_tile(self, p: nn.Parameter, a: int, b: int) -> tuple[int, int, torch.Tensor]:
        """This rank's elements ``[a, b)`` of the 2-D weight ``p`` in whole rows from a 128-row boundary, zeros
        elsewhere (never another rank's stale values): ``(first row, offset of a in the tile, tile [rows, K])``."""
        lo, k = self.ranges[p][0], p.shape[1]
        top = (a - lo) // k // BLOCK * BLOCK
        end = (b - lo - 1) // k + 1
        tile = torch.zeros((end - top) * k, dtype=self.param_data.dtype, device=self.device)
        start = a - lo - top * k
        tile[start : start + b - a] = self.param_data[a:b]
        return top, start, tile.view(end - top, k)

    def _set_scales(self) -> None:
        """Each weight's scales from its whole amaxes: this rank's shard amaxes (one per tensor, or per 128x128
        block), one MAX all-reduce over dp of all of them, then each per-tensor amax over the layer's TP group (block
        scales never span TP shards: the recipe's shape rule)."""
        params = list(self.ranges)
        sizes = [math.prod(_block_grid(p)) if self._blockwise(p) else 1 for p in params]
        amax = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)
        views = dict(zip(params, amax.split(sizes), strict=True))
        for p in params:
            a, b = self._shard_part(p, self.bucket_of[p])
            if a >= b:
                continue
            if not self._blockwise(p):
                views[p][0] = abs_max(self.param_data[a:b])
                continue
            top, _, tile = self._shard_tile(p, a, b)
            local = block_amax(tile, "128x128")
            views[p].view(_block_grid(p))[top // BLOCK : top // BLOCK + local.shape[0]] = local
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.dp_group)
        by_reduce: dict[int, tuple] = {}  # the layers of one enable_low_precision call share one TP reduction
        for p in params:
            fn = self.layers[p].weight_amax_reduce
            if fn is not None and not self._blockwise(p):
                by_reduce.setdefault(id(fn), (fn, []))[1].append(p)
        for fn, members in by_reduce.values():
            part = torch.cat([views[p] for p in members])
            fn(part)
            for p, value in zip(members, part, strict=True):
                views[p].copy_(value.reshape(1))
        for p in params:
            if self._blockwise(p):
                used = views[p].view(_block_grid(p))
            else:
                used = self._scale_amax(self.layers[p], views[p][0])
            # the multiplier itself, not 1 / scale: the reciprocal of a reciprocal need not round back to it
            self._multipliers[id(p)], self._scales[id(p)] = scale_from_amax(used, FP8_MAX[E4M3])

    def _blockwise(self, p: nn.Parameter) -> bool:
        return self.layers[p].recipe.name == "blockwise"

    @staticmethod
    def _scale_amax(layer: LowPrecisionLinear, amax: torch.Tensor) -> torch.Tensor:
        """The amax the layer's own weight cast scales by (``fp8_delayed.AmaxHistory.quantize``'s rules)."""
        if layer.recipe.name == "tensorwise":
            return amax
        history = layer.histories["w"]
        used = history.scale_amax()
        history.record(amax)
        if used is None:  # no history yet: current scaling
            return amax
        if history.overflow == "recast":  # decided on the device: no host sync
            return torch.where((amax > used) | amax.isnan(), amax, used)
        return used

    def wait_param_gather(self, bucket: Bucket) -> None:
        if bucket.param_handle is None:
            return
        bucket.param_handle.wait()
        bucket.param_handle = None
        fp8 = self.fp8_data.view(E4M3)
        for p in bucket.params:
            lo, hi = self.ranges[p]
            granularity = "128x128" if self._blockwise(p) else "tensor"
            w = Quantized(fp8[lo:hi].view(p.shape), self._scales[id(p)], granularity)
            self._operands[id(p)] = [w, None, None]

    # ---- what the layers read -------------------------------------------------------------------------------
    def _provider(self, param: nn.Parameter):
        def operands(weight: torch.Tensor, transposed: bool) -> tuple[Quantized, Quantized | None]:
            if weight is not param:
                raise ValueError(
                    f"fp8 parameter all-gather: the layer of a weight {tuple(param.shape)} was called with another "
                    f"tensor {tuple(weight.shape)}; its fp8 copy is gathered for its own weight only"
                )
            self.wait_param_gather(self.bucket_of[param])  # a forward outside the DDP pre-hooks
            entry = self._operands.get(id(param))
            if entry is not None and entry[2] is not None and entry[2] != param._version:
                entry = None  # cast locally from a bf16 weight changed in place since
            if entry is None:
                if not self.high_precision_complete:
                    raise RuntimeError(
                        f"fp8 parameter all-gather: no fp8 copy of a weight {tuple(param.shape)} and its bf16 values "
                        "are current only in this rank's shard; call start_param_sync() after the optimizer step, or "
                        "finish_param_sync() + params_replaced() after writing the parameters"
                    )
                # the layer's own cast of its complete bf16 weight (first step, after a load, dp = 1)
                w, w_t = self.layers[param].cast_weight_operands(weight, transposed=True)
                entry = self._operands[id(param)] = [w, w_t, param._version]
            if transposed and entry[1] is None:  # the same scales serve W^T: one per tensor, or the blocks'
                w = entry[0]
                scale = w.scale.t().contiguous() if w.granularity == "128x128" else w.scale
                entry[1] = Quantized(w.data.t().contiguous(), scale, w.granularity)
            return entry[0], entry[1] if transposed else None

        return operands

    # ---- high precision on demand ---------------------------------------------------------------------------
    def gather_high_precision(self) -> None:
        """All-gather the bf16 weights (once after each fp8 gather): for readers outside the fp8 forward."""
        self.finish_param_gather()
        if self.high_precision_complete:
            return
        for bucket in self.buckets:
            full = self.param_data[bucket.start : bucket.end]
            all_gather_into(full, self.shard_view(self.param_data, bucket), self.dp_group)
        self.high_precision_complete = True

    def params_replaced(self) -> None:
        """The parameters were written whole on every rank (a loaded checkpoint): drop the fp8 copies."""
        self.finish_param_gather()
        self._operands.clear()
        self.high_precision_complete = True
