"""The planner's bytes per parameter under the precision-aware optimizer (optim.main_grads_dtype / exp_avg_dtype /
exp_avg_sq_dtype), against hand counts: gradients 4 -> 2 bytes (DDP buffers; FSDP2's shards stay fp32), moments
4 + 4 -> 2 + 2, and the fused AdamW pass 30 -> 20 bytes per parameter (master r/w 8, gradient 2, moments 2 x 4,
model parameter 2) plus the norm's gradient read."""

from __future__ import annotations

import pytest

from mcore.models.families import get_config
from mcore.train.config import load_config
from mcore.train.plan import layout_of, make_plan
from mcore.train.plan_report import _memory_lines
from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import rank_chunks, stage_memory, stage_parameters
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import predict_step
from mcore.train.planning.time_model import adamw_bytes_per_param

H200 = Network(PRESETS["h200-node"])
LLAMA8B = ModelShape.from_config(get_config("llama3-8b"))
BF16 = {"main_grads_dtype": "bf16", "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
LLAMA8B_RUN = ["model=llama3-8b", "train.global_batch_size=8", "train.micro_batch_size=1"]
OVERRIDES = ["optim.main_grads_dtype=bf16", "optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"]


def _params(layout: Layout) -> float:
    chunks = rank_chunks(LLAMA8B, layout)[0]
    return sum(stage_parameters(LLAMA8B, layout, 0, chunks))


@pytest.mark.parametrize("zero1", [False, True])
def test_ddp_gradients_and_optimizer_bytes(zero1):
    base = Layout(tp=2, dp=4, distributed_optimizer=zero1, global_batch=8, seq_length=4096)
    fp32, bf16 = stage_memory(LLAMA8B, base)[0], stage_memory(LLAMA8B, base.replace(**BF16))[0]
    n = _params(base)
    shards = 4 if zero1 else 1
    assert fp32.gradients == pytest.approx(4 * n) and bf16.gradients == pytest.approx(2 * n)
    assert fp32.optimizer == pytest.approx((4 + 8) * n / shards)  # fp32 master + two fp32 moments
    assert bf16.optimizer == pytest.approx((4 + 4) * n / shards)  # fp32 master + two bf16 moments
    only_v = stage_memory(LLAMA8B, base.replace(exp_avg_dtype="fp32", exp_avg_sq_dtype="bf16"))[0]
    assert only_v.optimizer == pytest.approx((4 + 6) * n / shards)
    assert fp32.weights == bf16.weights and fp32.activations == bf16.activations


def test_dp_shard_keeps_fp32_shard_gradients_and_halves_the_moments():
    base = Layout(dp=8, dp_shard=True, global_batch=8, seq_length=4096)
    fp32, bf16 = stage_memory(LLAMA8B, base)[0], stage_memory(LLAMA8B, base.replace(**BF16))[0]
    local = _params(base) / 8
    assert fp32.gradients == bf16.gradients == pytest.approx(4 * local)
    assert fp32.optimizer == pytest.approx(8 * local) and bf16.optimizer == pytest.approx(4 * local)


def test_optimizer_step_time_counts_the_bytes():
    assert adamw_bytes_per_param(Layout()) == 30
    assert adamw_bytes_per_param(Layout(**BF16)) == 20
    assert adamw_bytes_per_param(Layout(main_grads_dtype="bf16")) == 28
    assert adamw_bytes_per_param(Layout(dp_shard=True, dp=2, **BF16)) == 22  # FSDP2's gradient shard is fp32
    base = Layout(global_batch=8, micro_batch=1, seq_length=4096)
    g = H200.gpu
    n = _params(base)
    for layout, adam, grad in ((base, 30, 4), (base.replace(**BF16), 20, 2)):
        out = predict_step(LLAMA8B, layout, H200).breakdown
        expected = adam * n / (g.copy_gbps * 1e9 * g.optimizer_efficiency) + g.memory_seconds(grad * n)
        assert out["optimizer"] == pytest.approx(expected, rel=1e-9)
        # the embedding and the norms: the linears' first weight-gradient GEMM of a step overwrites their region
        filled = LLAMA8B.vocab * LLAMA8B.hidden + (2 * LLAMA8B.layers + 1) * LLAMA8B.hidden
        assert out["grad_zero"] == pytest.approx(grad * filled / (g.copy_gbps * 1e9), rel=1e-9)


def test_dp_gradient_reduction_moves_half_the_bytes():
    base = Layout(dp=8, distributed_optimizer=True, overlap_grad_reduce=False, global_batch=8, seq_length=4096)
    fp32 = predict_step(LLAMA8B, base, H200).breakdown["dp_grad_comm"]
    bf16 = predict_step(LLAMA8B, base.replace(**BF16), H200).breakdown["dp_grad_comm"]
    assert 0.4 * fp32 < bf16 < 0.6 * fp32  # half the bytes, up to the collectives' latency terms


def test_plan_reads_the_config_keys_and_prints_the_states():
    config = load_config(None, [*LLAMA8B_RUN, *OVERRIDES])
    layout = layout_of(config, 8)
    assert (layout.main_grads_dtype, layout.exp_avg_dtype, layout.exp_avg_sq_dtype) == ("bf16", "bf16", "bf16")
    assert [o for o in layout.overrides() if o.startswith("optim.")] == OVERRIDES
    plan = make_plan(config, 8, 141.0)
    assert "bf16 gradients, fp32 masters, bf16 exp_avg, bf16 exp_avg_sq" in _memory_lines(plan)[0]
    default = make_plan(load_config(None, LLAMA8B_RUN), 8, 141.0)
    assert "fp32 gradients and optimizer states" in _memory_lines(default)[0]
    assert plan.worst.total < default.worst.total


def test_layout_refuses_other_dtypes():
    with pytest.raises(ValueError, match=r"Layout.exp_avg_dtype must be 'fp32' or 'bf16', got 'fp16'"):
        Layout(exp_avg_dtype="fp16")
