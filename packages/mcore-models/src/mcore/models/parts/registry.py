"""The part registries (token mixers and MLPs): name -> :class:`PartSpec`.

Together with the family registry (``mcore.models.families``) these are the model registry, the one piece of
process-wide state in mcore-models (documented in ``docs/architecture.md``): they are filled at import time with
the built-in parts and grow only through an explicit ``register``.

Built-in entries are written as ``"module:attribute"`` strings and imported on first use. That keeps this module
free of imports from the rest of mcore-models, so that ``config.py`` can validate part names at construction
without an import cycle (parts import the config; the config only needs the names).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class PartContext:
    """What every part's builder gets besides the config and the layer index: the parallel layout and the
    parameters' dtype and device. ``recompute`` is the model's mode (``None``, ``"selective"``, ``"full"``); under
    ``"selective"``, ``recompute_modules`` names the sub-blocks recomputed (``mcore.models.recompute``; ``None``:
    each part's default, attention: its core)."""

    tp_group: Any = None
    tp_size: int = 1
    sequence_parallel: bool = False
    recompute: str | None = None
    recompute_modules: tuple[str, ...] | None = None
    params_dtype: torch.dtype = torch.float32
    device: torch.device | str | None = None
    groups: Any = None  # the model's ProcessGroups (the moe part takes its ep / etp groups from it)

    def recomputes(self, module: str) -> bool:
        """Whether sub-block ``module`` (a name of ``mcore.models.recompute.RECOMPUTE_MODULES``) is recomputed."""
        from mcore.models.recompute import recomputes  # deferred: this module imports nothing of mcore-models

        return recomputes(self.recompute, self.recompute_modules, module)


def _no_sequence_flops(config: Any, layer_index: int, seq_len: int) -> float:
    return 0.0


@dataclass(frozen=True)
class PartSpec:
    """One part a layer can be built from.

    - ``build(config, layer_index, context) -> nn.Module``; a mixer's module is called as
      ``module(x, rope, cu_seqlens=..., kv_cache=...)``, an MLP's as ``module(x)``, both on ``[s(/tp), b, h]``.
    - ``attribute``: the module's name inside the layer (``attention``, ``mlp``...), the prefix of its parameters.
    - ``parameters(config, layer_index)``: parameter count of the whole (unsharded) part.
    - ``matmul_weights(config, layer_index)``: weight elements each token multiplies (active ones only, as for
      MoE): 6x this is the part's training FLOPs per token from weight matmuls.
    - ``sequence_flops(config, layer_index, seq_len)``: training FLOPs per token that grow with the sequence
      (attention's scores and weighted sum), on top of the matmul term.
    - ``check_tensor_parallel(config, tp)``: raise ``ValueError`` (naming valid values) unless the part splits
      over ``tp`` ranks.
    """

    name: str
    attribute: str
    build: Callable[[Any, int, PartContext], nn.Module]
    parameters: Callable[[Any, int], int]
    matmul_weights: Callable[[Any, int], int]
    check_tensor_parallel: Callable[[Any, int], None]
    sequence_flops: Callable[[Any, int, int], float] = _no_sequence_flops


class PartRegistry:
    """The parts of one slot (``mixer`` or ``mlp``), by name."""

    def __init__(self, slot: str, builtin: dict[str, str]) -> None:
        self.slot = slot
        self._entries: dict[str, PartSpec | str] = dict(builtin)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def get(self, name: str) -> PartSpec:
        """The spec registered as ``name`` (imported on first use)."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.slot} part {name!r}; registered {self.slot} parts: {self.names()}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            entry = getattr(importlib.import_module(module), attribute)
            if not isinstance(entry, PartSpec) or entry.name != name:
                raise TypeError(f"{self.slot} part {name!r}: {self._entries[name]!r} is not a PartSpec named {name!r}")
            self._entries[name] = entry
        return entry

    def register(self, spec: PartSpec, *, replace: bool = False) -> None:
        """Add ``spec`` under ``spec.name``; an existing name is an error unless ``replace``."""
        if not isinstance(spec, PartSpec):
            raise TypeError(f"{self.slot} registry takes a PartSpec, got {type(spec).__name__}")
        if spec.name in self._entries and not replace:
            raise ValueError(f"{self.slot} part {spec.name!r} is already registered (pass replace=True to override)")
        self._entries[spec.name] = spec

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests that register throwaway parts)."""
        if name not in self._entries:
            raise ValueError(f"{self.slot} part {name!r} is not registered")
        del self._entries[name]


# The name of the empty part of either slot: a layer with it has no such sub-block at all (no norm, no residual
# branch), as Mamba-2 layers have no MLP and Nemotron-H's MLP-only layers no mixer.
NO_PART = "none"

# HF ``layer_types`` names for the attention mixers; more mixers (mla, mamba2, ...) register themselves.
MIXERS = PartRegistry(
    "mixer",
    {
        "full_attention": "mcore.models.layers.attention:FULL_ATTENTION",
        "sliding_attention": "mcore.models.layers.attention:SLIDING_ATTENTION",
        "nope_attention": "mcore.models.layers.attention:NOPE_ATTENTION",
        "mla": "mcore.models.layers.mla:MLA",
        "mamba2": "mcore.models.layers.mamba2:MAMBA2",
        "falcon_h1_parallel": "mcore.models.layers.falcon_h1:FALCON_H1_PARALLEL",
        NO_PART: "mcore.models.layers.block:NO_MIXER",
        "bitnet_attention": "mcore.models.layers.bitnet:BITNET_ATTENTION",
    },
)
# ``mlp_layer_types`` names; "dense" is the gated MLP of every Llama-family layer.
MLPS = PartRegistry(
    "mlp",
    {
        "dense": "mcore.models.layers.mlp:DENSE_MLP",
        "relu2": "mcore.models.layers.relu2_mlp:RELU2_MLP",
        "falcon_h1_mlp": "mcore.models.layers.falcon_h1:FALCON_H1_MLP",
        NO_PART: "mcore.models.layers.block:NO_MLP",
        "moe": "mcore.models.layers.moe:MOE_MLP",
        "moe_relu2": "mcore.models.layers.relu2_moe:RELU2_MOE_MLP",
        "bitnet_mlp": "mcore.models.layers.bitnet:BITNET_MLP",
    },
)
