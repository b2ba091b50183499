"""MoE experts (every bf16 GEMM mode, fp8 row-wise and block-wise) and BitNet linears honour the layer's
``WeightGradStore``: inside ``deferring()`` backward gives the input gradient of the undeferred run and leaves the
weight gradients untouched (no ``.grad``, ``main_grad`` unchanged), one closure per weight is queued, and once the
store has run them (one micro-batch late, as a zero-bubble stage lets its W passes wait) ``.grad`` (no DDP) or
``main_grad`` (DDP with the GEMMs writing it: the step's first micro-batch overwriting it unread, NaN-poisoned here,
the later ones adding) equals the undeferred run bit for bit. CPU: the reference GEMMs, fp32 weights."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import replace

import pytest
import torch

from mcore.kernels.low_precision_linear import Recipe
from mcore.parallel import DistributedDataParallel, MoELayer
from mcore.parallel.low_precision import enable_low_precision
from mcore.parallel.weight_grad_store import WeightGradStore, attach_weight_grad_store
from tests.helpers.main_grad import record_wgrad_targets, start_step
from tests.parallel._moe import BASE
from tests.parallel.test_fp8_deferred_wgrad import _counting_store, _grad_state, _same
from tests.parallel.test_fp8_wgrad import _MLP

grouped_gemm_module = importlib.import_module("mcore.kernels.grouped_gemm")  # mcore.kernels has a function so named
TOKENS = (3, 12, 7)  # per micro-batch; 3 tokens x top-2 leave most of the 8 experts without rows
STEPS = 2
# name -> (expert_gemm mode, fp8 recipe of the experts or None, hidden, expert FFN)
EXPERTS = {
    "grouped": ("grouped", None, 16, 24),
    "grouped_mm": ("grouped", None, 16, 24),  # torch._grouped_mm forced (CUDA's choice for bf16)
    "per_expert": ("per_expert", None, 16, 24),
    "grouped_fp32_wgrad": ("grouped_fp32_wgrad", None, 16, 24),
    "fp8-rowwise": ("grouped", "rowwise", 32, 48),  # multiples of 16
    "fp8-blockwise": ("grouped", "blockwise", 128, 128),  # multiples of 128, each expert's rows padded to 128
}


def _experts_model(kind: str):
    gemm, recipe, hidden, ffn = EXPERTS[kind]
    layer = MoELayer(replace(BASE, hidden_size=hidden, moe_intermediate_size=ffn, expert_gemm=gemm))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if recipe is not None:
        assert [d.recipe for d in enable_low_precision(layer, Recipe(recipe), keep=())] == [f"{recipe}-grouped"]
    weights = {"gate_up": layer.experts.gate_up, "down": layer.experts.down}
    return layer, weights, hidden


def _bitnet_model():
    torch.manual_seed(0)
    model = _MLP()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    assert {d.recipe for d in enable_low_precision(model, Recipe("bitnet"), keep=())} == {"bitnet"}
    return model, {"up": model.up.weight, "down": model.down.weight}, model.up.in_features


def _batch(hidden: int, step: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + micro)
    n = TOKENS[micro]
    return torch.randn(n, hidden, generator=g), torch.randn(n, hidden, generator=g)


def _run(kind: str, *, defer: bool, ddp: bool, monkeypatch):
    if kind == "grouped_mm":
        if not hasattr(torch, "_grouped_mm"):
            pytest.skip("torch._grouped_mm is not in this torch")
        monkeypatch.setattr(grouped_gemm_module, "_choose", lambda x, w, backend: grouped_gemm_module.GROUPED_MM)
    """STEPS steps of len(TOKENS) micro-batches; returns per backward (dx, whether it changed each weight's gradient),
    each step's weight gradients (main_grad under DDP), the queued parameter names and, per weight-gradient GEMM
    that took main_grad, whether it overwrote it."""
    model, weights, hidden = _bitnet_model() if kind == "bitnet" else _experts_model(kind)
    names = {id(w): name for name, w in weights.items()}
    queued: list[str] = []
    store = _counting_store(queued, names)
    if defer:
        assert attach_weight_grad_store([model], store) == (2 if kind == "bitnet" else 1)
    taken = record_wgrad_targets(monkeypatch)
    wrapper = DistributedDataParallel(model, dp_group=None, gradient_accumulation_fusion=True) if ddp else model
    ready: list[tuple[str, torch.Tensor]] = []  # (weight, its main_grad) whenever DDP's hook declared it complete
    for buffer in wrapper.grad_buffers if ddp else ():
        mark = buffer.mark_ready
        buffer.mark_ready = lambda p, mark=mark: (
            ready.append((names[id(p)], p.main_grad.clone())) if id(p) in names else None,
            mark(p),
        )
    last = len(TOKENS) - 1

    def sync(micro: int):  # a zero-bubble schedule's: gradient sync on for the last micro-batch's B and W only
        return wrapper.no_sync() if ddp and micro < last else contextlib.nullcontext()

    per_backward, per_step = [], []
    for step in range(STEPS):
        if ddp:  # the experts' GEMMs write main_grad unread on the first micro-batch: a read would show NaN
            start_step(wrapper, weights.values(), poison=kind != "bitnet")
        else:
            model.zero_grad(set_to_none=True)
        waiting: list[int] = []
        for micro in range(len(TOKENS)):
            x, probe = _batch(hidden, step, micro)
            before = [_grad_state(w) for w in weights.values()]
            with sync(micro), store.deferring() if defer else contextlib.nullcontext():
                x = x.clone().requires_grad_()
                (wrapper(x) * probe).sum().backward()
            changed = [not _same(a, _grad_state(w)) for a, w in zip(before, weights.values(), strict=True)]
            per_backward.append((x.grad, changed))
            waiting.append(micro)
            while len(waiting) > (1 if micro < last else 0):  # the W pass of the oldest waiting micro-batch
                with sync(waiting.pop(0)):
                    assert store.flush(1) == (1 if defer else 0)
        if ddp:
            wrapper.finish_grad_sync()
        per_step.append({name: (w.main_grad if ddp else w.grad).clone() for name, w in weights.items()})
        # DDP may reduce a weight's bucket once its hook said ready: by then its main_grad must be the step's
        # (a deferred gradient calls the hook after it is in place, not the B pass before it)
        assert sorted(name for name, _ in ready) == (sorted(weights) if ddp else [])
        for name, at_ready in ready:
            assert torch.equal(at_ready, per_step[-1][name]), (kind, step, name)
        ready.clear()
    return per_backward, per_step, queued, taken


@pytest.mark.parametrize("ddp", [False, True], ids=["grad", "ddp-main-grad"])
@pytest.mark.parametrize("kind", [*EXPERTS, "bitnet"])
def test_deferred_weight_gradients_equal_the_undeferred_bit_for_bit(kind, ddp, monkeypatch):
    now, now_steps, now_queued, now_taken = _run(kind, defer=False, ddp=ddp, monkeypatch=monkeypatch)
    later, later_steps, queued, taken = _run(kind, defer=True, ddp=ddp, monkeypatch=monkeypatch)
    order = ["down", "gate_up"] if kind != "bitnet" else ["down", "up"]  # backward order
    assert now_queued == [] and queued == order * (STEPS * len(TOKENS))
    for (dx_now, changed_now), (dx_later, changed_later) in zip(now, later, strict=True):
        assert torch.equal(dx_now, dx_later)
        assert changed_now == [True, True]  # so the check below can fail
        assert changed_later == [False, False]  # only the store's W pass writes the weights' gradients
    for a, b in zip(now_steps, later_steps, strict=True):
        for name, ga in a.items():
            assert torch.isfinite(ga).all() and ga.abs().sum() > 0, (kind, name)
            assert torch.equal(ga, b[name]), (kind, name, (ga - b[name]).abs().max())
    if ddp and kind != "bitnet":  # per step the first micro-batch overwrote both experts' main_grad, the rest added
        assert taken == now_taken == ([True, True] + [False] * 2 * (len(TOKENS) - 1)) * STEPS
    else:  # without DDP (and for BitNet, whose gradient DDP's hook adds) no GEMM took main_grad
        assert taken == now_taken == []


def test_recomputed_experts_defer_too(monkeypatch):
    """Under non-reentrant activation recompute the saved expert weights come back as other tensors: the deferred
    gradient still goes to the parameter (and equals the undeferred one)."""
    from torch.utils.checkpoint import checkpoint

    grads = []
    for defer in (False, True):
        layer, weights, hidden = _experts_model("grouped")
        store = WeightGradStore()
        attach_weight_grad_store([layer], store)
        x, probe = _batch(hidden, 0, 1)
        with store.deferring() if defer else contextlib.nullcontext():
            (checkpoint(layer, x, use_reentrant=False) * probe).sum().backward()
        assert all((w.grad is None) == defer for w in weights.values())
        assert store.flush() == int(defer)
        grads.append([w.grad for w in weights.values()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_outside_deferring_nothing_is_queued():
    layer, weights, hidden = _experts_model("grouped")
    store = WeightGradStore()
    attach_weight_grad_store([layer], store)
    x, probe = _batch(hidden, 0, 1)
    (layer(x) * probe).sum().backward()
    assert store.pending() == 0 and all(w.grad is not None for w in weights.values())
