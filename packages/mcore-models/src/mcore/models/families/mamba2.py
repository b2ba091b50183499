"""Mamba-2 (``Mamba2ForCausalLM``): every layer is ``x + mixer(norm(x))`` with the ``mamba2`` mixer and no MLP.

HF's Mamba2 config spells the mixer's sizes ``num_heads``, ``head_dim``, ``state_size`` and ``expand``; here
they are ``mamba_num_heads`` / ``num_attention_heads`` (the same head count), ``mamba_head_dim`` / ``head_dim``,
``ssm_state_size`` and ``intermediate_size = expand * hidden_size`` (HF Mamba2's own ``intermediate_size``, the
mixer's inner width). No layer attends, so ``num_attention_heads`` and ``head_dim`` only mirror the mixer's heads.
One norm eps (HF ``layer_norm_epsilon``) serves the layer norms and the gated norm.
"""

from __future__ import annotations

from typing import Any

FAMILY = "mamba2"
HF_ARCHITECTURE = "Mamba2ForCausalLM"

DEFAULTS: dict[str, Any] = {
    "model_type": "mamba2",
    "normalization": "rmsnorm",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 256,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "mamba_norm_before_gate": False,
    "tie_word_embeddings": False,
}


def mamba2_sizes(*, hidden: int, layers: int, heads: int, head_dim: int, state: int, vocab: int, **extra: Any):
    """A preset's fields: the mixer sizes (mirrored into the attention-head fields) and the per-layer pattern."""
    return {
        "hidden_size": hidden,
        "intermediate_size": heads * head_dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "mamba_num_heads": heads,
        "mamba_head_dim": head_dim,
        "ssm_state_size": state,
        "vocab_size": vocab,
        "layer_types": ["mamba2"] * layers,
        "mlp_layer_types": ["none"] * layers,
        **extra,
    }


PRESETS: dict[str, dict[str, Any]] = {
    # chunk 8 < the test sequences (24 tokens: three chunks), two groups (TP 2 keeps one each).
    "mamba2-tiny": mamba2_sizes(
        hidden=64,
        layers=2,
        heads=8,
        head_dim=16,
        state=8,
        vocab=320,
        n_groups=2,
        chunk_size=8,
        max_position_embeddings=256,
    ),  # fmt: skip
    # mistralai/Mamba-Codestral-7B-v0.1 config.json.
    "mamba-codestral-7b": mamba2_sizes(hidden=4096, layers=64, heads=128, head_dim=64, state=128, vocab=32768),
    # state-spaces/mamba2-2.7b (one group, tied embeddings, vocabulary padded to 50288).
    "mamba2-2.7b": mamba2_sizes(
        hidden=2560, layers=64, heads=80, head_dim=64, state=128, vocab=50288, n_groups=1, tie_word_embeddings=True
    ),
}
