"""CPU dry run of benchmarks/moe_throughput.py: the real mcore-train MoE step, the micro-benchmarks, the JSON with
the baseline's keys, and a FLOP count equal to hf_moe_baseline.py's formula for the same shape."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# ../shared beside a checkout (the lead's), or shared/ inside it (the GPU machine's copy)
HF_MOE_BASELINE = (
    next(
        (p for p in (ROOT.parent / "shared", ROOT / "shared") if (p / "bench" / "hf_moe_baseline.py").is_file()),
        ROOT.parent / "shared",
    )
    / "bench"
    / "hf_moe_baseline.py"
)
BASELINE_KEYS = ("impl", "shape", "params", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_throughput")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = ROOT / "benchmarks" / "moe_throughput.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--json-dir", str(out)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_dry_run_writes_the_baseline_keys(dry_run):
    record = json.loads((dry_run / "mcore_tiny.json").read_text())
    assert all(k in record for k in BASELINE_KEYS)
    assert record["impl"] == "mcore-dryrun" and record["tokens_per_s"] > 0 and len(record["losses"]) == 5
    summary = json.loads((dry_run / "summary.json").read_text())
    assert summary["failures"] == [] and "tiny" in summary["shapes"]
    mla = json.loads((dry_run / "mcore_tiny_mla.json").read_text())  # the moonlight8l model at a tiny size
    assert mla["family"] == "deepseek_v3" and mla["tokens_per_s"] > 0 and len(mla["losses"]) == 5


def test_micro_benchmarks_ran(dry_run):
    micro, _ = json.loads((dry_run / "micro.json").read_text())
    for key in ("grouped_gemm_tflops", "dense_gemm_tflops", "router_and_plan_ms", "permute_fwd_bwd_ms"):
        assert micro[key] > 0, key
    assert micro["tokens_per_expert_max"] >= micro["tokens_per_expert_mean"]


@pytest.mark.skipif(not HF_MOE_BASELINE.is_file(), reason="needs ../shared/bench/hf_moe_baseline.py")
def test_flops_match_the_baseline_formula(dry_run):
    spec = importlib.util.spec_from_file_location("hf_moe_baseline", HF_MOE_BASELINE)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for name in (*moe_throughput.DRY_RUN_SHAPES, *moe_throughput.GPU_SHAPES):
        shape = moe_throughput.SHAPES[name]
        want = 6 * baseline.active_matmul_weights(shape) + baseline.attention_flops_per_token(shape)
        from mcore.models.accounting import model_flops_per_token
        from mcore.models.config import TransformerConfig

        config = TransformerConfig(**moe_throughput.moe_model(shape, align=8))
        assert model_flops_per_token(config, shape["seq"]) == pytest.approx(want, rel=1e-9), name
    for name in moe_throughput.DRY_RUN_SHAPES:
        record = json.loads((dry_run / f"mcore_{name}.json").read_text())
        tiny = moe_throughput.SHAPES[name]
        want = 6 * baseline.active_matmul_weights(tiny) + baseline.attention_flops_per_token(tiny)
        assert record["flops_per_token"] == pytest.approx(want, rel=1e-9), name
