"""DeepSeek-V2 (``DeepseekV2ForCausalLM``; V2-Lite): MLA, softmax greedy or group-limited routing, shared experts,
dense first layers (tensor names: ``deepseek_layout``)."""

from __future__ import annotations

from mcore.bridge.mappings.base import FamilyMapping
from mcore.bridge.mappings.config_rules import family_rules
from mcore.bridge.mappings.deepseek_layout import deepseek_config_rules, deepseek_tensors

# transformers' DeepseekV2Config defaults
CONFIG = family_rules(
    "deepseek_v2",
    deepseek_config_rules(version=2, max_position_embeddings=2048, moe_intermediate_size=1407, q_lora_rank=1536),
)

MAPPING = FamilyMapping(
    name="deepseek_v2",
    hf_model_type="deepseek_v2",
    tensors=deepseek_tensors(expert_bias=False),
    config=CONFIG,
    description="DeepSeek-V2, DeepSeek-V2-Lite (MLA; softmax top-6 of 64/160 experts + 2 shared)",
)
