"""The DeepSeek fields of ``TransformerConfig`` (multi-head latent attention, dense-first layers, MTP): their rules.

Kept apart from ``layers/mla.py`` (the mixer itself) so that ``config.py`` can validate the fields at construction
without importing the layers, which import the config. Field names are Hugging Face ``DeepseekV3Config``'s.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MLA_SIZE_FIELDS", "check_mla_fields", "mla_softmax_scale", "qk_head_dim"]

# Fields every MLA model sets (q_lora_rank may stay None: a full-rank query projection).
MLA_SIZE_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _count(config: Any, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TransformerConfig.{name} must be an int >= {minimum}, got {value!r}")


def _uses_mla(config: Any) -> bool:
    return config.kv_lora_rank is not None or "mla" in (config.layer_types or ())


def check_mla_fields(config: Any) -> None:
    """Validate the DeepSeek fields (called from ``TransformerConfig.__post_init__`` before the head checks)."""
    _count(config, "first_k_dense_replace", 0)
    _count(config, "num_nextn_predict_layers", 0)
    if not isinstance(config.rope_interleave, bool):
        raise TypeError(f"TransformerConfig.rope_interleave must be a bool, got {config.rope_interleave!r}")
    if config.first_k_dense_replace > config.num_hidden_layers:
        raise ValueError(
            f"TransformerConfig.first_k_dense_replace ({config.first_k_dense_replace}) exceeds num_hidden_layers "
            f"({config.num_hidden_layers})"
        )
    if not _uses_mla(config):
        extra = [n for n in ("q_lora_rank", *MLA_SIZE_FIELDS) if getattr(config, n) is not None]
        if extra:
            raise ValueError(f"TransformerConfig: {extra} are multi-head latent attention fields; set kv_lora_rank too")
        return
    missing = [n for n in MLA_SIZE_FIELDS if getattr(config, n) is None]
    if missing:
        raise ValueError(f"TransformerConfig: multi-head latent attention needs {missing} (HF DeepseekV3Config names)")
    for name in MLA_SIZE_FIELDS:
        _count(config, name, 1)
    if config.q_lora_rank is not None:
        _count(config, "q_lora_rank", 1)
    if config.qk_rope_head_dim % 2:
        raise ValueError(
            f"TransformerConfig.qk_rope_head_dim must be even (RoPE rotates pairs), got {config.qk_rope_head_dim}"
        )
    # The model's rotary tables are built for head_dim; MLA rotates only the decoupled qk_rope_head_dim part (HF's
    # DeepseekV3Config sets head_dim = qk_rope_head_dim for the same reason).
    if config.head_dim is None:
        object.__setattr__(config, "head_dim", config.qk_rope_head_dim)
    if config.head_dim != config.qk_rope_head_dim:
        raise ValueError(
            f"TransformerConfig.head_dim ({config.head_dim}) must equal qk_rope_head_dim ({config.qk_rope_head_dim}) "
            "for multi-head latent attention (it is the rotary width); leave head_dim unset"
        )
    if config.attention_bias or config.attention_out_bias:
        raise ValueError("TransformerConfig: multi-head latent attention has no biases; set attention_bias=False")
    if config.qk_norm:
        raise ValueError(
            "TransformerConfig: multi-head latent attention normalises its latents, not q/k; qk_norm=False"
        )


def qk_head_dim(config: Any) -> int:
    """Width of one query/key head: the position-free part plus the decoupled rotary part (192 in DeepSeek-V3)."""
    return config.qk_nope_head_dim + config.qk_rope_head_dim


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config: Any) -> float:
    """``1/sqrt(qk_head_dim)``, times DeepSeek's YaRN ``mscale(factor, mscale_all_dim)**2`` when the rope is scaled.

    YaRN's attention factor already multiplies cos/sin (``mscale / mscale_all_dim``); DeepSeek puts the
    ``mscale_all_dim`` part into the softmax scale instead, which also scales the position-free dims.
    """
    scale = qk_head_dim(config) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale
