"""FP8 parameter all-gather for the distributed optimizer (Megatron's ``--fp8-param-gather``).

With ZeRO-1 each dp rank updates its shard of every bucket and the shards are all-gathered before the next
forward, in the parameters' dtype (bf16: 2 bytes per element). The weights of fp8 linears are only ever read as
their fp8 casts, so for them :class:`Fp8GatherBuffer` all-gathers the fp8 cast instead: 1 byte per element, and
each rank casts only its shard (``1/dp`` of the cast work) instead of the whole weight.

After the optimizer step, per buffer:

1. each rank takes ``max |w|`` of its shard of every weight; one MAX all-reduce over dp (then each layer's TP
   reduction) gives every rank every whole weight's amax, the amax the layer would measure on the gathered weight;
2. tensor-wise: the scale comes from it; delayed: from the layer's weight amax history, which records it (and,
   with ``delayed_overflow: recast``, from the amax itself when it exceeds the history's), as the layer's own cast;
3. each rank casts its shard (``cast(clamp(w * 448 / amax))``, elementwise) and the fp8 bytes are all-gathered,
   bucket by bucket (asynchronously with ``overlap_param_gather``);
4. on arrival the fp8 ``W`` (a view of the gathered bytes) and ``W^T`` (transposed once, when the backward first
   asks) are handed to the layer through ``LowPrecisionLinear.weight_provider``.

Since the cast is elementwise and the amax is the whole weight's, the fp8 operands are bit for bit those the
layer casts from the bf16 weight after the ordinary gather (tested), so training is unchanged.

Per-tensor recipes only (``tensorwise``, ``delayed``): their one scale serves ``W`` and ``W^T``, so one fp8 copy
is gathered. Row-wise scales differ between ``W`` (per row) and ``W^T`` (per column): two fp8 copies are as many
bytes as the bf16 weight; block-wise is not implemented (128x128 block amaxes across shard boundaries).

The bf16 weights of these layers are then current on each rank only in its own shard. Whatever reads them outside
the fp8 forward must first call ``DistributedDataParallel.finish_param_sync()``, which all-gathers them in bf16
(checkpoints do: the optimizer's and the trainer's state dicts call it), and whatever writes them outside the
optimizer (loading a checkpoint) must call ``params_replaced()``: the fp8 copies are then cast afresh from the
bf16 weights at their next use, as the layer would without this buffer. A weight shared with another module (a
tied output layer) is gathered in bf16 as before: the other module reads it in high precision.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mcore.kernels.low_precision_linear import FP8_RECIPES, LowPrecisionLinear
from mcore.kernels.quantization import E4M3, FP8_MAX, Quantized, abs_max, reference_cast, scale_from_amax
from mcore.parallel.comm import all_gather_into
from mcore.parallel.grad_buffer import Bucket, GradBuffer

__all__ = ["PER_TENSOR_RECIPES", "Fp8GatherBuffer", "fp8_gathered_layers"]

logger = logging.getLogger("mcore.parallel")
PER_TENSOR_RECIPES = ("tensorwise", "delayed")


def fp8_gathered_layers(module: nn.Module) -> dict[nn.Parameter, LowPrecisionLinear]:
    """The weights under ``module`` whose fp8 cast can be all-gathered, each with the fp8 linear that reads it.

    Raises ``ValueError`` when ``module`` has no fp8 linear (``enable_low_precision`` first) or one whose recipe
    is not per-tensor. A weight that another module also holds (tied) is left out, with a log line."""
    holders = Counter(id(p) for m in module.modules() for p in m.parameters(recurse=False))
    out: dict[nn.Parameter, LowPrecisionLinear] = {}
    for name, m in module.named_modules():
        layer = getattr(m, "low_precision", None)
        if not isinstance(layer, LowPrecisionLinear) or layer.recipe.name not in FP8_RECIPES:
            continue
        if layer.recipe.name not in PER_TENSOR_RECIPES:
            raise ValueError(
                f"fp8 parameter all-gather: layer {name!r} runs the fp8 recipe {layer.recipe.name!r}; only the "
                f"per-tensor recipes {PER_TENSOR_RECIPES} gather one fp8 copy that serves W and W^T (row-wise needs "
                "two, as many bytes as bf16; block-wise is not implemented): turn fp8 parameter all-gather off"
            )
        weight = m.weight
        if not weight.requires_grad:
            continue
        if holders[id(weight)] > 1:
            logger.info("fp8 parameter all-gather: %s.weight is shared with another module: gathered in bf16", name)
            continue
        out[weight] = layer
    if not out:
        raise ValueError(
            "fp8 parameter all-gather: the model has no fp8 linear (tensorwise or delayed) to gather: install the "
            "recipe with enable_low_precision before wrapping the model, or turn fp8 parameter all-gather off"
        )
    return out


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
                if a < b:
                    # torch's cast: the bits of the Triton cast (native rounding), on 1/dp of the weight
                    fp8[a:b].copy_(reference_cast(self.param_data[a:b], self._multipliers[id(p)], E4M3))
            full = self.fp8_data[bucket.start : bucket.end]
            bucket.param_handle = all_gather_into(
                full, self.shard_view(self.fp8_data, bucket), self.dp_group, async_op=True
            )

    def _shard_part(self, p: nn.Parameter, bucket: Bucket) -> tuple[int, int]:
        lo, hi = self.ranges[p]
        return max(lo, bucket.shard_start), min(hi, bucket.shard_end)

    def _set_scales(self) -> None:
        """Each weight's dequantization scale from its whole amax: shard amaxes, MAX over dp, then over TP."""
        params = list(self.ranges)
        amax = torch.zeros(len(params), dtype=torch.float32, device=self.device)
        for i, p in enumerate(params):
            a, b = self._shard_part(p, self.bucket_of[p])
            if a < b:
                amax[i] = abs_max(self.param_data[a:b])
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.dp_group)
        by_reduce: dict[int, tuple] = {}  # the layers of one enable_low_precision call share one TP reduction
        for i, p in enumerate(params):
            fn = self.layers[p].weight_amax_reduce
            if fn is not None:
                by_reduce.setdefault(id(fn), (fn, []))[1].append(i)
        for fn, indices in by_reduce.values():
            part = amax[indices]
            fn(part)
            amax[indices] = part
        for i, p in enumerate(params):
            used = self._scale_amax(self.layers[p], amax[i])
            # the multiplier itself, not 1 / scale: the reciprocal of a reciprocal need not round back to it
            self._multipliers[id(p)], self._scales[id(p)] = scale_from_amax(used.reshape(()), FP8_MAX[E4M3])

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
            w = Quantized(fp8[lo:hi].view(p.shape), self._scales[id(p)], "tensor")
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
                layer = self.layers[param]
                saved, layer.weight_provider = layer.weight_provider, None
                try:  # the layer's own cast of its complete bf16 weight (first step, after a load, dp = 1)
                    w, w_t = layer.weight_operands(weight, transposed=True)
                finally:
                    layer.weight_provider = saved
                entry = self._operands[id(param)] = [w, w_t, param._version]
            if transposed and entry[1] is None:
                w = entry[0]
                entry[1] = Quantized(w.data.t().contiguous(), w.scale, "tensor")  # one scale serves both
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
