"""Permute / unpermute against float64 loops over tokens: dropless, aligned, capacity dropping, padding."""

from __future__ import annotations

import math

import pytest
import torch

from mcore.kernels.moe import permute, plan_permutation, unpermute
from mcore.kernels.moe_permute import capacity

T, K, E, H = 13, 3, 5, 6


def _routing(tokens=T, k=K, experts=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    weights, indices = scores.topk(k, -1)
    return indices, weights / weights.sum(-1, keepdim=True)


def _kept_choices(indices, weights, cap, policy):
    """Float64 hand rule: per expert, choices in flat (token, choice) order; keep the first ``cap``
    (position) or the ``cap`` largest weights (probability)."""
    kept = set()
    for e in range(E):
        choices = [(t, j) for t in range(indices.shape[0]) for j in range(indices.shape[1]) if indices[t, j] == e]
        if policy == "probability":
            choices = sorted(choices, key=lambda c: -float(weights[c]))
        kept.update(choices[: len(choices) if cap is None else cap])
    return kept


def _expert_fn(w_e, rows):
    return torch.tanh(rows @ w_e)


def _moe_float64(x, indices, weights, w, kept):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j in kept:
        e = int(indices[t, j])
        out[t] += weights[t, j].double() * _expert_fn(w[e].double(), x[t].double())
    return out


def _moe_ours(x, indices, weights, w, backend=None, **plan_kwargs):
    plan = plan_permutation(indices, E, weights=weights, **plan_kwargs)
    rows = permute(x, plan, backend=backend)
    ends = plan.offsets.tolist()
    starts = [0] + ends[:-1]
    y = torch.cat([_expert_fn(w[e], rows[s:t]) for e, (s, t) in enumerate(zip(starts, ends))] + [rows[ends[-1] :]])
    return unpermute(y, weights, plan, backend=backend), plan, rows


CASES = {
    "dropless": dict(),
    "align4": dict(align=4),
    "capacity-position": dict(capacity_factor=0.6),
    "capacity-probability": dict(capacity_factor=0.6, drop_policy="probability"),
    "capacity-padded": dict(capacity_factor=0.8, pad_to_capacity=True),
    "capacity-large": dict(capacity_factor=4.0, drop_policy="probability"),
}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_through_plan_matches_float64_loop(case, backend):
    kwargs = CASES[case]
    indices, weights = _routing()
    x = torch.randn(T, H, requires_grad=True)
    w = torch.randn(E, H, H, requires_grad=True)
    wts = weights.clone().requires_grad_(True)
    out, plan, rows = _moe_ours(x, indices, wts, w, backend=backend, **kwargs)
    cap = None if "capacity_factor" not in kwargs else capacity(T, K, E, kwargs["capacity_factor"])
    kept = _kept_choices(indices, weights, cap, kwargs.get("drop_policy", "position"))
    x64, w64, wts64 = (t.detach().double().requires_grad_(True) for t in (x, w, weights))
    want = _moe_float64(x64, indices, wts64, w64, kept)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    probe = torch.randn(T, H)
    (out * probe).sum().backward()
    (want * probe.double()).sum().backward()
    for ours, ref in ((x, x64), (w, w64), (wts, wts64)):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
    # the plan's bookkeeping, checked choice by choice
    assert int(plan.dropped) == T * K - len(kept)
    dropped = {(t, j) for t in range(T) for j in range(K)} - kept
    assert all(int(plan.slot_of_choice[t, j]) == -1 for t, j in dropped)
    counts = torch.bincount(torch.tensor([int(indices[c]) for c in sorted(kept)]), minlength=E)
    assert torch.equal(plan.tokens_per_expert, counts)
    padding = plan.choice_of_slot < 0
    assert int((~padding).sum()) == len(kept) and rows[padding].abs().sum() == 0


def test_dropless_rows_are_expert_contiguous_in_token_order():
    indices, _ = _routing()
    plan = plan_permutation(indices, E)
    assert plan.num_rows == T * K and plan.max_unused_tail == 0
    flat = indices.reshape(-1)
    want = [c for e in range(E) for c in range(T * K) if flat[c] == e]
    assert plan.choice_of_slot.tolist() == want
    assert plan.offsets.tolist() == torch.bincount(flat, minlength=E).cumsum(0).tolist()
    assert plan.offsets.dtype == torch.int32


def test_alignment_pads_each_segment():
    indices, _ = _routing()
    plan = plan_permutation(indices, E, align=4)
    assert plan.num_rows == T * K + E * 3 and plan.max_unused_tail == E * 3
    assert int(plan.offsets[-1]) >= plan.num_rows - plan.max_unused_tail
    sizes = torch.diff(plan.offsets, prepend=plan.offsets.new_zeros(1))
    counts = torch.bincount(indices.reshape(-1), minlength=E)
    assert torch.equal(sizes.long(), (counts + 3) // 4 * 4)


def test_pad_to_capacity_has_static_segments():
    indices, _ = _routing()
    cap = capacity(T, K, E, 0.8)
    assert cap == math.ceil(T * K * 0.8 / E)
    plan = plan_permutation(indices, E, capacity_factor=0.8, pad_to_capacity=True)
    assert plan.num_rows == E * cap and plan.max_unused_tail == 0
    assert plan_permutation(indices, E, capacity_factor=0.8).max_unused_tail is None  # dropping: unknown
    assert plan.offsets.tolist() == [cap * (e + 1) for e in range(E)]


def test_bf16_rows_and_weights_fp32():
    indices, weights = _routing()
    x = torch.randn(T, H).bfloat16()
    plan = plan_permutation(indices, E)
    rows = permute(x, plan)
    assert rows.dtype == torch.bfloat16
    out = unpermute(rows, weights, plan)  # identity experts: out = sum_j w_j * x = x
    torch.testing.assert_close(out.float(), x.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(align=0), "align must be a positive int"),
        (dict(drop_policy="random", capacity_factor=1.0), "drop_policy"),
        (dict(pad_to_capacity=True), "pad_to_capacity needs a capacity_factor"),
        (dict(capacity_factor=1.0, drop_policy="probability"), "needs weights"),
        (dict(capacity_factor=-1.0), "capacity_factor must be > 0"),
    ],
)
def test_bad_plan_arguments(kwargs, match):
    indices, _ = _routing()
    with pytest.raises(ValueError, match=match):
        plan_permutation(indices, E, **kwargs)


