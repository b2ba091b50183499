"""BitNet b1.58 quantizers against float64 formulas and Hugging Face's online quantizers; the STE linear."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.bitnet import bitnet_linear, int8_per_token, ternary_weight
from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe


def test_ternary_weight_against_float64():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    q = ternary_weight(w)
    mean = w.double().abs().mean()
    levels = torch.round(w.double() / mean).clamp(-1, 1)
    torch.testing.assert_close(q.double(), levels * mean, rtol=1e-6, atol=0)
    assert set(torch.unique(torch.round(q.double() / mean)).tolist()) == {-1.0, 0.0, 1.0}
    assert ternary_weight(torch.zeros(4, 4)).abs().sum() == 0  # eps guards the all-zero weight


def test_int8_per_token_against_float64():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 5).unsqueeze(-1)
    q = int8_per_token(x)
    x64 = x.double()
    step = x64.abs().amax(-1, keepdim=True) / 127
    torch.testing.assert_close(q.double(), torch.round(x64 / step).clamp(-128, 127) * step, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # the largest stays


def test_matches_hugging_face_online_quantizers():
    bitnet = pytest.importorskip("transformers.integrations.bitnet")
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 128, generator=gen) * 0.05, torch.randn(16, 128, generator=gen)
    # their forwards are torch.compile'd; config.patch rather than monkeypatch, whose undo (pytest >= 9.2) deletes
    # the entry and hides it from torch for the rest of the session
    with torch._dynamo.config.patch(disable=True):
        torch.testing.assert_close(ternary_weight(w), bitnet.WeightQuant.apply(w), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(int8_per_token(x), bitnet.ActQuant.apply(x), rtol=1e-6, atol=1e-6)


def test_straight_through_gradients():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 64, generator=gen, requires_grad=True)
    w = (torch.randn(32, 64, generator=gen) * 0.1).requires_grad_()
    b = torch.randn(32, generator=gen, requires_grad=True)
    g = torch.randn(2, 8, 32, generator=gen)
    bitnet_linear(x, w, b).backward(g)
    # the same with autograd and the detach trick (quantize in value, identity in gradient), in float64
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    xq = x64 + (int8_per_token(x64.float()).double() - x64).detach()
    wq = w64 + (ternary_weight(w64.float()).double() - w64).detach()
    (xq @ wq.t() + b.detach().double()).backward(g.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, g.sum((0, 1)))
    via_recipe = LowPrecisionLinear(Recipe("bitnet"))(x.detach(), w.detach(), b.detach())
    torch.testing.assert_close(via_recipe, bitnet_linear(x.detach(), w.detach(), b.detach()))
    with pytest.raises(ValueError, match="does not match weight"):
        bitnet_linear(torch.randn(2, 8), w)


def test_row_segments_give_each_fused_projection_its_own_scale(monkeypatch):
    """A fused [q; k; v] weight with segments quantizes like the three projections apart (HF's three linears)."""
    gen = torch.Generator().manual_seed(4)
    parts = [torch.randn(rows, 64, generator=gen) * s for rows, s in ((32, 0.02), (16, 0.2), (16, 1.0))]
    segments = torch.cat([torch.full((p.shape[0],), i) for i, p in enumerate(parts)])
    fused = ternary_weight(torch.cat(parts), row_segments=segments)
    torch.testing.assert_close(fused, torch.cat([ternary_weight(p) for p in parts]), rtol=0, atol=0)
    assert not torch.equal(ternary_weight(torch.cat(parts)), fused)  # one scale over all is another quantizer
    # summed over the shards' ranks: two halves of each segment, added as sum_reduce would
    halves = [torch.cat([p[: p.shape[0] // 2] for p in parts]), torch.cat([p[p.shape[0] // 2 :] for p in parts])]
    seg_half = torch.cat([torch.full((p.shape[0] // 2,), i) for i, p in enumerate(parts)])
    other = {}

    def reduce_with(other_half):
        def reduce(stats):
            rows = other_half.float().abs().sum(1, dtype=torch.float64)
            totals = torch.zeros_like(rows).index_add_(0, seg_half, rows)
            counts = torch.zeros_like(rows).index_add_(0, seg_half, torch.full_like(rows, 64.0))
            stats += torch.stack((totals, counts))

        return reduce

    for i in (0, 1):
        other[i] = ternary_weight(halves[i], row_segments=seg_half, sum_reduce=reduce_with(halves[1 - i]))
    joined = torch.cat([torch.cat([other[0][a:b], other[1][a:b]]) for a, b in ((0, 16), (16, 24), (24, 32))])
    torch.testing.assert_close(joined, fused, rtol=0, atol=0)
    with pytest.raises(ValueError, match="row_segments must be"):
        ternary_weight(torch.cat(parts), row_segments=segments[:5])
