"""``benchmarks/fp8_delayed_clipping.py``: the clipped casts of delayed fp8 scaling counted per operand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clipping(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fp8_delayed_clipping

    return fp8_delayed_clipping


def test_stats_count_only_casts_whose_own_amax_exceeds_the_scales(clipping):
    pairs = [(1.0, 0.5), (1.0, 1.0), (2.0, 3.0), (1.0, 4.0), (0.0, 9.0)]  # (scale amax, own amax)
    stats = clipping.clipping_stats(pairs)
    want = {"casts": 4, "recast": 0, "clipped": 2, "clipped_fraction": 0.5, "median_ratio": 2.75, "max_ratio": 4.0}
    assert stats == want
    assert clipping.clipping_stats([])["clipped_fraction"] == 0.0
    # recast casts (delayed_overflow=recast) overflowed the history but did not clip: counted apart
    recast = clipping.clipping_stats([(1.0, 0.5, False), (2.0, 3.0, True), (1.0, 4.0, False), (0.0, 9.0, True)])
    assert recast == {**want, "casts": 3, "recast": 1, "clipped": 1, "clipped_fraction": 1 / 3}


def test_a_growing_input_clips_every_delayed_cast_by_its_growth(clipping):
    """An input doubled at every call: each cast after the first scales by the last call's amax (most recent) or
    the max of the history, half the tensor's own, so every x cast clips by 2; the weight never changes."""
    from mcore.kernels.fp8_delayed import AmaxHistory
    from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe

    gen = torch.Generator().manual_seed(3)
    x0, w = torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen)
    quantize = AmaxHistory.quantize
    for compute, overflow in (("max", "saturate"), ("most_recent", "saturate"), ("max", "recast")):
        with clipping.recording_casts() as records:
            recipe = Recipe("delayed", amax_compute=compute, delayed_overflow=overflow)
            layer = LowPrecisionLinear(recipe, backend="reference")
            for i in range(4):
                layer(x0 * 2.0**i, w)
        assert AmaxHistory.quantize is quantize  # restored
        x = clipping.clipping_stats(records["x"])
        recast = 3 if overflow == "recast" else 0  # recast: every overflowing cast cast again, none clipped
        assert x["casts"] == 3 and x["recast"] == recast and x["clipped"] == 3 - recast
        assert x["median_ratio"] == pytest.approx(2.0) and x["max_ratio"] == pytest.approx(2.0)
        assert clipping.clipping_stats(records["w"]) | {"casts": None} == {
            "casts": None, "recast": 0, "clipped": 0, "clipped_fraction": 0.0, "median_ratio": None, "max_ratio": None,
        }  # fmt: skip


@pytest.mark.parametrize("config", ["fp8-delayed", "fp8-delayed-recast"])
def test_dry_run_writes_every_operand(tmp_path, config):
    """Both configurations train and count; with recast nothing stays clipped (every overflow cast again)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8_delayed_clipping.py"), "--dry-run", "--out", str(tmp_path)]
    proc = subprocess.run([*cmd, "--config", config], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "fp8_delayed_clipping.json").read_text())
    assert data["config"] == config and data["steps"] == 6
    for operand in ("x", "w", "g"):
        whole = data["operands"][operand]["all"]
        assert whole["casts"] > 0 and 0 <= whole["clipped"] <= whole["casts"], operand
        if config == "fp8-delayed-recast":
            assert whole["clipped"] == 0, operand
        else:
            assert whole["recast"] == 0, operand
    if config == "fp8-delayed-recast":  # the demo's 6 steps overflow the history often enough to be recast
        assert sum(data["operands"][op]["all"]["recast"] for op in ("x", "w", "g")) > 0
    assert "| g | all |" in (tmp_path / "fp8_delayed_clipping.md").read_text()
