"""FP8 experts: ``enable_low_precision`` gives MoE layers row-wise fp8 grouped GEMMs (padded to 16 rows per expert),
block-wise ones under ``blockwise`` (padded to 128), keeps them by pattern, names shape mismatches, and the layer
tracks its high-precision self. Under DDP their weight gradients go into ``main_grad`` (``wgrad_into``: written on a
step's first micro-batch, so DDP skips its zero-fill, added after) and train exactly as when the GEMMs return them
and DDP's hook adds them."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import mcore.kernels.fp8_block_grouped_gemm as block
import mcore.parallel.expert_biases as expert_biases
import mcore.parallel.expert_parallel as expert_parallel
from mcore.kernels.fp8_block_grouped_gemm import fp8_block_grouped_gemm
from mcore.kernels.fp8_grouped_gemm import fp8_grouped_gemm
from mcore.kernels.low_precision_linear import Recipe
from mcore.parallel import DistributedDataParallel
from mcore.parallel.expert_biases import use_gpt_oss_options
from mcore.parallel.expert_parallel import MoEConfig, MoELayer
from mcore.parallel.low_precision import disable_low_precision, enable_low_precision
from mcore.parallel.param_attrs import wgrad_overwrites_main_grad

H, E, TOPK, F = 64, 4, 2, 96


def _model(hidden: int = H, gpt_oss: bool = False, ffn: int = F) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=hidden, num_experts=E, topk=TOPK, moe_intermediate_size=ffn, norm_topk_prob=True)
    layer = MoELayer(config)
    if gpt_oss:  # biased routers and experts, clamped SwiGLU: their own forward (expert_biases.py)
        use_gpt_oss_options(layer, router_bias=True, expert_biases=True, activation=(1.702, 0.6))
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
    decisions = enable_low_precision(fp8, Recipe("rowwise"), keep=())
    assert [(d.name, d.recipe) for d in decisions] == [("mlp.experts", "rowwise-grouped")]
    assert fp8["mlp"].experts.low_precision.gemm is fp8_grouped_gemm and fp8["mlp"].config.align == 16
    import mcore.kernels.fp8_grouped_gemm as module

    calls, original = [], module.ROWWISE.gemm
    counting = dataclasses.replace(module.ROWWISE, gemm=lambda *a: calls.append(a) or original(*a))
    monkeypatch.setattr(module, "ROWWISE", counting)
    for got, want in zip(_run(fp8, x), _run(high, x), strict=True):
        rel = ((got - want).norm() / want.norm()).item()
        assert 1e-4 < rel < 0.1, rel  # quantized, within what e4m3 allows
    assert len(calls) == 4  # gate_up and down, forward and dgrad
    disable_low_precision(fp8)
    assert fp8["mlp"].experts.low_precision is None


def test_blockwise_experts_run_block_scaled_gemms_padded_to_128_close_to_high_precision(monkeypatch, caplog):
    x = torch.randn(2, 40, 128, generator=torch.Generator().manual_seed(6))
    high = _model(hidden=128, ffn=128)
    fp8 = copy.deepcopy(high)
    with caplog.at_level("INFO", logger="mcore.parallel"):
        decisions = enable_low_precision(fp8, Recipe("blockwise"), keep=())
    assert [(d.name, d.recipe) for d in decisions] == [("mlp.experts", "blockwise-grouped")]
    assert fp8["mlp"].experts.low_precision.gemm is fp8_block_grouped_gemm and fp8["mlp"].config.align == 128
    assert "mlp.experts runs blockwise-grouped fp8 GEMMs" in caplog.text
    calls, original = [], block.BLOCKWISE.gemm
    counting = dataclasses.replace(block.BLOCKWISE, gemm=lambda *a: calls.append(a) or original(*a))
    monkeypatch.setattr(block, "BLOCKWISE", counting)
    for got, want in zip(_run(fp8, x), _run(high, x), strict=True):
        rel = ((got - want).norm() / want.norm()).item()
        assert 1e-4 < rel < 0.08, rel  # quantized; measured 0.061-0.065 (y, dx, dw of both GEMMs) over 4 seeds
    assert len(calls) == 4  # gate_up and down, forward and dgrad


def test_blockwise_experts_off_the_128_grid_are_named_or_fall_back_and_other_recipes_stay_rowwise():
    model = _model()  # hidden 64, expert FFN 96: multiples of 16, not of 128
    with pytest.raises(ValueError, match=r"layer 'mlp.experts': hidden 64 and expert FFN 96 must be multiples of 128"):
        enable_low_precision(model, Recipe("blockwise"), keep=())
    [decision] = enable_low_precision(model, Recipe("blockwise"), keep=(), on_mismatch="fallback")
    assert decision.recipe is None and model["mlp"].experts.low_precision is None and model["mlp"].config.align == 1
    [decision] = enable_low_precision(model, Recipe("tensorwise"), keep=())
    assert decision.recipe == "rowwise-grouped" and model["mlp"].experts.low_precision.gemm is fp8_grouped_gemm
    [decision] = enable_low_precision(_model(hidden=128, ffn=128), Recipe("blockwise"), keep=("mlp.*",))
    assert decision.recipe is None and "keep pattern" in decision.reason


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


def _ddp_run(monkeypatch, into: bool, gpt_oss: bool, shape=("rowwise", H, F)) -> dict:
    """Two SGD steps of two micro-batches (1 token, so top-2 leaves two experts without rows; then 40) through DDP,
    every gradient buffer NaN-poisoned before each zero_grad_buffer; ``into=False``: no ``wgrad_into`` (the GEMMs
    return the gradients, DDP zero-fills and adds them: the previous path)."""
    recipe, hidden, ffn = shape
    wrapped = _model(hidden, gpt_oss=gpt_oss, ffn=ffn)
    enable_low_precision(wrapped, Recipe(recipe), keep=())
    model = wrapped["mlp"]
    gemms = {"rowwise": fp8_grouped_gemm, "blockwise": fp8_block_grouped_gemm}
    assert model.experts.low_precision.gemm is gemms[recipe]
    with monkeypatch.context() as patch:
        if not into:
            for module in (expert_parallel, expert_biases):  # the plain and the GPT-OSS experts' forward
                patch.setattr(module, "expert_wgrad_into", lambda w, host_offsets=None: None)
        ddp = DistributedDataParallel(model, dp_group=None)
        experts = model.experts
        out = {"grads": [], "kept": [], "overwrites": []}
        for step in range(2):
            for buf in ddp.grad_buffers:
                buf.grad_data.fill_(float("nan"))
            ddp.zero_grad_buffer()
            out["kept"].append([bool(torch.isnan(w.main_grad).all()) for w in (experts.gate_up, experts.down)])
            for micro, tokens in enumerate((1, 40)):
                g = torch.Generator().manual_seed(10 * step + micro)
                x, probe = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g)
                with ddp.no_sync() if micro == 0 else torch.enable_grad():
                    (ddp(x) * probe).sum().backward()
            ddp.finish_grad_sync()
            out["grads"].append({name: p.main_grad.clone() for name, p in model.named_parameters()})
            out["overwrites"].append([wgrad_overwrites_main_grad(w) for w in (experts.gate_up, experts.down)])
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.5 * p.main_grad)
    out["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("shape", [("rowwise", H, F), ("blockwise", 128, 128)], ids=["rowwise", "blockwise"])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt_oss"])
def test_fp8_expert_weight_gradients_go_into_main_grad_and_train_as_the_returned_ones(monkeypatch, gpt_oss, shape):
    previous = _ddp_run(monkeypatch, into=False, gpt_oss=gpt_oss, shape=shape)
    ours = _ddp_run(monkeypatch, into=True, gpt_oss=gpt_oss, shape=shape)
    # the previous path: never overwritten, so always zero-filled; ours: written on step 1, so step 2's fill skipped
    assert previous["overwrites"] == [[False, False]] * 2 and previous["kept"] == [[False, False]] * 2
    assert ours["overwrites"] == [[True, True]] * 2 and ours["kept"] == [[False, False], [True, True]]
    # bit-equal: the same fp32 products, copied then added instead of added to zeros then added
    for got, want in zip([*ours["grads"], ours["params"]], [*previous["grads"], previous["params"]], strict=True):
        for name, ref in want.items():
            assert torch.isfinite(got[name]).all() and torch.any(got[name] != 0), name
            assert torch.equal(got[name], ref), name
