"""MoE routing and its losses against Hugging Face's router modules and float64 hand computations."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.moe import (
    RouterConfig,
    expert_bias_update,
    load_balancing_loss,
    route,
    tokens_per_expert,
    z_loss,
)

transformers = pytest.importorskip("transformers")


def _hf_router(cls_name: str, config_name: str, **config):
    module = getattr(transformers, config_name)(**config)
    models = transformers.models
    family = {"Mixtral": models.mixtral.modeling_mixtral, "Qwen3Moe": models.qwen3_moe.modeling_qwen3_moe}
    family["DeepseekV3"] = models.deepseek_v3.modeling_deepseek_v3
    prefix = next(p for p in family if cls_name.startswith(p))
    return getattr(family[prefix], cls_name)(module)


def _sorted_by_index(weights, indices):
    order = indices.argsort(-1)
    return weights.gather(-1, order), indices.gather(-1, order)


def _compare_with_hf(hf, ours_config, hidden, expert_bias=None):
    x = torch.randn(23, hidden)
    hf_x = x.clone().requires_grad_(True)
    logits, hf_w, hf_i = hf(hf_x)
    our_x = x.clone().requires_grad_(True)
    routing = route(our_x @ hf.weight.detach().t(), ours_config, expert_bias=expert_bias)
    hw, hi = _sorted_by_index(hf_w, hf_i)
    ow, oi = _sorted_by_index(routing.weights, routing.indices)
    assert torch.equal(hi, oi)
    torch.testing.assert_close(ow, hw.float(), rtol=1e-6, atol=1e-7)
    probe = torch.randn_like(ow)
    (hw.float() * probe).sum().backward()
    (ow * probe).sum().backward()
    torch.testing.assert_close(our_x.grad, hf_x.grad, rtol=1e-5, atol=1e-6)


def test_mixtral_router_matches_hf():
    hf = _hf_router("MixtralTopKRouter", "MixtralConfig", hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    torch.nn.init.normal_(hf.weight)
    _compare_with_hf(hf, RouterConfig(num_experts=8, topk=2, norm_topk_prob=True), 16)
    # softmax over the k chosen logits is the same function (Megatron's "top-k then softmax")
    _compare_with_hf(hf, RouterConfig(num_experts=8, topk=2, softmax_before_topk=False), 16)


@pytest.mark.parametrize("norm", [False, True])
def test_qwen3_moe_router_matches_hf(norm):
    hf = _hf_router(
        "Qwen3MoeTopKRouter",
        "Qwen3MoeConfig",
        hidden_size=16,
        num_experts=12,
        num_experts_per_tok=4,
        norm_topk_prob=norm,
    )
    torch.nn.init.normal_(hf.weight)
    _compare_with_hf(hf, RouterConfig(num_experts=12, topk=4, norm_topk_prob=norm), 16)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_deepseek_v3_router_matches_hf(n_group, topk_group):
    hf = _hf_router(
        "DeepseekV3TopkRouter",
        "DeepseekV3Config",
        hidden_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    torch.nn.init.normal_(hf.weight)
    bias = torch.randn(16) * 0.3
    hf.e_score_correction_bias.copy_(bias)
    config = RouterConfig(
        num_experts=16,
        topk=4,
        score_function="sigmoid",
        norm_topk_prob=True,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
    )
    _compare_with_hf(hf, config, 16, expert_bias=bias)


def test_group_limited_choice_stays_in_best_groups_float64():
    logits = torch.randn(40, 16)
    cfg = RouterConfig(num_experts=16, topk=3, score_function="sigmoid", n_group=4, topk_group=2)
    routing = route(logits, cfg)
    scores = torch.sigmoid(logits.double())
    for t in range(40):
        group_score = scores[t].view(4, 4).topk(2, -1).values.sum(-1)
        best = set(group_score.topk(2).indices.tolist())
        allowed = torch.cat([torch.arange(g * 4, g * 4 + 4) for g in sorted(best)])
        want = set(allowed[scores[t, allowed].topk(3).indices].tolist())
        assert set(routing.indices[t].tolist()) == want


def test_expert_bias_changes_choice_not_weights():
    logits = torch.randn(30, 8)
    bias = torch.zeros(8)
    bias[5] = 10.0  # forces expert 5 into every token's top-2
    cfg = RouterConfig(num_experts=8, topk=2)
    routing = route(logits, cfg, expert_bias=bias)
    assert (routing.indices == 5).any(-1).all()
    probs = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(routing.weights.double(), probs.gather(1, routing.indices), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(routing.probs.double(), probs, rtol=1e-6, atol=1e-8)


def test_router_is_fp32_for_bf16_logits_and_scales():
    logits = torch.randn(10, 6).bfloat16()
    routing = route(logits, RouterConfig(num_experts=6, topk=2, routed_scaling_factor=2.0, norm_topk_prob=True))
    assert routing.weights.dtype == torch.float32 and routing.probs.dtype == torch.float32
    torch.testing.assert_close(routing.weights.sum(-1), torch.full((10,), 2.0), rtol=1e-6, atol=1e-6)


def test_load_balancing_loss_equals_hf_over_topk():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(2 * 9, 8)
    routing = route(logits, RouterConfig(num_experts=8, topk=3))
    hf = load_balancing_loss_func((logits,), num_experts=8, top_k=3)
    torch.testing.assert_close(load_balancing_loss(routing.probs, routing.indices), hf / 3, rtol=1e-6, atol=1e-7)


def test_load_balancing_loss_per_sequence_float64_and_gradient():
    batches, seq, experts, k = 3, 5, 6, 2
    logits = torch.randn(batches * seq, experts, dtype=torch.float64)
    probs = torch.softmax(logits, -1).requires_grad_(True)
    indices = probs.detach().topk(k, -1).indices
    got = load_balancing_loss(probs.float(), indices, sequence_length=seq)
    want = 0.0
    for b in range(batches):
        rows = slice(b * seq, (b + 1) * seq)
        f = torch.bincount(indices[rows].reshape(-1), minlength=experts).double() / (seq * k)
        want = want + experts * (f * probs[rows].mean(0)).sum() / batches
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=1e-8)
    # d loss / d probs[t, e] = E * f_e / (S * B) within each sequence
    p = probs.detach().float().requires_grad_(True)
    load_balancing_loss(p, indices, sequence_length=seq).backward()
    want.backward()
    torch.testing.assert_close(p.grad.double(), probs.grad, rtol=1e-6, atol=1e-8)


def test_balanced_routing_has_unit_loss():
    experts = 4
    indices = torch.arange(8).remainder(experts).view(8, 1)
    probs = torch.full((8, experts), 1 / experts)
    torch.testing.assert_close(load_balancing_loss(probs, indices), torch.tensor(1.0))


def test_z_loss_float64():
    logits = torch.randn(7, 5) * 3
    want = torch.log(torch.exp(logits.double()).sum(-1)).square().mean()
    torch.testing.assert_close(z_loss(logits.bfloat16().float()).double(), want, rtol=5e-2, atol=0)
    torch.testing.assert_close(z_loss(logits).double(), want, rtol=1e-6, atol=0)


def test_tokens_per_expert_and_bias_update():
    indices = torch.randint(0, 7, (50, 3))
    counts = tokens_per_expert(indices, 7)
    assert torch.equal(counts, torch.bincount(indices.reshape(-1), minlength=7))
    bias = torch.randn(7)
    start = bias.clone()
    expert_bias_update(bias, counts, 1e-3)
    mean = counts.double().mean().item()
    want = start.double() + 1e-3 * torch.tensor([float(mean > c) - float(mean < c) for c in counts.tolist()])
    torch.testing.assert_close(bias.double(), want, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts=4, topk=5), "topk=5 exceeds num_experts=4"),
        (dict(num_experts=6, topk=2, n_group=4), "n_group=4 must divide num_experts=6"),
        (dict(num_experts=8, topk=2, score_function="relu"), "score_function"),
        (dict(num_experts=8, topk=5, n_group=4, topk_group=1), "topk=5 exceeds the experts"),
    ],
)
def test_bad_router_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kwargs)


def test_bad_logits_shape():
    with pytest.raises(ValueError, match=r"num_experts=8\], got \(4, 6\)"):
        route(torch.randn(4, 6), RouterConfig(num_experts=8, topk=2))
