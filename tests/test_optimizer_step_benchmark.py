"""benchmarks/optimizer_step.py: its CPU dry run (every dtype combination, the Triton kernel checked under the
interpreter against the reference backend), its shapes' element counts against mcore's parameter count, and the
--override pass-through of moe_throughput.py that lets the next GPU run select the optimizer dtypes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import optimizer_step  # noqa: E402


def test_dry_run_checks_every_combination(tmp_path):
    out = tmp_path / "optimizer_step.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/optimizer_step.py", "--dry-run", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["check_backend"] == "triton" and data["all_checks_ok"]
    assert list(data["combos"]) == list(optimizer_step.COMBOS)
    for combo, res in data["combos"].items():
        assert res["check"]["ok"] and res["ms"] > 0, combo
    assert data["combos"]["fp32/fp32/fp32"]["bytes_per_element"] == 30
    assert data["combos"]["bf16/bf16/bf16"]["bytes_per_element"] == 20
    assert data["torch fused AdamW + clip + copy"]["ms"] > 0


def test_gptoss4l_elements_are_the_models_parameters():
    from mcore.models.accounting import parameter_counts
    from mcore.models.families import get_config
    from mcore.models.families.gpt_oss import alternating_layer_types

    config = dataclasses.replace(get_config("gpt-oss-20b"), num_hidden_layers=4, layer_types=alternating_layer_types(4))
    assert sum(optimizer_step.shapes_gptoss4l()) == parameter_counts(config).total == 4_451_017_664


def test_bad_combos_are_refused():
    with pytest.raises(ValueError, match=r"--combos entry 'bf16/fp16/fp32': want GRAD/EXP_AVG/EXP_AVG_SQ"):
        optimizer_step.parse_combos("fp32/fp32/fp32,bf16/fp16/fp32")


def test_moe_throughput_passes_overrides_to_ours():
    import moe_throughput

    keys = ["optim.main_grads_dtype=bf16", "optim.exp_avg_dtype=bf16"]
    args = moe_throughput.parse_args(["--dry-run", "--shape", "tiny", "--override", keys[0], "--override", keys[1]])
    spec = moe_throughput.build_spec(
        "tiny", iters=1, warmup=0, dry_run=True, layout="zero1", extra_overrides=args.override
    )
    assert spec.overrides[-2:] == keys
    runs = moe_throughput._runs(args, "tiny", Path("/tmp/x"))
    ours = runs[0][1]
    assert [ours[i + 1] for i, a in enumerate(ours) if a == "--override"] == keys
    with pytest.raises(SystemExit):
        moe_throughput.parse_args(["--dry-run", "--override", "no_equals_sign"])
