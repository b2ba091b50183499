"""benchmarks/step_profile.py: kernel categories, busy/idle and exposed communication from a Chrome trace."""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import step_profile  # noqa: E402


def _k(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"name": name, "cat": cat, "ts": ts, "dur": dur, "ph": "X"}


def _mark(ts: float, dur: float) -> dict:
    return {"name": step_profile.STEP_MARK, "cat": "user_annotation", "ts": ts, "dur": dur, "ph": "X"}


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "gemm"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("_fwd_kernel", "attention"),  # mcore's Triton flash kernels (gptoss4l's 5.4 ms were "other" on 2026-12-01)
        ("_bwd_kv_kernel", "attention"),
        ("_bwd_q_kernel", "attention"),
        ("_glu_fwd_kernel", "activation"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
        ("_norm_fwd_kernel", "norm"),
        ("_row_stats_kernel", "loss"),
        ("_grad_kernel", "loss"),
        ("_glu_bwd_kernel", "activation"),
        ("_rotary_kernel", "rope"),
        ("Memcpy DtoD (Device -> Device)", "copy/cast"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
            step_profile.OTHER,
        ),
    ],
)
def test_categories(name, category):
    assert step_profile.categorize(name) == category


def test_breakdown_busy_idle_and_exposed_communication():
    # Step 1 (host start at 0): gemm 10..40, comm 30..60 (10 of it under the gemm), norm 70..80 -> window 80,
    # busy 30+20+10 = 60, exposed comm 20. Step 2 (host start at 1000): attention 1005..1025 -> window 25, busy 20.
    trace = {
        "traceEvents": [
            _mark(0, 5),
            _k("sm90_xmma_gemm", 10, 30),
            _k("ncclDevKernel_AllGather", 30, 30),
            _k("_norm_fwd_kernel", 70, 10),
            _mark(1000, 5),
            _k("flash_bwd_kernel", 1005, 20),
            {"name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 3, "dur": 1, "ph": "X"},
        ]
    }
    b = step_profile.breakdown_from_trace(trace)
    assert b["steps"] == 2
    assert b["step_window_ms"] == pytest.approx((80 + 25) / 2 / 1e3)
    assert b["busy_ms"] == pytest.approx((60 + 20) / 2 / 1e3)
    assert b["idle_ms"] == pytest.approx((20 + 5) / 2 / 1e3)
    assert b["exposed_communication_ms"] == pytest.approx(20 / 2 / 1e3)
    assert b["categories_ms"] == pytest.approx(
        {"gemm": 0.015, "communication": 0.015, "attention": 0.01, "norm": 0.005}
    )
    assert [k["name"] for k in b["top_kernels"]][:2] == ["sm90_xmma_gemm", "ncclDevKernel_AllGather"]
    # the first step's idle, where it was: 10 us before the gemm, then 10 us between the all-gather and the norm
    assert b["idle_gaps"] == [
        {"at_ms": 0.0, "gap_ms": 0.01, "before": "(step start)", "after": "sm90_xmma_gemm"},
        {"at_ms": 0.06, "gap_ms": 0.01, "before": "ncclDevKernel_AllGather", "after": "_norm_fwd_kernel"},
    ]
    text = step_profile.render_breakdown(b)
    assert "| gemm | 0.01 |" in text and "idle (GPU waits for the host)" in text


def test_breakdown_without_marks_or_kernels_says_so():
    with pytest.raises(ValueError, match="annotations"):
        step_profile.breakdown_from_trace({"traceEvents": [_k("gemm", 0, 1)]})
    with pytest.raises(ValueError, match="no GPU kernels"):
        step_profile.breakdown_from_trace({"traceEvents": [_mark(0, 1)]})


def test_multi_gpu_report_lists_each_ranks_breakdown():
    import multi_gpu

    b = step_profile.breakdown_from_trace(
        {"traceEvents": [_mark(0, 1), _k("nvjet_gemm", 0, 300), _k("ncclDevKernel_SendRecv", 200, 200)]}
    )
    text = multi_gpu.render_profiles({"pp2-1f1b": {"profile": [b, b]}, "tp2": {"profile": None}})
    rows = [line for line in text.splitlines() if line.startswith("| pp2-1f1b")]
    assert len(rows) == 2
    # step 0.4 ms: GEMM 0.3, communication 0.2 of which 0.1 exposed, no idle
    assert rows[1].split("|")[2:9] == [" 1 ", " 0.4 ", " 0.3 ", " 0 ", " 0.2 ", " 0.1 ", " 0 "]
    assert multi_gpu.render_profiles({"tp2": {"profile": None}}) == ""


def _moe_trace_on_cpu():
    """A real CPU profiler trace of an MoE layer between two dense linears, forward and backward, inside a step
    mark; every GEMM op is given a fake GPU kernel (same time, linked by External id) named like a cuBLAS one."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from mcore.parallel.expert_parallel import MoEConfig, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=16, num_experts=4, topk=2, moe_intermediate_size=8))
    layer.router.reset_parameters()
    layer.experts.reset_parameters()
    dense = torch.nn.Linear(16, 16)
    x = torch.randn(2, 6, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function(step_profile.STEP_MARK):
        dense(layer(dense(x))).square().sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    gemms = [e for e in events if e.get("cat") == "cpu_op" and e["name"] in ("aten::mm", "aten::addmm")]
    kernels = [
        {
            "name": "nvjet_gemm",
            "cat": "kernel",
            "ts": e["ts"],
            "dur": e["dur"],
            "args": {"External id": e["args"]["External id"]},
        }
        for e in gemms
    ]
    return events + kernels, gemms


def test_moe_scopes_follow_kernels_into_backward():
    events, gemms = _moe_trace_on_cpu()
    label = step_profile.scope_labeller(events, step_profile.SCOPES)
    found = Counter(label({"args": {"External id": e["args"]["External id"]}}) for e in gemms)
    # experts (reference grouped GEMM, 4 experts): 2 GEMMs x 4 forward, 2 x 2 x 4 backward; router: its linear
    # forward, dgrad, wgrad; the two dense linears: 1 forward + 2 backward each, in no scope
    assert found == {"moe experts": 24, "moe router": 3, None: 6}
    b = step_profile.breakdown_from_trace({"traceEvents": events})
    assert set(b["categories_ms"]) == {"moe experts: gemm", "moe router: gemm", "gemm"}
    assert {k["category"] for k in b["top_kernels"]} == set(b["categories_ms"])


def test_scopes_by_correlation_and_nested_ranges():
    # forward op 1 (seq 7) inside the permute range launches kernel a; backward node (seq 7) launches kernel b
    # through a cuda_runtime event linked by correlation; an unscoped op launches c
    ann = {"cat": "user_annotation", "ph": "X", "tid": 1}
    op = {"cat": "cpu_op", "ph": "X"}
    events = [
        {**ann, "name": "mcore.moe.permute", "ts": 0, "dur": 10},
        {**op, "name": "aten::index", "tid": 1, "ts": 2, "dur": 1, "args": {"External id": 1, "Sequence number": 7}},
        {**op, "name": "aten::add", "tid": 1, "ts": 20, "dur": 1, "args": {"External id": 2, "Sequence number": 8}},
        {**op, "name": "autograd::engine::evaluate_function: X", "tid": 2, "ts": 30, "dur": 10,
         "args": {"External id": 3, "Sequence number": 7}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ph": "X", "tid": 2, "ts": 35, "dur": 1,
         "args": {"correlation": 99}},
    ]  # fmt: skip
    label = step_profile.scope_labeller(events, step_profile.SCOPES)
    assert label({"args": {"External id": 1}}) == "moe permute"
    assert label({"args": {"correlation": 99, "External id": 3}}) == "moe permute"
    assert label({"args": {"External id": 2}}) is None
    assert label({"args": {}}) is None
    nested = step_profile._Ranges([(0, 100, "outer"), (10, 20, "inner"), (30, 40, "second")])
    assert [nested.at(t) for t in (5, 15, 25, 35, 101)] == ["outer", "inner", "outer", "second", None]


def test_moe_rows_fold_the_categories():
    import moe_profile

    b = {
        "step_window_ms": 10.0,
        "idle_ms": 1.0,
        "categories_ms": {"moe experts: gemm": 4.0, "moe experts": 1.0, "moe router: gemm": 0.5, "moe router": 0.5,
                          "moe permute": 0.5, "gemm": 1.0, "attention": 1.0, "norm": 0.3, "loss": 0.2},
    }  # fmt: skip
    rows = moe_profile.moe_time_breakdown(b)["rows"]
    assert rows["grouped GEMMs"] == {"ms": 4.0, "percent": 40.0}
    assert rows["router"]["ms"] == 1.0 and rows["permute"]["ms"] == 0.5 and rows["unpermute"]["ms"] == 0.0
    assert rows["rest"]["ms"] == pytest.approx(0.5) and rows["idle"]["ms"] == 1.0
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(10.0)
    text = moe_profile.render_moe_breakdowns({"s": moe_profile.moe_time_breakdown(b)})
    assert "| grouped GEMMs | 4.00 (40.0%) |" in text


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("_dual_cast_kernel", "fp8 cast"),
        ("_amax_kernel", "fp8 cast"),
        ("_block_dual_kernel", "fp8 cast"),
        ("_block_quant_kernel", "fp8 cast"),
        ("_tiled_cast_kernel", "fp8 cast"),
        ("_block_scaled_mm_kernel", "fp8 gemm"),
        ("_grad_amax_kernel_x", step_profile.OTHER),  # anchored: only mcore's own cast kernels
    ],
)
def test_fp8_kernels_by_name(name, category):
    assert step_profile.categorize(name) == category


def test_fp8_gemms_by_the_torch_op_that_launched_them():
    # the same cuBLAS kernel name twice: launched inside aten::_scaled_mm (fp8) and inside aten::mm (bf16)
    op, rt = {"cat": "cpu_op", "ph": "X", "tid": 1}, {"cat": "cuda_runtime", "ph": "X", "tid": 1, "dur": 1}
    gemm = "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN"
    events = [
        _mark(0, 50),
        {**op, "name": "aten::_scaled_mm", "ts": 1, "dur": 5, "args": {"External id": 1}},
        {**rt, "name": "cudaLaunchKernel", "ts": 2, "args": {"correlation": 11}},
        {**op, "name": "aten::mm", "ts": 10, "dur": 5, "args": {"External id": 2}},
        {**rt, "name": "cudaLaunchKernel", "ts": 11, "args": {"correlation": 12}},
        {**op, "name": "aten::_scaled_mm_v2", "ts": 20, "dur": 5, "args": {"External id": 3}},
        {**rt, "name": "cudaLaunchKernel", "ts": 21, "args": {"correlation": 13}},
        {**_k(gemm, 30, 4), "args": {"correlation": 11}},
        {**_k(gemm, 34, 6), "args": {"correlation": 12}},
        {**_k(gemm, 40, 3), "args": {"correlation": 13}},
        _k("_dual_cast_kernel", 43, 2),
    ]
    b = step_profile.breakdown_from_trace({"traceEvents": events})
    assert b["categories_ms"] == pytest.approx({"fp8 gemm": 0.007, "gemm": 0.006, "fp8 cast": 0.002})
