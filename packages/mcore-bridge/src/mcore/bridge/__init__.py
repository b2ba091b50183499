"""mcore-bridge: streaming, lossless Hugging Face <-> mcore checkpoint conversion.

Command line: ``mcore-bridge convert|verify|inspect|list``. Python API (imported on first use, so that the command
line starts quickly)::

    from mcore.bridge import export_hf, load_hf_into
    from mcore.bridge.convert import convert       # what ``mcore-bridge convert`` runs
    from mcore.bridge.verify import verify         # what ``mcore-bridge verify`` runs
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# names that are not also submodules (``mcore.bridge.convert`` is the module once imported)
_EXPORTS = {
    "load_hf_into": "mcore.bridge.api",
    "export_hf": "mcore.bridge.api",
    "BridgeError": "mcore.bridge.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mcore.bridge' has no attribute {name!r}")
