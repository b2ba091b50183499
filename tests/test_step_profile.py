"""benchmarks/step_profile.py: kernel categories, busy/idle and exposed communication from a Chrome trace."""

from __future__ import annotations

import sys
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
