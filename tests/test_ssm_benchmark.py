"""The CPU dry run of benchmarks/ssm_throughput.py: kernels against HF's torch path, a training step, JSON out."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ssm_benchmark_dry_run_writes_its_json(tmp_path):
    # The interpreter makes the dry run time the Triton SSD kernels too (ours = the Triton backend here).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    argv = [sys.executable, str(ROOT / "benchmarks" / "ssm_throughput.py"), "--dry-run", "--out", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "ssm_throughput.json").read_text())
    kernels = result["kernels"]
    # Our SSD computes what HF's torch path computes (fp32 on CPU).
    assert kernels["ssd_rel_diff_vs_hf"] < 1e-5
    for ssd in ("ours", "ours_torch_states", "ours_triton_states", "ours_torch", "hf"):
        assert kernels[f"ssd_{ssd}_ms"] > 0
    for name in ("conv_ours_ms", "conv_hf_ms", "conv_ours_fwd_ms", "conv_hf_fwd_ms"):
        assert kernels[name] > 0
    # Our conv (the Triton kernels here) computes what HF's does, gradients included, on the mixer's layout.
    assert max(kernels["conv_rel_diff_vs_hf"].values()) < 1e-5
    assert set(kernels["ssd_parts_ms"]) == {"intra_fwd", "intra_bwd", "state_fwd", "state_bwd", "chunk_state_fwd",
                                            "chunk_state_bwd", "inter_fwd", "inter_bwd"}  # fmt: skip
    # Both training configurations ran through the real Trainer, bf16 with fp32 master weights even on the CPU.
    assert [t["config"] for t in result["training"]] == ["zero1", "fsdp_selective"]
    for train in result["training"]:
        assert train["impl"] == "mcore" and train["tokens_per_s"] > 0 and train["preset"] == "nemotron_h-tiny"
        assert train["precision"] == "bf16" and all(math.isfinite(loss) for loss in train["losses"])


def test_ssm_benchmark_dry_run_trains_the_memory_configs(tmp_path):
    """recompute_modules and FSDP2's auto settings through the benchmark's Trainer runs (the GPU plan's configs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    argv = [sys.executable, str(ROOT / "benchmarks" / "ssm_throughput.py"), "--dry-run", "--out", str(tmp_path),
            "--skip-kernels", "--train-configs", "zero1_modules,fsdp,zero1_full",
            "--override=train.seed=3"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "ssm_throughput.json").read_text())
    assert [t["config"] for t in result["training"]] == ["zero1_modules", "fsdp", "zero1_full"]
    for train in result["training"]:
        assert train["tokens_per_s"] > 0 and all(math.isfinite(loss) for loss in train["losses"]), train["config"]
    assert "train.recompute_modules=[mamba_core,layernorm,mlp]" in result["training"][0]["overrides"]
    assert all(t["overrides"][-1] == "train.seed=3" for t in result["training"])  # --override reaches every run


def test_tile_sweep_restores_the_defaults_and_times_every_value(monkeypatch):
    import time

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ssm_sweep
    from ssm_throughput import KERNEL_SHAPES

    from mcore.kernels import causal_conv1d, dispatch
    from mcore.kernels.triton import conv as tconv
    from mcore.kernels.triton import ssd as tssd

    if not dispatch.triton_interpreting():
        import pytest

        pytest.skip("the sweep's CPU check runs the kernels under TRITON_INTERPRET=1")
    monkeypatch.setattr(ssm_sweep, "SSD_TILES", {"INTRA_ROWS": (16, 32), "STATE_BLOCK": (64, 256)})
    monkeypatch.setattr(ssm_sweep, "STATES_ROWS", (16, 32))
    tile = tconv.ConvTile
    candidates = {"FWD_TILE": (tile(16, 32, 4), tile(32, 64, 2)), "DX_TILE": (tile(16, 64, 4),),
                  "DPRE_TILE": (tile(4, 64, 2, 2),), "FUSED_TILE": (tile(4, 64, 2, 4), tile(8, 32, 2, 2)),
                  "DW_TILE": (tile(4, 16, 1), tile(2, 64, 2))}  # fmt: skip
    monkeypatch.setattr(tconv, "TILE_CANDIDATES", candidates)
    names = (*ssm_sweep.CONV_KERNELS, "BACKWARD")
    before = (tssd.INTRA_ROWS, tssd.STATE_BLOCK, *(getattr(tconv, name) for name in names))
    s = KERNEL_SHAPES["tiny"]
    x = torch.randn(1, s["seq"], 48, requires_grad=True)
    w, bias = torch.randn(48, 4, requires_grad=True), torch.randn(48, requires_grad=True)

    def measure(fn, iters):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    seen = []

    def conv_step():
        seen.append(tuple(getattr(tconv, name) for name in names))
        causal_conv1d(x, w, bias, backend="triton").backward(torch.randn(x.shape))

    out = ssm_sweep.sweep(s, conv_step, torch.device("cpu"), torch.float32, measure, 1)
    # One step per candidate (on the path that runs its kernel), then both paths at the best tiles.
    assert len(seen) == sum(map(len, candidates.values())) + 2
    assert seen[0][0] == tile(16, 32, 4) and seen[1][0] == tile(32, 64, 2) and seen[0][-1] == "split"
    fused_steps = seen[4:6]  # after 2 forward, 1 dx and 1 dpre candidates
    assert {step[3] for step in fused_steps} == set(candidates["FUSED_TILE"])
    assert {step[-1] for step in fused_steps} == {"fused"}
    assert [step[-1] for step in seen[-2:]] == ["split", "fused"]
    conv = out["conv"]
    for name, tiles in candidates.items():
        assert set(conv[name]) == {t.label for t in tiles} and all(v > 0 for v in conv[name].values()), name
        assert conv["best"][name] == min(conv[name], key=conv[name].get)
    assert conv["best"]["BACKWARD"] == min(conv["BACKWARD"], key=conv["BACKWARD"].get)
    only_conv = ssm_sweep.sweep(s, conv_step, torch.device("cpu"), torch.float32, measure, 1, parts=("conv",))
    assert set(only_conv) == {"conv"}
    assert set(out["ssd"]["INTRA_ROWS"]) == {"16", "32"} and set(out["ssd"]["STATE_BLOCK"]) == {"64", "256"}
    assert set(out["ssd"]["states.ROWS"]) == {"16", "32"}
    assert before == (tssd.INTRA_ROWS, tssd.STATE_BLOCK, *(getattr(tconv, name) for name in names))


