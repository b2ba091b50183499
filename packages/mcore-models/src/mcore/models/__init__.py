"""GPT-family transformer models built from mcore.parallel modules and mcore.kernels ops.

    from mcore.models import GPTModel, get_config
    model = GPTModel(get_config("llama3-8b"), groups=groups, sequence_parallel=True)
    model.init_weights(seed=1234)
    loss = model(input_ids, labels=labels)          # per-token fp32 loss [b, s]

Public API: ``TransformerConfig``, the family registry (``get_config``, ``family_config``, ``preset_names``,
``family_names``), ``GPTModel``, ``generate``, and the accounting functions (``parameter_counts``,
``model_flops_per_token``, ``mfu``). Names resolve lazily so that ``import mcore.models`` stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "TransformerConfig": "mcore.models.config",
    "GPTModel": "mcore.models.gpt",
    "KVCache": "mcore.models.layers.kv_cache",
    "generate": "mcore.models.generate",
    "top_p_filter": "mcore.models.generate",
    "get_config": "mcore.models.families",
    "family_config": "mcore.models.families",
    "family_names": "mcore.models.families",
    "family_of": "mcore.models.families",
    "preset_names": "mcore.models.families",
    "ParameterCounts": "mcore.models.accounting",
    "parameter_counts": "mcore.models.accounting",
    "matmul_weight_count": "mcore.models.accounting",
    "model_flops_per_token": "mcore.models.accounting",
    "mfu": "mcore.models.accounting",
    "H100_BF16_PEAK_FLOPS": "mcore.models.accounting",
    "H200_BF16_PEAK_FLOPS": "mcore.models.accounting",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mcore.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
