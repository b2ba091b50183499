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
from mcore.train.planning.cluster import PRESETS, Group, Network
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


def test_mamba_conv_rate_reads_a_fused_backward_profile_too():
    """With the conv's fused backward (BACKWARD="fused") the profile has no dpre / dx kernels: the same time in one
    kernel gives the same rate."""
    kernels = json.loads((SSM_RUN / "ssm_throughput.json").read_text())["kernels"]
    split = rates_from_ssm_benchmark(kernels)["conv_gbps"]
    conv = kernels["conv_ours_kernels"]["kernels_ms"]
    fused = conv.pop("_conv_dpre_kernel") + conv.pop("_conv_dx_kernel")
    conv["_conv_bwd_fused_kernel"] = fused
    assert rates_from_ssm_benchmark(kernels)["conv_gbps"] == pytest.approx(split, rel=1e-12)


def test_selective_recompute_trades_mamba_activations_for_scan_time():
    shape = ModelShape.from_config(get_config("nemotron-h-8b-4l"))
    plain = Layout(seq_length=4096, distributed_optimizer=True)
    selective = plain.replace(recompute="selective")
    assert stage_memory(shape, selective)[0].activations < 0.7 * stage_memory(shape, plain)[0].activations
    f0, f1 = (TimeModel(shape, lay, H200).layer_cost(0) for lay in (plain, selective))
    assert f1.backward["ssm"] == pytest.approx(f0.backward["ssm"] + f0.forward["ssm"])
    assert "ssm" not in TimeModel(shape, plain, H200).layer_cost(3).forward  # the attention layer runs no scan
    assert "attention" not in f0.forward


def test_mamba_layers_under_cp_pay_the_all_to_all_around_the_scan():
    shape = ModelShape.from_config(get_config("nemotron-h-8b-4l"))
    cp2 = Layout(seq_length=8192, cp=2, distributed_optimizer=True)
    m, tokens = shape.mamba, 8192 / 2
    # in_proj's output in, the core's output back: bf16, over the 2 CP ranks, once in forward and once in backward
    want = H200.collective("all_to_all", Group(2, 1), tokens * (m.in_width + m.d_inner) * 2)
    mamba = TimeModel(shape, cp2, H200).layer_cost(0)
    assert want > 0
    assert mamba.forward["cp_comm"] == pytest.approx(want) and mamba.backward["cp_comm"] == pytest.approx(want)
    assert "cp_comm" not in TimeModel(shape, cp2.replace(cp=1), H200).layer_cost(0).forward


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
    assert Layout(cp=2, seq_length=64).problems(shape) == []  # the mixer's all-to-all: whole groups per CP rank
    assert Layout(tp=2, cp=2, seq_length=64).problems(shape) == [
        "cp=2 does not divide each TP rank's 1 Mamba-2 groups and 4 heads"
    ]
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
    # the grouped weight gradient is a bf16 GEMM (no fp32 epilogue) copied into main_grad: read 2, write 4 bytes
    bf16_wgrad = sum(g.grouped_gemm_seconds(8, rows, n, k) for n, k in ((2 * 14336, 4096), (4096, 14336)))
    grouped_experts = _grouped(g, rows) - bf16_wgrad * (g.wgrad_fp32_slowdown - 1)
    grouped_experts += g.memory_seconds(6 * 8 * 3 * 14336 * 4096)
    # everything but the experts is the same in both: the difference is theirs
    assert (t1.f + t1.b) - (t0.f + t0.b) == pytest.approx(8 * (fc1 + fc2) - grouped_experts, rel=1e-9)
    assert predict_step(shape, per_expert, H200).step_s < predict_step(shape, grouped, H200).step_s  # 2,048 rows each
    assert stage_memory(shape, per_expert)[0].allocated / GB == stage_memory(shape, grouped)[0].allocated / GB
    with pytest.raises(ValueError, match="expert_gemm"):
        Layout(expert_gemm="looped")
    config = load_config(overrides=["model=mixtral-8x7b", "model.moe_router={expert_gemm: per_expert}"])
    assert layout_of(config, 1).expert_gemm == "per_expert"


def test_grouped_fp32_wgrad_is_grouped_but_for_the_weight_gradients():
    shape = ModelShape(hidden=4096, ffn=14336, layers=2, heads=32, kv_heads=8, head_dim=128, vocab=32000,
                       num_experts=8, top_k=2, moe_ffn=14336)  # fmt: skip
    grouped = Layout(micro_batch=2, global_batch=2, seq_length=4096, distributed_optimizer=True)
    hybrid = grouped.replace(expert_gemm="grouped_fp32_wgrad")
    g = H200.gpu
    rows = 2 * 4096 * 2 / 8
    grouped_wgrad = g.grouped_gemm_seconds(8, rows, 2 * 14336, 4096) + g.grouped_gemm_seconds(8, rows, 4096, 14336)
    dense_wgrad = g.gemm_seconds(2 * 14336, 4096, rows) + g.gemm_seconds(4096, 14336, rows)
    t0, t1 = (TimeModel(shape, lay, H200).layer_cost(0) for lay in (grouped, hybrid))
    assert t1.f == pytest.approx(t0.f, rel=1e-12)  # the forward GEMMs are the grouped ones
    # grouped: a bf16 weight-gradient GEMM, then its copy into main_grad (read 2, write 4 bytes per element)
    want = 8 * dense_wgrad * g.wgrad_fp32_slowdown - grouped_wgrad - g.memory_seconds(6 * 8 * 3 * 14336 * 4096)
    assert t1.b - t0.b == pytest.approx(want, rel=1e-9)
    config = load_config(overrides=["model=mixtral-8x7b", "model.moe_router={expert_gemm: grouped_fp32_wgrad}"])
    assert layout_of(config, 1).expert_gemm == "grouped_fp32_wgrad"


