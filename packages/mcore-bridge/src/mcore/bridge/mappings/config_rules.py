"""Config translation rules: each rule owns some Hugging Face ``config.json`` keys and some ``TransformerConfig``
fields and translates between them in both directions.

The translator (``mcore.bridge.config_translation``) runs every rule of a family; HF keys no rule owns are carried
verbatim, so nothing is dropped. On export a rule whose fields still equal what the original ``config.json``
translates to writes the original keys back untouched (same spelling, same int/float, same key order), and only
a field that changed is written afresh with :meth:`ConfigRule.to_hf`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from mcore.bridge.errors import BridgeError

REQUIRED = object()  # sentinel: the HF key has no default and must be present


class ConfigRule(ABC):
    """Base of the rules; subclasses set ``hf_keys`` and ``mcore_fields`` and implement both directions."""

    hf_keys: tuple[str, ...] = ()
    mcore_fields: tuple[str, ...] = ()

    @abstractmethod
    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``TransformerConfig`` keyword values for this rule's fields, from the whole HF config."""

    @abstractmethod
    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        """HF keys for this rule from the whole ``TransformerConfig`` dict; ``original`` picks the spelling."""


@dataclass(frozen=True)
class Field(ConfigRule):
    """An HF key with the same name and meaning as a ``TransformerConfig`` field, with HF's default."""

    name: str
    default: Any = REQUIRED

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def mcore_fields(self) -> tuple[str, ...]:
        return (self.name,)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        if self.name in hf:
            return {self.name: hf[self.name]}
        if self.default is REQUIRED:
            raise BridgeError(f"config.json has no {self.name!r}, which this family requires")
        return {self.name: self.default}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        return {self.name: values[self.name]}


@dataclass(frozen=True)
class Fixed(ConfigRule):
    """A ``TransformerConfig`` field the family fixes (no HF key): e.g. Qwen2 always has Q/K/V biases.

    Exporting a model whose field differs fails: HF's class for this family cannot express it.
    """

    field: str
    value: Any

    @property
    def mcore_fields(self) -> tuple[str, ...]:
        return (self.field,)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {self.field: self.value}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        if values[self.field] != self.value:
            raise BridgeError(
                f"this family always has {self.field}={self.value!r} in Hugging Face, but the model has "
                f"{self.field}={values[self.field]!r}; it cannot be exported as this family"
            )
        return {}


@dataclass(frozen=True)
class McoreOnly(ConfigRule):
    """A ``TransformerConfig`` field without HF meaning (e.g. vocabulary padding): its default on import, ignored
    on export."""

    field: str
    value: Any

    @property
    def mcore_fields(self) -> tuple[str, ...]:
        return (self.field,)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {self.field: self.value}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class SharedAttentionBias(ConfigRule):
    """HF ``attention_bias`` (Llama, Qwen3) puts biases on Q/K/V *and* the output projection."""

    key: str = "attention_bias"

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return (self.key,)

    mcore_fields = ("attention_bias", "attention_out_bias")

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        bias = hf.get(self.key, False)
        return {"attention_bias": bias, "attention_out_bias": bias}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        if values["attention_bias"] != values["attention_out_bias"]:
            raise BridgeError(
                f"HF {self.key!r} sets Q/K/V and output-projection biases together, but the model has "
                f"attention_bias={values['attention_bias']} and attention_out_bias={values['attention_out_bias']}"
            )
        return {self.key: values["attention_bias"]}


