"""The typed, validated configuration of a GPT-family decoder.

Field names follow Hugging Face ``config.json`` wherever it has one, so that a user can read both side by
side and the bridge stays a thin renaming. Fields that describe what a family *is* (norm type, activation,
bias flags, qk-norm) are ordinary data here; ``mcore.models.families`` fills them per family.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from mcore.models.parts.registry import MIXERS, MLPS

NORMALIZATIONS = ("rmsnorm", "layernorm")
# HF ``hidden_act`` names of the gated MLP activations the kernels provide (silu -> swiglu, gelu -> geglu).
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "relu2")
# rope_scaling["rope_type"] -> the keys that type needs (as in HF ``config.json``).
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"TransformerConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"TransformerConfig.{name} must be >= 1, got {value}")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"TransformerConfig.{name} must be a number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"TransformerConfig.{name} must be a finite number > 0, got {value}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"TransformerConfig.{name} must be a bool, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class TransformerConfig:
    """Shape and behaviour of a decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral and kin).

    ``num_key_value_heads=None`` means multi-head attention (as many KV heads as query heads);
    ``head_dim=None`` means ``hidden_size // num_attention_heads``. ``layer_types`` (HF name) picks, per
    layer, the token mixer registered under that name (``"full_attention"``, ``"sliding_attention"``, ...: see
    ``mcore.models.parts``); when it is ``None`` every layer uses full attention, or ``sliding_window`` if that is
    set. ``mlp_layer_types`` picks each layer's MLP the same way (``None``: ``"dense"`` everywhere).
    ``attention_bias`` adds biases to the Q/K/V projection (Qwen2),
    ``attention_out_bias`` to the output projection (HF Llama's ``attention_bias=True`` sets both).
    ``make_vocab_size_divisible_by`` (Megatron's name) pads the vocabulary to a multiple of it times tp.
    GPT-OSS: ``attention_sinks`` adds a learned logit per head to the softmax denominator (trained).
    ``router_bias`` adds a bias to the MoE router's logits. ``expert_biases`` adds biases to every expert's two
    projections. ``swiglu_alpha`` is the clamped SwiGLU's sigmoid slope (1.702; None: plain SwiGLU).
    ``swiglu_limit`` clamps gate and up to it (7.0; None: no clamp).
    The config is frozen: derive variants with ``dataclasses.replace``, which validates again.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"  # "head": one norm per head (Qwen3); "projection": over all of q / k (OLMoE)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    normalization: str = "rmsnorm"
    initializer_range: float = 0.02
    make_vocab_size_divisible_by: int = 128
    model_type: str = "llama"
    # Mixture of experts (HF names; ``num_experts=None``: a dense model). Layers whose ``mlp_layer_types`` entry is
    # "moe" (every layer when that is None and num_experts is set) use them; see mcore.models.layers.moe.
    num_experts: int | None = None
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # None: intermediate_size (Mixtral)
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's shared expert
    shared_expert_gate: bool = False  # its sigmoid gate
    router_aux_loss_coef: float = 0.0
    moe_router: dict[str, Any] | None = None  # training knobs: mcore.models.moe_fields.ROUTER_KNOBS
    # DeepSeek-V2/V3 (HF DeepseekV3Config names; rules in mcore.models.mla_fields). ``kv_lora_rank`` set: every layer's
    # default mixer is multi-head latent attention ("mla"), and ``head_dim`` is the rotary width (as in HF).
    q_lora_rank: int | None = None  # None: a full-rank query projection (V2-Lite, Moonlight)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = False  # rotary dims stored as (x0, x1) pairs, not halves (HF's flag; V2 always)
    first_k_dense_replace: int = 0  # MoE models: the first k layers have the dense MLP
    num_nextn_predict_layers: int = 0  # multi-token-prediction modules after the last layer (mcore.models.mtp)
    # Mamba-2 mixer (``mamba2`` layers only; NemotronH's config.json names): validated when a layer uses it.
    mamba_num_heads: int | None = None
    mamba_head_dim: int | None = None
    ssm_state_size: int | None = None
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_before_gate: bool = False
    time_step_limit: tuple[float, ...] = (0.0, float("inf"))
    mamba_rms_norm: bool = True
    projectors_bias: bool = False
    # Falcon-H1's muP multipliers (HF names; 1.0 everywhere else): ssm_multipliers scale the in_proj blocks
    # [z, x, B, C, dt], mlp_multipliers the MLP's gate and down outputs.
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_multipliers: tuple[float, ...] = (1.0, 1.0)
    # GPT-OSS (validated in mcore.models.gpt_oss_fields): learned per-head attention sinks, a router bias, biases on
    # every expert's two projections, and the experts' clamped SwiGLU (HF's swiglu_alpha / swiglu_limit; both None:
    # plain SwiGLU).
    attention_sinks: bool = False
    router_bias: bool = False
    expert_biases: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            _positive_int(name, getattr(self, name))
        _positive_int("max_position_embeddings", self.max_position_embeddings)
        _positive_int("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            _positive_float(name, getattr(self, name))
        for name in ("tie_word_embeddings", "attention_bias", "attention_out_bias", "mlp_bias", "qk_norm"):
            _bool(name, getattr(self, name))
        if not isinstance(self.model_type, str) or not self.model_type:
            raise TypeError(f"TransformerConfig.model_type must be a non-empty str, got {self.model_type!r}")
        from mcore.models.mla_fields import check_mla_fields

        check_mla_fields(self)  # before _check_heads: MLA's head_dim defaults to the rotary width
        self._check_heads()
        self._check_rope_scaling()
        self._check_attention_pattern()
        self._check_mamba()
        if self.hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(
                f"TransformerConfig.hidden_act must be one of {GATED_ACTIVATIONS} (gated MLP), got {self.hidden_act!r}"
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"TransformerConfig.normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}"
            )
        if self.qk_norm_scope not in ("head", "projection"):
            raise ValueError(
                f"TransformerConfig.qk_norm_scope must be 'head' or 'projection', got {self.qk_norm_scope!r}"
            )
        if self.qk_norm_scope == "projection" and self.normalization != "rmsnorm":
            raise ValueError(
                "TransformerConfig.qk_norm_scope='projection' is an RMSNorm (OLMoE); set normalization=rmsnorm"
            )
        from mcore.models.gpt_oss_fields import check_gpt_oss_fields

        check_gpt_oss_fields(self)
        if self.num_experts is not None:
            from mcore.models.moe_fields import check_moe_fields

            check_moe_fields(self)
        elif self.mlp_layer_types is not None and "moe" in self.mlp_layer_types:
            raise ValueError(
                "TransformerConfig.mlp_layer_types has 'moe' layers but num_experts is None; set num_experts"
            )

    def _check_heads(self) -> None:
        heads = self.num_attention_heads
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", heads)
        _positive_int("num_key_value_heads", self.num_key_value_heads)
        kv = self.num_key_value_heads
        if heads % kv != 0:
            raise ValueError(
                f"TransformerConfig: num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv}); "
                f"valid num_key_value_heads for {heads} heads: {_divisors(heads)}"
            )
        if self.head_dim is None:
            if self.hidden_size % heads != 0:
                raise ValueError(
                    f"TransformerConfig: hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({heads}); set head_dim explicitly (e.g. head_dim={self.hidden_size // heads}) or pick a "
                    f"head count from {_divisors(self.hidden_size)}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // heads)
        _positive_int("head_dim", self.head_dim)
        if self.head_dim % 2 != 0:
            raise ValueError(f"TransformerConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")

    def _check_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise TypeError(f"TransformerConfig.rope_scaling must be a dict or None, got {type(scaling).__name__}")
        # Older HF configs spell the key "type"; normalise so that the kernels see one spelling.
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type not in ROPE_SCALING_KEYS:
            raise ValueError(
                f"TransformerConfig.rope_scaling['rope_type'] must be one of {sorted(ROPE_SCALING_KEYS)}, "
                f"got {rope_type!r}"
            )
        missing = [k for k in ROPE_SCALING_KEYS[rope_type] if k not in scaling]
        if missing:
            raise ValueError(
                f"TransformerConfig.rope_scaling of rope_type {rope_type!r} needs the keys {missing}; got {scaling}"
            )
        if "factor" in scaling:
            _positive_float("rope_scaling['factor']", scaling["factor"])
        normalised = {k: v for k, v in scaling.items() if k != "type"}
        normalised["rope_type"] = rope_type
        object.__setattr__(self, "rope_scaling", normalised)

    def _check_attention_pattern(self) -> None:
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        object.__setattr__(self, "layer_types", self._check_per_layer("layer_types", self.layer_types, MIXERS))
        mlp_types = self._check_per_layer("mlp_layer_types", self.mlp_layer_types, MLPS)
        object.__setattr__(self, "mlp_layer_types", mlp_types)
        if self.layer_types is not None and "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError(
                "TransformerConfig.layer_types has 'sliding_attention' layers but sliding_window is None; "
                "set sliding_window"
            )

    def _check_multipliers(self) -> None:
        for name, length in (("time_step_limit", 2), ("ssm_multipliers", 5), ("mlp_multipliers", 2)):
            value = getattr(self, name)
            if not isinstance(value, list | tuple) or len(value) != length:
                raise ValueError(f"TransformerConfig.{name} must be a list of {length} numbers, got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        for name in ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
                     "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier"):  # fmt: skip
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int | float):
                raise TypeError(f"TransformerConfig.{name} must be a number, got {getattr(self, name)!r}")

    def _check_mamba(self) -> None:
        self._check_multipliers()
        if not {"mamba2", "falcon_h1_parallel"} & set(self.layer_types or ()):
            return
        for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size"):
            if getattr(self, name) is None:
                raise ValueError(f"TransformerConfig.{name} must be set: layer_types has Mamba-2 layers")
        for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size"):
            _positive_int(name, getattr(self, name))
        for name in ("use_conv_bias", "mamba_proj_bias", "mamba_norm_before_gate", "mamba_rms_norm", "projectors_bias"):
            _bool(name, getattr(self, name))
        if self.mamba_num_heads % self.n_groups != 0:
            raise ValueError(
                f"TransformerConfig: n_groups ({self.n_groups}) must divide mamba_num_heads ({self.mamba_num_heads}); "
                f"valid n_groups: {_divisors(self.mamba_num_heads)}"
            )
        limit = self.time_step_limit
        if not (isinstance(limit, tuple) and len(limit) == 2 and 0.0 <= float(limit[0]) < float(limit[1])):
            raise ValueError(
                f"TransformerConfig.time_step_limit must be (low, high) with 0 <= low < high, got {limit!r}"
            )

    @property
    def mamba_d_inner(self) -> int:
        """Width of a Mamba-2 mixer's inner stream (heads x head_dim; HF Mamba2's ``expand * hidden_size``)."""
        return self.mamba_num_heads * self.mamba_head_dim

    def _check_per_layer(self, name: str, value: Any, registry: Any) -> tuple[str, ...] | None:
        if value is None:
            return None
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise TypeError(
                f"TransformerConfig.{name} must be a list of {registry.names()} (one per layer) or None, got {value!r}"
            )
        if len(value) != self.num_hidden_layers:
            raise ValueError(
                f"TransformerConfig.{name} has {len(value)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; give one entry per layer"
            )
        bad = sorted({t for t in value if t not in registry}, key=str)
        if bad:
            raise ValueError(
                f"TransformerConfig.{name} entries must be registered {registry.slot} parts "
                f"{registry.names()}, got {bad}"
            )
        return tuple(value)

    # --- derived quantities -------------------------------------------------------------------------

    @property
    def query_heads_per_kv_head(self) -> int:
        """Query heads sharing one KV head (1 for multi-head attention; Megatron's ``num_query_groups`` is the
        number of KV heads, which here is ``num_key_value_heads``)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        """Width of all query heads together (may differ from ``hidden_size`` when ``head_dim`` is set)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key heads together (and of all value heads)."""
        return self.num_key_value_heads * self.head_dim

    def _check_layer_index(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.num_hidden_layers:
            raise ValueError(f"layer_index must be in [0, {self.num_hidden_layers}), got {layer_index}")

    def mixer_type(self, layer_index: int) -> str:
        """The registered token mixer of layer ``layer_index`` (global index)."""
        self._check_layer_index(layer_index)
        if self.layer_types is not None:
            return self.layer_types[layer_index]
        if self.kv_lora_rank is not None:
            return "mla"
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def mlp_type(self, layer_index: int) -> str:
        """The registered MLP of layer ``layer_index`` (global index)."""
        self._check_layer_index(layer_index)
        if self.mlp_layer_types is None:
            return "dense" if self.num_experts is None or layer_index < self.first_k_dense_replace else "moe"
        return self.mlp_layer_types[layer_index]

    def window_for_layer(self, layer_index: int) -> int | None:
        """The sliding window of layer ``layer_index`` (global index), or ``None`` for full attention."""
        return self.sliding_window if self.mixer_type(layer_index) == "sliding_attention" else None

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp`` (every TP shard equal)."""
        _positive_int("tp", tp)
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ``ValueError`` unless every part of this model splits over ``tp`` tensor-parallel ranks.

        Each part states its own rule (attention keeps whole query groups per rank, the dense MLP splits its
        hidden width); the message adds the tp values that every part of this model accepts.
        """
        _positive_int("tp", tp)
        try:
            self._check_parts_tensor_parallel(tp)
        except ValueError as exc:
            raise ValueError(f"{exc}; valid tp for this model: {self.valid_tensor_parallel_sizes()}") from None

    def valid_tensor_parallel_sizes(self, limit: int = 512) -> list[int]:
        """The tensor-parallel sizes up to ``limit`` that every part of this model accepts."""
        ok = []
        for tp in range(1, limit + 1):
            try:
                self._check_parts_tensor_parallel(tp)
            except ValueError:
                continue
            ok.append(tp)
        return ok

    def _check_parts_tensor_parallel(self, tp: int) -> None:
        for registry, name in sorted(self._parts_used()):
            (MIXERS if registry == "mixer" else MLPS).get(name).check_tensor_parallel(self, tp)

    def _parts_used(self) -> set[tuple[str, str]]:
        used = set()
        for i in range(self.num_hidden_layers):
            used.add(("mixer", self.mixer_type(i)))
            used.add(("mlp", self.mlp_type(i)))
        return used

    # --- serialisation --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (what checkpoints store as ``model_config``)."""
        out = dataclasses.asdict(self)
        for name in ("layer_types", "mlp_layer_types"):
            if out[name] is not None:
                out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Inverse of ``to_dict``; unknown keys raise ``ValueError`` naming them (typos never pass silently)."""
        if not isinstance(data, dict):
            raise TypeError(f"TransformerConfig.from_dict expects a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TransformerConfig: unknown fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)
