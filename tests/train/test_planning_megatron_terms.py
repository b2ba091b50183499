"""The planner's terms for how Megatron-Core r0.8.0 runs a step: TE userbuffer overlap and the fp32 cross entropy."""

from __future__ import annotations

import pytest

from mcore.train.planning.calibration import load_calibration
from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import stage_memory
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import predict_step
from mcore.train.planning.time_model import TimeModel
from mcore.train.planning.tp_overlap import TE_COMM_SMS, TE_PIPELINE_SPLITS, exposed_seconds, overlap_plans

H100 = Network(PRESETS["dgx-h100"])
GPT = ModelShape(hidden=4096, ffn=16384, layers=4, heads=32, kv_heads=32, head_dim=128, vocab=131072, gated=False,
                 layernorm=True)  # fmt: skip
BASE = Layout(tp=8, dp=1, micro_batch=1, global_batch=1, seq_length=4096, sequence_parallel=True)


def test_overlap_plans_follow_transformer_engine_defaults():
    attention_then_mlp = overlap_plans(["column", "row", "column", "row"], tp=8, sm_count=132)
    slow = 132 / (132 - TE_COMM_SMS)
    entry, exit_ = attention_then_mlp[0], attention_then_mlp[1]
    assert (entry.fwd_chunks, entry.fwd_comm, entry.dgrad_comm, entry.wgrad_comm) == (8, "ring", "bulk", "bulk")
    assert entry.dgrad_slowdown == pytest.approx(slow) and entry.fwd_slowdown == 1.0
    assert (exit_.fwd_chunks, exit_.fwd_comm, exit_.dgrad_chunks, exit_.dgrad_comm) == (
        TE_PIPELINE_SPLITS,
        "pipeline",
        8,
        "ring",
    )
    assert attention_then_mlp[2] == entry and attention_then_mlp[3] == exit_
    # MLA: the down-projection is replicated, the second column linear of the block runs plainly
    mla = overlap_plans(["replicated", "column", "column", "row"], tp=8, sm_count=132)
    assert mla[0].fwd_comm == "" and mla[1].fwd_comm == "ring" and mla[2].fwd_comm == ""


def test_exposed_communication_by_overlap_kind():
    # ring: 7 copies of 1 ms beside 8 chunks of 0.5 ms -> 7 x 0.5 ms exposed; copies faster than chunks -> none
    assert exposed_seconds("ring", 4e-3, 8, 0.0, 1e-3) == pytest.approx(3.5e-3)
    assert exposed_seconds("ring", 16e-3, 8, 0.0, 1e-3) == 0.0
    assert exposed_seconds("pipeline", 4e-3, 4, 2e-3, 0.0) == pytest.approx(0.5e-3)  # the last chunk's share
    assert exposed_seconds("bulk", 4e-3, 1, 5e-3, 0.0) == pytest.approx(1e-3)
    assert exposed_seconds("", 4e-3, 1, 5e-3, 0.0) == 0.0


