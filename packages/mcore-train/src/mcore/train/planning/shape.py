"""What the planner needs to know about a model: its matmuls, parameters and activations per layer.

A :class:`ModelShape` is built from an ``mcore.models.TransformerConfig`` (:meth:`ModelShape.from_config`; MoE
and MLA fields are read when the config has them, under their Hugging Face names) or written out directly for
models mcore cannot build yet (Megatron's GPT-3-style benchmark models with a plain GELU MLP, DeepSeek-V3).

Every matmul of a layer is a :class:`Linear` with its tensor-parallel role: ``column`` splits the output
features over TP ranks, ``row`` the input features, ``replicated`` none (MLA's down-projections, the router).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Literal

from mcore.train.planning.mamba_terms import MambaShape

Role = Literal["column", "row", "replicated"]


@dataclass(frozen=True)
class Linear:
    """One weight matmul: ``tokens x in_features @ in_features x out_features`` for each token it sees."""

    name: str
    in_features: int
    out_features: int
    role: Role

    @property
    def weights(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as the planner sees it (unsharded sizes).

    ``gated``: a gated MLP (SwiGLU: fused gate/up of width ``2 ffn``) or a plain one (GELU, width ``ffn``).
    MoE: ``num_experts > 0`` makes every layer from ``first_dense_layers`` on a routed MLP of ``num_experts``
    experts of width ``moe_ffn``, ``top_k`` of them per token, plus always-on shared experts of total width
    ``shared_ffn``; ``moe_layers`` (per layer, True for MoE) overrides ``first_dense_layers`` when given (from
    ``mlp_layer_types``). MLA (DeepSeek): ``kv_lora_rank > 0`` replaces Q/K/V by low-rank projections.
    ``mtp_layers``: multi-token-prediction depths (``num_nextn_predict_layers``, ``mcore.models.mtp``) on the last
    stage, each three norms, ``eh_proj`` (2 hidden -> hidden, column-parallel), one layer like the last and the
    shared output layer with its loss. ``window``: sliding-window attention of that many tokens, in the layers
    ``window_layers`` marks (all when None). GPT-OSS's parameters: ``proj_bias`` (the attention output projection's
    bias), ``expert_bias`` (each expert's and the router's biases), ``sinks`` (one per head and layer).
    Hybrid (Nemotron-H): ``hybrid_pattern`` gives each layer's one block by its Megatron symbol (``M`` a Mamba-2
    mixer of shape ``mamba``, ``*`` attention, ``-`` the dense MLP), each after its own pre-norm
    (``planning/mamba_terms.py``).
    """

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated: bool = True
    tied: bool = False
    layernorm: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    first_dense_layers: int = 0
    moe_layers_pattern: tuple[bool, ...] | None = None
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    vocab_divisible_by: int = 128
    window: int = 0
    window_layers: tuple[bool, ...] | None = None
    proj_bias: bool = False
    expert_bias: bool = False
    sinks: bool = False
    hybrid_pattern: str | None = None
    mamba: MambaShape | None = None
    name: str = "model"

    def __post_init__(self) -> None:
        for field in ("hidden", "ffn", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field} must be an int >= 1, got {value!r}")
        if self.num_experts and not (1 <= self.top_k <= self.num_experts and self.moe_ffn > 0):
            raise ValueError(
                f"ModelShape with num_experts={self.num_experts} needs 1 <= top_k <= num_experts and moe_ffn > 0, "
                f"got top_k={self.top_k}, moe_ffn={self.moe_ffn}"
            )
        if self.hybrid_pattern is not None:
            bad = sorted(set(self.hybrid_pattern) - set(HYBRID_BLOCKS))
            if len(self.hybrid_pattern) != self.layers or bad or self.is_moe:
                raise ValueError(
                    f"ModelShape.hybrid_pattern {self.hybrid_pattern!r} must have one of {HYBRID_BLOCKS} per layer "
                    f"({self.layers} layers; MoE blocks are not modelled), got unknown {bad}"
                )
            if "M" in self.hybrid_pattern and self.mamba is None:
                raise ValueError("ModelShape.hybrid_pattern has Mamba-2 layers ('M'): set ModelShape.mamba")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config, name: str = "model") -> ModelShape:
        """From an ``mcore.models.TransformerConfig`` (or anything with its field names)."""
        g = lambda key, default=0: getattr(config, key, default) or default  # noqa: E731
        experts = g("num_experts") or g("n_routed_experts") or g("num_local_experts")
        return cls(
            hidden=config.hidden_size,
            ffn=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=g("qk_nope_head_dim") or config.head_dim or config.hidden_size // config.num_attention_heads,
            vocab=config.vocab_size,
            gated="relu2" not in (getattr(config, "mlp_layer_types", None) or ()),  # Nemotron-H's squared ReLU
            tied=bool(config.tie_word_embeddings),
            layernorm=getattr(config, "normalization", "rmsnorm") == "layernorm",
            qk_norm=bool(g("qk_norm", False)),
            attention_bias=bool(g("attention_bias", False)),
            num_experts=experts,
            top_k=g("num_experts_per_tok") or g("moe_router_topk"),
            moe_ffn=g("moe_intermediate_size") or (config.intermediate_size if experts else 0),
            shared_ffn=g("shared_expert_intermediate_size")
            or g("n_shared_experts") * (g("moe_intermediate_size") or config.intermediate_size),
            first_dense_layers=g("first_k_dense_replace"),
            moe_layers_pattern=_moe_pattern(config) if experts else None,
            q_lora_rank=g("q_lora_rank"),
            kv_lora_rank=g("kv_lora_rank"),
            qk_rope_head_dim=g("qk_rope_head_dim"),
            v_head_dim=g("v_head_dim"),
            mtp_layers=g("num_nextn_predict_layers"),
            vocab_divisible_by=g("make_vocab_size_divisible_by", 128),
            name=name,
            **_hybrid_fields(config),
        )

    # ------------------------------------------------------------------------------------------------ sizes
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_width(self) -> int:
        """Width of one token's attention output (what the score and value matmuls scale with)."""
        return self.heads * (self.v_head_dim if self.is_mla else self.head_dim)

    def score_width(self) -> int:
        """Width of one token's queries (QK^T scales with it)."""
        return self.heads * (self.head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim)

    def is_moe_layer(self, index: int) -> bool:
        if self.moe_layers_pattern is not None:
            return self.moe_layers_pattern[index]
        return self.is_moe and index >= self.first_dense_layers

    def layer_kinds(self, start: int, end: int) -> dict[int, int]:
        """Layers ``start..end-1`` grouped by kind: {index of the kind's first layer in the model: count}. Layers
        of one kind have the same parameters, activations and times, so the planner computes one per kind."""
        first = self._first_of_kind
        out: dict[int, int] = {}
        for i in range(start, end):
            key = first[self._kind(i)]
            out[key] = out.get(key, 0) + 1
        return out

    def is_window_layer(self, index: int) -> bool:
        return self.window > 0 and (self.window_layers is None or self.window_layers[index])

    def block(self, index: int) -> str:
        """Layer ``index``'s hybrid symbol (``M``, ``*``, ``-``), or ``T`` for a transformer layer."""
        return "T" if self.hybrid_pattern is None else self.hybrid_pattern[index]

    def has_attention(self, index: int) -> bool:
        return self.block(index) in ("T", "*")

    @property
    def attention_layers(self) -> int:
        return sum(self.has_attention(i) for i in range(self.layers))

    def _kind(self, index: int) -> tuple[bool, bool, str]:
        return self.is_moe_layer(index), self.is_window_layer(index), self.block(index)

    @cached_property
    def _first_of_kind(self) -> dict[tuple[bool, bool, str], int]:
        first: dict[tuple[bool, bool, str], int] = {}
        for i in range(self.layers):
            first.setdefault(self._kind(i), i)
        return first

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def padded_vocab(self, tp: int) -> int:
        step = self.vocab_divisible_by * tp
        return -(-self.vocab // step) * step

    # ------------------------------------------------------------------------------------------- matmuls
    def attention_linears(self) -> list[Linear]:
        h = self.hidden
        if not self.is_mla:
            return [
                Linear("qkv", h, self.q_size + 2 * self.kv_size, "column"),
                Linear("proj", self.q_size, h, "row"),
            ]
        qk_head = self.head_dim + self.qk_rope_head_dim  # head_dim is the no-rope part under MLA
        out = []
        if self.q_lora_rank:
            out += [
                Linear("q_down", h, self.q_lora_rank, "replicated"),
                Linear("q_up", self.q_lora_rank, self.heads * qk_head, "column"),
            ]
        else:
            out.append(Linear("q", h, self.heads * qk_head, "column"))
        out += [
            Linear("kv_down", h, self.kv_lora_rank + self.qk_rope_head_dim, "replicated"),
            Linear("kv_up", self.kv_lora_rank, self.heads * (self.head_dim + self.v_head_dim), "column"),
            Linear("proj", self.heads * self.v_head_dim, h, "row"),
        ]
        return out

    def dense_mlp_linears(self, width: int | None = None) -> list[Linear]:
        f = self.ffn if width is None else width
        return [
            Linear("fc1", self.hidden, (2 if self.gated else 1) * f, "column"),
            Linear("fc2", f, self.hidden, "row"),
        ]

    def expert_linears(self) -> list[Linear]:
        """One routed expert's matmuls (each token runs ``top_k`` of them)."""
        return self.dense_mlp_linears(self.moe_ffn)

    def mamba_linears(self) -> list[Linear]:
        m = self.mamba
        return [Linear("in_proj", self.hidden, m.in_width, "column"), Linear("out_proj", m.d_inner, self.hidden, "row")]

    def layer_linears(self, index: int) -> list[Linear]:
        """The matmuls every token runs once in layer ``index`` (routed experts apart, see expert_linears)."""
        block = self.block(index)
        if block != "T":
            return {"M": self.mamba_linears, "*": self.attention_linears, "-": self.dense_mlp_linears}[block]()
        out = self.attention_linears()
        if self.is_moe_layer(index):
            out.append(Linear("router", self.hidden, self.num_experts, "replicated"))
            if self.shared_ffn:
                out += self.dense_mlp_linears(self.shared_ffn)
        else:
            out += self.dense_mlp_linears()
        return out

    def norm_params(self) -> int:
        return self.hidden * (2 if self.layernorm else 1)

    # ------------------------------------------------------------------------------------------- counts
    def layer_norm_and_bias_params(self, index: int, tp: int = 1) -> float:
        """Non-matmul parameters of layer ``index`` on one TP rank: the two norms (replicated), q/k norms
        (replicated) and the Q/K/V bias (split like the projection); a hybrid layer: its one norm and its block's
        own (a Mamba-2 mixer's conv, per-head and norm parameters, split over TP like its heads)."""
        block = self.block(index)
        if block in ("M", "-"):
            return self.norm_params() + (self.mamba.own_parameters(tp) if block == "M" else 0.0)
        n = (1 if block == "*" else 2) * self.norm_params()
        if self.is_mla:  # the norms of MLA's compressed query and KV
            n += (self.q_lora_rank + self.kv_lora_rank) * (2 if self.layernorm else 1)
        if self.qk_norm:
            n += 2 * self.head_dim * (2 if self.layernorm else 1)
        if self.attention_bias:
            n += (self.q_size + 2 * self.kv_size) / tp
        if self.proj_bias:
            n += self.hidden  # the row-parallel projection's bias is replicated
        if self.sinks:
            n += self.heads / tp
        return n

    def layer_parameters(self, index: int) -> int:
        n = sum(lin.weights for lin in self.layer_linears(index)) + int(self.layer_norm_and_bias_params(index))
        if self.is_moe_layer(index):
            n += self.num_experts * sum(lin.weights for lin in self.expert_linears())
            if self.expert_bias:  # each expert's linears' biases and the router's
                n += self.num_experts * (sum(lin.out_features for lin in self.expert_linears()) + 1)
        return n

    def mtp_eh_proj(self) -> Linear:
        return Linear("eh_proj", 2 * self.hidden, self.hidden, "column")

    def mtp_parameters(self) -> int:
        """The MTP depths' own parameters (the embedding and output layer are shared)."""
        per_depth = self.layer_parameters(self.layers - 1) + 3 * self.norm_params() + self.mtp_eh_proj().weights
        return self.mtp_layers * per_depth

    def total_parameters(self) -> int:
        n = sum(self.layer_parameters(i) for i in range(self.layers)) + self.vocab * self.hidden + self.norm_params()
        n += self.mtp_parameters()
        return n if self.tied else n + self.vocab * self.hidden

    def active_matmul_weights(self) -> int:
        """Matmul weights one token multiplies (experts: only its top_k), the output layer included."""
        n = self.vocab * self.hidden
        for i in range(self.layers):
            n += sum(lin.weights for lin in self.layer_linears(i))
            if self.is_moe_layer(i):
                n += self.top_k * sum(lin.weights for lin in self.expert_linears())
        return n

    def layer_flops_per_token(self, index: int, seq_length: int) -> float:
        """Training model FLOPs per token of layer ``index`` (active experts only)."""
        n = sum(lin.weights for lin in self.layer_linears(index))
        if self.is_moe_layer(index):
            n += self.top_k * sum(lin.weights for lin in self.expert_linears())
        return 6.0 * n + self._sequence_flops(index, seq_length)

    def _sequence_flops(self, index: int, seq_length: int) -> float:
        """Attention's (full, not causal) or the Mamba-2 scan's training FLOPs per token (``mcore.models``)."""
        if self.block(index) == "M":
            return 3 * self.mamba.ssd_forward_flops(seq_length)
        return 6 * (self.score_width() + self.attention_width) * seq_length if self.has_attention(index) else 0.0

    @lru_cache(maxsize=256)  # noqa: B019 (shapes are frozen and few; the search asks for each layout)
    def model_flops_per_token(self, seq_length: int) -> float:
        """Training model FLOPs per token: ``6 x active matmul weights + 12 x layers x q width x seq`` (the
        ``mcore.models.model_flops_per_token`` / Megatron convention: full, not causal, attention), and per MTP
        depth its ``eh_proj``, a layer like the last and the output layer again."""
        attention = sum(self._sequence_flops(i, seq_length) for i in range(self.layers))
        mtp = 6.0 * (self.mtp_eh_proj().weights + self.vocab * self.hidden)
        mtp += self.layer_flops_per_token(self.layers - 1, seq_length)
        return 6.0 * self.active_matmul_weights() + attention + self.mtp_layers * mtp


HYBRID_BLOCKS = ("M", "*", "-")


def _hybrid_fields(config) -> dict:
    """A Nemotron-H-style config's per-layer blocks and Mamba-2 sizes; {} for a transformer."""
    types = tuple(getattr(config, "layer_types", None) or ())
    if "mamba2" not in types and "none" not in types:
        return {}
    from mcore.models.families.nemotron_h import parts_pattern

    pattern = parts_pattern(types, config.mlp_layer_types)
    mamba = None
    if "M" in pattern:
        mamba = MambaShape(
            heads=config.mamba_num_heads, head_dim=config.mamba_head_dim, groups=config.n_groups,
            state=config.ssm_state_size, conv=config.conv_kernel, chunk=config.chunk_size,
        )  # fmt: skip
    return {"hybrid_pattern": pattern, "mamba": mamba}


def _moe_pattern(config) -> tuple[bool, ...]:
    """Which layers of an MoE config are MoE: ``mlp_layer_types`` when set, else from ``first_k_dense_replace``."""
    types = getattr(config, "mlp_layer_types", None)
    if types is not None:
        return tuple(t == "moe" for t in types)
    first = getattr(config, "first_k_dense_replace", 0) or 0
    return tuple(i >= first for i in range(config.num_hidden_layers))
