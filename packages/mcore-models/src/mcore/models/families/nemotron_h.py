"""Nemotron-H (``NemotronHForCausalLM``): a hybrid whose every layer is one block, ``x + mixer(norm(x))``, the
mixer being a Mamba-2 mixer, an attention without positional encoding, a squared-ReLU MLP or a mixture of
squared-ReLU experts.

Each HF layer maps to one of our layers with the other slot ``"none"``: Mamba ``M`` -> (``mamba2``, none),
attention ``*`` -> (``nope_attention``, none), MLP ``-`` -> (none, ``relu2``), MoE ``E`` -> (none, ``moe_relu2``:
non-gated squared-ReLU experts behind a sigmoid, group-limited router with a score-correction bias, plus a shared
expert). The pattern is stated either as HF's ``layers_block_type`` list or as Megatron's ``hybrid_override_pattern``
string (``M``, ``*``, ``-``, ``E``); :func:`pattern_parts` reads both.
"""

from __future__ import annotations

from typing import Any

FAMILY = "nemotron_h"
HF_ARCHITECTURE = "NemotronHForCausalLM"

# Megatron's pattern symbol -> (mixer, MLP); HF's block-type names (current and legacy) -> the symbol.
SYMBOL_PARTS = {
    "M": ("mamba2", "none"),
    "*": ("nope_attention", "none"),
    "-": ("none", "relu2"),
    "E": ("none", "moe_relu2"),
}
HF_BLOCK_SYMBOLS = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}
SYMBOL_HF_BLOCK = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def pattern_parts(pattern: str | list[str] | tuple[str, ...]) -> dict[str, list[str]]:
    """``layer_types`` / ``mlp_layer_types`` / ``num_hidden_layers`` of a Megatron pattern string (``"M-M*-"``) or
    an HF ``layers_block_type`` list; ``ValueError`` names a symbol it does not know."""
    symbols = list(pattern) if isinstance(pattern, str) else [HF_BLOCK_SYMBOLS.get(t, f"?{t}") for t in pattern]
    bad = sorted({s for s in symbols if s not in SYMBOL_PARTS})
    if bad:
        raise ValueError(
            f"Nemotron-H pattern {pattern!r} has unknown entries {bad}; use the symbols {sorted(SYMBOL_PARTS)} or "
            f"the block types {sorted(HF_BLOCK_SYMBOLS)}"
        )
    parts = [SYMBOL_PARTS[s] for s in symbols]
    return {
        "num_hidden_layers": len(parts),
        "layer_types": [m for m, _ in parts],
        "mlp_layer_types": [f for _, f in parts],
    }


def parts_pattern(layer_types, mlp_layer_types) -> str:
    """The Megatron pattern string of per-layer parts (inverse of :func:`pattern_parts`)."""
    inverse = {parts: symbol for symbol, parts in SYMBOL_PARTS.items()}
    pairs = list(zip(layer_types, mlp_layer_types, strict=True))
    bad = sorted({p for p in pairs if p not in inverse})
    if bad:
        raise ValueError(f"Nemotron-H layers are one of {sorted(inverse)} (mixer, MLP); got {bad}")
    return "".join(inverse[p] for p in pairs)


# Nemotron-H's MoE routing (NemotronHTopkRouter): sigmoid scores, the score-correction bias added for the choice
# only (our expert_bias), group-limited top-k; n_group / topk_group / routed_scaling_factor come from each config.
MOE_ROUTER = {"score_function": "sigmoid", "expert_bias": True}

DEFAULTS: dict[str, Any] = {
    "model_type": "nemotron_h",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "rms_norm_eps": 1e-5,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "mamba_norm_before_gate": False,
    "tie_word_embeddings": False,
}

_8B_SHAPE = {
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "vocab_size": 131072,
    "max_position_embeddings": 8192,
}

