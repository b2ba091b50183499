"""Model families as data: each module says what its family is (``DEFAULTS``) and which published sizes exist
(``PRESETS``); this registry turns a one-word name into a validated ``TransformerConfig``.

    >>> from mcore.models.families import get_config
    >>> get_config("llama3-8b").num_key_value_heads
    8
    >>> get_config("qwen3-tiny", num_hidden_layers=4).num_hidden_layers
    4

A family module has ``FAMILY`` (its name, which is also ``TransformerConfig.model_type``), ``HF_ARCHITECTURE``
(the Hugging Face class it equals, e.g. ``"LlamaForCausalLM"``: the tests build it as the reference and the bridge
writes it into ``config.json``), ``DEFAULTS`` (what the family is: every field a Hugging Face ``config.json`` does
not state) and ``PRESETS`` (published sizes, including a ``<family>-tiny`` one for the tests). Built-in families
are listed in ``_FAMILY_MODULES``; :func:`register_family` adds one at run time (a plugin, or a test).
"""

from __future__ import annotations

from types import MappingProxyType, ModuleType
from typing import Any

from mcore.models.config import TransformerConfig
from mcore.models.families import (
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

_FAMILY_MODULES: tuple[ModuleType, ...] = (
    llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, qwen2_moe, olmoe, mamba2, nemotron_h, falcon_h1, bitnet,
    deepseek_v3, deepseek_v2,
    gpt_oss,
)  # fmt: skip

_FAMILIES: dict[str, MappingProxyType[str, Any]] = {}
_PRESETS: dict[str, tuple[str, MappingProxyType[str, Any]]] = {}
_HF_ARCHITECTURES: dict[str, str] = {}
# Read-only views: no caller can change what a name means; register_family is the one way in.
FAMILIES: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType(_FAMILIES)
# preset name -> (family, sizes)
PRESETS: MappingProxyType[str, tuple[str, MappingProxyType[str, Any]]] = MappingProxyType(_PRESETS)


def register_family(module: ModuleType | Any) -> None:
    """Add the family described by ``module`` (``FAMILY``, ``HF_ARCHITECTURE``, ``DEFAULTS``, ``PRESETS``).

    Every preset is validated into a ``TransformerConfig`` here, so a broken family fails when it is registered.
    """
    missing = [a for a in ("FAMILY", "HF_ARCHITECTURE", "DEFAULTS", "PRESETS") if not hasattr(module, a)]
    if missing:
        raise ValueError(f"register_family: {getattr(module, '__name__', module)!r} lacks {missing}")
    name = module.FAMILY
    if name in _FAMILIES:
        raise ValueError(f"register_family: family {name!r} is already registered")
    clash = sorted(set(module.PRESETS) & set(_PRESETS))
    if clash:
        raise ValueError(f"register_family: presets {clash} of {name!r} already belong to other families")
    if f"{name}-tiny" not in module.PRESETS:
        raise ValueError(f"register_family: family {name!r} needs a '{name}-tiny' preset (the per-family tests use it)")
    defaults = MappingProxyType(dict(module.DEFAULTS))
    if defaults.get("model_type") != name:
        raise ValueError(f"register_family: {name!r} DEFAULTS must set model_type={name!r}")
    for preset, sizes in module.PRESETS.items():
        try:
            TransformerConfig.from_dict({**defaults, **sizes})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"register_family: preset {preset!r} of {name!r} is invalid: {exc}") from None
    _FAMILIES[name] = defaults
    _HF_ARCHITECTURES[name] = module.HF_ARCHITECTURE
    for preset, sizes in module.PRESETS.items():
        _PRESETS[preset] = (name, MappingProxyType(dict(sizes)))


def unregister_family(name: str) -> None:
    """Remove family ``name`` and its presets (for tests that register a throwaway family)."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown family {name!r}; known families: {family_names()}")
    del _FAMILIES[name], _HF_ARCHITECTURES[name]
    for preset in [p for p, (fam, _) in _PRESETS.items() if fam == name]:
        del _PRESETS[preset]


def hf_architecture(family: str) -> str:
    """The Hugging Face class name ``family`` equals (``"LlamaForCausalLM"`` for ``llama``)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; known families: {family_names()}")
    return _HF_ARCHITECTURES[family]


for _module in _FAMILY_MODULES:
    register_family(_module)


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


__all__ = [
    "FAMILIES",
    "PRESETS",
    "family_config",
    "family_names",
    "family_of",
    "get_config",
    "hf_architecture",
    "preset_names",
    "register_family",
    "unregister_family",
]
