"""benchmarks/wgrad_gemm.py: its CPU dry run (the ways of writing the weight gradient agree), and that its 8b4l
linears are the model's: their weights and the output layer make up 8b4l's matmul weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import wgrad_gemm  # noqa: E402


def test_dry_run_checks_the_ways_agree(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "benchmarks/wgrad_gemm.py", "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "wgrad_gemm.json").read_text())
    rows = data["result"]["rows"]
    assert [r["linear"] for r in rows] == [name for name, *_ in wgrad_gemm.TINY]
    assert all(0 <= r["max_rel_err"] < 1e-5 for r in rows)  # fp32 on CPU: written and added agree with fp32 mm
    assert "nothing timed" in (tmp_path / "wgrad_gemm.md").read_text()


def test_the_8b4l_linears_are_the_models():
    from mcore.train.planning.shape import ModelShape
    from mcore.train.planning.validation import SHAPE_8B4L, _shape

    shape = _shape(SHAPE_8B4L, "8b4l")
    ours = sum(out_f * in_f * count for _, out_f, in_f, count in wgrad_gemm.LINEARS_8B4L)
    assert isinstance(shape, ModelShape) and ours == shape.active_matmul_weights()
