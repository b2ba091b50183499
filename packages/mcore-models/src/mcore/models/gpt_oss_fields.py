"""The GPT-OSS fields of ``TransformerConfig`` and their rules: ``attention_sinks``, ``router_bias``,
``expert_biases``, ``swiglu_alpha`` / ``swiglu_limit`` (the experts' clamped SwiGLU).

Kept in their own module (as ``moe_fields.py`` is for the MoE fields) so that ``config.py`` only calls the check.
The router and expert options need MoE layers; the clamped SwiGLU takes both of its numbers or neither.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_gpt_oss_fields", "expert_activation", "expert_bias_parameters"]


def expert_activation(config: Any) -> tuple[float, float] | None:
    """``(alpha, limit)`` of the experts' clamped SwiGLU, or ``None`` for the plain SwiGLU."""
    if config.swiglu_limit is None:
        return None
    return float(config.swiglu_alpha), float(config.swiglu_limit)


def expert_bias_parameters(config: Any) -> int:
    """Parameters the router bias and the expert biases add to one MoE layer (``E`` and ``E * (2F + H)``)."""
    e = config.num_experts
    ffn = config.intermediate_size if config.moe_intermediate_size is None else config.moe_intermediate_size
    n = e if config.router_bias else 0
    return n + (e * (2 * ffn + config.hidden_size) if config.expert_biases else 0)


def check_gpt_oss_fields(config: Any) -> None:
    """Validate the GPT-OSS fields of a ``TransformerConfig`` (called from its ``__post_init__``)."""
    for name in ("attention_sinks", "router_bias", "expert_biases"):
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise TypeError(f"TransformerConfig.{name} must be a bool, got {type(value).__name__} {value!r}")
    alpha, limit = config.swiglu_alpha, config.swiglu_limit
    if (alpha is None) != (limit is None):
        raise ValueError(
            f"TransformerConfig: swiglu_alpha ({alpha!r}) and swiglu_limit ({limit!r}) set the clamped SwiGLU "
            "together; set both (GPT-OSS: 1.702 and 7.0) or neither"
        )
    for name, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"TransformerConfig.{name} must be a number or None, got {type(value).__name__} {value!r}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"TransformerConfig.{name} must be a finite number > 0, got {value}")
    wanted = [n for n in ("router_bias", "expert_biases") if getattr(config, n)]
    if limit is not None:
        wanted.append("swiglu_limit")
    if wanted and config.num_experts is None:
        raise ValueError(f"TransformerConfig: {wanted} apply to MoE layers but num_experts is None; set num_experts")