def test_conv_sweep_records_a_failing_tile_and_a_kernel_that_did_not_run(monkeypatch):
    """On CUDA a candidate that does not build, or a kernel missing from the profile, is recorded and loses."""
    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ssm_sweep

    from mcore.kernels.triton import conv as tconv

    one = {name: tiles[:1] for name, tiles in tconv.TILE_CANDIDATES.items()}
    monkeypatch.setattr(tconv, "TILE_CANDIDATES", one | {"FWD_TILE": (tconv.FWD_TILE, tconv.ConvTile(64, 64, 2))})

    def kernel_ms(step, iters):
        if tconv.FWD_TILE.rows == 64:
            raise RuntimeError("out of resources")
        kernel = "_conv_bwd_fused_kernel" if tconv.BACKWARD == "fused" else "_conv_dpre_kernel"
        return {"_conv_fwd_kernel": 0.1, kernel: 0.2, "_conv_dw_kernel": 0.05}

    out = ssm_sweep._conv_sweep(lambda: None, kernel_ms, 1)
    assert out["FWD_TILE"]["64x64x2"].startswith("error: RuntimeError: out of resources")
    assert out["best"]["FWD_TILE"] == tconv.FWD_TILE.label
    assert out["DX_TILE"][tconv.DX_TILE.label].startswith("error: _conv_dx_kernel did not run")
    assert "DX_TILE" not in out["best"] and out["FUSED_TILE"][tconv.FUSED_TILE.label] == 0.2
    assert out["BACKWARD"] == pytest.approx({"split": 0.35, "fused": 0.35})


def test_step_profile_puts_the_ssm_kernels_in_their_category(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from step_profile import categorize

    names = ("_intra_fwd_kernel", "_intra_dx_kernel", "_intra_dcb_kernel", "_state_bwd_kernel", "_conv_dpre_kernel",
             "_conv_dx_kernel", "_conv_fwd_kernel")  # fmt: skip
    for name in (*names, "_chunk_state_fwd_kernel", "_chunk_state_bwd_kernel", "_inter_fwd_kernel"):
        assert categorize(name) == "ssm", name
    assert categorize("_flash_fwd_kernel") == "attention" and categorize("_rms_norm_fwd") == "norm"


def test_kernel_time_sums_device_events_per_call(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ssm_throughput import kernel_ms_from_trace

    events = [
        {"cat": "kernel", "name": "_conv_fwd_kernel", "dur": 30.0},
        {"cat": "kernel", "name": "_conv_fwd_kernel", "dur": 34.0},
        {"cat": "gpu_memset", "name": "Memset (Device)", "dur": 2.0},
        {"cat": "cpu_op", "name": "aten::empty", "dur": 500.0},  # host time: not counted
        {"cat": "kernel", "name": "no duration"},
    ]
    out = kernel_ms_from_trace(events, calls=2)
    assert out["kernels_ms"] == {"_conv_fwd_kernel": 0.032, "Memset (Device)": 0.001}
    assert abs(out["total_ms"] - 0.033) < 1e-12
