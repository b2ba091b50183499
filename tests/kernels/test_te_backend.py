"""Transformer Engine backend: clear errors without it; on a GPU with TE, its FP8 linears track ours."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe
from mcore.kernels.te_backend import TELinear, check_te_recipe, te_available

needs_te = pytest.mark.skipif(not te_available(), reason="transformer_engine is not installed")


def test_recipes_without_a_te_counterpart_name_the_alternative():
    for name in ("rowwise", "mxfp4", "bitnet"):
        with pytest.raises(ValueError, match=f"no '{name}' recipe.*kernels.backend=auto"):
            check_te_recipe(Recipe(name))
    check_te_recipe(Recipe("blockwise"))
    check_te_recipe(None)


def test_delayed_recast_has_no_te_mode():
    """TE's delayed scaling always saturates: recast is refused (before TE is imported), naming the key."""
    recast = Recipe("delayed", delayed_overflow="recast")
    for call in (check_te_recipe, TELinear):
        with pytest.raises(ValueError, match="no delayed_overflow='recast' mode \\(fp8.delayed_overflow.*=saturate"):
            call(recast)
    check_te_recipe(Recipe("delayed"))


@pytest.mark.skipif(te_available(), reason="transformer_engine is installed")
def test_without_te_the_request_says_how_to_install_it():
    with pytest.raises(RuntimeError, match=r"needs NVIDIA Transformer Engine \(pip install 'mcore-kernels\[te\]'"):
        TELinear(Recipe("tensorwise"))


@pytest.mark.gpu
@needs_te
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tensorwise", "delayed", "blockwise"])
def test_te_linear_tracks_ours_and_trains_our_parameters(name):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=gen).cuda().bfloat16()
    w = torch.nn.Parameter((torch.randn(384, 512, generator=gen) * 0.05).cuda().bfloat16())
    g = torch.randn(256, 384, generator=gen).cuda().bfloat16()
    xi = x.clone().requires_grad_()
    TELinear(Recipe(name)).__call__(xi, w).backward(g)
    te_out = (xi.grad.float(), w.grad.float())
    w.grad = None
    xo = x.clone().requires_grad_()
    LowPrecisionLinear(Recipe(name))(xo, w).backward(g)
    for te_t, ours in zip(te_out, (xo.grad.float(), w.grad.float()), strict=True):
        assert (te_t - ours).norm() / ours.norm() < 0.05
