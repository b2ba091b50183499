"""``mcore-train plan --search`` and ``--calibrate``: ranked layouts, explained rejections, a calibration file."""

from __future__ import annotations

import json

import pytest

from mcore.models.families import get_config
from mcore.train.cli import main
from mcore.train.config import load_config
from mcore.train.plan_cli import memory_warning
from mcore.train.planning.calibration import load_calibration
from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.search import EXACT_TOP, NOT_ENUMERATED, format_search, search
from mcore.train.planning.shape import ModelShape

H200 = Network(PRESETS["h200-node"])


def test_search_ranks_fitting_layouts_and_explains_the_rest():
    shape = ModelShape.from_config(get_config("llama3.2-1b"))
    found = search(shape, 12, 48, 4096, H200)  # 12 GPUs: pp 3, 6, 12 need balanced (uneven) layouts
    runs = [c for c in found if c.runs]
    speeds = [c.prediction.tokens_per_s for c in runs[:EXACT_TOP]]  # the leaders, re-ranked by the replay
    assert runs and speeds == sorted(speeds, reverse=True)
    assert all(c.memory_gb <= H200.gpu.memory_gb for c in runs)
    refused = [c for c in found if not c.runs]
    assert refused and all(c.reasons for c in refused)
    assert any(
        "interleaved 1F1B needs vpp >= 2 and micro-batches (1) divisible by pp" in r for c in refused for r in c.reasons
    )
    uneven = [c for c in runs if c.layout.pp == 3]
    assert uneven and all(sum(c.layout.pipeline_layout) == 16 for c in uneven)
    plain = next(c.layout for c in uneven if not c.layout.dp_shard and c.layout.cp == 1)  # fields mcore-train has
    config = load_config(None, ["model=llama3.2-1b", "data.seq_length=4096", *plain.overrides()])
    assert config.parallel.pp == 3 and sum(config.parallel.pipeline_layout) == 16
    text = format_search(found)
    assert "overrides of the best: parallel.tp=" in text and "why the others cannot run" in text
    best = runs[0].layout
    if best.cp == 1 and best.ep == 1 and not best.dp_shard and not best.optimizer_offload_fraction:
        config = load_config(None, ["model=llama3.2-1b", "data.seq_length=4096", *best.overrides()])
        assert config.parallel.tp * config.parallel.pp * config.parallel.dp == 12


def test_search_says_why_nothing_fits():
    shape = ModelShape.from_config(get_config("llama3-70b"))
    found = search(shape, 2, 8, 4096, H200, memory_gb=80.0)
    assert found and not any(c.runs for c in found)
    reasons = [r for c in found for r in c.reasons]
    assert any("GB per GPU even with full recompute, ZeRO-3 and offload; 80 GB available" in r for r in reasons)
    assert "no layout fits" in format_search(found)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_predicts_and_searches(capsys):
    base = ["model=llama3.2-1b", "data.seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=64"]
    code, out, _ = _run(capsys, "plan", *base, "parallel.dp=8", "--calibration", "h100-sxm")
    assert code == 0 and "predicted on h100-sxm: step" in out and "memory modes" in out
    code, out, _ = _run(capsys, "plan", "--search", "--gpus", "8", "--cluster", "dgx-h100", *base, "--top", "2")
    assert code == 0 and "1. " in out and "2. " in out and "3. " not in out and "overrides of the best" in out
    code, out, _ = _run(capsys, "plan", "--search", "--gpus", "12", *base, "train.global_batch_size=48", "--json")
    rows = json.loads(out)
    assert rows[0]["tokens_per_s"] > 0 and any(r["reasons"] for r in rows)
    code, _, err = _run(capsys, "plan", *base, "--calibration", "a100")
    assert code == 2 and "unknown calibration 'a100'" in err


def test_memory_warning_names_the_cheapest_fitting_mode():
    config = load_config(None, ["model=llama3-8b", "data.seq_length=4096", "train.micro_batch_size=1",
                                "train.global_batch_size=8", "parallel.dp=8"])  # fmt: skip
    text = memory_warning(config, 8, gpu_memory_gb=80.0)
    assert text and "more than the 80 GB" in text and "parallel.distributed_optimizer=true" in text
    assert memory_warning(config, 8, gpu_memory_gb=200.0) is None


def test_calibrate_dry_run_writes_a_calibration(capsys, tmp_path):
    path = tmp_path / "cal.json"
    code, out, _ = _run(capsys, "plan", "--calibrate", "--dry-run", "--output", str(path))
    assert code == 0 and "written to" in out
    cal = load_calibration(str(path))
    assert cal.gemm["bf16"] and cal.attention and cal.copy_gbps > 0
    assert [p[0] for p in cal.grouped_gemm] == [4.0, 8.0] and all(0 < p[1] <= 1 for p in cal.grouped_gemm)
    assert set(cal.nvlink) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert "measured: gemm" in cal.assumptions[0]


@pytest.mark.parametrize("bad", [["--search", "--gpus", "0"], ["--gpu-memory", "0"]])
def test_cli_plan_rejects_bad_numbers(capsys, bad):
    code, _, err = _run(capsys, "plan", "model=llama3.2-1b", *bad)
    assert code == 2 and "mcore-train: error:" in err


@pytest.mark.gpu
def test_calibrate_measures_this_gpu():
    from mcore.train.planning.measure import DOC_LENGTHS, GEMM_SIZES, GROUPED_ROWS, calibrate

    cal = calibrate(reps=3)
    assert [p[0] for p in cal.gemm["bf16"]] == sorted(2.0 * m * n * k for m, n, k in GEMM_SIZES)
    assert [int(p[0]) for p in cal.attention] == DOC_LENGTHS and cal.memory_gb > 10
    assert [int(p[0]) for p in cal.grouped_gemm] == GROUPED_ROWS and all(0 < p[1] <= 1 for p in cal.grouped_gemm)
    assert "(measured)" in cal.name and cal.wgrad_fp32_slowdown >= 1.0


