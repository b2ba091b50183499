"""Hugging Face ``config.json`` <-> ``TransformerConfig``, both ways, with nothing dropped.

Every key of ``config.json`` is either owned by one of the family's config rules (translated) or carried
verbatim (``torch_dtype``, ``bos_token_id``, ``rope_scaling`` spellings, unknown extras...). The original file is
kept beside the mcore checkpoint (``hf/config.json``), so export writes the carried keys back unchanged and
re-renders only the translated keys whose values changed.
"""

from __future__ import annotations

from typing import Any

from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings import FamilyMapping, family_for_hf_config
from mcore.models.config import TransformerConfig

# keys that name the weights' dtype in transformers 4 (torch_dtype) and 5 (dtype)
DTYPE_KEYS = ("torch_dtype", "dtype")
IDENTITY_KEYS = ("architectures", "model_type")


def hf_to_mcore(hf: dict[str, Any], family: FamilyMapping, where: str = "config.json") -> TransformerConfig:
    """The ``TransformerConfig`` that ``hf`` describes; BridgeError names the key when it cannot be built."""
    values: dict[str, Any] = {}
    for rule in family.config:
        try:
            values.update(rule.to_mcore(hf))
        except BridgeError as exc:
            raise BridgeError(f"{where}: {exc}") from None
    try:
        return TransformerConfig.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise BridgeError(f"{where}: cannot be expressed as an mcore {family.name} model: {exc}") from None


def owned_keys(family: FamilyMapping) -> set[str]:
    return {k for rule in family.config for k in rule.hf_keys}


def carried_keys(hf: dict[str, Any], family: FamilyMapping) -> list[str]:
    """Keys of ``hf`` that no rule translates: they travel verbatim."""
    owned = owned_keys(family) | set(IDENTITY_KEYS)
    return [k for k in hf if k not in owned]


def mcore_to_hf(
    config: TransformerConfig,
    family: FamilyMapping,
    original: dict[str, Any] | None = None,
    *,
    weights_dtype: str | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of ``config``.

    With ``original`` (the config the model was converted from), a translated key whose value did not change is
    written exactly as it was, carried keys are copied, and the key order is kept. ``weights_dtype`` is the dtype
    name of the exported weights: written when there is no original, and replacing an original ``torch_dtype`` /
    ``dtype`` that names another dtype (the weights were converted with ``--dtype``).
    """
    if config.model_type != family.name:
        raise BridgeError(f"model_type {config.model_type!r} cannot be exported with the {family.name} mapping")
    if original is not None and family_for_hf_config(original, "stored hf/config.json") is not family:
        raise BridgeError(f"the stored hf/config.json describes another family than model_type {config.model_type!r}")
    values = config.to_dict()
    before = hf_to_mcore(original, family, "stored hf/config.json").to_dict() if original is not None else None
    rendered: dict[str, Any] = {}
    for rule in family.config:
        unchanged = before is not None and all(before[f] == values[f] for f in rule.mcore_fields)
        if unchanged:
            rendered.update({k: original[k] for k in rule.hf_keys if k in original})
        else:
            rendered.update(rule.to_hf(values, original))
    if original is None:
        out: dict[str, Any] = {"architectures": [family.hf_architectures[0]], "model_type": family.hf_model_type}
        out.update(rendered)
        if weights_dtype is not None:
            out["torch_dtype"] = weights_dtype
        return out
    owned = owned_keys(family)
    out = {}
    for key, value in original.items():
        if key not in owned:
            out[key] = value
        elif key in rendered:
            out[key] = rendered.pop(key)
    out.update(rendered)  # keys the original did not spell (e.g. a newly set rope_scaling)
    if weights_dtype is not None:
        # only a dtype that contradicts the written weights is changed (after --dtype); null/"auto" stay
        for key in DTYPE_KEYS:
            if isinstance(out.get(key), str) and out[key] not in (weights_dtype, "auto"):
                out[key] = weights_dtype
    return out
