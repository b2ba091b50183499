"""``train.precision: fp8 | fp4`` in mcore-train: config, the trainer's linears, training, checkpoints, the
convergence script's dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore.kernels.low_precision_linear import LowPrecisionLinear
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mcore.train.config import load_config
from mcore.train.errors import UserError
from mcore.train.low_precision import expand_patterns
from mcore.train.runtime import init_runtime
from mcore.train.trainer import Trainer
from tests.train.tiny import TINY, train, train_records

ROOT = Path(__file__).resolve().parents[2]


def _linears(trainer):
    return {
        name: m
        for chunk in trainer.chunks
        for name, m in chunk.named_modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    }


def test_config_sections_and_their_errors():
    config = load_config(None, ["train.precision=fp8", "fp8.recipe=rowwise", "fp8.keep=[output, 'layers.{last}.*']"])
    recipe = config.fp8.to_recipe()
    assert recipe.name == "rowwise" and recipe.grad_format == "e4m3"  # row-wise default: e4m3 gradients
    assert load_config(None, ["fp8.recipe=delayed"]).fp8.to_recipe().grad_format == "e5m2"
    assert load_config(None, ["fp4.recipe=mxfp4", "fp4.quantize_grads=false"]).fp4.to_recipe().quantize_grads is False
    with pytest.raises(UserError, match="fp8.recipe"):
        load_config(None, ["fp8.recipe=int8"])
    with pytest.raises(UserError, match="min_features must be >= 0"):
        load_config(None, ["fp4.min_features=-1"])
    assert load_config(None, ["fp8.recipe=blockwise", "fp8.grad_format=e5m2"]).fp8.to_recipe().grad_format == "e5m2"
    assert recipe.fast_accum and not load_config(None, ["fp8.fast_accum=false"]).fp8.to_recipe().fast_accum
    recast = load_config(None, ["fp8.recipe=delayed", "fp8.delayed_overflow=recast"]).fp8.to_recipe()
    assert recast.delayed_overflow == "recast" and load_config(None, []).fp8.to_recipe().delayed_overflow == "saturate"
    with pytest.raises(UserError, match="fp8.delayed_overflow"):
        load_config(None, ["fp8.delayed_overflow=clip"])


def test_delayed_overflow_recast_outside_its_recipe_or_on_te_is_one_clear_error():
    for extra, message in (
        (["fp8.recipe=tensorwise"], "fp8.recipe=tensorwise: .*delayed_overflow='recast' applies to the 'delayed'"),
        (["fp8.recipe=delayed", "kernels.backend=te"], "no delayed_overflow='recast' mode \\(fp8.delayed_overflow"),
    ):
        config = load_config(None, [*TINY, "train.precision=fp8", "fp8.delayed_overflow=recast", *extra])
        with pytest.raises(UserError, match=message):
            Trainer(config, init_runtime(config))


def test_trainer_quantizes_the_tp_linears_but_the_kept_ones():
    config = load_config(None, [*TINY, "train.precision=fp8", "fp8.keep=[output, 'layers.{last}.*']"])
    trainer = Trainer(config, init_runtime(config))
    linears = _linears(trainer)
    last = config.model.num_hidden_layers - 1
    for name, module in linears.items():
        if name.startswith(f"layers.{last}.") or name == "output":
            assert module.low_precision is None, name
        else:
            assert isinstance(module.low_precision, LowPrecisionLinear), name
    assert any(name == "output" for name in linears) and linears["output"].low_precision is None
    assert {p.dtype for p in trainer.chunks[0].parameters()} == {torch.float32}  # fp32 on CPU: emulation
    assert trainer.precision == "fp8"


def test_a_recipe_that_does_not_fit_names_the_layer_and_the_rule():
    config = load_config(None, [*TINY, "train.precision=fp8", "fp8.recipe=blockwise"])
    with pytest.raises(UserError, match=r"fp8.recipe=blockwise: layer 'layers.0.\S+' .*must be a multiple of 128"):
        Trainer(config, init_runtime(config))
    fallback = load_config(None, [*TINY, "train.precision=fp8", "fp8.recipe=blockwise", "fp8.on_mismatch=fallback"])
    assert all(m.low_precision is None for m in _linears(Trainer(fallback, init_runtime(fallback))).values())


def test_moe_experts_train_in_fp8_and_follow_fp32(tmp_path):
    from mcore.kernels.fp8_grouped_gemm import fp8_grouped_gemm
    from mcore.parallel.expert_parallel import MoELayer

    moe = ["model=mixtral-tiny", "train.steps=8"]
    config = load_config(None, [*TINY, *moe, "train.precision=fp8", "fp8.recipe=rowwise"])
    layers = [m for chunk in Trainer(config, init_runtime(config)).chunks for m in chunk.modules()]
    layers = [m for m in layers if isinstance(m, MoELayer)]
    assert len(layers) == 2
    assert all(m.experts.low_precision.gemm is fp8_grouped_gemm and m.config.align == 16 for m in layers)
    ref, _ = train(tmp_path / "fp32", *moe)
    low, _ = train(tmp_path / "fp8", *moe, "train.precision=fp8", "fp8.recipe=rowwise")
    assert low.final_loss != ref.final_loss and abs(low.final_loss - ref.final_loss) / ref.final_loss < 0.02


@pytest.fixture
def caches(monkeypatch) -> list:
    """Every ``WeightCastCache`` the trainer makes from here on, in order."""
    import mcore.train.low_precision as train_low_precision

    made = []

    class RecordingCache(train_low_precision.WeightCastCache):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(train_low_precision, "WeightCastCache", RecordingCache)
    return made


def test_weight_casts_are_reused_within_a_step_and_renewed_by_the_optimizer_step(tmp_path, caches):
    """Two micro-batches per step: the second reuses the first's weight casts; the trainer drops them before the
    update, so training with the cache is training without it, step for step (a stale cast would differ)."""
    fp8 = ["train.precision=fp8", "fp8.recipe=rowwise", "train.steps=4"]
    config = load_config(None, [*TINY, *fp8])
    trainer = Trainer(config, init_runtime(config))
    assert all(m.low_precision.weight_cache is caches[0] for n, m in _linears(trainer).items() if n != "output")
    with_cache, _ = train(tmp_path / "cached", *fp8)
    cache = caches[-1]
    linears = 4 * config.model.num_hidden_layers  # qkv, out_proj, gate_up, down
    assert (cache.misses, cache.hits, len(cache)) == (4 * linears, 4 * linears, 0)  # once per step, 2 micro-batches
    without, _ = train(tmp_path / "uncached", *fp8, "fp8.weight_cache=false")
    assert len(caches) == 2  # no cache for the uncached run
    cached_losses = [r["loss"] for r in train_records(tmp_path / "cached").values()]
    assert cached_losses == [r["loss"] for r in train_records(tmp_path / "uncached").values()]
    assert len(cached_losses) == 4 and with_cache.final_loss == without.final_loss
    one = load_config(None, [*TINY, *fp8, "train.global_batch_size=2"])  # one micro-batch: nothing to reuse
    assert Trainer(one, init_runtime(one)).weight_casts is None


def test_fp8_expert_weight_casts_are_reused_within_a_step(tmp_path, caches):
    """mixtral-tiny, two micro-batches per step: the experts' fp8 weights are cast once per step too (the linears'
    cache), and training with the cache is training without it."""
    from mcore.parallel.expert_parallel import MoELayer

    fp8 = ["model=mixtral-tiny", "train.precision=fp8", "fp8.recipe=rowwise", "train.steps=3"]
    config = load_config(None, [*TINY, *fp8])
    trainer = Trainer(config, init_runtime(config))
    moe = [m for chunk in trainer.chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    assert moe and all(m.experts.low_precision.weight_casts is caches[0] for m in moe)
    linears = sum(getattr(m, "low_precision", None) is not None for m in _linears(trainer).values())
    train(tmp_path / "cached", *fp8)
    per_step = linears + 2 * len(moe)  # each expert layer: gate_up and down
    assert (caches[-1].misses, caches[-1].hits) == (3 * per_step, 3 * per_step)
    train(tmp_path / "uncached", *fp8, "fp8.weight_cache=false")
    cached = [r["loss"] for r in train_records(tmp_path / "cached").values()]
    assert len(cached) == 3 and cached == [r["loss"] for r in train_records(tmp_path / "uncached").values()]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("fp32"))[0]


@pytest.mark.parametrize("precision, recipe", [("fp8", "delayed"), ("fp4", "nvfp4")])
def test_training_follows_fp32_and_the_checkpoint_resumes_in_fp32(tmp_path, fp32_run, precision, recipe):
    ref = fp32_run
    low, out = train(tmp_path / "low", f"train.precision={precision}", f"{precision}.recipe={recipe}")
    assert low.status == "finished" and "precision " + precision in out
    assert low.final_loss != ref.final_loss  # the GEMMs really ran quantized
    assert abs(low.final_loss - ref.final_loss) / ref.final_loss < 0.02
    # the checkpoint holds high-precision weights only: it resumes at another precision
    resumed, _ = train(tmp_path / "resumed", "train.steps=14", f"checkpoint.load={low.last_checkpoint}")
    assert resumed.status == "finished" and resumed.iteration == 14


def test_convergence_script_dry_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = ROOT / "benchmarks" / "low_precision_convergence.py"
    args = ["--dry-run", "--only", "fp8-rowwise", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "low_precision_convergence.json").read_text())
    assert set(data["summary"]) == {"baseline", "fp8-rowwise"}
    assert all(len(curve) == 6 for curve in data["curves"].values())
    assert data["summary"]["fp8-rowwise"]["precision"] == "fp8"
    assert data["curves"]["fp8-rowwise"] != data["curves"]["baseline"]
    assert "fp8-rowwise" in (tmp_path / "low_precision_convergence.md").read_text()
    assert data["text"]["documents"] > 0 and "standard library" in data["text"]["text"]  # real text, named
    assert (tmp_path / "low_precision_convergence.png").stat().st_size > 0
    # --from reuses the baseline; what --only names is trained again even though the file holds it
    again = [
        "--dry-run",
        "--only",
        "fp8-rowwise",
        "--skip-baseline",
        "--from",
        str(tmp_path / "low_precision_convergence.json"),
    ]
    proc = subprocess.run([sys.executable, str(script), *again, "--out", str(tmp_path / "again")], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[fp8-rowwise] loss after" in proc.stdout and "[baseline]" not in proc.stdout
    merged = json.loads((tmp_path / "again" / "low_precision_convergence.json").read_text())
    assert merged["curves"]["baseline"] == data["curves"]["baseline"] and set(merged["summary"]) == set(data["summary"])


def test_convergence_script_pairs_seeds(tmp_path):
    """``--seeds``: every configuration at each seed, the gap paired by seed and averaged (what passes), the
    per-seed gaps and their spread reported; a later ``--from`` run keeps the seeds it reuses."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = ROOT / "benchmarks" / "low_precision_convergence.py"
    args = ["--dry-run", "--only", "fp8-tensorwise", "--seeds", "3,4", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "low_precision_convergence.json").read_text())
    assert data["seeds"] == ["3", "4"] and set(data["seed_curves"]) == {"baseline", "fp8-tensorwise"}
    runs = data["seed_curves"]
    assert runs["baseline"]["3"] != runs["baseline"]["4"]  # the seed reached the runs
    row = data["summary"]["fp8-tensorwise"]

    def final(curve):
        return sum(curve[-2:]) / 2  # the dry run's tail

    gaps = {s: final(runs["fp8-tensorwise"][s]) / final(runs["baseline"][s]) - 1 for s in ("3", "4")}
    assert row["gaps_by_seed"] == pytest.approx(gaps)
    assert row["relative_to_baseline"] == pytest.approx((gaps["3"] + gaps["4"]) / 2)
    assert row["gap_std"] == pytest.approx(abs(gaps["3"] - gaps["4"]) / 2**0.5)
    assert data["curves"]["baseline"] == pytest.approx([(a + b) / 2 for a, b in zip(*runs["baseline"].values())])
    assert "gap std over seeds" in (tmp_path / "low_precision_convergence.md").read_text()
    # --reuse: seed 4 comes from the file, only seed 5's runs are trained; the summary pairs the seeds asked for
    first = str(tmp_path / "low_precision_convergence.json")
    again = ["--dry-run", "--only", "fp8-tensorwise", "--seeds", "4,5", "--from", first, "--reuse"]
    proc = subprocess.run([sys.executable, str(script), *again, "--out", str(tmp_path / "b")], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(seed 5)" in proc.stdout and "(seed 4)" not in proc.stdout and "(seed 3)" not in proc.stdout
    merged = json.loads((tmp_path / "b" / "low_precision_convergence.json").read_text())
    assert merged["seeds"] == ["4", "5"] and set(merged["seed_curves"]["baseline"]) == {"4", "5"}
    assert merged["seed_curves"]["fp8-tensorwise"]["4"] == runs["fp8-tensorwise"]["4"]  # reused, not retrained
    assert merged["summary"]["fp8-tensorwise"]["gaps_by_seed"]["4"] == pytest.approx(gaps["4"])


def test_bitnet_quant_trains_and_rejects_fp8(tmp_path, fp32_run):
    result, _ = train(tmp_path / "bitnet", "train.quant=bitnet")
    assert result.status == "finished" and result.final_loss != fp32_run.final_loss
    assert result.final_loss < 6.0  # it learns (12 steps from ln(320) = 5.77 at init)
    config = load_config(None, [*TINY, "train.quant=bitnet"])
    linears = _linears(Trainer(config, init_runtime(config)))
    assert all(m.low_precision.recipe.name == "bitnet" for n, m in linears.items() if n != "output")
    with pytest.raises(UserError, match="train.quant=bitnet cannot be combined with train.precision=fp8"):
        load_config(None, ["train.quant=bitnet", "train.precision=fp8"])


def test_bitnet_family_trains_with_per_projection_scales(tmp_path):
    config = load_config(None, [*TINY, "model=bitnet-tiny", "train.quant=bitnet"])
    linears = _linears(Trainer(config, init_runtime(config)))
    qkv = linears["layers.0.attention.qkv"].low_precision
    assert qkv.recipe.name == "bitnet" and sorted(set(qkv.row_segments.tolist())) == [0, 1, 2]  # q, k, v
    assert linears["layers.0.mlp.down"].low_precision.row_segments is None
    result, _ = train(tmp_path / "bitnet", "model=bitnet-tiny", "train.quant=bitnet", "train.steps=6")
    assert result.status == "finished" and result.final_loss < 5.77  # ln(320) at init


@pytest.mark.skipif(__import__("mcore.kernels.te_backend").kernels.te_backend.te_available(), reason="TE installed")
def test_te_backend_without_te_is_one_clear_error():
    for extra in ([], ["train.precision=fp8"]):
        config = load_config(None, [*TINY, "kernels.backend=te", *extra])
        with pytest.raises(UserError, match="needs NVIDIA Transformer Engine"):
            Trainer(config, init_runtime(config))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise", "blockwise:e5m2"])
def test_cuda_fp8_training_follows_bf16(tmp_path, recipe):
    """The real kernels (Triton casts, torch's scaled_mm) in the demo for 60 steps: within 2% of bf16."""
    cuda = ["train.device=cuda", "train.steps=60", "log.interval=60", "train.eval_interval=0", "train.sample_tokens=0"]
    cuda += ["log.plot=false", "log.tensorboard=false", "log.progress_bar=false", "train.hang_timeout=0"]

    def run(name, *extra):
        config = load_config(None, [*cuda, f"log.run_dir={tmp_path / name}", *extra])
        from mcore.train.loop import run_training

        return run_training(config, init_runtime(config), stream=__import__("io").StringIO())

    bf16 = run("bf16", "train.precision=bf16")
    name, _, grads = recipe.partition(":")  # blockwise:e5m2 runs mcore's Triton block-scaled GEMM for dgrad/wgrad
    extra = [f"fp8.grad_format={grads}"] if grads else []
    fp8 = run(name + grads, "train.precision=fp8", f"fp8.recipe={name}", *extra)
    assert fp8.final_loss != bf16.final_loss
    assert abs(fp8.final_loss - bf16.final_loss) / bf16.final_loss < 0.02


def test_every_convergence_configuration_is_a_valid_config(capsys):
    """Each configuration of benchmarks/low_precision_convergence.py loads as mcore-train overrides (a mistyped
    key or value there would otherwise surface only in the GPU run), and the bf16-optimizer-states one really sets
    the three optimizer dtypes."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from low_precision_convergence import CONFIGS, build_spec, parse_args
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for overrides in CONFIGS.values():
        load_config(None, [*TINY, *overrides])  # raises UserError naming the key
    # --seed reaches the run's config (and without it the config's default seed stays)
    seeded, default = (
        build_spec("fp8-rowwise", 6, "cpu", "demo", None, seed=7),
        build_spec("baseline", 6, "cpu", "demo", None),
    )
    assert load_config(None, seeded.overrides).train.seed == 7
    assert load_config(None, default.overrides).train.seed == load_config(None, []).train.seed != 7
    # bad seed lists and a --reuse with nothing to reuse stop at the argument parser, naming the option
    for argv, message in (
        (["--seeds", "1,x"], "--seeds must be comma-separated integers"),
        (["--seeds", "1,1"], "--seeds lists a seed twice"),
        (["--reuse"], "--reuse reuses the runs of --from files"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*argv, "--out", "/tmp/unused"])
        assert message in capsys.readouterr().err
    assert parse_args(["--seeds", "3,4", "--out", "/tmp/unused"]).seed_list == [3, 4]
    # the medium model trains at its own (GPT-3 125M's) learning rate, the demo at the config default
    medium_spec = build_spec("fp8-blockwise", 6, "cuda", "medium", None)
    medium = load_config(None, medium_spec.overrides, default_model=medium_spec.model)
    assert (medium.lr.max_lr, medium.lr.min_lr, medium.data.seq_length) == (6e-4, 6e-5, 1024)
    assert load_config(None, default.overrides).lr.max_lr == load_config(None, []).lr.max_lr
    # the first-last configurations keep decoder layers 0 and 7 of the medium model (and its output layer) in bf16
    first_last = build_spec("fp8-blockwise-first-last-bf16", 6, "cuda", "medium", None)
    keep = load_config(None, first_last.overrides, default_model=first_last.model).fp8.keep
    assert expand_patterns(keep, 8) == ["output", "layers.0.*", "layers.7.*"]
    recast = load_config(None, [*TINY, *CONFIGS["fp8-delayed-recast"]]).fp8.to_recipe()
    assert (recast.name, recast.delayed_overflow) == ("delayed", "recast")
    states = load_config(None, [*TINY, *CONFIGS["bf16-optimizer-states"]]).optim
    assert (states.main_grads_dtype, states.exp_avg_dtype, states.exp_avg_sq_dtype) == ("bf16", "bf16", "bf16")
