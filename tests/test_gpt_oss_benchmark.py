"""CPU dry run of ``benchmarks/moe_throughput.py --shape gptoss``: the real mcore-train step of a tiny GPT-OSS (sinks,
sliding / full layers, YaRN, biased experts, clamped SwiGLU), its JSON with the baseline's keys, and FLOP counts
equal to ``hf_moe_baseline.py``'s formula for the gptoss4l shapes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.test_moe_benchmark import BASELINE_KEYS, HF_MOE_BASELINE, ROOT


def _moe_throughput():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return moe_throughput


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_oss_throughput")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = ROOT / "benchmarks" / "moe_throughput.py"
    argv = [sys.executable, str(script), "--dry-run", "--shape", "gptoss", "--skip-micro", "--json-dir", str(out)]
    argv += ["--variants", "zero1:grouped,zero1:per_expert"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_dry_run_trains_a_gpt_oss_model(dry_run):
    record = json.loads((dry_run / "mcore_gptoss_tiny.json").read_text())
    assert all(k in record for k in BASELINE_KEYS)
    assert record["family"] == "gpt_oss" and record["tokens_per_s"] > 0 and len(record["losses"]) == 5
    assert all(loss == loss for loss in record["losses"])  # finite, not NaN
    summary = json.loads((dry_run / "summary.json").read_text())
    assert summary["failures"] == [] and list(summary["shapes"]) == ["gptoss_tiny"]


def test_per_expert_gemms_train_gpt_oss_like_grouped(dry_run):
    """The biased experts with one GEMM per expert (weight gradients into main_grad in fp32): the same losses."""
    grouped = json.loads((dry_run / "mcore_gptoss_tiny.json").read_text())["losses"]
    per_expert = json.loads((dry_run / "mcore-per_expert_gptoss_tiny.json").read_text())
    assert per_expert["expert_gemm"] == "per_expert" and len(per_expert["losses"]) == len(grouped) == 5
    assert per_expert["losses"] == pytest.approx(grouped, rel=1e-5)


def test_gpt_oss_model_section_is_the_family():
    from mcore.models.config import TransformerConfig

    bench = _moe_throughput()
    config = TransformerConfig(**bench.moe_model(bench.SHAPES["gptoss4l"], align=8))
    assert config.attention_sinks and config.router_bias and config.expert_biases and config.swiglu_limit == 7.0
    assert config.layer_types == ("sliding_attention", "full_attention") * 2 and config.sliding_window == 128
    assert config.rope_scaling["rope_type"] == "yarn"
    assert config.moe_router == {"softmax_before_topk": False, "align": 8}
    per_expert = bench.moe_model(bench.SHAPES["gptoss4l"], align=8, expert_gemm="per_expert")
    assert per_expert["moe_router"] == {"softmax_before_topk": False, "align": 8, "expert_gemm": "per_expert"}
    assert bench.SHAPES["gptoss4l_mb2"]["mbs"] == 2 and bench.SHAPES["gptoss4l_mb2"]["baseline"] is False


@pytest.mark.skipif(not HF_MOE_BASELINE.is_file(), reason="needs ../shared/bench/hf_moe_baseline.py")
def test_flops_match_the_baseline_formula():
    from mcore.models.accounting import model_flops_per_token
    from mcore.models.config import TransformerConfig

    spec = importlib.util.spec_from_file_location("hf_moe_baseline", HF_MOE_BASELINE)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    bench = _moe_throughput()
    for name in ("gptoss_tiny", *bench.GPT_OSS_SHAPES):
        shape = bench.SHAPES[name]
        want = 6 * baseline.active_matmul_weights(shape) + baseline.attention_flops_per_token(shape)
        config = TransformerConfig(**bench.moe_model(shape, align=8))
        assert model_flops_per_token(config, shape["seq"]) == pytest.approx(want, rel=1e-9), name
