"""``optim.main_grads_dtype`` / ``optim.exp_avg_dtype`` / ``optim.exp_avg_sq_dtype`` through mcore-train (llama-tiny on
the embedded corpus, CPU, fp32 parameters so that the states' dtypes are the only difference between the runs).

- 120 steps with bf16 gradients and moments track the fp32-state run: every logged loss within ``LOSS_RTOL`` = 3%
  and the mean of the last 20 within 1% (measured: 0.84% and 0.01%), while the two are *not* bit-equal from step 2
  on (the first step's update is sign(g) * lr either way, so only later steps can tell);
- a checkpoint saved with fp32 moments resumes into bf16 moments (the log says so, the next checkpoint holds bf16
  moments) and that one back into fp32 moments;
- ``parallel.dp_shard`` (FSDP2, 2 gloo ranks) with all three in bf16 (reduce_dtype bf16, bf16 moments on the
  shards): the fp32-state losses to 1e-4 over 3 steps, not bit-equal to them, and a checkpoint of bf16 moments;
- bad values are one error naming the key.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mcore.train.config import load_config
from mcore.train.errors import UserError
from tests.helpers.distributed import run_workers
from tests.train.tiny import train, train_records

LONG = ["train.steps=120", "log.interval=1", "checkpoint.save_interval=0"]
BF16_STATES = ["optim.main_grads_dtype=bf16", "optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"]
LOSS_RTOL = 0.03


def _losses(run_dir) -> dict[int, float]:
    return {step: r["loss"] for step, r in train_records(run_dir).items()}


def test_bf16_grads_and_moments_track_fp32_over_120_steps(tmp_path):
    train(tmp_path / "fp32", *LONG)
    train(tmp_path / "bf16", *LONG, *BF16_STATES)
    fp32, bf16 = _losses(tmp_path / "fp32"), _losses(tmp_path / "bf16")
    assert sorted(fp32) == sorted(bf16) and len(fp32) == 120
    assert fp32[120] < 0.8 * fp32[1]  # it learned
    for step in fp32:
        assert abs(bf16[step] - fp32[step]) <= LOSS_RTOL * fp32[step], (step, bf16[step], fp32[step])
    tail = range(101, 121)
    mean32, mean16 = (sum(d[s] for s in tail) / len(tail) for d in (fp32, bf16))
    assert abs(mean16 - mean32) <= 0.01 * mean32, (mean16, mean32)
    assert sum(bf16[s] != fp32[s] for s in range(2, 121)) >= 100  # the bf16 states are really used


def _moment_dtypes(checkpoint) -> set[str]:
    tensors = load_file(checkpoint / "optim" / "tp00-pp00.safetensors")
    assert {t.dtype for k, t in tensors.items() if k.endswith("/master")} == {torch.float32}
    return {str(t.dtype).removeprefix("torch.") for k, t in tensors.items() if "/exp_avg" in k}


def test_checkpoints_move_between_fp32_and_bf16_moments(tmp_path):
    run = tmp_path / "run"
    steps = ["train.steps=6", "checkpoint.save_interval=2"]
    train(run, *steps, "train.stop_at_step=2")
    assert _moment_dtypes(run / "checkpoints" / "iter_0000002") == {"float32"}
    _, log = train(run, *steps, *BF16_STATES[1:], "train.stop_at_step=4")
    assert "optimizer moments cast on load (exp_avg: float32 -> bfloat16; exp_avg_sq: float32 -> bfloat16)" in log
    assert _moment_dtypes(run / "checkpoints" / "iter_0000004") == {"bfloat16"}
    _, log = train(run, *steps)
    assert "exp_avg: bfloat16 -> float32; exp_avg_sq: bfloat16 -> float32" in log
    assert _moment_dtypes(run / "checkpoints" / "iter_0000006") == {"float32"}
    losses = _losses(run)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["optim.exp_avg_dtype=fp16"], r"config key 'optim.exp_avg_dtype' must be one of 'fp32', 'bf16', got"),
        (["optim.main_grads_dtype=float32"], r"config key 'optim.main_grads_dtype' must be one of 'fp32', 'bf16'"),
        (["optim.exp_avg_sq_dtype=bf16", "optim.beta2=0.999"], r"optim.beta2=0.999 with optim.exp_avg_sq_dtype=bf16"),
    ],
)
def test_bad_values_name_the_key(overrides, match):
    with pytest.raises((UserError, ValueError), match=match):
        load_config(None, ["model=llama-tiny", *overrides])


def _dp_shard_cases(rank: int, world_size: int, base) -> dict | None:
    out = {}
    for name, extra in (("fp32", []), ("bf16", BF16_STATES)):
        steps = ["train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=1"]
        train(base / name, *steps, "parallel.dp_shard=true", *extra)
        out[name] = _losses(base / name)
        out[f"{name} moments"] = _moment_dtypes(base / name / "checkpoints" / "iter_0000003") if rank == 0 else None
    return out if rank == 0 else None


def test_dp_shard_reduces_in_bf16(tmp_path):
    out = run_workers(2, _dp_shard_cases, tmp_path)[0]
    fp32, bf16 = out["fp32"], out["bf16"]
    assert sorted(fp32) == sorted(bf16) == [1, 2, 3]
    assert all(abs(bf16[s] - fp32[s]) <= 1e-4 * fp32[s] for s in fp32), (fp32, bf16)
    assert bf16[3] != fp32[3]
    assert out["fp32 moments"] == {"float32"} and out["bf16 moments"] == {"bfloat16"}  # gathered over dp as stored