@dataclass(frozen=True)
class Rope(ConfigRule):
    """RoPE base and scaling, spelled ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5, theta inside). Export keeps the spelling of the original config; a fresh export uses the
    transformers-4 spelling, which both major versions read."""

    default_theta: float = 10000.0
    hf_keys = ("rope_theta", "rope_scaling", "rope_parameters")
    mcore_fields = ("rope_theta", "rope_scaling")

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        params = hf.get("rope_parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise BridgeError(f"config.json 'rope_parameters' must be an object, got {params!r}")
            theta = params.get("rope_theta", hf.get("rope_theta", self.default_theta))
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        else:
            theta = hf.get("rope_theta", self.default_theta)
            scaling = hf.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            extra = set(scaling) - {"rope_type", "type"}
            if extra:
                raise BridgeError(f"config.json rope settings of type 'default' have unexpected keys {sorted(extra)}")
            scaling = None
        return {"rope_theta": theta, "rope_scaling": scaling}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        theta, scaling = values["rope_theta"], values["rope_scaling"]
        if original is not None and "rope_parameters" in original:
            params = dict(scaling) if scaling else {"rope_type": "default"}
            params["rope_theta"] = theta
            return {"rope_parameters": params}
        return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None}


@dataclass(frozen=True)
class QwenSlidingWindow(ConfigRule):
    """Qwen2/Qwen3: ``use_sliding_window`` switches ``sliding_window`` on for the layers from
    ``max_window_layers`` on (or as ``layer_types`` lists); with it off every layer attends fully."""

    default_window: int | None = 4096
    default_max_window_layers: int = 28
    hf_keys = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    mcore_fields = ("sliding_window", "layer_types")

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        n = hf.get("num_hidden_layers")
        window = hf.get("sliding_window", self.default_window) if hf.get("use_sliding_window", False) else None
        types = hf.get("layer_types")
        if types is None:
            start = hf.get("max_window_layers", self.default_max_window_layers)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(n or 0)]
        sliding = [t == "sliding_attention" for t in types]
        if window is None or not any(sliding):
            return {"sliding_window": None, "layer_types": None}
        if all(sliding):
            return {"sliding_window": window, "layer_types": None}
        return {"sliding_window": window, "layer_types": list(types)}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        n, window, types = values["num_hidden_layers"], values["sliding_window"], values["layer_types"]
        if window is None:
            return {
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": n,
                "layer_types": ["full_attention"] * n,
            }
        types = list(types) if types is not None else ["sliding_attention"] * n
        leading_full = next((i for i, t in enumerate(types) if t != "full_attention"), n)
        return {
            "use_sliding_window": True,
            "sliding_window": window,
            "max_window_layers": leading_full,
            "layer_types": types,
        }


@dataclass(frozen=True)
class UseSlidingWindow(ConfigRule):
    """Qwen3-MoE: ``sliding_window`` applies to every layer only with ``use_sliding_window`` (no per-layer types)."""

    default_window: int | None = 4096
    hf_keys = ("use_sliding_window", "sliding_window")
    mcore_fields = ("sliding_window",)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        on = bool(hf.get("use_sliding_window", False))
        return {"sliding_window": hf.get("sliding_window", self.default_window) if on else None}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        window = values["sliding_window"]
        return {"use_sliding_window": window is not None, "sliding_window": window}


@dataclass(frozen=True)
class MustBe(ConfigRule):
    """An HF key mcore does not implement beyond one value (OLMoE's ``clip_qkv``: only ``null``): any other value
    fails the import, naming the key, instead of being carried and silently ignored."""

    key: str
    value: Any = None

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return (self.key,)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        if hf.get(self.key, self.value) != self.value:
            raise BridgeError(f"config.json {self.key}={hf[self.key]!r} is not supported (only {self.value!r})")
        return {}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        return {self.key: self.value}


@dataclass(frozen=True)
class Renamed(ConfigRule):
    """An HF key whose meaning is a ``TransformerConfig`` field of another name (Mixtral's ``num_local_experts``)."""

    key: str
    field: str
    default: Any = REQUIRED

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return (self.key,)

    @property
    def mcore_fields(self) -> tuple[str, ...]:
        return (self.field,)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        if self.key not in hf and self.default is REQUIRED:
            raise BridgeError(f"config.json has no {self.key!r}, which this family requires")
        return {self.field: hf.get(self.key, self.default)}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        return {self.key: values[self.field]}


