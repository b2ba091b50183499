"""FP8 experts: ``enable_low_precision`` gives MoE layers row-wise fp8 grouped GEMMs (padded to 16 rows per expert),
keeps them by pattern, names shape mismatches, and the layer tracks its high-precision self."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from mcore.kernels.fp8_grouped_gemm import fp8_grouped_gemm
from mcore.kernels.low_precision_linear import Recipe
from mcore.parallel.expert_parallel import MoEConfig, MoELayer
from mcore.parallel.low_precision import disable_low_precision, enable_low_precision

H, E, TOPK, F = 64, 4, 2, 96


def _model(hidden: int = H) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=hidden, num_experts=E, topk=TOPK, moe_intermediate_size=F, norm_topk_prob=True)
    layer = MoELayer(config)
    layer.router.reset_parameters(torch.Generator().manual_seed(1))
    layer.experts.reset_parameters(torch.Generator().manual_seed(2))
    return torch.nn.ModuleDict({"mlp": layer})


def _run(model, x):
    x = x.clone().requires_grad_()
    y = model["mlp"](x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)))
    experts = model["mlp"].experts
    return y.detach(), x.grad, experts.gate_up.grad, experts.down.grad


def test_experts_run_fp8_grouped_gemms_close_to_high_precision(monkeypatch):
    x = torch.randn(2, 40, H, generator=torch.Generator().manual_seed(3))
    high = _model()
    fp8 = copy.deepcopy(high)
    decisions = enable_low_precision(fp8, Recipe("blockwise"), keep=())
    assert [(d.name, d.recipe) for d in decisions] == [("mlp.experts", "rowwise-grouped")]
    assert fp8["mlp"].experts.low_precision.gemm is fp8_grouped_gemm and fp8["mlp"].config.align == 16
    import mcore.kernels.fp8_grouped_gemm as module

    calls, original = [], module._grouped_2d_3d
    monkeypatch.setattr(module, "_grouped_2d_3d", lambda *a: calls.append(a) or original(*a))
    for got, want in zip(_run(fp8, x), _run(high, x), strict=True):
        rel = ((got - want).norm() / want.norm()).item()
        assert 1e-4 < rel < 0.1, rel  # quantized, within what e4m3 allows
    assert len(calls) == 4  # gate_up and down, forward and dgrad
    disable_low_precision(fp8)
    assert fp8["mlp"].experts.low_precision is None


def test_padding_to_16_rows_leaves_the_high_precision_layer_unchanged():
    x = torch.randn(2, 40, H, generator=torch.Generator().manual_seed(5))
    plain = _model()
    padded = copy.deepcopy(plain)
    padded["mlp"].config = dataclasses.replace(padded["mlp"].config, align=16)
    for got, want in zip(_run(padded, x), _run(plain, x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_experts_kept_by_pattern_or_recipe():
    model = _model()
    [decision] = enable_low_precision(model, Recipe("rowwise"), keep=("mlp.*",))
    assert decision.recipe is None and "keep pattern" in decision.reason
    [decision] = enable_low_precision(model, Recipe("mxfp8"), keep=())
    assert decision.recipe is None and "an fp8 recipe, not mcore:mxfp8" in decision.reason
    assert model["mlp"].experts.low_precision is None and model["mlp"].config.align == 1


def test_a_shape_the_kernel_cannot_take_is_named_or_falls_back():
    model = _model(hidden=72)
    with pytest.raises(ValueError, match=r"layer 'mlp.experts': hidden 72 .* multiples of 16"):
        enable_low_precision(model, Recipe("tensorwise"), keep=())
    [decision] = enable_low_precision(model, Recipe("tensorwise"), keep=(), on_mismatch="fallback")
    assert decision.recipe is None and model["mlp"].experts.low_precision is None
