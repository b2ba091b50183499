"""GPT-OSS's MoE options on one MoELayer (``mcore.parallel.expert_biases``): router bias, per-expert biases and the
clamped SwiGLU against a float64 token-by-token loop written from the definition, dropless and with padded expert
rows (align) or dropped tokens (capacity), forward and every gradient, with grouped or per-expert GEMMs (whose
weight gradients go into DDP's fp32 ``main_grad`` inside the GEMM)."""

from __future__ import annotations

import math

import pytest
import torch

from mcore.parallel import DistributedDataParallel, MoEConfig, MoELayer
from mcore.parallel.expert_biases import BiasedGroupedExperts, BiasedRouter, use_gpt_oss_options

H, F, E, K, T = 16, 8, 4, 2, 10
ALPHA, LIMIT = 1.702, 0.6


def _layer(**knobs) -> MoELayer:
    config = MoEConfig(
        hidden_size=H, num_experts=E, topk=K, moe_intermediate_size=F, softmax_before_topk=False, **knobs
    )
    layer = MoELayer(config)
    use_gpt_oss_options(layer, router_bias=True, expert_biases=True, activation=(ALPHA, LIMIT))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor, dropped: set[tuple[int, int]] = frozenset()):
    """float64, one token and one chosen expert at a time: top-k of the biased logits, softmax over the k."""
    w = {n: p.detach().double().requires_grad_(True) for n, p in layer.named_parameters()}
    xs = x.double()
    out = torch.zeros_like(xs)
    for t in range(xs.shape[0]):
        logits = xs[t] @ w["router.weight"].T + w["router.bias"]
        top = torch.topk(logits, K)
        probs = torch.softmax(top.values, dim=0)
        for j, e in enumerate(top.indices.tolist()):
            if (t, j) in dropped:
                continue
            h = w["experts.gate_up"][e] @ xs[t] + w["experts.gate_up_bias"][e]
            gate, up = h[:F].clamp(max=LIMIT), h[F:].clamp(-LIMIT, LIMIT)
            y = w["experts.down"][e] @ ((up + 1) * gate * torch.sigmoid(ALPHA * gate)) + w["experts.down_bias"][e]
            out[t] = out[t] + probs[j] * y
    return out, w


@pytest.mark.parametrize("gemm", ["grouped", "per_expert"])
@pytest.mark.parametrize("knobs", [{}, {"align": 4}], ids=["dropless", "align4"])
def test_layer_equals_float64_loop(knobs, gemm):
    layer = _layer(**knobs, expert_gemm=gemm)
    assert isinstance(layer.router, BiasedRouter) and isinstance(layer.experts, BiasedGroupedExperts)
    assert layer.experts.gemm == gemm
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    probe = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    (out * probe).sum().backward()
    ref, w = _reference(layer, x)
    (ref * probe.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(
            p.grad.double(), w[name].grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_dropped_tokens_get_no_expert_bias():
    # capacity 0.5: each expert keeps ceil(T*K*0.5/E) rows; a dropped choice adds nothing, biases included
    layer = _layer(capacity_factor=0.5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    counts = layer.stats["tokens_per_expert"]
    assert int(layer.stats["dropped"]) > 0 and counts.sum() == T * K
    routing_logits = x.double() @ layer.router.weight.double().T + layer.router.bias.double()
    top = torch.topk(routing_logits, K).indices
    capacity = math.ceil(T * K * 0.5 / E)
    kept: dict[int, int] = {}
    dropped = set()
    for t in range(T):  # drop policy "position": earlier tokens first
        for j, e in enumerate(top[t].tolist()):
            kept[e] = kept.get(e, 0) + 1
            if kept[e] > capacity:
                dropped.add((t, j))
    ref, _ = _reference(layer, x, dropped)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_no_options_leave_the_layer_as_it_was():
    config = MoEConfig(hidden_size=H, num_experts=E, topk=K, moe_intermediate_size=F)
    layer = MoELayer(config)
    before = type(layer.router), type(layer.experts)
    use_gpt_oss_options(layer, router_bias=False, expert_biases=False, activation=None)
    assert (type(layer.router), type(layer.experts)) == before


def test_per_expert_weight_gradients_go_into_main_grad(monkeypatch):
    import mcore.parallel.expert_gemm as expert_gemm

    fused = []
    real = expert_gemm.accumulate_weight_grad_
    monkeypatch.setattr(expert_gemm, "accumulate_weight_grad_", lambda *a: fused.append(1) or real(*a))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    grads = {}
    for gemm in ("grouped", "per_expert"):
        ddp = DistributedDataParallel(_layer(expert_gemm=gemm), dp_group=None)
        ddp.module(x).square().sum().backward()
        experts = ddp.module.experts
        names = ("gate_up", "down", "gate_up_bias", "down_bias")
        assert all(getattr(experts, n).grad is None for n in names)  # DDP moved them all into main_grad
        grads[gemm] = [getattr(experts, n).main_grad.clone() for n in names]
    assert len(fused) == 2 * E  # both weights of every expert: fp32 accumulation inside the GEMM, no add pass
    for ours, ref in zip(grads["per_expert"], grads["grouped"], strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert ours.abs().sum() > 0
