"""The GPT-OSS shapes of ``moe_throughput.py`` and their ``model`` sections (kept here so that the MoE benchmark's
table stays the baseline's).

``gptoss4l``: gpt-oss-20b layers x 4 (sinks, sliding 128 / full, YaRN, biased experts, clamped SwiGLU), seq 4096,
micro-batch 1, against ``hf_moe_baseline.py --shape gptoss4l``; ``gptoss4l_mb2``: the same at micro-batch 2, ours
only (HF eager runs out of memory there); ``gptoss_tiny``: their CPU dry run (window 16 < seq 64).
"""

from __future__ import annotations

from typing import Any

_20B = dict(family="gpt_oss", hidden=2880, layers=4, heads=64, kv=8, head_dim=64, experts=32, topk=4, moe_ffn=2880,
            vocab=201088, seq=4096)  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "gptoss4l": dict(_20B, mbs=1),
    "gptoss4l_mb2": dict(_20B, mbs=2, baseline=False),
    "gptoss_tiny": dict(family="gpt_oss", hidden=64, layers=2, heads=4, kv=2, head_dim=16, experts=4, topk=2,
                        moe_ffn=32, vocab=259, seq=64, mbs=2, window=16),
}  # fmt: skip
GPT_OSS_SHAPES = ("gptoss4l", "gptoss4l_mb2")  # what --shape gptoss runs
# --dry-run runs the dry-run shape of the GPU shape asked for
DRY_RUN_SHAPES = {"gptoss": "gptoss_tiny", "gptoss4l": "gptoss_tiny", "gptoss4l_mb2": "gptoss_tiny"}


def gpt_oss_model(shape: dict[str, Any], *, align: int, expert_gemm: str = "grouped") -> dict[str, Any]:
    """The ``model`` section of a GPT-OSS shape: the family's fields, then the shape's sizes (and
    ``moe_router.expert_gemm`` when not the default)."""
    from mcore.models.families import FAMILIES
    from mcore.models.families.gpt_oss import alternating_layer_types

    model = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FAMILIES["gpt_oss"].items()}
    model.update(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        layer_types=alternating_layer_types(shape["layers"]),
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["moe_ffn"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["topk"],
        vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq"],
        sliding_window=shape.get("window", 128),
    )
    if align > 1:
        model["moe_router"] = {**model["moe_router"], "align": align}
    if expert_gemm != "grouped":
        model["moe_router"] = {**model["moe_router"], "expert_gemm": expert_gemm}
    return model