def test_plan_reads_the_memory_fields_other_sections_add_and_suggests_a_mode():
    from mcore.train.plan import layout_of, make_plan
    from mcore.train.plan_report import format_plan

    config = load_config(None, ["model=llama3-8b", "data.seq_length=4096", "train.micro_batch_size=1",
                                "train.global_batch_size=8", "parallel.dp=8"])  # fmt: skip
    plain = layout_of(config, 8)
    assert (plain.dp_shard, plain.optimizer_offload_fraction, plain.ep) == (False, 0.0, 1)
    config.parallel.dp_shard, config.optim.offload_fraction = True, 0.25  # fields of the FSDP / offload work
    sharded = layout_of(config, 8)
    assert sharded.dp_shard and sharded.optimizer_offload_fraction == 0.25
    config.parallel.dp_shard, config.optim.offload_fraction = False, 0.0
    text = format_plan(make_plan(config, 8, 80.0, H200))
    assert "does NOT fit in 80 GB" in text and "cheapest that fits: ZeRO-3: parallel.dp_shard=true" in text


def test_cli_plan_names_the_fastest_memory_mode_for_a_full_8b_on_one_h200(capsys):
    """The full Llama-3-8B (~176 GB of training state and activations) on one 141 GB H200 with 32 micro-batches
    per step: offloading half the optimizer (one CPU step per 32 micro-batches) beats any recompute (one extra
    forward per micro-batch), so the plan suggests it, and the config as given is refused in words."""
    args = ["model=llama3-8b", "data.seq_length=4096", "train.device=cuda", "train.precision=bf16"]
    args += ["parallel.distributed_optimizer=true", "train.micro_batch_size=1", "train.global_batch_size=32"]
    code, out, _ = _run(capsys, "plan", *args, "--gpu-memory", "141", "--calibration", "h200-sxm")
    assert code == 0, out
    assert "does NOT fit in 141 GB" in out
    suggestion = [line for line in out.splitlines() if line.strip().startswith("cheapest that fits")]
    assert suggestion and suggestion[0].endswith("parallel.distributed_optimizer=true optim.offload_fraction=0.5")


def test_search_offloads_half_the_optimizer_when_that_beats_recompute():
    """The full Llama-3-8B on one H200, 32 sequences per step: the search's best layout keeps every activation and
    offloads half the optimizer (as ``plan`` suggests for that config), ahead of any recompute."""
    shape = ModelShape.from_config(get_config("llama3-8b"))
    found = search(shape, 1, 32, 4096, Network(PRESETS["h200-node"]))
    best = found[0].layout
    assert (best.recompute, best.optimizer_offload_fraction) == ("none", 0.5)
    assert all(c.prediction.step_s >= found[0].prediction.step_s for c in found if c.runs)


def test_every_refused_layout_is_counted_under_its_reason():
    """A layout that cannot run is explained, never silently skipped: the summary's counts per reason add up to
    the refused layouts' reasons, each with an example, including an ep the data-parallel grid cannot hold."""
    shape = ModelShape(hidden=256, ffn=512, layers=6, heads=4, kv_heads=2, head_dim=64, vocab=1024, num_experts=16,
                       top_k=2, moe_ffn=128, name="tiny-moe")  # fmt: skip
    found = search(shape, 8, 8, 512, H200, memory_gb=0.05)
    refused = [c for c in found if not c.runs]
    assert refused and all(c.reasons for c in refused)
    text = format_search(found)
    summary = text.split("why the others cannot run (layouts per reason, with one example):\n")[1].splitlines()[:-1]
    counts = {line.split(None, 1)[1]: int(line.split(None, 1)[0]) for line in summary}
    assert sum(counts.values()) == sum(len(c.reasons) for c in refused)
    reasons = " ".join(counts)
    for rule in ("does not divide tp x cp x dp", "does not divide the 4 query", "GB per GPU even with full recompute",
                 "interleaved 1F1B needs"):  # fmt: skip
        assert rule in reasons, (rule, counts)
    assert any(c.layout.ep == 16 and c.layout.tp * c.layout.dp * c.layout.cp < 16 for c in refused)
    assert text.endswith(NOT_ENUMERATED)  # and what the enumeration leaves out is said


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 8), (2, 8, 4), (4, 2, 8), (4, 5, 4)])
def test_closed_form_pipeline_never_ends_before_the_work_and_tracks_the_replay(pp, vpp, m):
    """The closed form ranks the search; with interleaving and few micro-batches it used to end before the busiest
    rank had run its micro-batches (a 25% optimistic ZeRO-3 layout then crowded the replayed leaders)."""
    from mcore.parallel.pipeline import Interleaved1F1B, OneFOneB
    from mcore.train.planning.pipeline_sim import estimate, run_schedule

    schedule = Interleaved1F1B if vpp > 1 else OneFOneB
    times = {"F": 1.0, "B": 2.0, "W": 0.0}
    op_time = lambda rank, kind, chunk: times[kind] / vpp * (1.2 if rank == pp - 1 else 1.0)  # noqa: E731
    closed, exact = estimate(schedule, pp, vpp, m, op_time, 0.0), run_schedule(schedule, pp, vpp, m, op_time, 0.0)
    assert closed.span >= max(closed.busy) and exact.span >= max(exact.busy)
    assert closed.span == pytest.approx(exact.span, rel=0.15), (closed.span, exact.span)