def _grouped(g, rows: float) -> float:
    out = 0.0
    for n, k in ((2 * 14336, 4096), (4096, 14336)):
        fwd = g.grouped_gemm_seconds(8, rows, n, k)
        out += fwd + g.grouped_gemm_seconds(8, rows, k, n) + fwd * g.wgrad_fp32_slowdown
    return out


def _saved_by_mamba_layer(
    device: str, tokens: int, recompute: str, modules: tuple[str, ...] | None = None, index: int = 0, config=None
) -> tuple[float, float]:
    """(planned, measured) bytes one Nemotron-H-8B layer (``index`` 0: Mamba-2, 1: MLP; or of ``config``) in bf16
    keeps for backward: the distinct storages autograd saves during its forward (parameters and views of them
    apart: they are not activations) against ``activation_parts_per_layer``."""
    from mcore.train.planning.memory import activation_parts_per_layer

    config = get_config("nemotron-h-8b-4l") if config is None else config
    model = GPTModel(config, layer_range=(index, index + 1), pre_process=False, post_process=False,
                     params_dtype=torch.bfloat16, device=device, recompute=None if recompute == "none" else recompute,
                     recompute_modules=modules)  # fmt: skip
    x = torch.randn(tokens, 1, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[str(index)](x, None)
    layout = Layout(seq_length=tokens, recompute=recompute, recompute_modules=modules)
    parts = activation_parts_per_layer(ModelShape.from_config(config), layout, index)
    return sum(parts.values()), float(sum(storages.values()))


def test_mamba_layer_with_its_core_recomputed_saves_what_the_planner_counts():
    """Selective recompute keeps the norm's input, in_proj's input and output and out_proj's input, whatever the
    scan's backend (the full scan's saved tensors are the Triton kernels': the CUDA test below)."""
    planned, measured = _saved_by_mamba_layer("cpu", 256, "selective")
    assert planned == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize(
    "index,modules",
    [
        (0, ("mamba_core",)),
        (0, ("layernorm", "mamba_core")),
        (1, ("mlp",)),
        (1, ("layernorm",)),
        (1, ("layernorm", "mlp")),
    ],
)
def test_recompute_modules_on_hybrid_layers_save_what_the_planner_counts(index, modules):
    """train.recompute_modules on a Mamba-2 layer (the core recomputed: the CPU scan's saved tensors are not the
    Triton kernels', so the core itself is compared on CUDA) and on an MLP layer: within 1%."""
    planned, measured = _saved_by_mamba_layer("cpu", 256, "selective", modules, index)
    assert planned == pytest.approx(measured, rel=0.01)


def test_a_list_without_mamba_core_plans_the_core_kept():
    shape = ModelShape.from_config(get_config("nemotron-h-8b-4l"))
    from mcore.train.planning.memory import activation_bytes_per_layer

    default, mlp_only, core = (
        activation_bytes_per_layer(shape, Layout(seq_length=4096, recompute="selective", recompute_modules=m), 0)
        for m in (None, ("mlp",), ("mamba_core",))
    )
    plain = activation_bytes_per_layer(shape, Layout(seq_length=4096), 0)
    assert default == core < mlp_only == plain
    f_mlp, f_core = (
        TimeModel(shape, Layout(seq_length=4096, recompute="selective", recompute_modules=m), H200).layer_cost(0)
        for m in (("mlp",), ("mamba_core",))
    )
    assert f_core.backward["ssm"] == pytest.approx(f_mlp.backward["ssm"] + f_mlp.forward["ssm"])
    assert f_mlp.backward == TimeModel(shape, Layout(seq_length=4096), H200).layer_cost(0).backward


@pytest.mark.parametrize("recompute,modules", [("none", None), ("selective", ("mlp",))])
def test_mamba_layer_with_the_triton_kernels_saves_what_the_planner_counts(recompute, modules, monkeypatch):
    """The core kept (no recompute, or a list without mamba_core): the Triton conv, SSD and gated norm run under
    the CPU interpreter, as on CUDA, at a small shape of the 8B's proportions (chunks of 32 tokens), within 1%."""
    from mcore.kernels import dispatch

    if not (dispatch.triton_available() and dispatch.triton_interpreting()):
        pytest.skip("needs triton and TRITON_INTERPRET=1 (on CUDA the test below runs the compiled kernels)")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    config = replace(
        get_config("nemotron-h-8b-4l"), hidden_size=128, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
        ssm_state_size=32, chunk_size=32,
    )  # fmt: skip
    planned, measured = _saved_by_mamba_layer("cpu", 128, recompute, modules, config=config)
    assert planned == pytest.approx(measured, rel=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton scan saves what it saves)")
@pytest.mark.parametrize(
    "recompute,modules",
    [("none", None), ("selective", None), ("selective", ("mlp",)), ("selective", ("layernorm", "mamba_core"))],
)
def test_mamba_layer_saves_what_the_planner_counts_on_cuda(recompute, modules, monkeypatch):
    """At 4,096 tokens with the Triton SSD and conv kernels, within 3% (a list without mamba_core: the core's
    tensors are kept, as without recompute). The state matmuls are pinned to the Triton kernels the planner counts
    (``auto`` picks them at this shape on an H200, by timing: torch's fp32 matmuls would save other tensors)."""
    import mcore.kernels.ssd_triton as ssd_triton

    monkeypatch.setattr(ssd_triton, "STATE_MATMULS", "triton")
    planned, measured = _saved_by_mamba_layer("cuda", 4096, recompute, modules)
    assert planned == pytest.approx(measured, rel=0.03)
