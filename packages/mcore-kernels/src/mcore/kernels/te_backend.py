"""Transformer Engine as an optional backend of the linears (``kernels.backend: te``).

Nothing imports ``transformer_engine`` unless this backend is asked for; without it the request fails with
one message saying how to install it. :class:`TELinear` is called like ``F.linear(x, weight, bias)`` and runs
a ``transformer_engine.pytorch.Linear`` whose parameters *are* ours (the same ``Parameter`` objects, so the
optimizer, DDP and checkpoints see nothing new), under TE's FP8 autocast with the recipe mapped from ours:

==============  =======================================================================
ours            Transformer Engine recipe
==============  =======================================================================
``tensorwise``  ``Float8CurrentScaling``
``delayed``     ``DelayedScaling(amax_history_len, amax_compute_algo)``
``blockwise``   ``Float8BlockScaling``
``mxfp8``       ``MXFP8BlockScaling`` (Blackwell)
``nvfp4``       ``NVFP4BlockScaling`` (Blackwell, TE >= 2.8)
``None``        no autocast: TE's high-precision GEMM
==============  =======================================================================

``grad_format: e5m2`` is TE's ``Format.HYBRID`` (e4m3 forward, e5m2 backward), ``e4m3`` its ``Format.E4M3``. TE
reduces delayed-scaling amaxes over ``amax_group`` (the TP group) itself. Row-wise, MXFP4 and BitNet have no TE
recipe, nor ``delayed_overflow: recast`` a TE mode: asking for them names the recipe (or key) and the alternative.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from mcore.kernels.low_precision_linear import Recipe

TE_RECIPES = {
    "tensorwise": "Float8CurrentScaling",
    "delayed": "DelayedScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def import_te():
    """``transformer_engine.pytorch``, or a ``RuntimeError`` saying how to get it."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as exc:
        raise RuntimeError(
            "kernels.backend=te needs NVIDIA Transformer Engine (pip install 'mcore-kernels[te]', or "
            f"transformer_engine[pytorch] matching your CUDA); importing it failed: {exc}. Use kernels.backend=auto "
            "for mcore's own kernels"
        ) from None


def check_te_recipe(recipe: Recipe | None) -> None:
    """Raise ``ValueError`` when ``recipe`` has no Transformer Engine counterpart."""
    if recipe is not None and recipe.name not in TE_RECIPES:
        raise ValueError(
            f"Transformer Engine has no {recipe.name!r} recipe (it has {sorted(TE_RECIPES)}); use "
            "kernels.backend=auto for mcore's own implementation"
        )
    if recipe is not None and recipe.delayed_overflow != "saturate":
        # TE's DelayedScaling always saturates a tensor that outgrew its history: no recast to map onto
        raise ValueError(
            f"Transformer Engine has no delayed_overflow={recipe.delayed_overflow!r} mode (fp8.delayed_overflow; its "
            "delayed scaling saturates): use fp8.delayed_overflow=saturate, or kernels.backend=auto for mcore's recast"
        )


def te_recipe(recipe: Recipe):
    """The ``transformer_engine.common.recipe`` object for ``recipe``."""
    check_te_recipe(recipe)
    te_recipes = importlib.import_module("transformer_engine.common.recipe")
    fmt = te_recipes.Format.HYBRID if recipe.grad_format == "e5m2" else te_recipes.Format.E4M3
    cls = getattr(te_recipes, TE_RECIPES[recipe.name], None)
    if cls is None:
        raise RuntimeError(f"this Transformer Engine has no {TE_RECIPES[recipe.name]} recipe; upgrade it")
    if recipe.name == "delayed":
        return cls(fp8_format=fmt, amax_history_len=recipe.amax_history_len, amax_compute_algo=recipe.amax_compute)
    if recipe.name == "nvfp4":
        return cls()
    return cls(fp8_format=fmt)


class TELinear:
    """Callable ``(x, weight, bias) -> y`` through ``transformer_engine.pytorch.Linear`` on our parameters."""

    def __init__(self, recipe: Recipe | None, *, amax_group=None, name: str = "") -> None:
        check_te_recipe(recipe)
        self.te = import_te()
        self.recipe, self.amax_group, self.name = recipe, amax_group, name
        self._module = None
        self._fp8_recipe = None if recipe is None else te_recipe(recipe)

    def _module_for(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None):
        if self._module is None:
            out_features, in_features = weight.shape
            module = self.te.Linear(
                in_features, out_features, bias=bias is not None, params_dtype=weight.dtype, device=weight.device
            )
            # share our parameters: TE reads them by attribute name at every forward
            module._parameters["weight"] = weight
            if bias is not None:
                module._parameters["bias"] = bias
            self._module = module
        return self._module

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        module = self._module_for(weight, bias)
        if self._fp8_recipe is None:
            return module(x)
        autocast = getattr(self.te, "fp8_autocast", None) or self.te.autocast
        with autocast(enabled=True, fp8_recipe=self._fp8_recipe, fp8_group=self.amax_group):
            return module(x)

    def __repr__(self) -> str:
        return f"TELinear({None if self.recipe is None else self.recipe.name}, name={self.name!r})"
