"""The planner's parts against independent counts: model accounting, schedule theory, collective formulas."""

from __future__ import annotations

import json

import pytest

from mcore.models.accounting import model_flops_per_token, parameter_counts
from mcore.models.families import get_config
from mcore.parallel.pipeline import GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleH1
from mcore.train.errors import UserError
from mcore.train.planning.calibration import Calibration, interpolate, load_calibration
from mcore.train.planning.cluster import PRESETS, Group, Network, load_cluster
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import live_activation_peak, stage_memory
from mcore.train.planning.pipeline_sim import replay, run_schedule
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import predict_step

H200 = Network(PRESETS["h200-node"])
LLAMA8B = ModelShape.from_config(get_config("llama3-8b"))


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen2-7b", "qwen3-8b", "llama3.2-1b"])
def test_shape_counts_match_model_accounting(preset):
    config = get_config(preset)
    shape = ModelShape.from_config(config)
    assert shape.total_parameters() == parameter_counts(config).total
    assert shape.model_flops_per_token(4096) == pytest.approx(model_flops_per_token(config, 4096), rel=1e-12)


def test_moe_shape_counts_active_and_total_experts():
    dense = ModelShape(hidden=64, ffn=128, layers=4, heads=4, kv_heads=4, head_dim=16, vocab=100)
    moe = ModelShape(
        hidden=64, ffn=128, layers=4, heads=4, kv_heads=4, head_dim=16, vocab=100, num_experts=8, top_k=2,
        moe_ffn=32, first_dense_layers=1,
    )  # fmt: skip
    expert = 3 * 64 * 32
    assert moe.total_parameters() - dense.total_parameters() == 3 * (8 * expert + 64 * 8 - 3 * 64 * 128)
    assert moe.active_matmul_weights() - dense.active_matmul_weights() == 3 * (2 * expert + 64 * 8 - 3 * 64 * 128)
    with pytest.raises(ValueError, match="top_k"):
        ModelShape(hidden=64, ffn=128, layers=4, heads=4, kv_heads=4, head_dim=16, vocab=100, num_experts=8)


def test_layout_problems_name_the_numbers():
    shape = ModelShape(hidden=64, ffn=128, layers=6, heads=6, kv_heads=2, head_dim=16, vocab=100)
    assert Layout(tp=2, global_batch=4).problems(shape) == []
    problems = " | ".join(Layout(tp=4, pp=4, dp=3, global_batch=8, ep=2, cp=3, seq_length=100).problems(shape))
    expected = (
        "tp=4 does not divide the 6 query",
        "not a multiple of 2*cp = 6",
        "not a multiple of micro_batch x dp = 3",
        "6 layers do not split evenly over pp x vpp = 4",
        "ep=2 needs a MoE model",
    )
    for text in expected:
        assert text in problems
    with pytest.raises(ValueError, match="optimizer_offload_fraction"):
        Layout(optimizer_offload_fraction=1.5)


def test_memory_follows_sharding_and_offload():
    base = Layout(dp=8, micro_batch=1, global_batch=8, seq_length=4096)
    plain = stage_memory(LLAMA8B, base)[0]
    zero1 = stage_memory(LLAMA8B, base.replace(distributed_optimizer=True))[0]
    zero3 = stage_memory(LLAMA8B, base.replace(dp_shard=True))[0]
    half = stage_memory(LLAMA8B, base.replace(distributed_optimizer=True, optimizer_offload_fraction=0.5))[0]
    n = plain.parameters
    assert plain.weights == pytest.approx(2 * n) and plain.gradients == pytest.approx(4 * n)
    assert plain.optimizer == pytest.approx(12 * n) and zero1.optimizer == pytest.approx(12 * n / 8)
    assert half.optimizer == pytest.approx(zero1.optimizer / 2)
    # ZeRO-3 as mcore's dp_shard runs it: fp32 shards that are the masters, two layers gathered in bf16, fp32
    # gradient shards, the moments; with one micro-batch the gradients appear as the activations are freed
    assert zero1.weights == plain.weights
    assert zero3.weights == pytest.approx(4 * n / 8 + 2 * 2 * n / LLAMA8B.layers)
    assert zero3.gradients == pytest.approx(4 * n / 8) and zero3.optimizer == pytest.approx(8 * n / 8)
    assert zero3.never_together == pytest.approx(min(zero3.gradients, zero3.activations + zero3.logits))
    two = stage_memory(LLAMA8B, base.replace(dp_shard=True, global_batch=16))[0]  # they coexist from the 2nd on
    assert two.never_together == 0 and two.allocated == pytest.approx(zero3.allocated + zero3.never_together)
    full = stage_memory(LLAMA8B, base.replace(recompute="full"))[0]
    selective = stage_memory(LLAMA8B, base.replace(recompute="selective"))[0]
    assert full.activations < selective.activations < plain.activations


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 16)])
def test_in_flight_micro_batches_follow_the_schedule(pp, m):
    layout = Layout(pp=pp, global_batch=m, micro_batch=1)
    for rank in range(pp):  # 1F1B: rank r holds pp - r micro-batches at its peak
        assert live_activation_peak(layout, [1.0], rank) == pp - rank
        assert live_activation_peak(layout.replace(schedule="gpipe"), [1.0], rank) == m
    inter = layout.replace(vpp=2)
    assert live_activation_peak(inter, [0.5, 0.5], 0) > pp / 1  # interleaving holds more than 1F1B on rank 0
    zb = live_activation_peak(layout.replace(schedule="zero-bubble"), [1.0], pp - 1)
    assert zb > 1.0  # deferred weight-gradient passes keep part of the activations


