"""The example configs load, validate and plan; the tiny one is exactly the embedded default."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore.train.config import config_to_dict, load_config
from mcore.train.plan import make_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_tiny_example_is_the_embedded_default():
    assert config_to_dict(load_config(EXAMPLES / "tiny.yaml")) == config_to_dict(load_config())


@pytest.mark.parametrize(
    "name,world_size",
    [("tiny.yaml", 1), ("gpt-125m.yaml", 8), ("llama3-8b-tp2-pp2.yaml", 8)],
)
def test_examples_load_and_fit_their_gpus(name, world_size):
    config = load_config(EXAMPLES / name)
    plan = make_plan(config, world_size, gpu_memory_gb=80.0)
    assert plan.fits, name


def test_llama3_example_uses_the_preset_and_layout():
    config = load_config(EXAMPLES / "llama3-8b-tp2-pp2.yaml")
    assert config.model.num_hidden_layers == 32 and config.model.num_key_value_heads == 8
    assert (config.parallel.tp, config.parallel.pp) == (2, 2)


def test_slurm_example_launches_mcore_train_with_torchrun():
    script = (EXAMPLES / "slurm" / "llama3-8b.sbatch").read_text()
    assert "torchrun" in script and "-m mcore.train" in script and "--rdzv-backend=c10d" in script
    assert "examples/llama3-8b-tp2-pp2.yaml" in script


def test_llama3_128k_example_runs_context_parallel_and_plans(capsys):
    from mcore.train.cli import main

    config = load_config(EXAMPLES / "llama3-8b-128k.yaml")
    assert config.data.seq_length == 131072 == config.model.max_position_embeddings
    p = config.parallel
    assert (p.tp, p.cp, p.pp, p.cp_comm_type, p.sequence_parallel) == (2, 8, 1, "p2p", True)
    plan = make_plan(config, 16, gpu_memory_gb=80.0)
    assert plan.dp == 1 and plan.tokens_per_step == 8 * 131072
    code = main(["plan", "--config", str(EXAMPLES / "llama3-8b-128k.yaml"), "--world-size", "16"])
    out = capsys.readouterr().out
    assert code == 0 and "16 rank(s) = tp 2 x cp 8 x pp 1 x dp 1" in out, out
    with pytest.raises(Exception, match="not divisible by tp\\*pp\\*cp = 16"):  # 12 GPUs cannot hold tp 2 x cp 8
        make_plan(config, 12, gpu_memory_gb=80.0)
