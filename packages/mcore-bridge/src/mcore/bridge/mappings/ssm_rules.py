"""Config rules of the state-space families (Mamba-2, Nemotron-H): HF keys whose name differs from ours, one HF
key that sets several of our fields, Mamba-2's ``expand``, and per-layer patterns derived from HF's layer list."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings.config_rules import REQUIRED, ConfigRule


def _get(hf: dict[str, Any], key: str, default: Any) -> Any:
    if key in hf:
        return hf[key]
    if default is REQUIRED:
        raise BridgeError(f"config.json has no {key!r}, which this family requires")
    return default


@dataclass(frozen=True)
class Alias(ConfigRule):
    """One HF key setting one or more of our fields to its value (e.g. Mamba2's ``num_heads`` is both the mixer's
    head count and the head-count fields an attention-free model mirrors). Export needs them all equal."""

    key: str
    fields: tuple[str, ...]
    default: Any = REQUIRED

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return (self.key,)

    @property
    def mcore_fields(self) -> tuple[str, ...]:
        return self.fields

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        value = _get(hf, self.key, self.default)
        return dict.fromkeys(self.fields, value)

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        got = {f: values[f] for f in self.fields}
        if len({repr(v) for v in got.values()}) != 1:
            raise BridgeError(f"HF {self.key!r} sets {list(self.fields)} together, but the model has {got}")
        return {self.key: got[self.fields[0]]}


@dataclass(frozen=True)
class Expand(ConfigRule):
    """Mamba2's ``expand``: the mixer's inner width is ``expand * hidden_size`` (our ``intermediate_size``)."""

    default: float = 2

    hf_keys = ("expand",)
    mcore_fields = ("intermediate_size",)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"intermediate_size": int(_get(hf, "expand", self.default) * hf["hidden_size"])}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        inner, hidden = values["intermediate_size"], values["hidden_size"]
        return {"expand": inner // hidden if inner % hidden == 0 else inner / hidden}


@dataclass(frozen=True)
class LayerPattern(ConfigRule):
    """Our ``layer_types`` / ``mlp_layer_types`` from HF's list of layers.

    ``parts(hf) -> [(mixer, mlp) per layer]`` reads the HF config (Mamba2: every layer a mamba2 mixer and no MLP);
    ``render(pairs) -> {hf keys}`` writes it back and raises ``BridgeError`` for a pattern HF cannot state.
    """

    keys: tuple[str, ...]
    parts: Callable[[dict[str, Any]], list[tuple[str, str]]]
    render: Callable[[list[tuple[str, str]]], dict[str, Any]]

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return self.keys

    mcore_fields = ("layer_types", "mlp_layer_types")

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        pairs = self.parts(hf)
        return {"layer_types": [m for m, _ in pairs], "mlp_layer_types": [f for _, f in pairs]}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        n = values["num_hidden_layers"]
        mixers = values["layer_types"] or ["full_attention"] * n
        mlps = values["mlp_layer_types"] or ["dense"] * n
        return self.render(list(zip(mixers, mlps, strict=True)))


def _decode_float(value: Any) -> float:
    """transformers 5 writes non-finite floats as ``{"__float__": "Infinity"}``; older files as JSON ``Infinity``."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BridgeError(f"config.json 'time_step_limit' entries must be numbers, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TimeStepLimit(ConfigRule):
    """``time_step_limit`` ``[low, high]`` (dt's clamp), whichever way the file spells infinity."""

    key: str = "time_step_limit"

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return (self.key,)

    mcore_fields = ("time_step_limit",)

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        limit = hf.get(self.key, [0.0, float("inf")])
        if not isinstance(limit, list | tuple) or len(limit) != 2:
            raise BridgeError(f"config.json {self.key!r} must be [low, high], got {limit!r}")
        return {"time_step_limit": [_decode_float(v) for v in limit]}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        return {self.key: [float(v) for v in values["time_step_limit"]]}


