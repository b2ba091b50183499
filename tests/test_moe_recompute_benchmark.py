"""``benchmarks/moe_throughput.py --recompute-modules``: the overrides reach mcore-train (a CPU dry run of the tiny
MLA shape trains with them and records them) and the orchestrator passes them to ours only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = "moe,mla_up_proj,layernorm,mlp"


def _benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return moe_throughput


def test_spec_and_runs_carry_the_modules():
    bench = _benchmark()
    spec = bench.build_spec("moonlight8l", iters=1, warmup=0, dry_run=False, recompute_modules=MODULES)
    assert "train.recompute=selective" in spec.overrides
    assert f"train.recompute_modules=[{MODULES}]" in spec.overrides
    plain = bench.build_spec("moonlight8l", iters=1, warmup=0, dry_run=False)
    assert not any(o.startswith("train.recompute") for o in plain.overrides)
    args = bench.parse_args(["--shape", "moonlight8l", "--json-dir", "/tmp/x", "--recompute-modules", MODULES])
    runs = dict(bench._runs(args, "moonlight8l", Path("/tmp/x")))
    assert runs["mcore"][runs["mcore"].index("--recompute-modules") + 1] == MODULES
    assert "--recompute-modules" not in runs["hf"]


def test_dry_run_trains_with_the_modules(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "mcore_tiny_mla.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "moe_throughput.py"), "--only", "mcore", "--shape", "tiny_mla",
            "--dry-run", "--json", str(out), "--recompute-modules", MODULES]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["recompute_modules"] == MODULES and all(loss > 0 for loss in record["losses"])
