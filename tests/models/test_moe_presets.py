"""MoE presets: totals of the released checkpoints, and FLOPs that count the active parameters only."""

import pytest

from mcore.models.accounting import matmul_weight_count, parameter_counts
from mcore.models.families import get_config

# Exact parameter counts of the released checkpoints (safetensors index totals / model cards).
RELEASED = {
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_630_071_296,
    "qwen3_moe-30b-a3b": 30_532_122_624,
    "qwen3_moe-235b-a22b": 235_093_634_560,
    "qwen2_moe-a2.7b": 14_315_784_192,
    "olmoe-1b-7b": 6_919_161_856,
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_totals(name):
    assert parameter_counts(get_config(name)).total == RELEASED[name]


def test_flops_count_active_experts():
    c = get_config("mixtral-8x7b")
    h, f, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    attention = h * (c.q_size + 2 * c.kv_size) + c.q_size * h
    active = layers * (attention + h * 8 + 2 * 3 * h * f) + h * c.vocab_size  # router + top-2 of 8 + output
    assert matmul_weight_count(c) == active
    # 12.9B active parameters per token, as published
    assert 12.8e9 < active + c.vocab_size * h < 13.0e9
