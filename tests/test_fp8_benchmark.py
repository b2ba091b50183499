"""The CPU dry run of ``benchmarks/fp8.py``: every part runs (GEMMs, casts, the training step per recipe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fp8_benchmark_dry_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--dry-run", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "fp8.json").read_text())
    shapes = data["linear_shapes"]
    assert set(shapes) == {"qkv", "out_proj", "gate_up", "down"}
    m, n, k = shapes["gate_up"]
    assert (m, n, k) == (128, 512, 128)  # dry-run shape: seq 64 x mbs 2 tokens, 2 x ffn 256, hidden 128
    gemms = {(r["layer"], r["gemm"], r["impl"]) for r in data["gemms"]}
    for layer in shapes:
        for gemm in ("fwd", "dgrad", "wgrad"):
            assert {(layer, gemm, impl) for impl in ("bf16", "tensorwise", "rowwise", "blockwise")} <= gemms
        assert (layer, "linear", "delayed") in gemms
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in data["gemms"])
    casts = {r["cast"] for r in data["casts"]}
    assert "copy (clone)" in casts and "128x128 transposed" in casts
    training = {r["recipe"]: r for r in data["training"]}
    assert set(training) == {"bf16", "tensorwise", "delayed", "rowwise", "blockwise"}
    assert training["bf16"]["speedup"] == 1.0
    for recipe, row in training.items():
        assert row["precision"] == ("fp32" if recipe == "bf16" else "fp8")  # CPU dry run: fp32 parameters
        assert len(row["losses"]) == 4  # the untimed first step and 3 timed ones
    assert training["tensorwise"]["losses"] != training["bf16"]["losses"]  # the recipe really ran
    assert "| 8b4l-blockwise |" in (tmp_path / "fp8.md").read_text()
    experts = {(r["gemm"], r["impl"]): r for r in data["experts"]}
    assert set(experts) == {(g, i) for g in ("gate_up", "down") for i in ("bf16", "fp8-rowwise")}
    assert all(r["ms"] > 0 and "error" not in r for r in experts.values())
    moe = {r["recipe"]: r for r in data["moe_training"]}
    assert set(moe) == {"bf16", "rowwise"} and moe["rowwise"]["precision"] == "fp8" and "error" not in moe["rowwise"]
    assert moe["rowwise"]["final_loss"] != moe["bf16"]["final_loss"]
