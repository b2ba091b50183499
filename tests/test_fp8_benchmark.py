"""The CPU dry run of ``benchmarks/fp8.py``: every part runs (GEMMs, linears, casts, the training step per
recipe through the Trainer, experts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fp8_benchmark_dry_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--dry-run", "--sweep-casts", "--out", str(tmp_path)]
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
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in data["gemms"])
    linears = {(r["layer"], r["impl"]): r for r in data["linears"]}
    impls = ["bf16", "tensorwise", "delayed", "rowwise", "blockwise"]
    impls += [f"{r}+weight cache" for r in ("tensorwise", "rowwise", "blockwise")]
    assert set(linears) == {(layer, impl) for layer in shapes for impl in impls}
    assert all(r["ms"] > 0 and "error" not in r for r in linears.values())
    sweep = data["cast_sweep"]
    assert (
        set(sweep["best"]) == {"AMAX_TILE", "CAST_TILE", "BLOCK_TILE"}
        and "Fused cast tiles" in (tmp_path / "fp8.md").read_text()
    )
    casts = {r["cast"]: r for r in data["casts"]}
    for granularity in ("tensor", "row", "1x128", "128x128"):
        assert {f"{granularity} fused q + q^T", f"{granularity} two single casts"} <= set(casts)
        assert any(c.startswith(f"{granularity} quantize_dual (") for c in casts)
    assert "copy (clone)" in casts and all(r["gbps"] > 0 and r["pct_ideal"] > 0 for c, r in casts.items() if "q" in c)
    training = {r["recipe"]: r for r in data["training"]}
    assert set(training) == {"bf16", "tensorwise", "delayed", "rowwise", "blockwise", "tensorwise+output"}
    assert training["bf16"]["speedup"] == 1.0
    for recipe, row in training.items():
        assert row["precision"] == ("fp32" if recipe == "bf16" else "fp8")  # CPU dry run: fp32 parameters
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0 and row["peak_mem_gb"] > 0, row
        assert len(row["losses"]) == 4  # the untimed first step and 3 timed ones
        assert row["profile"] is None and row["time_breakdown"] is None  # the profiler needs a GPU
    assert training["tensorwise"]["losses"] != training["bf16"]["losses"]  # the recipe really ran
    assert training["tensorwise+output"]["losses"] != training["tensorwise"]["losses"]  # the output layer too
    assert "| 8b4l-blockwise |" in (tmp_path / "fp8.md").read_text()
    experts = {(r["gemm"], r["impl"]): r for r in data["experts"]}
    assert set(experts) == {(g, i) for g in ("gate_up", "down") for i in ("bf16", "fp8-rowwise", "fp8-blockwise")}
    assert all(r["ms"] > 0 and "error" not in r for r in experts.values())
    moe = {r["recipe"]: r for r in data["moe_training"]}
    assert set(moe) == {"bf16", "rowwise"} and moe["rowwise"]["precision"] == "fp8" and "error" not in moe["rowwise"]
    assert moe["rowwise"]["final_loss"] != moe["bf16"]["final_loss"]


def test_time_breakdown_folds_the_profile_and_renders(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fp8

    profile = {
        "categories_ms": {"fp8 gemm": 100.0, "gemm": 40.0, "fp8 cast": 20.0, "attention": 50.0, "norm": 3.0,
                          "optimizer": 8.0, "copy/cast": 4.0, "activation": 2.0},
        "idle_ms": 6.0,
        "step_window_ms": 233.0,
    }  # fmt: skip
    got = fp8.time_breakdown(profile)
    assert got == {"fp8 cast": 20.0, "fp8 gemm": 100.0, "bf16 gemm": 40.0, "attention": 50.0, "optimizer": 8.0,
                   "copy/cast (torch)": 4.0, "other": 5.0, "idle": 6.0, "step": 233.0}  # fmt: skip
    assert fp8.time_breakdown(None) is None
    row = {"config": "8b4l-tensorwise", "tokens_per_s": 1.0, "time_breakdown": got}
    text = fp8.render({"device": "x", "torch": "y", "date": "z", "training": [row]})
    assert "GPU time per step" in text and "| 8b4l-tensorwise | 20" in text


def test_cast_sweep_times_every_candidate_and_restores_the_defaults(monkeypatch):
    """``fp8.py --sweep-casts``: every candidate of each constant timed over the granularities it shapes, the later
    constants with the earlier ones at their best, a failing tile recorded and passed over, the defaults restored."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from fp8_cast_sweep import CAST_SWEEP, label, sweep_casts

    from mcore.kernels.triton import quant_fused as qf

    before = {name: getattr(qf, name) for name in CAST_SWEEP}
    seen = []

    def time_cast(x, granularity):
        tiles = tuple(getattr(qf, name) for name in CAST_SWEEP)
        seen.append((tiles, granularity))
        if qf.CAST_TILE == (128, 128, 8):
            raise RuntimeError("out of resources")
        return float(sum(map(sum, tiles)))  # deterministic: the smaller tiles "win"

    out = sweep_casts(torch.zeros(1), time_cast)
    # (the failing tile stops at the first of its two granularities)
    assert len(seen) == sum(len(qf.TILE_CANDIDATES[n]) * len(g) for n, g in CAST_SWEEP.items()) - 1
    for name in CAST_SWEEP:
        assert set(out[name]) == {label(t) for t in qf.TILE_CANDIDATES[name]}
        timed = {k: v for k, v in out[name].items() if isinstance(v, float)}
        assert out["best"][name] == min(timed, key=timed.get)
    assert out["CAST_TILE"]["128x128x8"].startswith("error: RuntimeError: out of resources")
    best = {name: tuple(int(v) for v in out["best"][name].split("x")) for name in CAST_SWEEP}
    assert all(tiles[:2] == (best["AMAX_TILE"], best["CAST_TILE"]) for tiles, g in seen if g in ("1x128", "128x128"))
    assert before == {name: getattr(qf, name) for name in CAST_SWEEP}