def test_bad_shapes():
    indices, weights = _routing()
    plan = plan_permutation(indices, E)
    with pytest.raises(ValueError, match=r"x must be \[13, hidden\]"):
        permute(torch.randn(12, H), plan)
    with pytest.raises(ValueError, match=r"y must be \[39, hidden\]"):
        unpermute(torch.randn(12, H), weights, plan)
    with pytest.raises(ValueError, match="int64"):
        plan_permutation(indices.int(), E)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "k", "experts", "hidden"), [(37, 1, 4, 40), (29, 8, 16, 1100)])
def test_triton_kernels_equal_the_reference(dtype, tokens, k, experts, hidden):
    # hidden 1100 spans two column blocks of the gathers and two loop steps of the unpermute backward;
    # align 8 leaves padding rows, which must stay zero in the rows and in their gradient
    indices, weights = _routing(tokens, k, experts, seed=1)
    plan = plan_permutation(indices, experts, align=8)
    x = torch.randn(tokens, hidden).to(dtype)
    y = torch.randn(plan.num_rows, hidden).to(dtype)
    drows = torch.randn(plan.num_rows, hidden).to(dtype)
    dout = torch.randn(tokens, hidden).to(dtype)
    results = {}
    for backend in ("reference", "triton"):
        xr, yr, wr = (t.clone().requires_grad_(True) for t in (x, y, weights))
        rows = permute(xr, plan, backend=backend)
        (rows.float() * drows.float()).sum().backward()
        out = unpermute(yr, wr, plan, backend=backend)
        out.backward(dout)
        results[backend] = (rows, xr.grad, out, yr.grad, wr.grad)
    exact = ("rows", None, None, "dy", None)  # gathers and single products round identically; sums may reorder
    for name, ours, ref in zip(exact, results["triton"], results["reference"]):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        if name is not None:
            assert torch.equal(ours, ref), name
        else:
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            scale = ref.float().abs().max().item()
            torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol * scale)
    padding = plan.choice_of_slot < 0
    assert results["triton"][0][padding].abs().sum() == 0 and results["triton"][3][padding].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("tokens", "k", "experts", "hidden"), [(4096, 2, 8, 4096), (4096, 8, 128, 2048)])
def test_cuda_triton_permute_matches_the_reference_in_bf16(tokens, k, experts, hidden):
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.rand(tokens, experts, device="cuda", generator=g)
    weights, indices = scores.topk(k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    plan = plan_permutation(indices, experts, align=8)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    y = torch.randn(plan.num_rows, hidden, device="cuda", generator=g).bfloat16()
    dout = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    got = {}
    for backend in ("reference", "triton"):
        xr, yr, wr = (t.clone().requires_grad_(True) for t in (x, y, weights))
        rows = permute(xr, plan, backend=backend)
        rows.backward(y)
        out = unpermute(yr, wr, plan, backend=backend)
        out.backward(dout)
        got[backend] = (rows, xr.grad, out, yr.grad, wr.grad)
    for ours, ref in zip(got["triton"], got["reference"]):
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(ours.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2 * scale)
