"""Model families as data: each module says what its family is (``DEFAULTS``) and which published sizes exist
(``PRESETS``); this registry turns a one-word name into a validated ``TransformerConfig``.

    >>> from mcore.models.families import get_config
    >>> get_config("llama3-8b").num_key_value_heads
    8
    >>> get_config("qwen3-tiny", num_hidden_layers=4).num_hidden_layers
    4

Adding a family means adding one module with ``FAMILY``, ``DEFAULTS`` and ``PRESETS`` and listing it in
``_FAMILY_MODULES``.
"""

from __future__ import annotations

from types import MappingProxyType, ModuleType
from typing import Any

from mcore.models.config import TransformerConfig
from mcore.models.families import llama, mistral, qwen2, qwen3

_FAMILY_MODULES: tuple[ModuleType, ...] = (llama, qwen2, qwen3, mistral)

FAMILIES: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType(
    {m.FAMILY: MappingProxyType(dict(m.DEFAULTS)) for m in _FAMILY_MODULES}
)
# preset name -> (family, sizes); read-only so that no caller can change what a name means.
PRESETS: MappingProxyType[str, tuple[str, MappingProxyType[str, Any]]] = MappingProxyType(
    {name: (m.FAMILY, MappingProxyType(dict(sizes))) for m in _FAMILY_MODULES for name, sizes in m.PRESETS.items()}
)


def family_names() -> list[str]:
    """Names of the known families (``llama``, ``qwen2``, ...)."""
    return list(FAMILIES)


def preset_names(family: str | None = None) -> list[str]:
    """Names of the published size presets, optionally only those of one family."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known families: {family_names()}")
    return [name for name, (fam, _) in PRESETS.items() if family is None or fam == family]


def family_of(preset: str) -> str:
    """The family a preset belongs to."""
    _check_preset(preset)
    return PRESETS[preset][0]


def get_config(name: str, **overrides: Any) -> TransformerConfig:
    """Build the ``TransformerConfig`` of preset ``name`` (family defaults, then sizes, then ``overrides``)."""
    _check_preset(name)
    family, sizes = PRESETS[name]
    fields: dict[str, Any] = {**FAMILIES[family], **sizes, **overrides}
    # Copy nested dicts so that a caller mutating its config's rope_scaling cannot change the preset.
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = dict(fields["rope_scaling"])
    return TransformerConfig.from_dict(fields)


def family_config(family: str, **fields: Any) -> TransformerConfig:
    """A config of ``family`` with explicit sizes (for models that are not a preset)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known families: {family_names()}")
    return TransformerConfig.from_dict({**FAMILIES[family], **fields})


def _check_preset(name: str) -> None:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")


__all__ = ["FAMILIES", "PRESETS", "family_config", "family_names", "family_of", "get_config", "preset_names"]
