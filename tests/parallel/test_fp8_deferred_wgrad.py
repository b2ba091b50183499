"""FP8 (and emulated MXFP8 / FP4) tensor-parallel linears honour the layer's ``WeightGradStore``: inside
``deferring()`` backward gives the input gradient of the undeferred run and no weight gradient, and one closure per
weight is queued; once the store runs its batch, ``.grad`` (no DDP) or ``main_grad`` (DDP, the first micro-batch's
GEMM writing it unread, later ones adding) equals the undeferred run bit for bit, and delayed scaling's amax
histories advance identically. CPU: the reference fp8 GEMMs, fp32 weights."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mcore.kernels.low_precision_linear import EMULATED_RECIPES, FP8_RECIPES
from mcore.parallel import DistributedDataParallel
from mcore.parallel.param_attrs import wgrad_overwrites_main_grad
from mcore.parallel.tensor_parallel import attach_weight_grad_store
from mcore.parallel.weight_grad_store import WeightGradStore
from tests.helpers.main_grad import start_step
from tests.parallel.test_fp8_wgrad import H, M, _model

RECIPES = FP8_RECIPES + EMULATED_RECIPES
MICRO = 2


def _weights(model):
    return [model.up.weight, model.down.weight]


def _counting_store(queued: list[str], names: dict) -> WeightGradStore:
    """A store that records the name of every parameter whose weight gradient it queued."""
    store = WeightGradStore()
    put = store.put
    store.put = lambda p, compute: (queued.append(names[id(p)]), put(p, compute))[-1]
    return store


def _histories(model) -> list[tuple[int, torch.Tensor | None]]:
    return [
        (h.count, None if h.history is None else h.history.clone())
        for layer in (model.up, model.down)
        for h in layer.low_precision.histories.values()
    ]


def _micro_batches(step: int):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(M, H, generator=g), torch.randn(M, H, generator=g)) for _ in range(MICRO)]


def _backward(module, x, probe) -> torch.Tensor:
    x = x.clone().requires_grad_()
    (module(x) * probe).sum().backward()
    return x.grad


def _grad_state(w) -> tuple:
    """What a weight gradient could have changed: ``.grad`` and, under DDP, ``main_grad``."""
    main = getattr(w, "main_grad", None)
    return tuple(None if t is None else t.clone() for t in (w.grad, main))


def _same(a: tuple, b: tuple) -> bool:
    """Bit-equal, NaN included (a poisoned main_grad left alone is unchanged)."""
    return all(
        (x is None) == (y is None) and (x is None or torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))
        for x, y in zip(a, b, strict=True)
    )


def _run(recipe: str, *, defer: bool, ddp: bool):
    """Two steps of MICRO micro-batches; returns per backward (dx, whether it changed each weight's gradient), the
    weights' gradients (main_grad under DDP) at each step's end, the amax histories, and the queued parameter names."""
    model = _model(recipe, torch.float32, "cpu")
    names = {id(model.up.weight): "up", id(model.down.weight): "down"}
    queued: list[str] = []
    store = _counting_store(queued, names)
    if defer:
        assert attach_weight_grad_store([model], store) == 2
    wrapper = DistributedDataParallel(model, dp_group=None, gradient_accumulation_fusion=True) if ddp else model
    per_backward, per_step, histories = [], [], []
    for step in range(2):
        if ddp:
            # fp8: NaN in main_grad, which a read before the first write would show (emulated ones add into it)
            start_step(wrapper, _weights(model), poison=recipe in FP8_RECIPES)
        else:
            model.zero_grad(set_to_none=True)
        for m, (x, probe) in enumerate(_micro_batches(step)):
            before = [_grad_state(w) for w in _weights(model)]
            with wrapper.no_sync() if ddp and m < MICRO - 1 else contextlib.nullcontext():
                with store.deferring() if defer else contextlib.nullcontext():
                    dx = _backward(wrapper, x, probe)
                changed = [not _same(a, _grad_state(w)) for a, w in zip(before, _weights(model), strict=True)]
                per_backward.append((dx, changed))
                assert store.flush() == (1 if defer else 0)  # the W pass (DDP's hooks run here when deferred)
            histories.append(_histories(model))
        if ddp:
            wrapper.finish_grad_sync()
        per_step.append([(w.main_grad if ddp else w.grad).clone() for w in _weights(model)])
    overwrote = [wgrad_overwrites_main_grad(w) for w in _weights(model)] if ddp else None
    return per_backward, per_step, histories, queued, overwrote


def _assert_same_histories(a, b):
    for (count_a, hist_a), (count_b, hist_b) in zip(a, b, strict=True):
        assert count_a == count_b
        assert (hist_a is None) == (hist_b is None)
        assert hist_a is None or torch.equal(hist_a, hist_b)


@pytest.mark.parametrize("ddp", [False, True], ids=["grad", "ddp-main-grad"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_deferred_weight_gradients_equal_the_undeferred_bit_for_bit(recipe, ddp):
    now, now_steps, now_hist, now_queued, now_overwrote = _run(recipe, defer=False, ddp=ddp)
    later, later_steps, later_hist, queued, overwrote = _run(recipe, defer=True, ddp=ddp)
    assert now_queued == []
    # every backward queued both weights' gradients (down first: backward order), none was computed at once
    assert queued == ["down", "up"] * (2 * MICRO)
    for (dx_now, changed_now), (dx_later, changed_later) in zip(now, later, strict=True):
        assert torch.equal(dx_now, dx_later)
        assert changed_now == [True, True]  # so the check below can fail
        assert changed_later == [False, False]  # only the store's flush writes the weights' gradients
    for a, b in zip(now_steps, later_steps, strict=True):
        for ga, gb in zip(a, b, strict=True):
            assert torch.isfinite(ga).all()
            assert torch.equal(ga, gb), (recipe, (ga - gb).abs().max())
    for a, b in zip(now_hist, later_hist, strict=True):
        _assert_same_histories(a, b)
    if ddp and recipe in FP8_RECIPES:  # the deferred GEMM still writes main_grad unread (DDP skips the fill)
        assert overwrote == now_overwrote == [True, True]


def test_delayed_histories_are_recorded():
    # the history comparison above is not vacuous: delayed scaling records x, w and g on every use
    _, _, histories, _, _ = _run("delayed", defer=True, ddp=False)
    assert all(count == 2 * MICRO and hist is not None for count, hist in histories[-1])


def test_outside_deferring_nothing_is_queued():
    model = _model("tensorwise", torch.float32, "cpu")
    store = WeightGradStore()
    attach_weight_grad_store([model], store)
    x, probe = _micro_batches(0)[0]
    _backward(model, x, probe)
    assert store.pending() == 0 and all(w.grad is not None for w in _weights(model))
