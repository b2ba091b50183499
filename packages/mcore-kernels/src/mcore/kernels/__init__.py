"""Fused GPU ops with pure-torch references.

Every public op runs on any device: on CUDA it dispatches to a Triton kernel, elsewhere to the torch
reference (``MCORE_KERNELS_BACKEND=reference|triton`` or the ``backend=`` keyword override it).
Names are resolved lazily so that ``import mcore.kernels`` stays cheap and never imports Triton.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "rms_norm": "mcore.kernels.norms",
    "layer_norm": "mcore.kernels.norms",
    "rope_inv_freq": "mcore.kernels.rotary",
    "rope_cos_sin": "mcore.kernels.rotary",
    "apply_rotary": "mcore.kernels.rotary",
    "swiglu": "mcore.kernels.activations",
    "geglu": "mcore.kernels.activations",
    "cross_entropy": "mcore.kernels.cross_entropy",
    "attention": "mcore.kernels.attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mcore.kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