@dataclass(frozen=True)
class ExpertCount(ConfigRule):
    """Qwen-MoE's ``num_experts`` (the Hub's spelling); transformers 5 writes it as ``num_local_experts`` and leaves
    ``num_experts: null``."""

    default: int = 60
    hf_keys = ("num_experts", "num_local_experts")
    mcore_fields = ("num_experts",)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        count = hf.get("num_experts")
        return {"num_experts": count if count is not None else hf.get("num_local_experts", self.default)}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        return {"num_experts": values["num_experts"]}


@dataclass(frozen=True)
class RouterAuxLoss(ConfigRule):
    """HF adds ``router_aux_loss_coef`` times its load-balancing loss only with ``output_router_logits``: the field
    is the coefficient in effect (0 when the flag is off)."""

    default_coef: float = 0.001
    hf_keys = ("output_router_logits", "router_aux_loss_coef")
    mcore_fields = ("router_aux_loss_coef",)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        on = bool(hf.get("output_router_logits", False))
        return {"router_aux_loss_coef": float(hf.get("router_aux_loss_coef", self.default_coef)) if on else 0.0}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        coef = values["router_aux_loss_coef"]
        return {"output_router_logits": coef > 0, "router_aux_loss_coef": coef if coef > 0 else self.default_coef}


@dataclass(frozen=True)
class SparseLayers(ConfigRule):
    """Qwen-MoE's choice of MoE layers: layer i is sparse unless it is in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0``; written as ``mlp_layer_types`` (None: every layer sparse)."""

    hf_keys = ("decoder_sparse_step", "mlp_only_layers")
    mcore_fields = ("mlp_layer_types",)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        if not isinstance(step, int) or step < 1:
            raise BridgeError(f"config.json decoder_sparse_step must be a positive int, got {step!r}")
        n = hf.get("num_hidden_layers") or 0
        types = ["dense" if i in dense or (i + 1) % step else "moe" for i in range(n)]
        return {"mlp_layer_types": None if all(t == "moe" for t in types) else types}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        types = values["mlp_layer_types"]
        dense = [] if types is None else [i for i, t in enumerate(types) if t != "moe"]
        return {"decoder_sparse_step": 1, "mlp_only_layers": dense}


# TransformerConfig fields that Hugging Face has no key for: their default on import, ignored on export.
MCORE_ONLY_FIELDS = ("make_vocab_size_divisible_by", "moe_router")


def family_rules(family: str, hf_rules: tuple[ConfigRule, ...]) -> tuple[ConfigRule, ...]:
    """``hf_rules`` (the fields a ``config.json`` states) plus one rule for every other ``TransformerConfig`` field.

    What the family *is* lives once, in ``mcore.models.families`` (its ``DEFAULTS``): each field no HF rule owns is
    :class:`Fixed` to the family's value (or to the field's default when the family does not set it), so an export
    of a model that differs fails instead of writing a config that HF would read as something else. Fields with no
    HF meaning (``MCORE_ONLY_FIELDS``) are :class:`McoreOnly`.
    """
    import dataclasses

    from mcore.models.config import TransformerConfig
    from mcore.models.families import FAMILIES

    if family not in FAMILIES:
        raise ValueError(f"family_rules: {family!r} is not a registered mcore family; known: {sorted(FAMILIES)}")
    defaults = FAMILIES[family]
    owned = {f for rule in hf_rules for f in rule.mcore_fields}
    derived: list[ConfigRule] = []
    for field in dataclasses.fields(TransformerConfig):
        if field.name in owned:
            continue
        value = defaults.get(field.name, field.default)
        if value is dataclasses.MISSING:
            raise ValueError(
                f"family_rules: {family!r} has no HF rule for the required field {field.name!r} and no default"
            )
        rule_type = McoreOnly if field.name in MCORE_ONLY_FIELDS else Fixed
        derived.append(rule_type(field.name, value))
    return (*hf_rules, *derived)
