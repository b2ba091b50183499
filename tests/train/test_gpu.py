"""On CUDA: bf16 parameters with fp32 master weights, no host synchronization inside the step, and NCCL runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from mcore.train.config import load_config
from mcore.train.datasets import build_run_data, microbatch_stream
from mcore.train.runtime import init_runtime
from mcore.train.trainer import Trainer, microbatch_to_device
from tests.train.tiny import TINY

GPU = [o for o in TINY if o != "train.device=cpu"] + ["train.device=cuda"]


@pytest.mark.gpu
def test_bf16_step_learns_without_host_syncs():
    config = load_config(None, [*GPU, "train.steps=40", "data.seq_length=128", "train.global_batch_size=8"])
    runtime = init_runtime(config)
    trainer = Trainer(config, runtime)
    assert trainer.precision == "bf16" and not trainer.skip_nonfinite
    assert all(p.dtype == torch.bfloat16 for p in trainer.chunks[0].parameters())
    masters = [g["params"] for g in trainer.optimizer.param_groups]
    assert all(m.dtype == torch.float32 for group in masters for m in group)
    data = build_run_data(config)
    stream = microbatch_stream(data.train, config, consumed_samples=0, dp_rank=0, dp_size=1)

    def step():
        micro = [microbatch_to_device(next(stream), runtime.device) for _ in range(trainer.num_microbatches)]
        return trainer.train_step(micro)

    losses = [step().loss for _ in range(3)]  # warm-up: allocator, kernels, lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            losses.append(step().loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    losses += [step().loss for _ in range(32)]
    values = torch.stack(losses).float().cpu()
    assert torch.isfinite(values).all()
    assert values[-5:].mean() < values[:5].mean() - 0.5


@pytest.mark.multigpu
def test_tensor_parallel_on_two_gpus_with_nccl(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "mcore.train", "--nproc-per-node", "2", *GPU, "parallel.tp=2", "train.steps=8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(
        [*argv, "train.stop_at_step=4", f"log.run_dir={run_dir}"], env=env, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "world 2 = tp 2 x pp 1 x dp 1" in first.stdout and "precision bf16" in first.stdout
    second = subprocess.run([*argv, f"log.run_dir={run_dir}"], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout
    assert re.search(r"^step 8/8 \| loss [0-9.]+", second.stdout, flags=re.M)


@pytest.mark.gpu
def test_gpu_readings_come_from_nvml():
    from mcore.train.gpu_stats import read_gpu_stats

    stats = read_gpu_stats(torch.device("cuda", 0))
    assert 0 < stats["memory_used_gb"] <= stats["memory_total_gb"]
    # nvidia-ml-py is a dependency of mcore-train, so the NVML readings must be there on a CUDA machine.
    assert {"power_w", "sm_clock_mhz", "temperature_c", "utilization_pct"} <= stats.keys(), stats


def test_gpu_readings_are_empty_off_cuda():
    from mcore.train.gpu_stats import read_gpu_stats

    assert read_gpu_stats(torch.device("cpu")) == {}
