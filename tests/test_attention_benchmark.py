"""CPU dry run of benchmarks/attention.py: the GPU run's whole path (cases, timing, sweep, check, JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_benchmark_dry_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--dry-run", "--sweep", "--jobs", "1",
         "--use-swept", "--no-atomic", "--totals-only", "2x32 sinks window8", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "attention.json").read_text())
    assert (tmp_path / "attention.md").read_text().count("| ours |") == len(report["cases"])
    for case in report["cases"]:
        ours = case["impls"]["ours"]
        # The count: 4 * L^2 / 2 * H * D per document (here H = 4; MLA: QK^T at 24, PV at 16).
        window = 8 if "window" in case["case"] else None
        pairs = sum(min(i + 1, window) for i in range(case["length"])) if window else case["length"] ** 2 / 2
        expected = 2 * case["docs"] * pairs * 4 * (case["d_qk"] + case["d_v"])
        assert abs(case["fwd_gflop"] * 1e9 - expected) < 1e-6 * expected
        assert abs(ours["fwd_tflops"] - expected / ours["fwd_ms"] / 1e9) < 1e-9
        total = 3.5 * expected / (ours["fwd_ms"] + ours["bwd_ms"]) / 1e9
        assert abs(ours["fwd_bwd_tflops"] - total) < 1e-9
        check = case["check"]
        assert check["ok"] and check["against"] in ("sdpa", "reference")
        assert max(v for k, v in check.items() if k not in ("against", "ok")) < 1e-5  # fp32 on the CPU
        assert {"dq", "dk", "dv"} <= set(check) and ("dsinks" in check) == ("sinks" in case["case"])
        assert "error" not in case["impls"]["flex"] and "fwd_ms" in case["impls"]["flex"]
    # The sweep: every candidate of every kernel ran, was checked against the reference and timed; then the
    # whole forward/backward with the best of each beside the defaults, checked too.
    # --totals-only: that case has the defaults' totals (with and without the preprocess pass), no candidates
    only = [row for row in report["sweep"] if row["case"] == "2x32 sinks window8"]
    assert sorted(row["kernel"] for row in only) == ["total-defaults", "total-defaults-preprocess"]
    assert all(row["ok"] for row in only)
    sweep = [row for row in report["sweep"] if row["case"] != "2x32 sinks window8"]
    kernels = {(row["kernel"], tuple(row["config"])) for row in sweep if not row["kernel"].startswith("total")}
    assert kernels == {(k, t) for k in ("fwd", "kv", "dq") for t in ((16, 16, 1, 1), (32, 16, 1, 1))} | {
        ("kv-atomic", (16, 16, 1, 1))
    }
    assert all(row["ok"] and "error" not in row for row in sweep), [r for r in sweep if not r.get("ok")]
    assert all(max(row["errors"].values()) < 1e-5 for row in sweep)
    assert all("ms" in row for row in sweep if not row["kernel"].startswith("total"))
    totals = {row["kernel"] for row in sweep if row["kernel"].startswith("total")}
    assert totals == {"total-best", "total-best-preprocess", "total-defaults", "total-defaults-preprocess"}
    # --use-swept: the comparison ran the swept case at the sweep's fastest tiles (the interpreter keeps its own)
    assert set(report["swept_defaults"]) == {"1x48"} and set(report["swept_defaults"]["1x48"]) == {"fwd", "kv", "dq"}
    assert all("ours-atomic-dq" not in case["impls"] for case in report["cases"])
    assert report["precompile_errors"] == []  # the compile pool ran every candidate once (here interpreted)
    table = (tmp_path / "attention_sweep.md").read_text()
    assert "| 1x48 | kv |" in table and "total-best" in table
