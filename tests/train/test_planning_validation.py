"""``mcore-train plan`` against measurements: our H200 runs (dense, multi-GPU, MoE) and Megatron's published table."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.published import MEGATRON_WEAK_SCALING, tuned_layout
from mcore.train.planning.validation import MOE_RUN_FILES, SUPERSEDED_MOE_RUNS, measured_cases, moe_cases

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H200 = Network(PRESETS["h200-node"])
H100 = Network(PRESETS["dgx-h100"])
CASES = {case.name: case for case in measured_cases(RESULTS)}


def test_every_timed_configuration_of_the_performance_doc_is_a_case():
    two_gpu = ["tp2", "tp2-sp", "pp2-1f1b", "pp2-vpp2-interleaved", "pp2-zero-bubble", "dp2", "dp2-overlap",
               "dp2-distopt", "dp2-distopt-overlap", "dp2-distopt-overlap-all"]  # fmt: skip
    runs = ("2026-11-30", "2026-12-01-parts")
    expected = {f"{shape} (1 GPU, {run})" for shape in ("1b", "8b4l") for run in runs}
    expected |= {"single (1 GPU)", "single-half-batch (1 GPU)"}
    expected |= {f"{shape} (1 GPU, MoE, 2026-12-01-e21cc44)" for shape in ("mixtral2l", "qwen3moe4l")}
    # call1's 8b4l_dp_shard measured FSDP2 before its one-rank rewrite (SUPERSEDED_DP_SHARD_RUNS)
    modes = {"call1": ["8b4l_zero1", "8b_optim_offload_0.5"],
             "call2": ["8b4l_zero1", "8b_optim_offload_0.5", "8b4l_optim_offload_0.25"]}  # fmt: skip
    expected |= {f"{name} (1 GPU, final-h200-2026-12-01/{call})" for call, names in modes.items() for name in names}
    probe = ("8b4l_zero1", "8b4l_act_offload_attn_mlp", "8b4l_act_offload_layer")
    expected |= {f"{name} (1 GPU, probe-h200-2026-12-01)" for name in probe}
    expected |= {f"{name} (1 GPU, memory-8b-h200-2026-12-01-s3)" for name in ("8b4l_zero1", "8b_optim_offload_0.5")}
    expected |= {f"{name} (2 GPU)" for name in two_gpu}
    # the moe branch's helper call: the per-expert GEMMs (its FSDP2 rows superseded, as call1's)
    expected |= {"mixtral2l per_expert (1 GPU, MoE, helpers-h200-2026-12-01-s3)"}
    expected |= {"nemotron-h-8b-4l zero1 (1 GPU, helpers-h200-2026-12-01-s3)"}
    # session 5: the expert GEMM modes, bf16 optimizer states and FSDP2 at one rank after its rewrite
    s5 = ("gptoss4l grouped_fp32_wgrad", "gptoss4l grouped_fp32_wgrad bf16 states", "gptoss4l",
          "mixtral2l per_expert bf16 states", "mixtral2l fsdp-per_expert", "moonlight8l grouped_fp32_wgrad bf16 states",
          "moonlight8l fsdp-grouped_fp32_wgrad", "qwen3moe4l bf16 states", "gptoss4l bf16 states",
          "moonlight8l bf16 states")  # fmt: skip
    expected |= {f"{name} (1 GPU, MoE, s5-h200-2026-12-01)" for name in s5}
    expected |= {f"nemotron-h-8b-4l {c} (1 GPU, s5-h200-2026-12-01)" for c in ("zero1", "zero1_modules")}
    # MoE calls after e21cc44 (moe-<shapes>-h200-<run>/<shape>/mcore_*.json, moonlight8l's hand-written from its
    # log): each record is a case too
    later = [p for p in RESULTS.glob(MOE_RUN_FILES[1]) if p.relative_to(RESULTS).parts[0] not in SUPERSEDED_MOE_RUNS]
    assert "moonlight8l (1 GPU, MoE, gptoss-moonlight-h200-2026-12-01-s3)" in CASES
    assert expected <= set(CASES) and len(CASES) == len(expected) + len(later), sorted(set(CASES) - expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_step_time_and_peak_memory_within_ten_percent(name):
    case = CASES[name]
    step, memory = case.predicted(H200)
    assert step == pytest.approx(case.measured_step_s, rel=0.10), (step, case.measured_step_s)
    assert len(memory) == len(case.measured_peak_gb)
    for predicted, measured in zip(memory, case.measured_peak_gb, strict=True):
        assert predicted == pytest.approx(measured, rel=0.10), (memory, case.measured_peak_gb)


@pytest.fixture(scope="module")
def megatron():
    return [(row, *tuned_layout(row, H100)) for row in MEGATRON_WEAK_SCALING]


def test_megatron_rows_fit_an_h100_and_keep_the_published_layout(megatron):
    for row, layout, prediction in megatron:
        assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (row.tp, row.pp, row.dp, row.gpus)
        assert layout.global_batch == row.batch and 0 < prediction.mfu < 1
        # the table's TFLOP/s and MFU use the same model-FLOP count as ours (6 x weights + 12 L h s, full attention)
        flops = row.shape().model_flops_per_token(4096)
        assert row.tflops_per_gpu / 989.4 * 100 == pytest.approx(row.mfu_percent, abs=0.6)
        assert flops > 0


def test_megatron_trend_and_offset(megatron):
    """What docs/scaling.md reports: MFU rises from the smallest to the largest models as published; with
    Megatron-Core r0.8.0's defaults modelled (its fp32 cross entropy, dropout, the NaN check and 1/dp scaling of
    every gradient bucket), TE's userbuffer overlap and the measured slowdown beside overlapped gradient
    reductions, every row is predicted within 5 points of the published MFU (docs/scaling.md, section 2)."""
    predicted = [100 * p.mfu for _, _, p in megatron]
    published = [row.mfu_percent for row, _, _ in megatron]
    assert min(predicted[-2:]) > predicted[0] and min(published[-2:]) > published[0]
    gaps = {row.name: p - q for (row, _, _), p, q in zip(megatron, predicted, published, strict=True)}
    assert all(abs(g) <= 5 for g in gaps.values()), gaps
    assert gaps["1.7B"] > 0  # still above: the host syncs Megatron adds are not charged (docs/scaling.md)


def test_session5_records_reach_the_layout():
    """The variant in ``impl`` (FSDP2 as ``mcore-fsdp-<expert gemm>``), the expert GEMM mode and the optimizer
    dtypes of ``overrides`` are the case's layout."""
    run = "(1 GPU, MoE, s5-h200-2026-12-01)"
    fsdp = CASES[f"mixtral2l fsdp-per_expert {run}"].layout
    zero1 = CASES[f"mixtral2l per_expert bf16 states {run}"].layout
    assert fsdp.dp_shard and not fsdp.distributed_optimizer and fsdp.expert_gemm == "per_expert"
    assert not zero1.dp_shard and zero1.distributed_optimizer and zero1.expert_gemm == "per_expert"
    dtypes = ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    assert [getattr(zero1, k) for k in dtypes] == ["bf16"] * 3 and [getattr(fsdp, k) for k in dtypes] == ["fp32"] * 3
    moon = CASES[f"moonlight8l fsdp-grouped_fp32_wgrad {run}"].layout
    assert moon.dp_shard and moon.expert_gemm == "grouped_fp32_wgrad"
    ssm = CASES["nemotron-h-8b-4l zero1_modules (1 GPU, s5-h200-2026-12-01)"].layout
    assert (ssm.main_grads_dtype, ssm.exp_avg_dtype, ssm.exp_avg_sq_dtype) == ("fp32", "bf16", "bf16")
    assert ssm.recompute_modules == ("mamba_core", "layernorm", "mlp")


def test_superseded_dp_shard_rows_are_left_out_and_their_other_rows_kept():
    names = set(CASES)
    assert "mixtral2l per_expert (1 GPU, MoE, helpers-h200-2026-12-01-s3)" in names
    assert not any("fsdp" in n and "helpers-h200-2026-12-01-s3" in n for n in names)
    assert "8b4l_zero1 (1 GPU, final-h200-2026-12-01/call1)" in names
    assert "8b4l_dp_shard (1 GPU, final-h200-2026-12-01/call1)" not in names


def test_two_moe_records_of_one_name_are_refused(tmp_path):
    src = RESULTS / "s5-h200-2026-12-01" / "gptoss4l" / "mcore-grouped_fp32_wgrad_gptoss4l.json"
    for d in ("a", "b"):
        (tmp_path / "s5-h200-x" / d).mkdir(parents=True)
        (tmp_path / "s5-h200-x" / d / src.name).write_text(src.read_text())
    with pytest.raises(ValueError, match="a second MoE record named"):
        moe_cases(tmp_path)
