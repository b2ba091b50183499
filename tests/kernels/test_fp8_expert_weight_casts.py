"""The fp8 expert GEMMs' weight casts reused through a ``WeightCastCache`` (``weight_casts=``): the micro-batches of
a step cast each expert weight once, with the bits of casting it every time; a changed weight or ``invalidate()``
casts afresh. Row-wise and block-wise, the GEMM and its activation form, on the CPU reference paths."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.activations import swiglu
from mcore.kernels.fp8_block_grouped_gemm import fp8_block_grouped_gemm, fp8_block_grouped_gemm_of_activation
from mcore.kernels.fp8_grouped_gemm import fp8_grouped_gemm, fp8_grouped_gemm_of_activation
from mcore.kernels.fp8_weight_cache import WeightCastCache

OFFSETS = [128, 128, 384]  # experts of 128, 0 and 256 rows (multiples of 128: block-wise's rule), 128 rows past
ROWS, K, N = 512, 256, 128
GEMMS = {
    "rowwise": (fp8_grouped_gemm, fp8_grouped_gemm_of_activation),
    "blockwise": (fp8_block_grouped_gemm, fp8_block_grouped_gemm_of_activation),
}


def _weight(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(len(OFFSETS), N, K, generator=gen) * 0.1).requires_grad_()


def _micro_batch(w, recipe: str, activation: bool, seed: int, cache):
    """One forward + backward of fresh inputs: (y, d input); ``w.grad`` accumulates."""
    gemm, of_activation = GEMMS[recipe]
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    if activation:
        h = torch.randn(ROWS, 2 * K, generator=gen).requires_grad_()
        y = of_activation(h, w, offsets, swiglu, weight_casts=cache)
    else:
        h = (torch.randn(ROWS, K, generator=gen) * torch.logspace(-1, 1, K)).requires_grad_()
        y = gemm(h, w, offsets, weight_casts=cache)
    y.backward(torch.randn(ROWS, N, generator=gen))
    return y.detach(), h.grad


@pytest.mark.parametrize("activation", [False, True], ids=["gemm", "of_activation"])
@pytest.mark.parametrize("recipe", list(GEMMS))
def test_a_step_casts_each_weight_once_with_the_same_bits(recipe, activation):
    cache = WeightCastCache()
    cached_w, plain_w = _weight(), _weight()
    for seed in (1, 2, 3):  # three micro-batches of one step
        got = _micro_batch(cached_w, recipe, activation, seed, cache)
        want = _micro_batch(plain_w, recipe, activation, seed, None)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert (cache.misses, cache.hits) == (1, 2)
    assert torch.equal(cached_w.grad, plain_w.grad) and torch.any(cached_w.grad != 0)


@pytest.mark.parametrize("recipe", list(GEMMS))
def test_a_changed_weight_or_invalidate_casts_afresh(recipe):
    cache, w = WeightCastCache(), _weight(4)
    _micro_batch(w, recipe, False, 5, cache)
    with torch.no_grad():
        w.mul_(1.5)  # in place: autograd's version counter moves
    y, _ = _micro_batch(w, recipe, False, 6, cache)
    assert (cache.misses, cache.hits) == (2, 0)
    assert torch.equal(y, _micro_batch(_weight(4).detach().mul(1.5).requires_grad_(), recipe, False, 6, None)[0])
    cache.invalidate()  # the trainer's call before each optimizer step (whose writes bypass the counter)
    _micro_batch(w, recipe, False, 7, cache)
    assert (cache.misses, cache.hits) == (3, 0)


def test_a_cast_without_the_transpose_is_completed_when_a_backward_needs_it():
    """A no-grad forward (evaluation) caches ``w`` alone; the next training forward needs ``w^T`` too: cast again."""
    cache, w = WeightCastCache(), _weight(8)
    with torch.no_grad():
        fp8_grouped_gemm(torch.randn(ROWS, K), w, torch.tensor(OFFSETS, dtype=torch.int32), weight_casts=cache)
    _micro_batch(w, "rowwise", False, 9, cache)
    _micro_batch(w, "rowwise", False, 10, cache)
    assert (cache.misses, cache.hits) == (2, 1)
