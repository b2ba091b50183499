"""The DeepSeek-V3 example (Megatron-Core's 1024-H100 layout) loads, has that layout and plans on 1024 GPUs."""

from __future__ import annotations

from pathlib import Path

from mcore.train.config import load_config
from mcore.train.plan import make_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepseek-v3-1024-h100.yaml"


def test_deepseek_v3_example_has_megatrons_layout_and_plans():
    config = load_config(EXAMPLE)
    m, p = config.model, config.parallel
    assert (m.num_hidden_layers, m.num_experts, m.kv_lora_rank, m.num_nextn_predict_layers) == (61, 256, 512, 1)
    assert (p.tp, p.pp, p.vpp, p.ep, p.etp) == (2, 8, 4, 64, 1)
    # "Et|(tt|)*30mL": embedding + 1 layer, 30 virtual stages of 2, the last with only MTP and the loss
    assert p.pipeline_layout == [1] + [2] * 30 + [0]
    assert (config.train.global_batch_size, config.train.micro_batch_size, config.data.seq_length) == (8192, 1, 4096)
    plan = make_plan(config, 1024, gpu_memory_gb=80.0)
    assert (plan.tp, plan.pp, plan.dp) == (2, 8, 64)
    assert len(plan.stages) == 8 and all(stage.activations > 0 for stage in plan.stages)
    assert plan.total_parameters > 671e9  # the base model plus its MTP depth
