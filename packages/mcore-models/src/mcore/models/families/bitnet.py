"""BitNet b1.58 (``BitNetForCausalLM``): a Llama with a relu2-gated MLP and two sub-norms, an RMSNorm over the
attention output before ``o_proj`` and one over the FFN width before ``down_proj`` (``bitnet_attention`` and
``bitnet_mlp`` parts). Trained as BitNet with ``train.quant: bitnet`` (ternary absmean weights, one scale per HF
projection, int8 per-token activations): Hugging Face's online ``AutoBitLinear`` mode. The bridge reads and
writes HF's packed ternary checkpoints (2 bits per weight, 4 per uint8, plus ``weight_scale``).
"""

from __future__ import annotations

from typing import Any

FAMILY = "bitnet"
HF_ARCHITECTURE = "BitNetForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "bitnet",
    "normalization": "rmsnorm",
    "hidden_act": "relu2",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}


def bitnet_layers(n: int) -> dict[str, Any]:
    return {"num_hidden_layers": n, "layer_types": ["bitnet_attention"] * n, "mlp_layer_types": ["bitnet_mlp"] * n}


PRESETS: dict[str, dict[str, Any]] = {
    "bitnet-tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        **bitnet_layers(2),
    },
    # microsoft/bitnet-b1.58-2B-4T (its config.json)
    "bitnet-b1.58-2b-4t": {
        "hidden_size": 2560,
        "intermediate_size": 6912,
        "num_attention_heads": 20,
        "num_key_value_heads": 5,
        "vocab_size": 128256,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        **bitnet_layers(30),
    },
}