@pytest.mark.parametrize("schedule,pp,vpp,m", [(OneFOneB, 4, 1, 8), (Interleaved1F1B, 4, 2, 8), (GPipe, 2, 1, 4),
                                               (OneFOneB, 4, 1, 64), (Interleaved1F1B, 4, 3, 40)])  # fmt: skip
def test_replay_with_uniform_ops_gives_the_schedule_bubble(schedule, pp, vpp, m):
    def op_time(rank, kind, chunk):
        return {"F": 1.0 / vpp, "B": 2.0 / vpp, "W": 0.0}[kind]

    run = run_schedule(schedule, pp, vpp, m, op_time, 0.0)
    assert run.bubble_fraction == pytest.approx(schedule.bubble_fraction(pp, vpp, m), abs=1e-12)
    assert run.span == pytest.approx(replay(schedule.plans(pp, vpp, m), pp, op_time, 0.0).span)


def test_replay_zero_bubble_and_transfers():
    def even(rank, kind, chunk):
        return 1.0

    zb = run_schedule(ZeroBubbleH1, 4, 1, 8, even, 0.0)
    assert zb.bubble_fraction == pytest.approx(ZeroBubbleH1.bubble_fraction(4, 1, 8))
    slow = run_schedule(OneFOneB, 4, 1, 8, even, 0.1)
    assert slow.span > run_schedule(OneFOneB, 4, 1, 8, even, 0.0).span


def test_collectives_inside_a_node_and_across_nodes():
    gpu = H200.gpu
    nbytes = 2.56e8
    tp8 = H200.collective("all_reduce", Group(8, 1), nbytes)
    assert tp8 == pytest.approx(nbytes * 2 * 7 / 8 / (261e9) + 14 * 5e-6, rel=1e-6)
    # a dp group of one GPU per node (tp=8 inside) gets one NIC's share; eight per node get eight
    one_per_node = H200.collective("reduce_scatter", Group(16, 8), nbytes)
    eight_per_node = H200.collective("reduce_scatter", Group(16, 1), nbytes)
    nic = 8 * 400 / 8 / 8 * 0.8
    assert one_per_node == pytest.approx(nbytes * 15 / 16 / (nic * 1e9) + 15 * 8e-6, rel=1e-6)
    assert eight_per_node < one_per_node / 4
    assert H200.collective("all_reduce", Group(1, 1), nbytes) == 0.0
    assert gpu.nvlink_busbw("all_gather", nbytes) == gpu.nvlink_busbw("all_reduce", nbytes)


def test_calibration_files_round_trip_and_reject_bad_input(tmp_path):
    for name in ("h200-sxm", "h100-sxm"):
        cal = load_calibration(name)
        path = tmp_path / f"{name}.json"
        cal.save(path)
        assert load_calibration(str(path)) == cal and cal.assumptions
    h100, h200 = load_calibration("h100-sxm"), load_calibration("h200-sxm")
    assert h100.copy_gbps == pytest.approx(h200.copy_gbps * 3.35 / 4.8, rel=1e-4) and h100.gemm == h200.gemm
    bad = load_calibration("h200-sxm").to_dict() | {"gemm_rate": 1}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="unknown keys \\['gemm_rate'\\]"):
        load_calibration(str(tmp_path / "bad.json"))
    with pytest.raises(UserError, match="unknown calibration 'a100'"):
        load_calibration("a100")
    with pytest.raises(ValueError, match="increasing x"):
        Calibration(**(load_calibration("h200-sxm").to_dict() | {"attention": [[4096, 300.0], [512, 100.0]]}))
    assert interpolate([[1, 10], [100, 1000]], 10) == pytest.approx(100)
    assert interpolate([[1, 10], [100, 1000]], 1e6) == 1000
    with pytest.raises(UserError, match="unknown cluster"):
        load_cluster("dgx-a100")


