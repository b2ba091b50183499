"""Turn the tensor-parallel linears of a model into FP8 / FP4 linears, with the amax reductions TP needs.

``enable_low_precision(model, recipe, tp_group=...)`` gives every ``ColumnParallelLinear`` and
``RowParallelLinear`` under ``model`` a :class:`mcore.kernels.low_precision_linear.LowPrecisionLinear`, except

* the ones whose module name matches a ``keep`` pattern (``fnmatch``: ``"output"``, ``"layers.0.*"``),
* the ones with a local in- or out-dimension below ``min_features`` (small GEMMs gain nothing from FP8),
* the ones whose local shape breaks the recipe's rule (K not a multiple of the block, ...): with
  ``on_mismatch="error"`` this raises one ``ValueError`` naming the layer and the rule; with ``"fallback"`` the
  layer stays in high precision and the log says why.

The experts of every MoE layer (``MoELayer.experts``) get FP8 grouped GEMMs, with the same ``keep`` /
``min_features`` / mismatch rules: block-wise under ``blockwise`` (``mcore.kernels.fp8_block_grouped_gemm``,
DeepSeek-V3's 1x128 / 128x128 tiles; hidden and expert FFN multiples of 128, each expert's rows padded to 128),
row-wise under the other fp8 recipes (``mcore.kernels.fp8_grouped_gemm``: torch's fp8 grouped kernel on sm90
takes row-wise scales; multiples of 16, rows padded to 16). Both quantize gradients in e4m3 (``grad_format`` is
the linears'). Expert tensor parallelism (etp > 1) keeps them in high precision: scales along the etp-sharded
FFN dimension would differ from the single-process run.

The weights are untouched (fp32 masters stay with the optimizer; checkpoints stay in high precision). The
amax reduction is a MAX all-reduce over ``tp_group`` (BitNet's weight mean a SUM): a column-parallel layer shards
N, a row-parallel layer K.
``disable_low_precision`` undoes it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from mcore.kernels import fp8_block_grouped_gemm as block
from mcore.kernels.fp8_grouped_gemm import ALIGN, fp8_grouped_gemm, fp8_grouped_gemm_of_activation
from mcore.kernels.fp8_weight_cache import WeightCastCache
from mcore.kernels.low_precision_linear import FP8_RECIPES, LowPrecisionLinear, Recipe, recipe_shape_problem
from mcore.parallel.comm import group_size
from mcore.parallel.expert_gemm import ExpertGemms
from mcore.parallel.expert_parallel import MoELayer
from mcore.parallel.param_attrs import mark_wgrad_in_main_grad, take_wgrad_target
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["LayerDecision", "Recipe", "WeightCastCache", "disable_low_precision", "enable_low_precision", "tp_reduce"]

logger = logging.getLogger("mcore.parallel")
# the experts' fp8 GEMMs: the input projection, and the down projection of the activation (recomputed)
FP8_EXPERT_GEMMS = ExpertGemms(fp8_grouped_gemm, fp8_grouped_gemm_of_activation)
BLOCK_FP8_EXPERT_GEMMS = ExpertGemms(block.fp8_block_grouped_gemm, block.fp8_block_grouped_gemm_of_activation)
MISMATCH_POLICIES = ("error", "fallback")
BACKENDS = ("mcore", "te")


@dataclass(frozen=True)
class LayerDecision:
    """What ``enable_low_precision`` did with one linear: ``recipe`` name, or ``None`` and the ``reason``."""

    name: str
    recipe: str | None
    reason: str = ""


def tp_reduce(tp_group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.MAX):
    """In-place all-reduce ``op`` over ``tp_group`` (``None`` when the group has one rank: nothing to reduce)."""
    if group_size(tp_group) == 1:
        return None

    def reduce(t):
        dist.all_reduce(t, op=op, group=tp_group)

    return reduce


def _local_shape(module: nn.Module) -> tuple[int, int]:
    out_features, in_features = module.weight.shape
    return out_features, in_features


def fp8_wgrad_into(weight) -> tuple | None:
    """``LowPrecisionLinear.wgrad_into``: DDP's ``main_grad`` (or FSDP2's one-rank shard gradient) of ``weight`` as
    ``(target, accumulate)``, ``accumulate=False`` on the step's first weight gradient (``take_wgrad_target``: the
    GEMM writes it unread, and DDP then skips its zero-fill); ``None`` without a data-parallel wrapper."""
    target, overwrite = take_wgrad_target(weight)
    if target is None:
        return None
    mark_wgrad_in_main_grad(weight)  # DDP's hook must not add a .grad: the gradient is in main_grad
    return target, not overwrite


def enable_low_precision(
    model: nn.Module,
    recipe: Recipe | None,
    *,
    backend: str = "mcore",
    tp_group: dist.ProcessGroup | None = None,
    keep: Sequence[str] = ("output",),
    min_features: int = 0,
    on_mismatch: str = "error",
    prefix: str = "",
    weight_cache: WeightCastCache | None = None,
) -> list[LayerDecision]:
    """Install ``recipe`` on the TP linears of ``model``; returns one decision per linear (also logged).

    ``backend="te"`` runs them through Transformer Engine instead (``mcore.kernels.te_backend``; ``recipe=None``:
    TE's high-precision GEMMs), which reduces amaxes over ``tp_group`` itself. ``weight_cache``: the fp8 linears
    and experts reuse their weight casts through it until its owner invalidates it (``fp8_weight_cache.py``).
    """
    if on_mismatch not in MISMATCH_POLICIES:
        raise ValueError(f"enable_low_precision: on_mismatch must be one of {MISMATCH_POLICIES}, got {on_mismatch!r}")
    if backend not in BACKENDS:
        raise ValueError(f"enable_low_precision: backend must be one of {BACKENDS}, got {backend!r}")
    if recipe is None and backend != "te":
        raise ValueError("enable_low_precision: recipe=None (high precision) is only meaningful with backend='te'")
    reduce, sum_reduce = tp_reduce(tp_group), tp_reduce(tp_group, dist.ReduceOp.SUM)
    decisions = []
    for name, module in model.named_modules(prefix=prefix):
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        out_features, in_features = _local_shape(module)
        reason = ""
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in keep):
            reason = f"matches a keep pattern of {list(keep)}"
        elif min(out_features, in_features) < min_features:
            reason = f"local weight [{out_features}, {in_features}] has a dimension below min_features={min_features}"
        elif recipe is not None:
            problem = recipe_shape_problem(recipe, out_features, in_features)
            if problem is not None:
                message = f"layer {name!r} (local weight [{out_features}, {in_features}]): {problem}"
                if on_mismatch == "error":
                    raise ValueError(
                        f"{message}; keep the layer in high precision with a keep pattern or set the mismatch "
                        "policy to 'fallback'"
                    )
                reason = f"{problem} (fallback)"
        if reason:
            module.low_precision = None
            decisions.append(LayerDecision(name, None, reason))
            logger.info("low precision: %s stays in high precision: %s", name, reason)
            continue
        if backend == "te":
            from mcore.kernels.te_backend import TELinear

            module.low_precision = TELinear(recipe, amax_group=tp_group, name=name)
            decisions.append(LayerDecision(name, f"te:{recipe.name if recipe else 'high precision'}"))
            continue
        # the GEMM dimension this layer splits: N for column-parallel, K for row-parallel
        sharded = "n" if isinstance(module, ColumnParallelLinear) else "k"
        sharded = None if group_size(module.tp_group) == 1 else sharded
        # a fused weight's projections (q, k, v; gate, up) as row segments: BitNet scales each on its own
        segments = getattr(module, "weight_row_segments", None)
        module.low_precision = LowPrecisionLinear(
            recipe,
            sharded=sharded,
            amax_reduce=reduce,
            sum_reduce=sum_reduce,
            name=name,
            row_segments=segments,
            weight_cache=weight_cache,
        )
        if recipe.name in FP8_RECIPES:
            module.low_precision.wgrad_into = fp8_wgrad_into
        decisions.append(LayerDecision(name, recipe.name))
    decisions += _enable_fp8_experts(model, recipe, backend, keep, min_features, on_mismatch, prefix, weight_cache)
    converted = sum(d.recipe is not None for d in decisions)
    what = f"{backend}:{recipe.name if recipe else 'high precision'}"
    logger.info("low precision: %d of %d linears and expert groups use %s", converted, len(decisions), what)
    return decisions


@dataclass(frozen=True)
class _ExpertScheme:
    """The experts' fp8 GEMMs under one recipe: the decision's name, the GEMMs, the rows / K / N multiple."""

    name: str
    gemms: ExpertGemms
    align: int


def _expert_scheme(recipe) -> _ExpertScheme:
    if recipe.name == "blockwise":  # DeepSeek-V3's tiles, as the recipe's linears
        return _ExpertScheme("blockwise-grouped", BLOCK_FP8_EXPERT_GEMMS, block.ALIGN)
    return _ExpertScheme("rowwise-grouped", FP8_EXPERT_GEMMS, ALIGN)  # torch's row-wise grouped kernel


def _expert_reason(layer: MoELayer, recipe, backend, min_features: int) -> tuple[str, bool]:
    """Why ``layer``'s experts stay in high precision (empty: they do not), and whether it is a shape mismatch."""
    hidden, local_ffn = layer.experts.down.shape[1], layer.experts.down.shape[2]
    if backend != "mcore" or recipe is None or recipe.name not in FP8_RECIPES:
        what = f"{backend}:{recipe.name if recipe else 'high precision'}"
        return f"fp8 experts need the mcore backend and an fp8 recipe, not {what}", False
    if layer.etp > 1:
        return "expert tensor parallelism (etp > 1) splits the FFN dimension the row-wise scales run along", False
    if min(hidden, local_ffn) < min_features:
        return f"hidden {hidden} or expert FFN {local_ffn} is below min_features={min_features}", False
    scheme = _expert_scheme(recipe)
    if hidden % scheme.align or local_ffn % scheme.align:
        rule = f"must be multiples of {scheme.align} for {scheme.name} fp8 expert GEMMs"
        return f"hidden {hidden} and expert FFN {local_ffn} {rule}", True
    return "", False


def _enable_fp8_experts(
    model, recipe, backend, keep, min_features, on_mismatch, prefix, weight_cache
) -> list[LayerDecision]:
    """FP8 grouped GEMMs for the experts of every MoE layer under ``model``, block- or row-wise by ``recipe`` (see
    the module docstring), reusing their weight casts through ``weight_cache`` when given."""
    decisions = []
    for layer_name, layer in model.named_modules(prefix=prefix):
        if not isinstance(layer, MoELayer):
            continue
        name = f"{layer_name}.experts" if layer_name else "experts"
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in keep):
            reason, mismatch = f"matches a keep pattern of {list(keep)}", False
        else:
            reason, mismatch = _expert_reason(layer, recipe, backend, min_features)
        if mismatch and on_mismatch == "error":
            raise ValueError(f"layer {name!r}: {reason}; keep it in high precision with a keep pattern or 'fallback'")
        if reason:
            layer.experts.low_precision = None
            decisions.append(LayerDecision(name, None, reason))
            logger.info("low precision: %s stays in high precision: %s", name, reason)
            continue
        scheme = _expert_scheme(recipe)
        layer.experts.low_precision = dataclasses.replace(scheme.gemms, weight_casts=weight_cache)
        if layer.experts.gemm != "grouped":
            logger.info("low precision: %s runs fp8 grouped GEMMs, not expert_gemm=%s", name, layer.experts.gemm)
        align = math.lcm(layer.config.align, scheme.align)
        if align != layer.config.align:
            layer.config = dataclasses.replace(layer.config, align=align)
            logger.info("low precision: %s pads each expert's rows to %d (%s alignment)", name, align, scheme.name)
        logger.info("low precision: %s runs %s fp8 GEMMs", name, scheme.name)
        decisions.append(LayerDecision(name, scheme.name))
    return decisions


def disable_low_precision(model: nn.Module) -> None:
    """Put every TP linear under ``model`` back to the high-precision ``F.linear`` path."""
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module.low_precision = None
        elif isinstance(module, MoELayer):
            module.experts.low_precision = None
