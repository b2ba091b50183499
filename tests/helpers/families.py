"""The per-family test table, derived from the family registry: every registered family is under every
per-family test (parity, bridge round trip, accounting, generation, config translation, bad input).

The Hugging Face reference of a family is the transformers class its module names (``HF_ARCHITECTURE``); a
registered family whose class transformers does not have fails here, loudly, instead of being skipped.
"""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from mcore.models.config import TransformerConfig
from mcore.models.families import family_names, get_config, hf_architecture
from tests.helpers.hf_adapters import adapter

# TransformerConfig fields whose name and meaning Hugging Face's config classes share.
_HF_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "hidden_act",
    "initializer_range",
)


def families() -> list[str]:
    """Every registered family, in registration order (evaluated when a test module is collected)."""
    return family_names()


def hf_classes(family: str) -> tuple[type, type]:
    """(config class, causal-LM class) of ``family``'s Hugging Face reference."""
    name = hf_architecture(family)
    model_cls = getattr(transformers, name, None)
    if model_cls is None:
        pytest.fail(f"family {family!r} names HF_ARCHITECTURE {name!r}, which transformers does not have")
    return model_cls.config_class, model_cls


def tiny_config(family: str, **overrides: Any) -> TransformerConfig:
    """The family's ``<family>-tiny`` preset (every registered family has one)."""
    return get_config(f"{family}-tiny", **overrides)


def hf_config_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """Keyword arguments of the HF config describing the same model (fp32, eager attention, no special tokens)."""
    special = adapter(config.model_type)
    if special is not None:
        return special.config_kwargs(config)
    return llama_shaped_config_kwargs(config)


def llama_shaped_config_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """The keyword arguments of a Llama-shaped family's HF config (shared with the adapters that extend them)."""
    rope = {"rope_type": "default"} if config.rope_scaling is None else dict(config.rope_scaling)
    kwargs = {name: getattr(config, name) for name in _HF_FIELDS}
    if config.layer_types is not None:
        kwargs["layer_types"] = list(config.layer_types)
    if config.num_experts is not None:
        kwargs.update(hf_moe_kwargs(config))
    kwargs.update(
        rope_parameters={**rope, "rope_theta": config.rope_theta},
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    return kwargs


def hf_moe_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """HF's MoE fields: Mixtral names its experts ``num_local_experts`` and their width ``intermediate_size``."""
    kwargs: dict[str, Any] = {"num_experts_per_tok": config.num_experts_per_tok, "router_aux_loss_coef": 0.0}
    if config.model_type == "mixtral":
        return {**kwargs, "num_local_experts": config.num_experts}
    if config.model_type == "olmoe":
        return {**kwargs, "num_experts": config.num_experts, "norm_topk_prob": config.norm_topk_prob}
    dense = [i for i in range(config.num_hidden_layers) if config.mlp_type(i) != "moe"]
    kwargs.update(
        num_experts=config.num_experts,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=dense,
    )
    if config.shared_expert_intermediate_size is not None:
        kwargs["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if config.model_type == "qwen2_moe":
        kwargs["qkv_bias"] = config.attention_bias
    return kwargs


def hf_config(config: TransformerConfig):
    """The HF config object of the same model, eager attention."""
    config_cls, _ = hf_classes(config.model_type)
    return config_cls(**hf_config_kwargs(config), attn_implementation="eager")