def test_step_prediction_moves_the_right_way():
    base = Layout(tp=8, pp=1, dp=4, micro_batch=1, global_batch=64, seq_length=4096, sequence_parallel=True,
                  distributed_optimizer=True)  # fmt: skip
    slow_net = Network(PRESETS["h200-node"].__class__("slow", "h200-sxm", nic_gbit=25.0))
    fast, slow = predict_step(LLAMA8B, base, H200), predict_step(LLAMA8B, base, slow_net)
    assert slow.step_s > fast.step_s and slow.breakdown["dp_grad_comm"] > fast.breakdown["dp_grad_comm"]
    overlap = predict_step(LLAMA8B, base.replace(overlap_param_gather=True), H200)
    assert overlap.breakdown["dp_param_comm"] < fast.breakdown["dp_param_comm"]
    recompute = predict_step(LLAMA8B, base.replace(recompute="full"), H200)
    assert recompute.step_s > fast.step_s and 0 < fast.mfu < 1
    # MFU is model FLOPs over the dense peak: tokens/s x flops/token / (GPUs x peak)
    assert fast.mfu == pytest.approx(fast.tokens_per_s * fast.model_flops_per_token / (32 * 989.4e12))


def test_moe_and_context_parallel_predictions_run():
    moe = ModelShape(
        hidden=2048, ffn=8192, layers=8, heads=16, kv_heads=4, head_dim=128, vocab=32000, num_experts=64, top_k=8,
        moe_ffn=1024, shared_ffn=1024, first_dense_layers=1,
    )  # fmt: skip
    layout = Layout(tp=1, dp=8, ep=8, micro_batch=1, global_batch=64, seq_length=4096, distributed_optimizer=True)
    assert layout.problems(moe) == [] and layout.expert_dp == 1
    p = predict_step(moe, layout, H200)
    assert p.breakdown["ep_comm"] > 0 and p.step_s > 0
    expert_params = stage_memory(moe, layout)[0].parameters
    assert expert_params < moe.total_parameters() / 4  # experts split over ep=8
    cp = Layout(cp=2, dp=4, micro_batch=1, global_batch=8, seq_length=8192)
    assert cp.problems(LLAMA8B) == [] and predict_step(LLAMA8B, cp, H200).breakdown.get("cp_comm", 0) >= 0


def test_moe_shape_from_hugging_face_names():
    from types import SimpleNamespace

    qwen2_moe = SimpleNamespace(
        hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=None, vocab_size=100, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=96, mlp_layer_types=("dense", "moe", "moe"),
    )  # fmt: skip
    shape = ModelShape.from_config(qwen2_moe)
    assert (shape.num_experts, shape.top_k, shape.moe_ffn, shape.shared_ffn) == (8, 2, 32, 96)
    assert [shape.is_moe_layer(i) for i in range(3)] == [False, True, True] and shape.layer_kinds(0, 3) == {0: 1, 1: 2}
    deepseek_like = SimpleNamespace(**{**vars(qwen2_moe), "mlp_layer_types": None, "first_k_dense_replace": 1,
                                       "shared_expert_intermediate_size": None, "n_shared_experts": 2})  # fmt: skip
    assert ModelShape.from_config(deepseek_like).shared_ffn == 64
    assert ModelShape.from_config(deepseek_like).moe_layers == 2


def test_grouped_gemm_runs_at_the_measured_efficiency_for_its_rows_per_expert():
    gpu = load_calibration("h200-sxm")
    dense = gpu.gemm_seconds(128 * 512, 1536, 2048)
    assert gpu.grouped_gemm_seconds(128, 512, 1536, 2048) == pytest.approx(dense / 0.503)
    between = gpu.grouped_gemm_seconds(16, 1024, 1536, 2048) / gpu.gemm_seconds(16 * 1024, 1536, 2048)
    assert 1 / 0.503 > between > 1 / 0.813  # log-log between the two measured points
    with pytest.raises(ValueError, match="grouped_gemm"):
        Calibration(**(gpu.to_dict() | {"grouped_gemm": []}))
