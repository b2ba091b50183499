"""The planner's hybrid (Nemotron-H) layers and per-expert GEMMs: shapes against the real models, the Mamba-2
rates against the kernel benchmark they come from, and the errors for what it cannot plan."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mcore.models import GPTModel, model_flops_per_token
from mcore.models.families import get_config
from mcore.train.config import load_config
from mcore.train.errors import UserError
from mcore.train.plan import layout_of
from mcore.train.planning.calibration import load_calibration
from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.mamba_terms import MambaShape, rates_from_ssm_benchmark
from mcore.train.planning.memory import GB, stage_memory
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import predict_step
from mcore.train.planning.time_model import TimeModel

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SSM_RUN = RESULTS / "helpers-h200-2026-12-01-s3" / "ssm"
H200 = Network(PRESETS["h200-node"])


def _tiny_hybrid_config():
    return replace(
        get_config("nemotron-h-8b-4l"), hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
        vocab_size=256,
    )  # fmt: skip


def test_hybrid_shape_counts_what_the_model_builds():
    """(The 8B preset's count is checked against its run's record in validation.ssm_cases.)"""
    config = _tiny_hybrid_config()
    shape = ModelShape.from_config(config)
    assert shape.hybrid_pattern == "M-M*" and not shape.gated and shape.attention_layers == 1
    with torch.device("meta"):
        model = GPTModel(config)
    assert shape.total_parameters() == sum(p.numel() for p in model.parameters())
    assert shape.model_flops_per_token(4096) == pytest.approx(model_flops_per_token(config, 4096), rel=1e-12)


def test_shipped_mamba_rates_are_the_kernel_benchmarks():
    kernels = json.loads((SSM_RUN / "ssm_throughput.json").read_text())["kernels"]
    derived = rates_from_ssm_benchmark(kernels)
    cal = load_calibration("h200-sxm")
    assert cal.ssd_tflops == pytest.approx(derived["ssd_tflops"], rel=1e-3)
    assert cal.conv_gbps == pytest.approx(derived["conv_gbps"], rel=1e-3)
    # the SSD's eight kernels are what the profiled training step spent in "ssm" (two Mamba layers), within 10%
    record = json.loads((SSM_RUN / "mcore_nemotronh8b4l_zero1.json").read_text())
    ssd_ms = sum(kernels["ssd_parts_ms"].values())
    assert 2 * ssd_ms == pytest.approx(record["profile"][0]["categories_ms"]["ssm"], rel=0.10)


def test_selective_recompute_trades_mamba_activations_for_scan_time():
    shape = ModelShape.from_config(get_config("nemotron-h-8b-4l"))
    plain = Layout(seq_length=4096, distributed_optimizer=True)
    selective = plain.replace(recompute="selective")
    assert stage_memory(shape, selective)[0].activations < 0.7 * stage_memory(shape, plain)[0].activations
    f0, f1 = (TimeModel(shape, lay, H200).layer_cost(0) for lay in (plain, selective))
    assert f1.backward["ssm"] == pytest.approx(f0.backward["ssm"] + f0.forward["ssm"])
    assert "ssm" not in TimeModel(shape, plain, H200).layer_cost(3).forward  # the attention layer runs no scan
    assert "attention" not in f0.forward


def test_hybrid_errors_name_the_problem():
    base = dict(hidden=64, ffn=96, layers=3, heads=4, kv_heads=2, head_dim=16, vocab=256, gated=False)
    with pytest.raises(ValueError, match="hybrid_pattern"):
        ModelShape(**base, hybrid_pattern="M-E", mamba=MambaShape(8, 8, 2, 16))
    with pytest.raises(ValueError, match="set ModelShape.mamba"):
        ModelShape(**base, hybrid_pattern="M-*")
    with pytest.raises(ValueError, match="multiple of groups"):
        MambaShape(heads=6, head_dim=8, groups=4, state=16)
    shape = ModelShape(**base, hybrid_pattern="M-*", mamba=MambaShape(8, 8, 2, 16))
    assert Layout(tp=2, seq_length=64).problems(shape) == []
    assert Layout(tp=4, seq_length=64).problems(shape) == [
        "tp=4 does not divide the 2 Mamba-2 groups (whole groups per rank)"
    ]
    assert any("no context parallelism" in p for p in Layout(cp=2, seq_length=64).problems(shape))
    no_rates = replace(H200.gpu, ssd_tflops=None)
    with pytest.raises(UserError, match="no Mamba-2 rates"):
        TimeModel(shape, Layout(seq_length=64), Network(H200.cluster, no_rates)).layer_cost(0)
    with pytest.raises(ValueError, match="ssd_tflops"):
        replace(H200.gpu, ssd_tflops=[1.0])


def test_per_expert_gemms_are_dense_gemms_per_expert():
    shape = ModelShape(hidden=4096, ffn=14336, layers=2, heads=32, kv_heads=8, head_dim=128, vocab=32000,
                       num_experts=8, top_k=2, moe_ffn=14336)  # fmt: skip
    grouped = Layout(micro_batch=2, global_batch=2, seq_length=4096, distributed_optimizer=True)
    per_expert = grouped.replace(expert_gemm="per_expert")
    g = H200.gpu
    rows = 2 * 4096 * 2 / 8
    fc1 = g.gemm_seconds(rows, 2 * 14336, 4096) + g.gemm_seconds(rows, 4096, 2 * 14336)
    fc1 += g.gemm_seconds(2 * 14336, 4096, rows) * g.wgrad_fp32_slowdown
    fc2 = g.gemm_seconds(rows, 4096, 14336) + g.gemm_seconds(rows, 14336, 4096)
    fc2 += g.gemm_seconds(4096, 14336, rows) * g.wgrad_fp32_slowdown
    t0, t1 = (TimeModel(shape, lay, H200).layer_cost(0) for lay in (grouped, per_expert))
    # everything but the experts is the same in both: the difference is theirs
    assert (t1.f + t1.b) - (t0.f + t0.b) == pytest.approx(8 * (fc1 + fc2) - _grouped(g, rows), rel=1e-9)
    assert predict_step(shape, per_expert, H200).step_s < predict_step(shape, grouped, H200).step_s  # 2,048 rows each
    assert stage_memory(shape, per_expert)[0].allocated / GB == stage_memory(shape, grouped)[0].allocated / GB
    with pytest.raises(ValueError, match="expert_gemm"):
        Layout(expert_gemm="looped")
    config = load_config(overrides=["model=mixtral-8x7b", "model.moe_router={expert_gemm: per_expert}"])
    assert layout_of(config, 1).expert_gemm == "per_expert"


def _grouped(g, rows: float) -> float:
    out = 0.0
    for n, k in ((2 * 14336, 4096), (4096, 14336)):
        fwd = g.grouped_gemm_seconds(8, rows, n, k)
        out += fwd + g.grouped_gemm_seconds(8, rows, k, n) + fwd * g.wgrad_fp32_slowdown
    return out


def _saved_by_mamba_layer(device: str, tokens: int, recompute: str) -> tuple[float, float]:
    """(planned, measured) bytes one Nemotron-H-8B Mamba-2 layer in bf16 keeps for backward: the distinct
    storages autograd saves during its forward against ``activation_parts_per_layer``."""
    from mcore.train.planning.memory import activation_parts_per_layer

    config = get_config("nemotron-h-8b-4l")
    model = GPTModel(config, layer_range=(0, 1), pre_process=False, post_process=False, params_dtype=torch.bfloat16,
                     device=device, recompute=None if recompute == "none" else recompute)  # fmt: skip
    x = torch.randn(tokens, 1, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x, None)
    parts = activation_parts_per_layer(
        ModelShape.from_config(config), Layout(seq_length=tokens, recompute=recompute), 0
    )
    return sum(parts.values()), float(sum(storages.values()))


def test_mamba_layer_with_its_core_recomputed_saves_what_the_planner_counts():
    """Selective recompute keeps the norm's input, in_proj's input and output and out_proj's input, whatever the
    scan's backend (the full scan's saved tensors are the Triton kernels': the CUDA test below)."""
    planned, measured = _saved_by_mamba_layer("cpu", 256, "selective")
    assert planned == pytest.approx(measured, rel=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton scan saves what it saves)")
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_mamba_layer_saves_what_the_planner_counts_on_cuda(recompute):
    """At 4,096 tokens with the Triton SSD and conv kernels, within 10%."""
    planned, measured = _saved_by_mamba_layer("cuda", 4096, recompute)
    assert planned == pytest.approx(measured, rel=0.10)
