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
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    from moe_throughput import HF_MOE_BASELINE  # ../shared beside a checkout or shared/ inside it
finally:
    sys.path.remove(str(ROOT / "benchmarks"))
BASELINE_KEYS = ("impl", "shape", "params", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb")


VARIANTS = "zero1:grouped,fsdp:per_expert"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_throughput")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = ROOT / "benchmarks" / "moe_throughput.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--json-dir", str(out), "--variants", VARIANTS],
        capture_output=True,
        text=True,
        env=env,
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


def test_dry_run_runs_each_variant(dry_run):
    """FSDP2 with the per-expert GEMMs ran beside ZeRO-1 with the grouped ones with the same losses over every step
    (same weights and data; the layouts differ in where the fp32 masters live): tiny_mla has MLA, shared experts and
    the expert-bias buffer, updated once per step, under FSDP2 at world size 1."""
    for shape in ("tiny", "tiny_mla"):
        zero1 = json.loads((dry_run / f"mcore_{shape}.json").read_text())
        fsdp = json.loads((dry_run / f"mcore-fsdp-per_expert_{shape}.json").read_text())
        assert fsdp["impl"] == "mcore-fsdp-per_expert-dryrun" and fsdp["expert_gemm"] == "per_expert"
        assert len(fsdp["losses"]) == 5 and fsdp["losses"] == pytest.approx(zero1["losses"], rel=1e-5)
    summary = json.loads((dry_run / "summary.json").read_text())
    assert set(summary["shapes"]["tiny"]["ratios_by_variant"]) == {"mcore", "mcore-fsdp-per_expert"}


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


def test_profile_steps_run_after_the_timed_ones():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    spec = moe_throughput.build_spec("mixtral2l", iters=8, warmup=2, dry_run=False, profile_steps=2)
    assert spec.profile_steps == 2 and "train.steps=13" in spec.overrides
    assert spec.model["moe_router"] == {"align": 8}
    per_expert = moe_throughput.build_spec("mixtral2l", iters=1, warmup=0, dry_run=False, expert_gemm="per_expert")
    assert per_expert.model["moe_router"] == {"align": 8, "expert_gemm": "per_expert"}
    assert moe_throughput.parse_args(["--json-dir", "/tmp/x"]).profile_steps == 1
    with pytest.raises(SystemExit):
        moe_throughput.parse_args(["--dry-run", "--profile-steps", "1"])


def test_fsdp_variant_swaps_the_optimizer_layout():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    spec = moe_throughput.build_spec("mixtral2l", iters=1, warmup=0, dry_run=False, fsdp=True)
    assert spec.name == "mcore-fsdp_mixtral2l" and "parallel.dp_shard=true" in spec.overrides
    assert "parallel.distributed_optimizer=true" not in spec.overrides
    args = moe_throughput.parse_args(["--fsdp", "--json-dir", "/tmp/x", "--shape", "mixtral2l"])
    labels = [label for label, _ in moe_throughput._runs(args, "mixtral2l", Path("/tmp/x"))]
    assert labels == ["mcore", "mcore-fsdp", "hf", "hf-compile"]
    variants = "zero1:per_expert,fsdp:grouped,fsdp_reshard:per_expert"
    args = moe_throughput.parse_args(["--variants", variants, "--skip-compile", "--json-dir", "/tmp/x"])
    runs = dict(moe_throughput._runs(args, "mixtral2l", Path("/tmp/x")))
    assert list(runs) == ["mcore-per_expert", "mcore-fsdp", "mcore-fsdp_reshard-per_expert", "hf"]
    child = runs["mcore-fsdp_reshard-per_expert"]
    assert (
        child[child.index("--layout") + 1] == "fsdp_reshard" and child[child.index("--expert-gemm") + 1] == "per_expert"
    )
    child_args = moe_throughput.parse_args(child[1:])
    spec = moe_throughput.build_spec("mixtral2l", iters=1, warmup=0, dry_run=False, layout=child_args.layout)
    assert (
        spec.name == "mcore-fsdp_reshard_mixtral2l" and "parallel.dp_shard_reshard_after_forward=true" in spec.overrides
    )
    assert child[child.index("--json") + 1] == "/tmp/x/mcore-fsdp_reshard-per_expert_mixtral2l.json"
    for bad, match in (("zero2:grouped", "want LAYOUT:GEMM"), ("fsdp", "want LAYOUT:GEMM"), ("zero1:x", "GEMM one of")):
        with pytest.raises(ValueError, match=match):
            moe_throughput.parse_variants(bad)
    with pytest.raises(ValueError, match="twice"):
        moe_throughput.parse_variants("fsdp:grouped,fsdp:grouped")


def test_memory_breakdown_dry_run(tmp_path):
    out = tmp_path / "memory.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = ROOT / "benchmarks" / "moe_memory.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--steps", "2", "--json", str(out), "--expert-gemm", "per_expert"]
        + ["--layout", "fsdp"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["shape"] == "tiny" and record["layout"] == "fsdp2" and record["params"] > 0
    assert len(record["steps"]) == 3 and record["peak_gb"] is None  # after the build, then 2 steps; CPU: no CUDA
    assert set(record["steps"][1]) >= {"start_gb", "forward_backward_peak_gb", "optimizer_peak_gb", "end_gb"}
    assert "after_forward_gb" in record["steps"][1] and record["expert_gemm"] == "per_expert"


def test_summary_renders_every_profiled_run_and_each_variants_ratios():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_throughput
        from moe_profile import moe_time_breakdown
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    b = moe_time_breakdown({"step_window_ms": 10.0, "idle_ms": 1.0, "categories_ms": {"moe experts: gemm": 9.0}})
    run = {"impl": "mcore", "tokens_per_s": 2.0, "step_s": 1.0, "tflops_per_gpu": 1.0, "mfu": 0.1, "peak_mem_gb": 1.0}
    run |= {"first_step_s": 1.0, "time_breakdown": b}
    hf = {**run, "impl": "hf-transformers", "tokens_per_s": 1.0, "peak_mem_gb": 2.0}
    results = {"mcore": run, "mcore-fsdp": {**run, "impl": "mcore-fsdp"}, "hf": hf}
    entry = {"results": results, "ratios": moe_throughput.ratios(results)}
    entry["ratios_by_variant"] = {"mcore-fsdp": moe_throughput.ratios({**results, "mcore": results["mcore-fsdp"]})}
    text = moe_throughput._render({"shapes": {"s": entry}, "failures": []})
    assert "| part | s mcore | s mcore-fsdp |" in text and "| grouped GEMMs | 9.00 (90.0%) |" in text
    assert "- s mcore-fsdp: tokens/s vs HF-eager 2.000, peak memory vs HF-eager 0.500" in text