_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_47B_PATTERN = "M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---M-M*-M-M-M-M-M-"
_56B_PATTERN = (
    "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-"
    "M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
)
_WIDE = {"num_attention_heads": 64, "mamba_num_heads": 256, "ssm_state_size": 256}  # the 47B and 56B


def _sizes(hidden: int, ffn: int, **fields: Any) -> dict[str, Any]:
    """A published Nemotron-H shape: what the HF configs share (GQA 8 x 128, Mamba heads of 64, 8 groups, state
    128, vocabulary 131072, 8K positions) overridden by ``fields``."""
    base = {
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "vocab_size": 131072,
        "max_position_embeddings": 8192,
    }
    return {**base, **fields}


# The tiny presets' sizes (chunk 8 < the test sequences); the presets differ in their patterns and MoE fields.
_TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 8,
    "n_groups": 2,
    "chunk_size": 8,
    "vocab_size": 320,
    "max_position_embeddings": 256,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Every block type, an attention layer between Mamba layers.
    "nemotron_h-tiny": {
        **_TINY_SHAPE,
        **pattern_parts("M-*M"),
    },
    # MoE layers too (E): 4 experts in 2 groups, top-2 from the best group, a shared expert.
    "nemotron_h-moe-tiny": {
        **_TINY_SHAPE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80,
        "norm_topk_prob": True,
        "moe_router": {**MOE_ROUTER, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
        **pattern_parts("ME*E-"),
    },
    # nvidia/Nemotron-H-8B-Base-8K: 24 Mamba, 24 MLP and 4 attention layers.
    "nemotron-h-8b": {**_8B_SHAPE, **pattern_parts(_8B_PATTERN)},
    # The sizes below are those of the HF configs (the same values as Megatron-Bridge's Nemotron-H providers).
    # nvidia/Nemotron-H-4B-Base-8K: the 8B pattern, narrower.
    "nemotron-h-4b": _sizes(3072, 12288, mamba_num_heads=112, **pattern_parts(_8B_PATTERN)),
    # nvidia/Nemotron-H-47B-Base-8K (pruned from the 56B) and nvidia/Nemotron-H-56B-Base-8K.
    "nemotron-h-47b": _sizes(8192, 30720, **_WIDE, **pattern_parts(_47B_PATTERN)),
    "nemotron-h-56b": _sizes(8192, 32768, **_WIDE, **pattern_parts(_56B_PATTERN)),
    # nvidia/NVIDIA-Nemotron-Nano-9B-v2 and -12B-v2: Mamba heads of 80, 40 query heads, 128K positions.
    "nemotron-nano-9b-v2": _sizes(
        4480,
        15680,
        num_attention_heads=40,
        mamba_head_dim=80,
        max_position_embeddings=131072,
        **pattern_parts("M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"),
    ),  # fmt: skip
    "nemotron-nano-12b-v2": _sizes(
        5120,
        20480,
        num_attention_heads=40,
        mamba_head_dim=80,
        max_position_embeddings=131072,
        **pattern_parts("M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-"),
    ),  # fmt: skip
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: 23 MoE layers of 128 squared-ReLU experts (top-6, weights x 2.5) and a
    # shared expert, 23 Mamba and 6 attention layers (2 KV heads).
    "nemotron-3-nano-30b-a3b": _sizes(
        2688,
        1856,
        num_key_value_heads=2,
        mamba_num_heads=64,
        max_position_embeddings=262144,
        num_experts=128,
        num_experts_per_tok=6,
        moe_intermediate_size=1856,
        shared_expert_intermediate_size=3712,
        norm_topk_prob=True,
        moe_router={**MOE_ROUTER, "routed_scaling_factor": 2.5},
        **pattern_parts("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
    ),  # fmt: skip
    # The benchmark shape (../shared/bench/hf_hybrid_baseline.py nemotronh8b4l): 8B layers in the order M - M *.
    "nemotron-h-8b-4l": {**_8B_SHAPE, "max_position_embeddings": 4096, **pattern_parts("M-M*")},
}
