"""CPU dry runs of benchmarks/memory_modes.py and benchmarks/cpu_adamw.py.

The memory-modes dry run goes through the GPU run's whole path (orchestrator, one process per configuration, the
real ``Trainer`` with each mode, host memory, JSON, summary) on a tiny fp32 model for a few of its configurations;
the modes must give the reference's losses (fp32 on CPU, within 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the reference, FSDP at world size 1 (auto settings; resharded after forward), and the two offloads together (the
# 8B part's second configuration)
CONFIGS = ["8b4l_zero1", "8b4l_dp_shard", "8b4l_dp_shard_reshard", "8b_optim_offload_0.5_act_offload_mlp"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory_modes")
    proc = _run("benchmarks/memory_modes.py", "--dry-run", "--out", str(out), "--configs", ",".join(CONFIGS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_every_configuration_ran_and_reports_memory(summary):
    assert sorted(summary["results"]) == sorted(CONFIGS)
    for name, res in summary["results"].items():
        assert res["tokens_per_s"] > 0 and res["peak_host_mem_gb"] > 0, name
        assert res["steps"] == [1, 2, 3], name
    assert summary["relative"]["8b4l_zero1"]["tokens_per_s_vs_zero1"] == 1.0
    assert set(summary["relative"]["8b_optim_offload_0.5_act_offload_mlp"]) == {
        "tokens_per_s_per_layer_vs_8b4l",
        "mfu_vs_8b4l",
    }
    assert "| 8b4l_dp_shard |" in summary["markdown"]


def test_modes_keep_the_reference_losses(summary):
    results = summary["results"]
    ref = results["8b4l_zero1"]["losses"]
    for name in ("8b4l_dp_shard", "8b4l_dp_shard_reshard", "8b_optim_offload_0.5_act_offload_mlp"):
        assert results[name]["losses"] == pytest.approx(ref, rel=1e-5), name


def test_cpu_adamw_dry_run_agrees_across_paths(tmp_path):
    out = tmp_path / "cpu_adamw.json"
    proc = _run("benchmarks/cpu_adamw.py", "--dry-run", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"foreach", "fused", "mcore"} and data["fastest"] in data["results"]
    for impl, res in data["results"].items():
        assert res["max_abs_diff_vs_foreach"] < 1e-6, impl


def test_profile_steps_are_refused_in_a_dry_run():
    proc = _run("benchmarks/memory_modes.py", "--dry-run", "--profile-steps", "1")
    assert proc.returncode == 2 and "0 in a dry run" in proc.stderr, proc.stderr[-2000:]
