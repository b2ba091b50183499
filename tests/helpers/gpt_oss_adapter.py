"""How the per-family tests speak to Hugging Face's GPT-OSS: its config keywords, and its in-memory tensors under our
names (written from HF's layout, independently of the bridge): experts ``gate_up_proj`` [E, H, 2I] with gate and up
interleaved (even / odd columns) -> our ``[E, 2I, H]`` gate rows then up rows; ``down_proj`` [E, I, H] -> ``[E, H, I]``;
the router's weight and bias; the attention sinks."""

from __future__ import annotations

from typing import Any

import torch

from mcore.models.config import TransformerConfig
from tests.helpers.hf_renames import LayerTable, to_mcore_state


def gpt_oss_config_kwargs(config: TransformerConfig) -> dict[str, Any]:
    names = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
        "attention_bias", "sliding_window", "hidden_act", "initializer_range", "num_experts_per_tok",
        "swiglu_alpha", "swiglu_limit",
    )  # fmt: skip
    kwargs = {name: getattr(config, name) for name in names}
    return dict(
        kwargs,
        num_local_experts=config.num_experts,
        layer_types=list(config.layer_types),
        rope_parameters={**config.rope_scaling, "rope_theta": config.rope_theta},
        router_aux_loss_coef=0.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Last dim ``[g0, u0, g1, u1, ...]`` -> ``[g0, g1, ..., u0, u1, ...]``."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


_GPT_OSS_LAYER = LayerTable(
    renames=(
        ("input_layernorm.", "input_norm."),
        ("post_attention_layernorm.", "mlp_norm."),
        ("self_attn.o_proj.", "attention.out_proj."),
        ("self_attn.sinks", "attention.sinks.weight"),
        ("mlp.router.", "mlp.router."),
        ("mlp.experts.down_proj_bias", "mlp.experts.down_bias"),
    ),
    qkv=(("self_attn.", "attention."),),
    converts=(
        ("mlp.experts.gate_up_proj", "mlp.experts.gate_up", lambda t: _deinterleave(t).transpose(1, 2)),
        ("mlp.experts.gate_up_proj_bias", "mlp.experts.gate_up_bias", _deinterleave),
        ("mlp.experts.down_proj", "mlp.experts.down", lambda t: t.transpose(1, 2)),
    ),
)


def gpt_oss_to_mcore_state(hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    return to_mcore_state(hf_state, config, _GPT_OSS_LAYER)
