"""The planner's context-parallel terms by ``cp_comm_type`` (docs/context_parallel.md's cost terms) and MTP depths."""

from __future__ import annotations

import pytest

from mcore.train.planning.cluster import PRESETS, Group, Network
from mcore.train.planning.cp_cost import cp_cost, cp_held_bytes, kv_and_qkvo_bytes
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import activation_bytes_per_layer, stage_memory
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.time_model import TimeModel

H200 = Network(PRESETS["h200-node"])
LLAMA = ModelShape(hidden=4096, ffn=14336, layers=4, heads=32, kv_heads=8, head_dim=128, vocab=128256)
MLA = ModelShape(hidden=2048, ffn=8192, layers=2, heads=16, kv_heads=16, head_dim=128, vocab=1000, q_lora_rank=512,
                 kv_lora_rank=256, qk_rope_head_dim=64, v_head_dim=128)  # fmt: skip


def _layout(**kw) -> Layout:
    return Layout(**{"tp": 2, "cp": 4, "dp": 1, "micro_batch": 1, "global_batch": 1, "seq_length": 16384} | kw)


def test_kv_and_qkvo_bytes_per_rank():
    kv, qkvo = kv_and_qkvo_bytes(LLAMA, _layout(), 2)
    tokens = 16384 / 4
    assert kv == tokens * (8 / 2) * (128 + 128) * 2
    assert qkvo == tokens * (16 * 128 + 4 * 128 + 4 * 128 + 16 * 128) * 2
    # MLA exchanges its up-projected K and V: every head, q/k dim with the rope part
    kv_mla, _ = kv_and_qkvo_bytes(MLA, _layout(), 2)
    assert kv_mla == tokens * (16 / 2) * (128 + 64 + 128) * 2


def test_p2p_ring_forward_and_backward_bytes():
    layout = _layout()
    kv, _ = kv_and_qkvo_bytes(LLAMA, layout, 2)
    cost = cp_cost(LLAMA, layout, H200, 2)
    assert cost.ring_forward == pytest.approx(3 * H200.p2p(kv, False))
    assert cost.ring_backward == pytest.approx(3 * H200.p2p(kv, False) + 4 * H200.p2p(2 * kv, False))
    assert cost.blocking_forward == cost.blocking_backward == 0
    assert cp_held_bytes(LLAMA, layout, 2) == 0


def test_all_gather_and_a2a_block_and_all_gather_holds_the_gathered_kv():
    kv, qkvo = kv_and_qkvo_bytes(LLAMA, _layout(), 2)
    gather = cp_cost(LLAMA, _layout(cp_comm_type="all_gather"), H200, 2)
    assert gather.blocking_forward == pytest.approx(H200.collective("all_gather", Group(4, 2), 4 * kv))
    assert gather.blocking_backward == pytest.approx(H200.collective("reduce_scatter", Group(4, 2), 4 * kv))
    assert cp_held_bytes(LLAMA, _layout(cp_comm_type="all_gather"), 2) == 3 * kv
    held = activation_bytes_per_layer(LLAMA, _layout(cp_comm_type="all_gather"), 0)
    assert held - activation_bytes_per_layer(LLAMA, _layout(), 0) == pytest.approx(3 * kv)
    a2a = cp_cost(LLAMA, _layout(cp_comm_type="a2a"), H200, 2)
    assert (
        a2a.blocking_forward == a2a.blocking_backward == pytest.approx(H200.collective("all_to_all", Group(4, 2), qkvo))
    )
    assert a2a.ring_forward == 0
    # a2a+p2p, A = 2: the a2a inside pairs, then a ring of 2 over the pairs
    mixed = cp_cost(LLAMA, _layout(cp_comm_type="a2a+p2p", cp_a2a_size=2), H200, 2)
    assert mixed.blocking_forward == pytest.approx(H200.collective("all_to_all", Group(2, 2), qkvo))
    assert mixed.ring_forward == pytest.approx(H200.p2p(kv, False))


def test_blocking_comm_reaches_the_step_and_the_ring_hides_under_attention():
    ring = TimeModel(LLAMA, _layout(), H200).layer_cost(0)
    blocking = TimeModel(LLAMA, _layout(cp_comm_type="all_gather"), H200).layer_cost(0)
    assert blocking.forward["cp_comm"] > 0 and blocking.backward["cp_comm"] > 0
    assert ring.forward["cp_comm"] < blocking.forward["cp_comm"]  # 16k tokens: each block hides its transfer


