"""Family mappings, one module per family; this registry finds the one for an HF config or an mcore model."""

from __future__ import annotations

from typing import Any

from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings import (
    bitnet,
    deepseek_v2,
    deepseek_v3,
    falcon_h1,
    gpt_oss,
    llama,
    mamba2,
    mistral,
    mixtral,
    nemotron_h,
    olmoe,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from mcore.bridge.mappings.base import FamilyMapping, TensorRule

_BUILTIN = (llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, qwen2_moe, olmoe, mamba2, nemotron_h, falcon_h1, bitnet)
_BUILTIN += (deepseek_v3, deepseek_v2)
_BUILTIN += (gpt_oss,)
FAMILIES: dict[str, FamilyMapping] = {m.MAPPING.name: m.MAPPING for m in _BUILTIN}


def register_mapping(mapping: FamilyMapping) -> None:
    """Add the mapping of a family registered in ``mcore.models.families`` (a plugin, or a test)."""
    if not isinstance(mapping, FamilyMapping):
        raise TypeError(f"register_mapping takes a FamilyMapping, got {type(mapping).__name__}")
    if mapping.name in FAMILIES:
        raise ValueError(f"register_mapping: family {mapping.name!r} already has a mapping")
    FAMILIES[mapping.name] = mapping


def unregister_mapping(name: str) -> None:
    """Remove the mapping of ``name`` (for tests that register a throwaway family)."""
    if name not in FAMILIES:
        raise ValueError(f"unregister_mapping: family {name!r} has no mapping")
    del FAMILIES[name]


def _supported() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.hf_architectures)})" for f in FAMILIES.values())


def family_for_hf_config(config: dict[str, Any], where: str = "config.json") -> FamilyMapping:
    """The mapping for an HF config, by ``architectures`` (and ``model_type`` when there is none)."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    for family in FAMILIES.values():
        if any(a in family.hf_architectures for a in architectures):
            if config.get("model_type", family.hf_model_type) != family.hf_model_type:
                raise BridgeError(
                    f"{where}: architectures {architectures} says {family.name} but model_type is "
                    f"{config.get('model_type')!r}, expected {family.hf_model_type!r}"
                )
            return family
    if not architectures:
        for family in FAMILIES.values():
            if config.get("model_type") == family.hf_model_type:
                return family
    found = architectures or config.get("model_type")
    raise BridgeError(f"{where}: unsupported architecture {found!r}; supported: {_supported()}")


def family_by_name(name: str, where: str = "checkpoint") -> FamilyMapping:
    """The mapping of an mcore family name (``TransformerConfig.model_type``)."""
    if name not in FAMILIES:
        raise BridgeError(f"{where}: model_type {name!r} has no Hugging Face mapping; supported: {_supported()}")
    return FAMILIES[name]


__all__ = [
    "FAMILIES",
    "FamilyMapping",
    "TensorRule",
    "family_by_name",
    "family_for_hf_config",
    "register_mapping",
    "unregister_mapping",
]
