"""``parallel.cp=2`` on two CUDA GPUs through the real launcher (NCCL, our Triton attention blocks in the ring):
the per-step losses and gradient norms of cp2 runs (p2p and a2a, packed documents and not, dynamic CP) equal one
GPU's (skipped with fewer than two GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.train.tiny import TINY, train_records

pytestmark = pytest.mark.multigpu

GPU = [o for o in TINY if not o.startswith("train.device")] + ["train.device=cuda"]
STEPS = ["train.steps=4", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.eps=1e-6"]
# fp32: exact products in the kernels, so only the summation order differs; bf16: its rounding
PRECISION = {"fp32": 1e-4, "bf16": 3e-2}


def _run(run_dir, nproc, *extra):
    argv = [sys.executable, "-m", "mcore.train", *(["--nproc-per-node", str(nproc)] if nproc > 1 else [])]
    argv += [*GPU, *STEPS, *extra, f"log.run_dir={run_dir}", "checkpoint.save_at_end=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout, train_records(run_dir)


@pytest.mark.parametrize("precision", sorted(PRECISION))
@pytest.mark.parametrize(
    "comm_type,data",
    [
        ("p2p", []),
        ("p2p", ["data.mock=true", "data.packing=true"]),
        ("a2a", ["data.mock=true", "data.packing=true"]),
        ("p2p", ["data.packing=true", "data.seq_length=64", "parallel.cp_dynamic=true"]),  # dynamic CP
    ],
)
def test_cp2_on_two_gpus_trains_like_one_gpu(tmp_path, precision, comm_type, data):
    common = [f"train.precision={precision}", *(o for o in data if not o.startswith("parallel."))]
    layout = ["parallel.cp=2", f"parallel.cp_comm_type={comm_type}", *(o for o in data if o.startswith("parallel."))]
    _, single = _run(tmp_path / "single", 1, *common)
    out, got = _run(tmp_path / "cp2", 2, *common, *layout)
    assert "world 2 = tp 1 x cp 2 x pp 1 x dp 1" in out
    assert sorted(got) == sorted(single) == [1, 2, 3, 4]
    for step in single:
        for key in ("loss", "grad_norm"):
            want = single[step][key]
            assert got[step][key] == pytest.approx(want, rel=PRECISION[precision]), (step, key)


# GPT-OSS's sinks and sliding window; DeepSeek-V3's MLA (q/k 32, v 16 in the Triton blocks), MoE with the expert bias
# and the sequence aux loss, and MTP's shift across the CP chunks (tests/train/test_cp_sinks_mtp.py on gloo)
MODELS = {
    "gpt_oss": (["model=gpt_oss-tiny", "data.mock=true", "data.packing=true"], "p2p"),
    "deepseek_v3_mtp": (
        [
            "model=deepseek_v3-tiny",
            "model.num_nextn_predict_layers=1",
            "model.router_aux_loss_coef=0.01",
            "model.moe_router={score_function: sigmoid, expert_bias: true, n_group: 4, topk_group: 2, "
            "routed_scaling_factor: 2.5, bias_update_rate: 0.01, aux_loss_type: sequence}",
            "train.mtp_loss_weight=0.3",
        ],
        "a2a",
    ),
}


def _cp2_trains_like_one_gpu(tmp_path, model: str, common: list[str], comm_type: str) -> None:
    """fp32 losses and grad norms of 4 steps at cp=2 (``comm_type``) equal one GPU's within ``PRECISION``."""
    common = ["train.precision=fp32", *common]
    _, single = _run(tmp_path / "single", 1, *common)
    out, got = _run(tmp_path / "cp2", 2, *common, "parallel.cp=2", f"parallel.cp_comm_type={comm_type}")
    assert "world 2 = tp 1 x cp 2 x pp 1 x dp 1" in out
    assert sorted(got) == sorted(single) == [1, 2, 3, 4]
    for step in single:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(single[step][key], rel=PRECISION["fp32"]), (model, step, key)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_cp2_sinks_mla_mtp_on_two_gpus_train_like_one_gpu(tmp_path, model):
    _cp2_trains_like_one_gpu(tmp_path, model, *MODELS[model])


# Mamba-2 hybrids: the all-to-all around the Triton conv + scan (mcore.parallel.cp_ssm; tests/models/test_cp_hybrid.py
# on gloo), Nemotron-H with packed documents, Falcon-H1's parallel mixer with the a2a attention
HYBRIDS = {
    "nemotron_h": (["model=nemotron_h-tiny", "data.mock=true", "data.packing=true"], "p2p"),
    "falcon_h1": (["model=falcon_h1-tiny"], "a2a"),
}


@pytest.mark.parametrize("model", sorted(HYBRIDS))
def test_cp2_mamba_hybrids_on_two_gpus_train_like_one_gpu(tmp_path, model):
    _cp2_trains_like_one_gpu(tmp_path, model, *HYBRIDS[model])
