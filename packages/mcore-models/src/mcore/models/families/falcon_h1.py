"""Falcon-H1 (``FalconH1ForCausalLM``): every layer runs attention (RoPE) and a Mamba-2 mixer side by side on the
same normed input and adds both (the ``falcon_h1_parallel`` mixer), then a gated MLP (``falcon_h1_mlp``), with
Falcon-H1's muP multipliers on the embedding, the LM head, keys, both mixers' inputs and outputs, the in_proj
blocks and the MLP. Its Mamba-2 may run without the gated norm (``mamba_rms_norm``), normalising before the gate.
"""

from __future__ import annotations

from typing import Any

FAMILY = "falcon_h1"
HF_ARCHITECTURE = "FalconH1ForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "falcon_h1",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "rms_norm_eps": 1e-5,
    "n_groups": 1,
    "conv_kernel": 4,
    "chunk_size": 256,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "projectors_bias": False,
    "mamba_norm_before_gate": True,
    "mamba_rms_norm": False,
    "tie_word_embeddings": False,
}


def falcon_layers(n: int) -> dict[str, Any]:
    return {"num_hidden_layers": n, "layer_types": ["falcon_h1_parallel"] * n, "mlp_layer_types": ["falcon_h1_mlp"] * n}


def _published(
    *,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    mamba_heads: int,
    mamba_head_dim: int,
    groups: int,
    chunk: int,
    vocab: int,
    positions: int,
    layers: int,
    **multipliers: Any,
) -> dict[str, Any]:
    """A released Falcon-H1 size: what the 1.5B-Deep, 7B and 34B configs share (attention heads of 128, SSM state
    256, the gated RMSNorm after the gate, RoPE base 1e11, attention_in_multiplier 1) plus its own fields."""
    return {
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        "mamba_num_heads": mamba_heads,
        "mamba_head_dim": mamba_head_dim,
        "ssm_state_size": 256,
        "n_groups": groups,
        "chunk_size": chunk,
        "mamba_rms_norm": True,
        "mamba_norm_before_gate": False,
        "vocab_size": vocab,
        "max_position_embeddings": positions,
        "rope_theta": 100000000000.0,
        "attention_in_multiplier": 1.0,
        **multipliers,
        **falcon_layers(layers),
    }


PRESETS: dict[str, dict[str, Any]] = {
    # Every multiplier away from 1 so that a dropped one fails parity; chunk 8 < the test sequences.
    "falcon_h1-tiny": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 8,
        "n_groups": 2,
        "chunk_size": 8,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "rope_theta": 100000.0,
        "embedding_multiplier": 1.5,
        "lm_head_multiplier": 0.7,
        "key_multiplier": 0.9,
        "attention_in_multiplier": 1.1,
        "attention_out_multiplier": 0.8,
        "ssm_in_multiplier": 1.2,
        "ssm_out_multiplier": 0.6,
        "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.3],
        "mlp_multipliers": [1.2, 0.7],
        **falcon_layers(2),
    },
    # tiiuae/Falcon-H1-0.5B-Base (its config.json; mamba_d_ssm = 24 heads x 64).
    "falcon-h1-0.5b": {
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_num_heads": 24,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 1,
        "chunk_size": 128,
        "mamba_norm_before_gate": False,
        "vocab_size": 32784,
        "max_position_embeddings": 16384,
        "rope_theta": 100000000000.0,
        "embedding_multiplier": 5.656854249492381,
        "lm_head_multiplier": 0.0390625,
        "key_multiplier": 0.39062499999999994,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.9375,
        "ssm_in_multiplier": 1.25,
        "ssm_out_multiplier": 0.23570226039551587,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "mlp_multipliers": [0.8838834764831844, 0.5859375],
        **falcon_layers(36),
    },
    # The three below: sizes and muP multipliers from Megatron-Bridge's Falcon-H1 providers ("from config.json" of
    # tiiuae/Falcon-H1-{1.5B-Deep,7B,34B}-Instruct; NVIDIA-NeMo/Megatron-Bridge commit ec51e1a4,
    # src/megatron/bridge/models/falcon_h1/falconh1_provider.py), attention head_dim 128 from the transformers
    # FalconH1 doc's size table (d_head 128 / 64 or 128 / 128). The gated norm runs after the gate
    # (mamba_norm_before_gate false): the 7B's config.json (a GPTQ export's copy) and the 34B-derived
    # tiny-random/falcon-h1 config say so, and Megatron-Bridge runs all three with norm_before_gate=False.
    "falcon-h1-1.5b-deep": _published(
        hidden=1280,
        ffn=3072,
        heads=6,
        kv_heads=2,
        mamba_heads=24,
        mamba_head_dim=64,
        groups=1,
        chunk=128,
        vocab=65537,
        positions=131072,
        layers=66,
        embedding_multiplier=5.656854249492381,
        lm_head_multiplier=0.03125,
        key_multiplier=0.17677669529663687,
        attention_out_multiplier=0.5,
        ssm_in_multiplier=1.0,
        ssm_out_multiplier=0.23570226039551587,
        mlp_multipliers=[0.7071067811865476, 0.3125],
        ssm_multipliers=[0.3535533905932738, 0.25, 0.1767766952966369, 0.5, 0.3535533905932738],
    ),
    "falcon-h1-7b": _published(
        hidden=3072,
        ffn=12288,
        heads=12,
        kv_heads=2,
        mamba_heads=24,
        mamba_head_dim=128,
        groups=1,
        chunk=256,
        vocab=130049,
        positions=262144,
        layers=44,
        embedding_multiplier=5.656854249492381,
        lm_head_multiplier=0.013020833333333334,
        key_multiplier=0.030690398488999456,
        attention_out_multiplier=0.10416666666666667,
        ssm_in_multiplier=0.4166666666666667,
        ssm_out_multiplier=0.11785113019775793,
        mlp_multipliers=[0.2946278254943948, 0.032552083333333336],
        ssm_multipliers=[0.3535533905932738, 0.25, 0.1767766952966369, 0.5, 0.3535533905932738],
    ),
    "falcon-h1-34b": _published(
        hidden=5120,
        ffn=21504,
        heads=20,
        kv_heads=4,
        mamba_heads=32,
        mamba_head_dim=128,
        groups=2,
        chunk=128,
        vocab=261120,
        positions=262144,
        layers=72,
        embedding_multiplier=5.656854249492381,
        lm_head_multiplier=0.0078125,
        key_multiplier=0.011048543456039804,
        attention_out_multiplier=0.0375,
        ssm_in_multiplier=0.25,
        ssm_out_multiplier=0.08838834764831845,
        mlp_multipliers=[0.1767766952966369, 0.011160714285714284],
        ssm_multipliers=[0.3535533905932738, 0.25, 0.1767766952966369, 0.5, 0.3535533905932738],
    ),
}
