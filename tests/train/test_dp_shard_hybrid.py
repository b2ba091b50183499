"""``parallel.dp_shard`` on the hybrid families in bf16 through mcore-train (one gloo rank, the fp32 groups of
Mamba-2's ``A_log`` / ``D`` / ``dt_bias``, ``mcore.parallel.fsdp_fp32``): Nemotron-H and Falcon-H1 tiny train
like the unsharded bf16 run (fp32 masters, the three in fp32 as well) over 4 steps within 1e-3 (the weight
gradients' GEMMs accumulate differently; the exact comparison is tests/parallel/test_fsdp_fp32_params.py),
evaluate, sample at the end (generation through the sharded model), and a run stopped at step 2 and resumed gives
the straight run's losses bit for bit."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_workers
from tests.train.tiny import train, train_records

STEPS = ["train.steps=4", "train.global_batch_size=4", "train.micro_batch_size=2", "train.precision=bf16"]
SHARD = "parallel.dp_shard=true"
EVAL = ["train.eval_interval=2", "train.sample_tokens=4"]
MODELS = {"nemotron_h": "model=nemotron_h-tiny", "falcon_h1": "model=falcon_h1-tiny"}


def _sharded_runs(rank: int, world_size: int, base):
    out = {}
    for name, model in MODELS.items():
        result, _ = train(base / name, model, *STEPS, SHARD, *EVAL)
        out[name] = train_records(base / name)
        out[f"{name}_sample"], out[f"{name}_val"] = result.sample, result.val_loss
    model = MODELS["nemotron_h"]
    train(base / "resumed", model, *STEPS, SHARD, *EVAL, "train.stop_at_step=2")
    _, log = train(base / "resumed", model, *STEPS, SHARD, *EVAL)
    out["resumed"], out["resumed_log"] = train_records(base / "resumed"), log
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("dp_shard_hybrid")
    singles = {}
    for name, model in MODELS.items():
        train(base / f"single_{name}", model, *STEPS)
        singles[name] = train_records(base / f"single_{name}")
    return singles, run_workers(1, _sharded_runs, base)[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_dp_shard_trains_like_the_unsharded_bf16_run(results, name):
    singles, sharded = results
    got, single = sharded[name], singles[name]
    assert sorted(got) == sorted(single) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert got[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-3, abs=0), (name, step)
    assert got[4]["loss"] < got[1]["loss"]
    assert sharded[f"{name}_sample"] and sharded[f"{name}_val"] > 0


def test_resume_is_bitwise(results):
    _, sharded = results
    assert "resuming from" in sharded["resumed_log"]
    for step in range(1, 5):
        assert sharded["resumed"][step]["loss"] == sharded["nemotron_h"][step]["loss"], step
