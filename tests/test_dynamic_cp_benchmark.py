"""benchmarks/dynamic_cp.py: the predicted static-vs-dynamic comparison runs and its numbers are consistent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "dynamic_cp.py"), "--out", str(tmp_path), "--batches", "3", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((tmp_path / "dynamic_cp.json").read_text())


def test_dynamic_cp_benchmark_lognormal(tmp_path):
    report = _run(tmp_path, "--sigma", "1.4")
    (result,) = report["distributions"].values()
    assert set(result) == {"static cp2", "static cp4", "static cp8", "dynamic", "documents_per_batch"}
    assert result["dynamic"]["dynamic_speedup"] == 1.0
    assert result["static cp8"]["imbalance_mean"] == 1.0  # one CP group holds every document: no imbalance
    for name in ("static cp2", "static cp4", "static cp8"):
        row = result[name]
        ratio = row["step_seconds_mean"] / result["dynamic"]["step_seconds_mean"]
        assert abs(row["dynamic_speedup"] - ratio) < 1e-9 and row["dynamic_speedup"] > 1.0
    assert "| dynamic |" in (tmp_path / "dynamic_cp.md").read_text()


def test_dynamic_cp_benchmark_lengths_file_and_rates(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [100, 200, 3000, 20000, 50, 800] * 5))
    rates = tmp_path / "attention.json"
    cases = [{"case": f"{d}x{n}", "length": n, "d_qk": 128, "d_v": 128, "impls": {"ours": {"fwd_bwd_tflops": r}}}
             for d, n, r in [(128, 128, 150.0), (1, 16384, 500.0)]]  # fmt: skip
    rates.write_text(json.dumps({"cases": cases}))
    report = _run(tmp_path / "out", "--lengths", str(lengths), "--rates", str(rates))
    assert report["rates"] == [[128, 150.0], [16384, 500.0]]
    assert list(report["distributions"]) == ["file lengths.txt"]
