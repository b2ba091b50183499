"""How the per-family tests speak to Hugging Face's GPT-OSS: its config keywords, and its in-memory tensors under our
names (written from HF's layout, independently of the bridge): experts ``gate_up_proj`` [E, H, 2I] with gate and up
interleaved (even / odd columns) -> our ``[E, 2I, H]`` gate rows then up rows; ``down_proj`` [E, I, H] -> ``[E, H, I]``;
the router's weight and bias; the attention sinks."""

from __future__ import annotations

from typing import Any

import torch

from mcore.models.config import TransformerConfig


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


def _fuse_qkv(q, k, v, config):
    groups, d = config.num_key_value_heads, config.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, config.query_heads_per_kv_head * d, *rest)
    return torch.cat([q, k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Last dim ``[g0, u0, g1, u1, ...]`` -> ``[g0, g1, ..., u0, u1, ...]``."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def gpt_oss_to_mcore_state(hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    out = {"embedding.weight": hf_state["model.embed_tokens.weight"]}
    out["final_norm.weight"] = hf_state["model.norm.weight"]
    if not config.tie_word_embeddings:
        out["output.weight"] = hf_state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        a, m = hf + "self_attn.", hf + "mlp."
        out[ours + "input_norm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[ours + "mlp_norm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            qkv = [hf_state[a + f"{n}_proj.{kind}"] for n in "qkv"]
            out[ours + f"attention.qkv.{kind}"] = _fuse_qkv(*qkv, config)
            out[ours + f"attention.out_proj.{kind}"] = hf_state[a + f"o_proj.{kind}"]
            out[ours + f"mlp.router.{kind}"] = hf_state[m + f"router.{kind}"]
        out[ours + "attention.sinks.weight"] = hf_state[a + "sinks"]
        out[ours + "mlp.experts.gate_up"] = _deinterleave(hf_state[m + "experts.gate_up_proj"]).transpose(1, 2)
        out[ours + "mlp.experts.gate_up_bias"] = _deinterleave(hf_state[m + "experts.gate_up_proj_bias"])
        out[ours + "mlp.experts.down"] = hf_state[m + "experts.down_proj"].transpose(1, 2)
        out[ours + "mlp.experts.down_bias"] = hf_state[m + "experts.down_proj_bias"]
    return out


def gpt_oss_parts(model: torch.nn.Module, config: TransformerConfig) -> tuple[int, int]:
    params = dict(model.named_parameters())
    mixers = sum(p.numel() for n, p in params.items() if ".self_attn." in n)
    return mixers, sum(p.numel() for n, p in params.items() if ".mlp." in n)