def test_userbuffer_overlap_hides_communication_but_splits_gemms():
    plain = TimeModel(GPT, BASE, H100).layer_cost(0)
    model = TimeModel(GPT, BASE.replace(tp_comm_overlap=True), H100)
    overlap, t = model.layer_cost(0), model.tp_times
    assert overlap.forward["tp_comm"] < plain.forward["tp_comm"]
    # backward per block: the output gradient's all-gather (ring), the saved input's all-gather and the input
    # gradient's reduce-scatter (bulk): less exposed than the three of both blocks run back to back
    assert 0 < overlap.backward["tp_comm"] < 2 * (2 * t["all_gather"] + t["reduce_scatter"])
    # the split GEMMs (tokens / tp rows per chunk, SMs shared with the collectives) run slower than whole ones
    assert overlap.forward["gemm"] > plain.forward["gemm"] and overlap.backward["gemm"] > plain.backward["gemm"]
    gpu = load_calibration("h100-sxm")
    qkv_whole = gpu.gemm_seconds(4096, 3 * 4096 // 8, 4096)
    qkv_chunks = 8 * gpu.gemm_seconds(512, 3 * 4096 // 8, 4096)
    assert qkv_chunks > 1.5 * qkv_whole  # why small micro-batches at tp 8 lose under --tp-comm-overlap


def test_tp_comm_overlap_needs_sequence_parallel():
    bad = BASE.replace(sequence_parallel=False, tp_comm_overlap=True)
    assert any("tp_comm_overlap needs sequence_parallel" in p for p in bad.problems(GPT))
    with pytest.raises(ValueError, match="cross_entropy must be one of"):
        Layout(cross_entropy="bf16")


def test_fp32_cross_entropy_costs_time_and_memory_on_the_last_stage():
    layout = Layout(tp=1, pp=2, micro_batch=1, global_batch=4, seq_length=4096)
    fused, fp32 = predict_step(GPT, layout, H100), predict_step(GPT, layout.replace(cross_entropy="fp32"), H100)
    assert fp32.step_s > fused.step_s  # the last stage is slower, the pipeline waits for it
    model = TimeModel(GPT, layout.replace(cross_entropy="fp32"), H100)
    extra = model.head_cost(False, True).f - TimeModel(GPT, layout, H100).head_cost(False, True).f
    # 36 more bytes per logit element in forward: tokens x vocab x 36 at the calibrated copy rate
    assert extra == pytest.approx(model.gpu.memory_seconds(4096 * 131072 * 36), rel=1e-9)
    first, last = stage_memory(GPT, layout), stage_memory(GPT, layout.replace(cross_entropy="fp32"))
    assert first[0].logits == last[0].logits == 0  # the first stage has no logits
    assert last[1].logits == pytest.approx(first[1].logits * 6 / 4)  # bf16 logits + fp32 softmax vs bf16 + grad


def test_overlapped_gradient_reduction_slows_the_backward_as_measured():
    from pathlib import Path

    from mcore.train.planning.validation import multi_gpu_cases

    h200 = Network(PRESETS["h200-node"])
    cases = {c.name.split(" ")[0]: c for c in multi_gpu_cases(Path(__file__).resolve().parents[2] / "benchmarks"
                                                             / "results")}  # fmt: skip
    for overlapped, plain in (("dp2-overlap", "dp2"), ("dp2-distopt-overlap", "dp2-distopt")):
        a, b = cases[overlapped], cases[plain]
        pa, pb = predict_step(a.shape, a.layout, h200), predict_step(b.shape, b.layout, h200)
        assert pb.breakdown["dp_overlap_slowdown"] == 0 < pa.breakdown["dp_overlap_slowdown"]
        hidden = pb.breakdown["dp_grad_comm"] - pa.breakdown["dp_grad_comm"]
        assert pa.breakdown["dp_overlap_slowdown"] == pytest.approx(0.49 * hidden)
        # what overlapping saves, predicted and measured, within a millisecond
        assert pa.step_s - pb.step_s == pytest.approx(a.measured_step_s - b.measured_step_s, abs=1e-3)
    # an overlapped all-gather costs nothing beside it
    gather = cases["dp2-distopt-overlap-all"]
    assert predict_step(gather.shape, gather.layout, h200).breakdown["dp_overlap_slowdown"] == pytest.approx(
        predict_step(cases["dp2-distopt-overlap"].shape, cases["dp2-distopt-overlap"].layout, h200).breakdown[
            "dp_overlap_slowdown"])  # fmt: skip


def test_megatron_defaults_dropout_and_nan_check_cost_what_their_bytes_say():
    """Megatron-Core r0.8's defaults the published rows ran with: hidden dropout (a 1-byte mask per element of
    each bias-dropout-add), attention dropout inside cuDNN's kernel (+3.4%, measured on an H200), and the NaN check
    of every bucket's gradients (a 4-byte read per parameter); the in-place 1/dp scaling (8 bytes) mcore does too."""
    from mcore.train.planning.time_model import ATTENTION_DROPOUT_COST, DROPOUT_BYTES

    layout = Layout(dp=4, micro_batch=1, global_batch=4, seq_length=4096, distributed_optimizer=True)
    plain, drop = TimeModel(GPT, layout, H100), TimeModel(GPT, layout.replace(dropout=True), H100)
    a, b = plain.layer_cost(0), drop.layer_cost(0)
    assert b.forward["attention"] == pytest.approx(a.forward["attention"] * (1 + ATTENTION_DROPOUT_COST))
    tokens = 4096
    masks = 2 * DROPOUT_BYTES[0] * GPT.hidden * tokens
    assert b.forward["memory"] - a.forward["memory"] == pytest.approx(plain.gpu.memory_seconds(masks))
    assert 0.03 < ATTENTION_DROPOUT_COST < 0.04
    held = stage_memory(GPT, layout.replace(dropout=True))[0].activations - stage_memory(GPT, layout)[0].activations
    assert held == pytest.approx((GPT.layers + 1) * 2 * tokens * GPT.hidden)  # two masks a layer, + workspace
    checked = predict_step(GPT, layout.replace(grad_nan_check=True), H100).breakdown
    scaled = predict_step(GPT, layout, H100).breakdown
    n = GPT.total_parameters()
    assert scaled["grad_bucket_passes"] == pytest.approx(plain.gpu.memory_seconds(8 * n), rel=1e-6)
    assert checked["grad_bucket_passes"] == pytest.approx(plain.gpu.memory_seconds(12 * n), rel=1e-6)
    assert "grad_bucket_passes" not in predict_step(GPT, layout.replace(dp=1, global_batch=1), H100).breakdown
    # DDP zeroes its buffer each step, also where another rank's optimizer updates, except the linears' weights
    # (their first weight-gradient GEMM overwrites): the embedding and the layer norms' weights and biases are left
    filled = GPT.vocab * GPT.hidden + (2 * GPT.layers + 1) * 2 * GPT.hidden  # vocab 131072: no padding
    assert scaled["grad_zero"] == pytest.approx(4 * filled / (plain.gpu.copy_gbps * 1e9), rel=1e-6)


def test_sliding_window_layers_cost_their_pairs_and_are_a_kind_of_their_own():
    full = ModelShape(hidden=1024, ffn=2048, layers=4, heads=8, kv_heads=8, head_dim=128, vocab=1000)
    slid = ModelShape(hidden=1024, ffn=2048, layers=4, heads=8, kv_heads=8, head_dim=128, vocab=1000, window=128,
                      window_layers=(True, False, True, False))  # fmt: skip
    assert slid.layer_kinds(0, 4) == {0: 2, 1: 2} and full.layer_kinds(0, 4) == {0: 4}
    layout = Layout(micro_batch=1, global_batch=1, seq_length=4096)
    a, b = TimeModel(full, layout, H100), TimeModel(slid, layout, H100)
    assert b.layer_cost(1).forward["attention"] == pytest.approx(a.layer_cost(1).forward["attention"])
    pairs = 4096 * 128 - 128**2 / 2
    width = 2 * 1024
    expected = b.gpu.attention_seconds(2 * pairs * width * 3.5, 128) / 3.5
    assert b.layer_cost(0).forward["attention"] == pytest.approx(expected)
    biased = ModelShape(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100, num_experts=4,
                        top_k=2, moe_ffn=32, proj_bias=True, expert_bias=True, sinks=True)  # fmt: skip
    plain = ModelShape(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100, num_experts=4,
                       top_k=2, moe_ffn=32)  # fmt: skip
    # per layer: the projection's bias (64), 4 sinks, 4 experts x (64 + 64) biases, the router's 4
    assert biased.total_parameters() - plain.total_parameters() == 2 * (64 + 4 + 4 * 128 + 4)
