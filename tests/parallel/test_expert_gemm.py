"""``expert_gemm: per_expert``: one GEMM per expert from host offsets, against float64 and the grouped path; its
weight gradient goes straight into DDP's fp32 ``main_grad``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore.kernels import swiglu
from mcore.parallel import DistributedDataParallel, MoELayer
from mcore.parallel.expert_gemm import expert_bounds, per_expert_linear, per_expert_linear_of_activation
from tests.parallel._moe import BASE, full_weights

OFFSETS = [5, 5, 12, 16]  # an expert without rows, then 4 rows of no expert
ROWS, K, M = 20, 8, 16


def _float64(x, w, offsets):
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offsets):
        y[start:end] = x[start:end].double() @ w[g].double().t()
        start = end
    return y


@pytest.mark.parametrize("with_activation", [False, True])
def test_per_expert_matches_float64(with_activation, monkeypatch):
    # the outputs are allocated uninitialised: make that memory NaN so that any row or expert left unwritten shows
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    width = 2 * K if with_activation else K
    x = torch.randn(ROWS, width, requires_grad=True)
    w = torch.randn(len(OFFSETS), M, K, requires_grad=True)
    bounds = expert_bounds(torch.tensor(OFFSETS, dtype=torch.int32))
    assert bounds == [(0, 5), (5, 5), (5, 12), (12, 16)]
    y = per_expert_linear_of_activation(x, w, bounds, swiglu) if with_activation else per_expert_linear(x, w, bounds)
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
    a64 = torch.nn.functional.silu(x64[:, :K]) * x64[:, K:] if with_activation else x64
    want = _float64(a64, w64, OFFSETS)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    probe = torch.randn(ROWS, M)
    (y * probe).sum().backward()
    (want * probe.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-6, atol=1e-6)
    assert torch.all(x.grad[OFFSETS[-1] :] == 0) and torch.all(w.grad[1] == 0)


def _layer(gemm: str) -> MoELayer:
    layer = MoELayer(replace(BASE, expert_gemm=gemm))
    layer.load_full_weights(*full_weights())
    return layer


def test_per_expert_layer_equals_grouped_and_fills_main_grad(monkeypatch):
    import mcore.parallel.expert_gemm as expert_gemm

    fused = []
    real = expert_gemm.accumulate_weight_grad_
    monkeypatch.setattr(expert_gemm, "accumulate_weight_grad_", lambda *a: fused.append(1) or real(*a))
    x = torch.randn(12, 2, BASE.hidden_size, generator=torch.Generator().manual_seed(1))
    grads = {}
    for gemm in ("grouped", "per_expert"):
        layer = DistributedDataParallel(_layer(gemm), dp_group=None)
        layer.module(x).square().sum().backward()
        experts = layer.module.experts
        assert experts.gate_up.grad is None  # everything went into main_grad
        grads[gemm] = [experts.gate_up.main_grad.clone(), experts.down.main_grad.clone()]
    assert len(fused) > 0  # the per-expert weight gradients accumulated in main_grad inside the GEMM
    for ours, ref in zip(grads["per_expert"], grads["grouped"]):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert ours.abs().sum() > 0


def test_bad_expert_gemm_is_named():
    with pytest.raises(ValueError, match=r"expert_gemm must be one of \('grouped', 'per_expert'\), got 'loop'"):
        replace(BASE, expert_gemm="loop")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_per_expert_bf16_matches_grouped_with_main_grad():
    # Mixtral-like proportions at small width; bf16 weights under DDP: the fp32 main_grad of both paths agree
    config = replace(BASE, hidden_size=256, moe_intermediate_size=512, align=8)
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(8, 256, generator=g), torch.randn(8, 1024, 256, generator=g) * 0.05)
    full = (*full, torch.randn(8, 256, 512, generator=g) * 0.05)
    x = torch.randn(512, 2, 256, generator=g).cuda().bfloat16()
    grads = {}
    for gemm in ("grouped", "per_expert"):
        layer = MoELayer(replace(config, expert_gemm=gemm), params_dtype=torch.bfloat16, device="cuda")
        layer.load_full_weights(*(t.cuda() for t in full))
        ddp = DistributedDataParallel(layer, dp_group=None)
        ddp.module(x).float().square().sum().backward()
        grads[gemm] = [layer.experts.gate_up.main_grad.clone(), layer.experts.down.main_grad.clone()]
    for ours, ref in zip(grads["per_expert"], grads["grouped"]):
        scale = ref.abs().max().item()
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-2 * scale)
