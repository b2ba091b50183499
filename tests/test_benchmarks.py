"""CPU dry runs of the GPU benchmark scripts (benchmarks/*.py) and their loss-curve checks.

Each script's ``--dry-run`` goes through the whole path the GPU run takes (orchestrator, launcher, the real
``Trainer`` in every configuration, JSON, comparison, report) on gloo with a tiny fp32 model; the tests then
check the JSON against numbers computed here (FLOPs from the shape, losses of every layout against each
other), and that a perturbed loss curve makes the scripts exit non-zero.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
HF_BASELINE = ROOT.parent / "shared" / "bench" / "hf_baseline.py"
# On CPU in fp32 the layouts differ only by summation order: the design guide's bar is relative 1e-5.
CPU_RTOL = 1e-5


def _run(script: str, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture(scope="module")
def bench():
    """The benchmark modules, imported the way the scripts import each other (their folder on sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        import _common
        import eight_gpu
        import multi_gpu
        import train_throughput

        yield {"common": _common, "multi": multi_gpu, "eight": eight_gpu, "throughput": train_throughput}


@pytest.fixture(scope="module")
def throughput_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    proc = _run("train_throughput.py", "--dry-run", "--json-dir", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def multi_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_gpu")
    proc = _run("multi_gpu.py", "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # What comes back from a device call: a few files, all in --out.
    assert sorted(p.name for p in out.iterdir()) == ["launches.log", "results.json", "results.md"]
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def eight_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eight_gpu")
    proc = _run("eight_gpu.py", "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["launches.log", "results.json", "results.md"]
    return out, json.loads((out / "results.json").read_text())


def _flops_per_token(s: dict[str, int]) -> float:
    """hf_baseline.py's formula from the shape alone: 6 x matmul weights (output layer in, embedding and norms
    out) + 12 x layers x hidden x seq."""
    head_dim = s["hidden"] // s["heads"]
    attn = s["hidden"] * (s["heads"] + 2 * s["kv"]) * head_dim + s["heads"] * head_dim * s["hidden"]
    mlp = 3 * s["hidden"] * s["ffn"]
    return 6 * (s["layers"] * (attn + mlp) + s["vocab"] * s["hidden"]) + 12 * s["layers"] * s["hidden"] * s["seq"]


def _layout(result: dict, *keys: str) -> tuple[int, ...]:
    return tuple(result["layout"][k] for k in keys)


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def _hf_baseline_source() -> ast.Module:
    if not HF_BASELINE.is_file():
        pytest.skip(f"{HF_BASELINE} is not present")
    return ast.parse(HF_BASELINE.read_text())


# ------------------------------------------------------------------------------------------ train_throughput
def test_throughput_dry_run_writes_the_baseline_keys_with_consistent_numbers(throughput_run, bench):
    res = json.loads((throughput_run / "mcore_tiny.json").read_text())
    shape = bench["common"].SHAPES["tiny"]
    assert res["impl"].startswith("mcore") and res["shape"] == "tiny"
    assert {k: res[k] for k in shape} == shape
    tokens = shape["mbs"] * shape["seq"]
    assert res["tokens_per_s"] == pytest.approx(tokens / res["step_s"], rel=1e-12)
    flops = _flops_per_token(shape)
    assert res["flops_per_token"] == flops
    assert res["tflops_per_gpu"] == pytest.approx(flops * res["tokens_per_s"] / 1e12, rel=1e-12)
    assert res["mfu"] == pytest.approx(res["tflops_per_gpu"] * 1e12 / 989.4e12, rel=1e-12)
    # 1 first step + 1 warm-up + 3 timed; the median is over the timed ones only.
    assert len(res["step_times_s"]) == 5 and res["step_s"] == sorted(res["step_times_s"][2:])[1]
    assert res["peak_mem_gb"] > 0 and res["first_step_s"] > 0
    assert all(math.isfinite(x) for x in res["losses"])
    # An untrained model with small weights predicts uniformly over its 300 ids.
    assert res["losses"][0] == pytest.approx(math.log(shape["vocab"]), abs=0.05)

    assert sorted(p.name for p in throughput_run.iterdir()) == ["mcore_tiny.json", "summary.json", "throughput.log"]
    summary = json.loads((throughput_run / "summary.json").read_text())
    entry = summary["shapes"]["tiny"]
    assert summary["failures"] == [] and entry["baseline"] == "skipped"
    assert entry["results"]["mcore"] == res
    assert set(entry["ratios"]) == {
        "tokens_per_s_vs_hf",
        "tokens_per_s_vs_hf_compile",
        "peak_mem_vs_hf",
        "peak_mem_vs_hf_compile",
    }
    assert all(v is None for v in entry["ratios"].values())  # no baseline on CPU


def test_throughput_json_has_every_key_hf_baseline_writes(throughput_run):
    tree = _hf_baseline_source()
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "res":
            keys = {kw.arg for kw in node.value.keywords if kw.arg is not None}
    assert {"impl", "shape", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gb"} <= keys
    res = json.loads((throughput_run / "mcore_tiny.json").read_text())
    assert keys <= set(res), f"missing {sorted(keys - set(res))}"


def test_shapes_and_peak_are_those_of_hf_baseline(bench):
    tree = _hf_baseline_source()
    theirs, peak = {}, None
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SHAPES":
            for key, call in zip(node.value.keys, node.value.values):
                theirs[ast.literal_eval(key)] = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PEAK":
            peak = ast.literal_eval(node.value)
    assert set(theirs) == {"1b", "8b4l"}
    for name, shape in theirs.items():
        assert bench["common"].SHAPES[name] == shape
    from mcore.models.accounting import H200_BF16_PEAK_FLOPS

    assert peak == H200_BF16_PEAK_FLOPS


def test_throughput_ratios_are_ours_over_the_baselines(throughput_run, bench):
    ours = json.loads((throughput_run / "mcore_tiny.json").read_text())
    hf = {**ours, "impl": "hf-transformers", "tokens_per_s": ours["tokens_per_s"] / 2, "peak_mem_gb": 4.0}
    ratios = bench["throughput"].ratios({"mcore": ours, "hf": hf, "hf-compile": None})
    assert ratios["tokens_per_s_vs_hf"] == pytest.approx(2.0)
    assert ratios["peak_mem_vs_hf"] == pytest.approx(ours["peak_mem_gb"] / 4.0)
    assert ratios["tokens_per_s_vs_hf_compile"] is None and ratios["peak_mem_vs_hf_compile"] is None


def test_throughput_grads_option_runs_ours_once_per_gradient_dtype(bench, tmp_path):
    tt = bench["throughput"]
    argv = ["--shape", "8b4l", "--grads", "fp32,bf16", "--skip-baseline", "--json-dir", str(tmp_path)]
    args = tt.parse_args(argv)
    args.runs_dir = tmp_path
    runs = dict(tt._runs(args, "8b4l", "8b4l", None))
    assert list(runs) == ["mcore-fp32grads", "mcore-bf16grads"]
    for label, grads in (("mcore-fp32grads", "fp32"), ("mcore-bf16grads", "bf16")):
        child = tt.parse_args(runs[label][1:])  # what the child process parses
        assert child.only == "mcore" and child.grads == grads and child.json.name == f"{label}_8b4l.json"
        config = tt.spec_config(tt.build_spec("8b4l", iters=1, warmup=0, dry_run=False, grads=child.grads))
        assert config.optim.main_grads_dtype == grads  # the buffer's dtype is the one asked for
        assert config.optim.exp_avg_dtype == "fp32" and config.optim.exp_avg_sq_dtype == "fp32"
    default = tt.parse_args(["--shape", "8b4l", "--skip-baseline", "--json-dir", str(tmp_path)])
    default.runs_dir = tmp_path
    ((label, child_argv),) = tt._runs(default, "8b4l", "8b4l", None)  # one dtype: the label stays "mcore"
    assert label == "mcore" and tt.parse_args(child_argv[1:]).grads == "fp32"
    with pytest.raises(SystemExit):
        tt.parse_args(["--grads", "fp16"])
    with pytest.raises(ValueError, match="grads must be one of"):
        tt.build_spec("8b4l", iters=1, warmup=0, dry_run=False, grads="fp16")
    row = tt._row("8b4l", {"impl": "mcore", "grads": "bf16", "tokens_per_s": 1.0, "step_s": 1.0,
                           "tflops_per_gpu": 1.0, "mfu": 0.5, "peak_mem_gb": 1.0, "first_step_s": 1.0})  # fmt: skip
    assert row[1] == "mcore [bf16 grads]"


# ------------------------------------------------------------------------------------------ multi_gpu
def test_multi_gpu_dry_run_matches_the_single_process_run_in_every_layout(multi_run, bench):
    _, report = multi_run
    configs = report["configs"]
    assert report["ok"] and report["missing"] == []
    assert set(configs) == set(bench["multi"].CONFIGS)
    ref = configs["single"]
    assert ref["world_size"] == 1 and ref["num_microbatches"] == 4
    half = configs["single-half-batch"]
    assert half["world_size"] == 1 and 2 * half["global_batch_size"] == ref["global_batch_size"]
    assert "single-half-batch" not in report["checks"]  # another batch, another curve: used for scaling only
    assert report["scaling"]["dp2-overlap"]["kind"] == "weak" and report["scaling"]["tp2"]["kind"] == "strong"
    assert report["scaling"]["dp2"]["efficiency"] == pytest.approx(half["step_s"] / configs["dp2"]["step_s"])
    expected_layouts = {
        "tp2": (2, 1, 1, 1),
        "tp2-sp": (2, 1, 1, 1),
        "pp2-1f1b": (1, 2, 1, 1),
        "pp2-vpp2-interleaved": (1, 2, 1, 2),
        "pp2-zero-bubble": (1, 2, 1, 1),
        "dp2": (1, 1, 2, 1),
        "dp2-overlap": (1, 1, 2, 1),
        "dp2-distopt": (1, 1, 2, 1),
        "dp2-distopt-overlap": (1, 1, 2, 1),
        "dp2-distopt-overlap-all": (1, 1, 2, 1),
    }
    for name, (tp, pp, dp, vpp) in expected_layouts.items():
        res = configs[name]
        assert res["world_size"] == 2
        assert _layout(res, "tp", "pp", "dp", "vpp") == (tp, pp, dp, vpp)
        # The same global batch: dp ranks each run half the micro-batches.
        assert res["num_microbatches"] * dp == ref["num_microbatches"]
        assert res["global_batch_size"] == ref["global_batch_size"]
        assert res["steps"] == [1, 2, 3, 4]
        assert all(math.isfinite(x) for x in res["losses"])
        assert _max_rel(ref["losses"], res["losses"]) <= CPU_RTOL, name
        assert report["checks"][name]["ok"] and report["checks"][name]["steps_compared"] == 4
    assert configs["tp2-sp"]["sequence_parallel"]
    assert configs["dp2-distopt-overlap"]["distributed_optimizer"] and configs["dp2-overlap"]["overlap_grad_reduce"]
    assert not configs["dp2"]["overlap_grad_reduce"] and not configs["dp2"]["distributed_optimizer"]
    assert configs["dp2-distopt-overlap-all"]["overlap_param_gather"]
    assert not configs["dp2-distopt-overlap"]["overlap_param_gather"]
    assert {configs[n]["schedule"] for n in ("pp2-1f1b", "pp2-vpp2-interleaved", "pp2-zero-bubble")} == {
        "1f1b",
        "interleaved-1f1b",
        "zb-h1",
    }
    # Training moved the loss by far more than the tolerance, so the curves compared are not flat.
    assert max(ref["losses"]) - min(ref["losses"]) > 100 * CPU_RTOL * ref["losses"][0]


def _perturbed_copy(out: Path, dest: Path, name: str, index: int, factor: float) -> Path:
    """A copy of a run's results.json with one loss of ``name`` multiplied by ``factor``."""
    data = json.loads((out / "results.json").read_text())
    data["configs"][name]["losses"][index] *= factor
    dest.mkdir(parents=True)
    (dest / "results.json").write_text(json.dumps(data))
    return dest


def test_multi_gpu_exits_nonzero_when_a_loss_curve_is_off(multi_run, tmp_path):
    out, _ = multi_run
    copy = _perturbed_copy(out, tmp_path / "results", "pp2-zero-bubble", 2, 1 + 3e-4)  # fp32 tolerance: 1e-4
    proc = _run("multi_gpu.py", "--report", str(copy), "--out", str(tmp_path / "report"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = json.loads((tmp_path / "report" / "results.json").read_text())
    assert not verdict["ok"]
    assert not verdict["checks"]["pp2-zero-bubble"]["ok"] and verdict["checks"]["pp2-zero-bubble"]["worst_step"] == 3
    assert all(c["ok"] for n, c in verdict["checks"].items() if n != "pp2-zero-bubble")
    assert "pp2-zero-bubble: step 3" in proc.stdout
    # The unperturbed results pass the same re-check.
    proc = _run("multi_gpu.py", "--report", str(out), "--out", str(tmp_path / "again"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_multi_gpu_report_fails_when_a_configuration_is_missing(multi_run, tmp_path):
    out, _ = multi_run
    data = json.loads((out / "results.json").read_text())
    del data["configs"]["tp2"]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "results.json").write_text(json.dumps(data))
    proc = _run("multi_gpu.py", "--report", str(tmp_path / "results"), "--out", str(tmp_path / "report"))
    assert proc.returncode == 1
    assert json.loads((tmp_path / "report" / "results.json").read_text())["missing"] == ["tp2"]


# ------------------------------------------------------------------------------------------ eight_gpu
def test_eight_gpu_dry_run_agrees_across_layouts_and_after_resharding(eight_run):
    _, report = eight_run
    configs = report["configs"]
    assert report["ok"] and report["missing"] == [] and report["skipped"] == {}
    layouts = {"tp2-pp2-dp2": (2, 2, 2), "tp1-pp2-dp4": (1, 2, 4), "tp2-pp1-dp4": (2, 1, 4), "tp1-pp1-dp8": (1, 1, 8)}
    ref = configs["tp2-pp2-dp2"]
    for name, (tp, pp, dp) in layouts.items():
        res = configs[name]
        assert res["world_size"] == 8 and _layout(res, "tp", "pp", "dp") == (tp, pp, dp)
        assert res["distributed_optimizer"] and res["overlap_grad_reduce"]
        assert res["steps"] == [1, 2, 3, 4] and all(math.isfinite(x) for x in res["losses"])
        assert _max_rel(ref["losses"], res["losses"]) <= CPU_RTOL, name
        assert res["tokens_per_s_per_gpu"] == pytest.approx(res["tokens_per_s"] / 8)
    assert ref["checkpoint"]["step"] == 2 and ref["checkpoint"]["path"].endswith("iter_0000002")
    assert not Path(ref["checkpoint"]["path"]).exists()  # the temporary checkpoint is removed at the end
    assert report["complete"]
    resumed = configs["resume-tp1-pp2-dp4"]
    assert resumed["resumed_from"] and _layout(resumed, "tp", "pp", "dp") == (1, 2, 4)
    assert resumed["steps"] == [3, 4]
    assert _max_rel(ref["losses"][2:], resumed["losses"]) <= CPU_RTOL
    # Resharded RNG streams start fresh, which the loader reports.
    assert any("resharded" in note for note in resumed["notes"])


def test_eight_gpu_exits_nonzero_when_the_resumed_run_differs(eight_run, tmp_path):
    out, _ = eight_run
    copy = _perturbed_copy(out, tmp_path / "results", "resume-tp1-pp2-dp4", 0, 1 - 3e-4)
    proc = _run("eight_gpu.py", "--report", str(copy), "--out", str(tmp_path / "report"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = json.loads((tmp_path / "report" / "results.json").read_text())["checks"]
    assert not checks["resume-tp1-pp2-dp4"]["ok"] and checks["resume-tp1-pp2-dp4"]["worst_step"] == 3
    assert checks["tp1-pp1-dp8"]["ok"]


# ------------------------------------------------------------------------------------------ the comparison
def test_compare_loss_curves(bench):
    compare = bench["common"].compare_loss_curves
    ref = {1: 12.0, 2: 11.5, 3: 11.0, 4: 10.9}
    assert compare(ref, dict(ref), rtol=1e-2).ok
    close = {s: v * (1 + 0.004 * (-1) ** s) for s, v in ref.items()}
    assert compare(ref, close, rtol=1e-2).ok

    off = {**ref, 3: 11.0 * 1.02}
    check = compare(ref, off, rtol=1e-2)
    assert not check.ok and check.worst_step == 3 and check.max_rel_diff == pytest.approx(0.02)
    assert any(p.startswith("step 3:") for p in check.problems)
    # Only the first max_steps common steps count.
    assert compare(ref, off, rtol=1e-2, max_steps=2).ok

    # Within 1e-2 at every step, but rising where the reference falls by more than 1e-2.
    trend = compare({1: 10.0, 2: 9.88}, {1: 9.95, 2: 9.96}, rtol=1e-2)
    assert all(abs(c - r) / r <= 1e-2 for c, r in ((9.95, 10.0), (9.96, 9.88)))
    assert not trend.ok and any("trend differs" in p for p in trend.problems)

    nan = compare(ref, {**ref, 2: float("nan")}, rtol=1e-2)
    assert not nan.ok and nan.worst_step == 2
    assert not compare(ref, {10: 1.0}, rtol=1e-2).ok
    with pytest.raises(ValueError, match="rtol"):
        compare(ref, ref, rtol=0)
    with pytest.raises(TypeError, match="mapping"):
        compare(ref, [12.0, 11.5], rtol=1e-2)


# ------------------------------------------------------------------------------------------ the GPU specs
def test_gpu_configurations_are_valid_and_fit(bench):
    """What the device will run, checked on CPU: configs, layouts, micro-batch splits, schedules, memory."""
    from mcore.train.plan import make_plan

    common, multi, eight, throughput = bench["common"], bench["multi"], bench["eight"], bench["throughput"]
    for shape in ("1b", "8b4l"):
        spec = throughput.build_spec(shape, iters=8, warmup=2, dry_run=False)
        config = common.check_spec(spec)
        assert config.train.precision == "bf16" and config.parallel.distributed_optimizer
        assert config.train.global_batch_size == config.train.micro_batch_size == common.SHAPES[shape]["mbs"]
        assert make_plan(config, 1, 141.0).fits
    args = multi.parse_args([])
    for spec in multi.build_specs(args, list(multi.CONFIGS)):
        config = common.check_spec(spec)
        assert config.train.precision == "bf16" and config.data.seq_length == 4096
        assert make_plan(config, spec.world_size, 141.0).fits, spec.name
    pp2 = common.check_spec(multi.build_specs(args, ["pp2-1f1b"])[0])
    assert pp2.num_microbatches(1) == 8  # the "pp=2 1F1B with 8 micro-batches"
    args = eight.parse_args([])
    specs = eight.build_specs(args, eight.CONFIG_NAMES, "/nonexistent/ckpt")
    for spec in specs:
        fits, text = eight.memory_plan(spec, 141.0)
        assert fits or spec.name == eight.OPTIONAL, text
        config = common.check_spec(spec)
        assert config.model.num_hidden_layers == 32 and config.model.vocab_size == 128256
        assert config.data.seq_length == 8192 and config.train.steps == 30
    assert specs[0].save_at == 10 and specs[-1].resume_from == "/nonexistent/ckpt" and specs[-1].stop_after == 15


def test_invalid_specs_are_refused_before_launching(bench):
    common = bench["common"]
    model = common.llama_model(common.SHAPES["tiny"])
    bad_tp = common.RunSpec("tp3", 3, ["parallel.tp=3", "train.device=cpu"], model)
    with pytest.raises(ValueError, match="configuration tp3 is invalid"):
        common.check_spec(bad_tp)
    # Interleaved 1F1B needs the micro-batches (here 3) to be a multiple of pp (2).
    four_layers = common.llama_model(common.SHAPES["tiny"], num_hidden_layers=4)
    overrides = [
        "parallel.pp=2",
        "data.seq_length=64",
        "train.global_batch_size=6",
        "train.micro_batch_size=2",
        "train.device=cpu",
    ]
    assert common.check_spec(common.RunSpec("even", 2, overrides, four_layers)).parallel.vpp == 1
    odd = common.RunSpec("odd", 2, [*overrides, "parallel.vpp=2"], four_layers)
    with pytest.raises(ValueError, match="configuration odd is invalid.*Interleaved"):
        common.check_spec(odd)
    with pytest.raises(ValueError, match="save_at and ckpt_dir"):
        common.RunSpec("x", 1, [], model, save_at=3)
    with pytest.raises(ValueError, match="name"):
        common.RunSpec("a b", 1, [], model)