def test_apply_tiles_sets_the_swept_constants_and_refuses_unknown_ones(monkeypatch):
    """``fp8.py --use-swept-casts``: the sweep's best labels become quant_fused's constants; a name or tile outside
    the candidates is one clear error."""
    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from fp8_cast_sweep import CAST_SWEEP, apply_tiles, label

    from mcore.kernels.triton import quant_fused as qf

    for name in CAST_SWEEP:  # restored after the test whatever it sets
        monkeypatch.setattr(qf, name, getattr(qf, name))
    pick = {name: label(qf.TILE_CANDIDATES[name][-1]) for name in CAST_SWEEP}
    assert apply_tiles(pick) == pick
    assert all(getattr(qf, name) == qf.TILE_CANDIDATES[name][-1] for name in CAST_SWEEP)
    with pytest.raises(KeyError, match="not a swept constant"):
        apply_tiles({"NOPE": "1x2"})
    with pytest.raises(ValueError, match="not among its candidates"):
        apply_tiles({"CAST_TILE": "3x3x3"})


def test_fp8_host_time_dry_run(tmp_path):
    """``benchmarks/fp8_host_time.py`` on CPU: every recipe's linear timed and its CPU ops listed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8_host_time.py"), "--dry-run", "--size", "128", "--out",
           str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "fp8_host_time.json").read_text())
    assert [r["impl"] for r in data["rows"]] == ["fp32", "tensorwise", "delayed", "rowwise", "blockwise"]
    assert all(r["host_us"] > 0 for r in data["rows"])
    assert set(data["cpu_ops"]) == {"tensorwise", "delayed", "rowwise", "blockwise"}
    assert all(ops and all(o["self_us"] >= 0 for o in ops) for ops in data["cpu_ops"].values())
    # the Python-level profile: our autograd function's forward among each recipe's functions, times non-negative
    assert set(data["python"]) == set(data["cpu_ops"])
    for funcs in data["python"].values():
        assert all(f["own_us"] >= 0 and f["cum_us"] >= f["own_us"] - 1e-6 and f["count"] > 0 for f in funcs)
    assert any("low_precision_linear.py" in f["function"] for f in data["python"]["tensorwise"])
    text = (tmp_path / "fp8_host_time.md").read_text()
    assert "host us per forward + backward" in text and "top Python functions" in text


def test_dual_path_override_is_parsed_checked_and_applied(monkeypatch):
    """``fp8.py --dual-path 128x128=two_casts``: the step measured with the other block cast path; bad items are
    one error naming the item and the choices."""
    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from fp8 import apply_dual_path, parse_dual_path

    from mcore.kernels import fp8_casts

    monkeypatch.setattr(fp8_casts, "DUAL_PATH", dict(fp8_casts.DUAL_PATH))
    chosen = parse_dual_path("128x128=two_casts,1x128=fused")
    assert chosen == {"128x128": "two_casts", "1x128": "fused"} and parse_dual_path("") == {}
    in_force = apply_dual_path(chosen)
    assert fp8_casts.DUAL_PATH["128x128"] == "two_casts" and in_force["1x128"] == "fused"
    for bad in ("128x128=fast", "2x2=fused", "128x128"):
        with pytest.raises(ValueError, match="granularity=path"):
            parse_dual_path(bad)


def test_moe_rows_per_micro_batch_count(tmp_path):
    """``--moe-micro-batches 1,2``: a bf16 and an fp8 row per count, each speedup against its own count's bf16 row,
    the 2-micro-batch rows training twice the tokens per step; bad values are one parser error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = str(ROOT / "benchmarks" / "fp8.py")
    skip = "gemms,linears,casts,training,experts"
    cmd = [sys.executable, script, "--dry-run", "--skip", skip, "--moe-micro-batches", "1,2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        (r["recipe"], r["micro_batches"]): r for r in json.loads((tmp_path / "fp8.json").read_text())["moe_training"]
    }
    assert set(rows) == {(r, n) for r in ("bf16", "rowwise") for n in (1, 2)}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows.values()), rows
    assert rows[("bf16", 1)]["speedup"] == rows[("bf16", 2)]["speedup"] == 1.0
    assert rows[("rowwise", 2)]["config"] == "mixtral2l-rowwise-mb2"
    assert rows[("rowwise", 2)]["final_loss"] != rows[("rowwise", 1)]["final_loss"]  # another batch: really ran
    assert "| mixtral2l-rowwise-mb2 | 2 |" in (tmp_path / "fp8.md").read_text()
    for bad in (["--moe-micro-batches", "0"], ["--moe-micro-batches", "x"], ["--moe-recipes", "int8"]):
        proc = subprocess.run([*cmd, *bad], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2 and "--moe-" in proc.stderr, proc.stderr[-500:]
