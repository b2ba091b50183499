"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Moonlight and Kimi-K2 use it with other values): MLA, sigmoid group-limited
routing with the aux-loss-free bias, shared experts, dense first layers (tensor names: ``deepseek_layout``)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import family_rules
from mcore.bridge.mappings.deepseek_layout import MTP_COPIES, MTP_TENSORS, deepseek_config_rules, deepseek_tensors

# transformers' DeepseekV3Config defaults (DeepSeek-V3's sizes)
CONFIG = family_rules(
    "deepseek_v3",
    deepseek_config_rules(version=3, max_position_embeddings=4096, moe_intermediate_size=2048, q_lora_rank=1536),
)

MAPPING = FamilyMapping(
    name="deepseek_v3",
    hf_model_type="deepseek_v3",
    tensors=deepseek_tensors(expert_bias=True),
    config=CONFIG,
    mtp_tensors=MTP_TENSORS,
    mtp_copies=MTP_COPIES,
    description="DeepSeek-V3 671B, Moonlight-16B-A3B, Kimi-K2 (MLA; sigmoid top-8 of 256 experts + shared)",
)
