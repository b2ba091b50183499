"""``train.precision: fp8 | fp4``: the config sections and how the trainer applies them to its model chunks.

With ``fp8`` or ``fp4`` the parameters keep the high precision of the device (bf16 on CUDA with fp32 master
weights, fp32 on CPU) and every tensor-parallel linear not kept by a pattern runs its three GEMMs through
:class:`mcore.kernels.low_precision_linear.LowPrecisionLinear`. Checkpoints hold the high-precision weights
only, so a checkpoint trained in FP8 loads at any precision and vice versa.

``keep`` patterns (``fnmatch`` on module names such as ``layers.3.mlp.down``) may use ``{first}`` and
``{last}`` for the first and last decoder layer: ``["layers.{first}.*", "layers.{last}.*"]`` keeps both in
high precision. The output layer (``output``; a tied output layer shares the embedding and is never
quantized) is kept by default. ``train.quant: bitnet`` (with the ``bitnet`` section's patterns) makes the same
linears BitNet b1.58 linears instead, at any ``train.precision`` but fp8/fp4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mcore.parallel.fp8_param_gather import GATHERED_RECIPES
from mcore.parallel.low_precision import LayerDecision, Recipe, WeightCastCache, enable_low_precision
from mcore.train.errors import UserError

LOW_PRECISIONS = ("fp8", "fp4")


@dataclass
class _LowPrecisionSection:
    keep: list[str] = field(default_factory=lambda: ["output"])
    min_features: int = 0
    on_mismatch: Literal["error", "fallback"] = "error"

    def __post_init__(self) -> None:
        if self.min_features < 0:
            raise ValueError(f"min_features must be >= 0, got {self.min_features}")


@dataclass
class Fp8Section(_LowPrecisionSection):
    """FP8 training (``train.precision: fp8``).

    ``recipe``: ``tensorwise`` (current scaling), ``delayed`` (tensor-wise from an amax history of
    ``amax_history_len`` steps, ``amax_compute`` max or most_recent), ``rowwise``, ``blockwise`` (1x128
    activations and gradients, 128x128 weights) or ``mxfp8`` (emulated). ``delayed_overflow`` (delayed recipe
    only, any other refuses ``recast``): ``saturate`` (a tensor whose amax grew past the history's saturates above
    it) or ``recast`` (such a tensor is cast again with current scaling from its own amax, decided on the device;
    Transformer Engine has no such mode). ``grad_format``: e4m3 or e5m2 for the gradient operands (default e5m2
    for delayed scaling, e4m3 for the others; block-wise with e5m2 runs mcore's Triton block-scaled GEMM on CUDA,
    as cuBLAS's takes e4m3 only).
    ``keep`` / ``min_features`` / ``on_mismatch``: which linears stay in high precision, and what a linear
    whose shape does not fit the recipe does (``error`` or ``fallback`` to high precision, logged).
    ``weight_cache``: cast each weight once per optimizer step, not once per micro-batch (with one micro-batch
    per step and no recompute there is nothing to reuse: no cache). ``fast_accum``: the
    forward GEMM of tensor- and row-wise recipes accumulates in the tensor cores' fast mode (gradients never).
    ``param_gather`` (Megatron's ``--fp8-param-gather``; with ``parallel.distributed_optimizer``, tensor-wise,
    delayed or block-wise): the distributed optimizer all-gathers the fp8 linears' updated weights as their fp8
    casts, 1 byte per element instead of 2, each rank casting only its shard (``mcore.parallel.fp8_param_gather``).
    """

    recipe: Literal["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"] = "tensorwise"
    grad_format: Literal["e4m3", "e5m2"] | None = None
    amax_history_len: int = 16
    amax_compute: Literal["max", "most_recent"] = "max"
    delayed_overflow: Literal["saturate", "recast"] = "saturate"
    weight_cache: bool = True
    fast_accum: bool = True
    param_gather: bool = False

    def to_recipe(self) -> Recipe:
        history, compute = self.amax_history_len, self.amax_compute
        return Recipe(
            self.recipe,
            grad_format=self.grad_format,
            amax_history_len=history,
            amax_compute=compute,
            delayed_overflow=self.delayed_overflow,
            fast_accum=self.fast_accum,
        )


@dataclass
class Fp4Section(_LowPrecisionSection):
    """Emulated FP4 training (``train.precision: fp4``): ``recipe`` mxfp4 (E8M0 scales per 32) or nvfp4 (E4M3
    scales per 16 under a per-tensor fp32 scale); ``quantize_grads``: also quantize the gradient operands."""

    recipe: Literal["mxfp4", "nvfp4"] = "nvfp4"
    quantize_grads: bool = True

    def to_recipe(self) -> Recipe:
        return Recipe(self.recipe, quantize_grads=self.quantize_grads)


@dataclass
class BitNetSection(_LowPrecisionSection):
    """BitNet b1.58 quantization-aware training (``train.quant: bitnet``): every TP linear not kept runs with
    ternary absmean weights and int8 per-token activations (straight-through gradients)."""

    def to_recipe(self) -> Recipe:
        return Recipe("bitnet")


@dataclass
class KernelsSection:
    """``backend``: ``auto`` (mcore's kernels: Triton on CUDA, torch references elsewhere) or ``te`` (the linears
    through NVIDIA Transformer Engine, with the fp8 recipe when ``train.precision: fp8``; it must import)."""

    backend: Literal["auto", "te"] = "auto"


def check_fp8_param_gather(config) -> None:
    """``fp8.param_gather`` needs the fp8 linears it gathers and the distributed optimizer that shards them."""
    if not config.fp8.param_gather:
        return
    problems = []
    if config.train.precision != "fp8" or config.train.quant != "none":
        problems.append(f"train.precision=fp8 (got {config.train.precision}, quant {config.train.quant})")
    if config.fp8.recipe not in GATHERED_RECIPES:
        problems.append(f"fp8.recipe tensorwise, delayed or blockwise (got {config.fp8.recipe})")
    if not config.parallel.distributed_optimizer:
        problems.append("parallel.distributed_optimizer=true (it gathers the shards that optimizer updates)")
    if config.kernels.backend != "auto":
        problems.append(f"kernels.backend=auto (got {config.kernels.backend}: Transformer Engine casts its own)")
    if problems:
        raise ValueError(f"fp8.param_gather=true needs {'; '.join(problems)}; or set fp8.param_gather=false")


def base_precision(precision: str, device: torch.device) -> str:
    """The parameter precision behind ``precision``: fp8/fp4 keep bf16 parameters on CUDA and fp32 on CPU."""
    if precision in LOW_PRECISIONS:
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def expand_patterns(patterns: list[str], num_layers: int) -> list[str]:
    return [p.replace("{first}", "0").replace("{last}", str(num_layers - 1)) for p in patterns]


def weight_cast_cache(config, num_microbatches: int) -> WeightCastCache | None:
    """The cache of fp8 weight casts (linears and experts) the trainer invalidates each optimizer step; ``None`` when
    not fp8, off, or nothing would reuse a cast (one micro-batch per step and no recompute: the cache would only keep
    the forward's fp8 weights alive through the backward, 1 byte per weight element)."""
    fp8 = config.train.precision == "fp8" and config.train.quant != "bitnet" and config.kernels.backend != "te"
    reused = num_microbatches > 1 or config.train.recompute != "none"
    return WeightCastCache() if fp8 and config.fp8.weight_cache and reused else None


def apply_low_precision(
    config, chunk: torch.nn.Module, tp_group, weight_cache: WeightCastCache | None = None
) -> list[LayerDecision]:
    """Install the configured recipe on ``chunk``'s TP linears (nothing unless precision is fp8 or fp4)."""
    precision = config.train.precision
    backend = "te" if config.kernels.backend == "te" else "mcore"
    if config.train.quant == "bitnet":
        precision, section = "bitnet", config.bitnet
    elif precision in LOW_PRECISIONS:
        section = config.fp8 if precision == "fp8" else config.fp4
    elif backend == "te":
        try:
            return enable_low_precision(chunk, None, backend="te", tp_group=tp_group, keep=("output",))
        except RuntimeError as exc:
            raise UserError(str(exc)) from None
    else:
        return []
    try:
        return enable_low_precision(
            chunk,
            section.to_recipe(),
            backend=backend,
            tp_group=tp_group,
            keep=expand_patterns(section.keep, config.model.num_hidden_layers),
            min_features=section.min_features,
            on_mismatch=section.on_mismatch,
            weight_cache=weight_cache,
        )
    except (ValueError, RuntimeError) as exc:
        recipe = getattr(section, "recipe", "bitnet")
        raise UserError(f"{precision}.recipe={recipe}: {exc}") from None