def test_cp_layout_problems_follow_mcore_train():
    assert _layout(cp_comm_type="a2a+p2p").problems(LLAMA) == [
        "cp_comm_type a2a+p2p needs cp_a2a_size among the divisors [2] of cp=4"
    ]
    assert "only for cp_comm_type a2a+p2p" in _layout(cp_a2a_size=2).problems(LLAMA)[0]
    # 8 KV heads over tp 2 = 4 per rank: a2a over 8 CP ranks cannot split them
    assert any("splits the 4 KV heads" in p for p in _layout(cp=8, cp_comm_type="a2a").problems(LLAMA))
    moe = ModelShape(hidden=512, ffn=1024, layers=2, heads=8, kv_heads=8, head_dim=64, vocab=1000, num_experts=8,
                     top_k=2, moe_ffn=256)  # fmt: skip
    assert _layout(tp=1, cp=2, ep=2, dp=1).problems(moe) == []  # CP with EP runs (tests/train/test_cp_sinks_mtp.py)
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        Layout(cp_comm_type="ring")
    assert "parallel.cp_comm_type=a2a" in _layout(cp_comm_type="a2a").overrides()


def test_optimizer_states_shard_over_dp_times_cp():
    a = stage_memory(LLAMA, _layout(tp=1, cp=2, dp=2, global_batch=2, distributed_optimizer=True))[0]
    b = stage_memory(LLAMA, _layout(tp=1, cp=1, dp=4, global_batch=4, distributed_optimizer=True))[0]
    assert a.optimizer == pytest.approx(b.optimizer) and a.weights == b.weights
    model = TimeModel(LLAMA, _layout(tp=2, cp=2, dp=2, global_batch=2), H200)
    assert (model.dp_group.size, model.dp_group.stride) == (4, 2)


def test_mtp_depths_add_a_layer_a_projection_and_the_output_layer_on_the_last_stage():
    base = ModelShape(hidden=256, ffn=512, layers=4, heads=4, kv_heads=4, head_dim=64, vocab=1000)
    mtp = ModelShape(**{**base.__dict__, "mtp_layers": 1})
    h = 256
    assert mtp.total_parameters() - base.total_parameters() == base.layer_parameters(3) + 3 * h + 2 * h * h
    extra = mtp.model_flops_per_token(128) - base.model_flops_per_token(128)
    assert extra == pytest.approx(6 * (2 * h * h + 1000 * h) + base.layer_flops_per_token(3, 128))
    layout = Layout(pp=2, micro_batch=1, global_batch=2, seq_length=128)
    plain, with_mtp = stage_memory(base, layout), stage_memory(mtp, layout)
    assert with_mtp[0].total == plain[0].total  # the first stage is unchanged
    assert with_mtp[1].parameters - plain[1].parameters == mtp.total_parameters() - base.total_parameters()
    assert with_mtp[1].logits == 2 * plain[1].logits and with_mtp[1].activations > plain[1].activations


def test_mtp_shape_matches_model_accounting_when_the_deepseek_family_is_registered():
    from mcore.models.accounting import model_flops_per_token, parameter_counts
    from mcore.models.families import get_config

    try:
        config = get_config("deepseek_v3-tiny")
    except (KeyError, ValueError):
        pytest.skip("the deepseek_v3 family is not registered on this branch")
    config = type(config)(**{**config.__dict__, "num_nextn_predict_layers": 1})
    shape = ModelShape.from_config(config)
    assert shape.mtp_layers == 1
    assert shape.total_parameters() == parameter_counts(config).total
    assert shape.model_flops_per_token(256) == pytest.approx(model_flops_per_token(config, 256), rel=1e-9)


@pytest.mark.parametrize(("cp", "comm", "a2a"), [(2, "p2p", None), (4, "p2p", None), (4, "all_gather", None),
                                                 (4, "a2a", None), (4, "a2a+p2p", 2)])  # fmt: skip
def test_time_terms_move_the_bytes_counted_on_the_real_cp_attention(cp, comm, a2a):
    """``cp_cost`` times the bytes ``planning.cp_terms`` counts (tests/train/test_planning_cp_terms.py checks those
    on the collectives of ``mcore.parallel.cp_attention``): the same bytes, each on its link."""
    from mcore.train.planning.cp_terms import cp_layer_terms

    layout = _layout(cp=cp, cp_comm_type=comm, cp_a2a_size=a2a)
    kv, qkvo = kv_and_qkvo_bytes(LLAMA, layout, 2)
    terms = cp_layer_terms(LLAMA, tokens=16384 / cp, tp=2, cp=cp, comm_type=comm, a2a_size=a2a)
    a2a_size = cp if comm == "a2a" else a2a or 1
    ring = cp // a2a_size
    a2a_bytes = (a2a_size - 1) / a2a_size * qkvo if a2a_size > 1 else 0.0
    if comm == "all_gather":
        forward, backward = (cp - 1) * kv, (cp - 1) * kv
    elif ring == 1:  # a2a alone
        forward = backward = a2a_bytes
    else:  # the ring's K/V transfers, then backward's fp32 dK/dV (2 KV each), as cp_cost times them
        forward, backward = a2a_bytes + (ring - 1) * kv, a2a_bytes + (ring - 1) * kv + ring * 2 * kv
    assert (terms.forward_bytes, terms.backward_bytes) == (pytest.approx(forward), pytest.approx(backward))
    assert terms.extra_activation_bytes == cp_held_bytes(LLAMA, layout, 2)