@dataclass(frozen=True)
class MambaInnerWidth(ConfigRule):
    """Falcon-H1's ``mamba_d_ssm`` (or ``mamba_expand * hidden_size`` when it is null): the Mamba inner width, which
    must equal heads x head_dim. It sets no field of ours (the width is derived); import checks it, export writes it."""

    heads_key: str = "mamba_n_heads"
    head_dim_key: str = "mamba_d_head"
    hf_keys = ("mamba_d_ssm", "mamba_expand")
    mcore_fields = ()

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        width = hf.get("mamba_d_ssm")
        if width is None:
            width = int(hf.get("mamba_expand", 2) * hf["hidden_size"])
        heads, head_dim = hf.get(self.heads_key), hf.get(self.head_dim_key)
        if heads is not None and head_dim is not None and width != heads * head_dim:
            raise BridgeError(
                f"config.json: mamba_d_ssm {width} != {self.heads_key} {heads} x {self.head_dim_key} {head_dim}"
            )
        return {}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        return {"mamba_d_ssm": values["mamba_num_heads"] * values["mamba_head_dim"]}


# NemotronHConfig's MoE keys -> our fields (the routing knobs go into moe_router)
_NEMOTRON_MOE_FIELDS = {
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
}
_NEMOTRON_ROUTER_KEYS = ("n_group", "topk_group", "routed_scaling_factor")
# transformers' NemotronHConfig defaults
_NEMOTRON_MOE_DEFAULTS = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}


@dataclass(frozen=True)
class NemotronMoE(ConfigRule):
    """Nemotron-H's MoE keys, read only when the pattern has MoE layers (``has_moe(hf)``); a model without them has
    no experts whatever the file's (default) MoE keys say. The router is always sigmoid with the score-correction
    bias (``router``: the family's fixed knobs); ``n_group`` / ``topk_group`` / ``routed_scaling_factor`` join it.
    ``moe_latent_size`` (Nemotron-3 Super's latent expert projections) is refused."""

    has_moe: Callable[[dict[str, Any]], bool]
    router: tuple[tuple[str, Any], ...]

    hf_keys = (*_NEMOTRON_MOE_FIELDS, *_NEMOTRON_ROUTER_KEYS, "moe_latent_size")
    mcore_fields = (*_NEMOTRON_MOE_FIELDS.values(), "moe_router")

    def to_mcore(self, hf: dict[str, Any]) -> dict[str, Any]:
        if not self.has_moe(hf):
            return {"num_experts": None, "num_experts_per_tok": 2, "moe_intermediate_size": None,
                    "shared_expert_intermediate_size": None, "norm_topk_prob": False, "moe_router": None}  # fmt: skip
        if hf.get("moe_latent_size") is not None:
            raise BridgeError(
                f"config.json moe_latent_size={hf['moe_latent_size']} (latent expert projections, Nemotron-3 Super) "
                "is not supported; only models whose experts see the hidden size convert"
            )
        out = {ours: hf.get(key, _NEMOTRON_MOE_DEFAULTS[key]) for key, ours in _NEMOTRON_MOE_FIELDS.items()}
        knobs = {key: hf.get(key, _NEMOTRON_MOE_DEFAULTS[key]) for key in _NEMOTRON_ROUTER_KEYS}
        return {**out, "moe_router": {**dict(self.router), **knobs}}

    def to_hf(self, values: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
        if values["num_experts"] is None:
            return {}
        router = dict(values["moe_router"] or {})
        fixed = {k: router.get(k) for k, _ in self.router}
        if fixed != dict(self.router):
            raise BridgeError(f"Nemotron-H's router is {dict(self.router)}; the model's moe_router has {fixed}")
        out = {key: values[ours] for key, ours in _NEMOTRON_MOE_FIELDS.items()}
        out.update({key: router.get(key, _NEMOTRON_MOE_DEFAULTS[key]) for key in _NEMOTRON_ROUTER_KEYS})
        return out
