"""adamw_step_ with bf16 gradients and bf16 moments (Megatron's precision-aware optimizer), both backends, against
a float64 evaluation of the same update, step by step.

Each step is checked from the state the kernel left: the float64 reference reads the stored (possibly bf16)
moments and the fp32 master, computes the update exactly, and the kernel's results must be

* the master: within ``RTOL`` (a few fp32 ulps, as in test_adamw.py) of the float64 value, which is computed with
  the *unrounded* new moments (rounding them to bf16 first would move the master by ~lr * 4e-3, 100x the
  tolerance, so the test tells the two orders apart);
* an fp32 moment: within ``RTOL`` of the float64 one;
* a bf16 moment: the float64 value rounded to bf16, to half a bf16 ulp for the reference backend (torch rounds
  to nearest even) and to one ulp under Triton's CPU interpreter, which truncates fp32 to bf16 (the GPU test
  checks the compiled kernel's rounding against the reference).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mcore.kernels import adamw_step_

BETAS = (0.9, 0.95)
EPS = 1e-6
LRS = (3e-2, 1e-2, 2e-2, 5e-3)
MULTIPLIERS = (0.37, 0.81, 0.05, 0.6)
SHAPES = [(7,), (4097,), (3, 33)]
GRAD_SCALES = (1.0, 3e-5, 1e-2)
RTOL = 2e-6
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: one ulp is at most this fraction of the value
COMBOS = list(itertools.product((torch.float32, torch.bfloat16), repeat=3))  # (grad, exp_avg, exp_avg_sq)


def _problem(grad_dtype, m_dtype, v_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    m = [(torch.randn(s, generator=gen) * 0.1 * k).to(m_dtype) for s, k in zip(SHAPES, GRAD_SCALES)]
    v = [(torch.rand(s, generator=gen) * 0.01 * k * k).to(v_dtype) for s, k in zip(SHAPES, GRAD_SCALES)]
    grads = [[(torch.randn(s, generator=gen) * k).to(grad_dtype) for s, k in zip(SHAPES, GRAD_SCALES)] for _ in LRS]
    return params, m, v, grads


def _float64_step(p, g, m, v, *, steps, lr, multiplier, weight_decay):
    """One AdamW update in float64 from the stored state (torch.optim.AdamW's order of operations)."""
    b1, b2 = BETAS
    g = g.double().reshape(p.shape) * float(torch.tensor(multiplier, dtype=torch.float32))
    p = p.double() * (1 - lr * weight_decay)
    m = b1 * m.double() + (1 - b1) * g
    v = b2 * v.double() + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2**steps) ** 0.5 + EPS
    return p - lr / (1 - b1**steps) * m / denom, m, v


def _assert_fp32_close(actual, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=RTOL, atol=RTOL * scale)


def _assert_bf16_rounding(stored, exact, ulps):
    """``stored`` (bf16) is ``exact`` rounded to bf16, within ``ulps`` ulps, plus the fp32 computation's error
    (``RTOL`` of the tensor's scale: where the two terms of a moment cancel, fp32 rounding dominates)."""
    assert stored.dtype == torch.bfloat16
    err = (stored.double() - exact).abs()
    bound = ulps * BF16_EPS * exact.abs() + RTOL * exact.abs().max()
    assert (err <= bound).all(), (err / exact.abs().clamp(min=1e-30)).max().item()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize(("grad_dtype", "m_dtype", "v_dtype"), COMBOS)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_each_step_matches_float64_for_every_dtype_combination(
    backend, grad_dtype, m_dtype, v_dtype, weight_decay, request
):
    if backend == "triton":
        request.getfixturevalue("interpreter")
    params, m, v, grads = _problem(grad_dtype, m_dtype, v_dtype, seed=len(request.node.name))
    models = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
    ulps = 0.5 if backend == "reference" else 1.0
    for k, lr in enumerate(LRS):
        steps = 3 + k
        expected = [
            _float64_step(p, g, a, b, steps=steps, lr=lr, multiplier=MULTIPLIERS[k], weight_decay=weight_decay)
            for p, g, a, b in zip(params, grads[k], m, v)
        ]
        before = [p.clone() for p in params]
        adamw_step_(
            params, grads[k], m, v, steps=steps, lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
            weight_decay=weight_decay, grad_multiplier=torch.tensor(MULTIPLIERS[k]), model_params=models,
            backend=backend,
        )  # fmt: skip
        for i, (p64, m64, v64) in enumerate(expected):
            assert params[i].dtype == torch.float32 and m[i].dtype == m_dtype and v[i].dtype == v_dtype
            assert not torch.equal(params[i], before[i])
            _assert_fp32_close(params[i], p64)
            for stored, exact in ((m[i], m64), (v[i], v64)):
                if stored.dtype == torch.float32:
                    _assert_fp32_close(stored, exact)
                else:
                    _assert_bf16_rounding(stored, exact, ulps)


def test_master_is_updated_with_the_unrounded_moments():
    """The order the module docstring promises: rounding the new moments to bf16 before the parameter update would
    move the master by far more than the tolerance above (so that test can tell)."""
    params, m, v, grads = _problem(torch.float32, torch.bfloat16, torch.bfloat16, seed=11)
    p64, m64, v64 = _float64_step(params[1], grads[0][1], m[1], v[1], steps=3, lr=LRS[0], multiplier=1.0,
                                  weight_decay=0.0)  # fmt: skip
    b1, b2 = BETAS
    m_r, v_r = m64.to(torch.bfloat16).double(), v64.to(torch.bfloat16).double()
    rounded_first = params[1].double() - LRS[0] / (1 - b1**3) * m_r / (v_r.sqrt() / (1 - b2**3) ** 0.5 + EPS)
    gap = (rounded_first - p64).abs().max().item()
    assert gap > 50 * RTOL * p64.abs().max().item(), gap


def test_fp16_moments_are_refused_with_the_reason():
    p = torch.zeros(4)
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\] must be float32, bfloat16, got torch.float16 \(fp16"):
        adamw_step_([p], [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4, dtype=torch.float16)],
                    steps=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)  # fmt: skip


@pytest.mark.gpu
def test_cuda_bf16_moments_round_to_nearest_like_the_reference(cuda_triton):
    """The compiled kernel with bf16 gradient and moments on 20M elements: the master against the reference backend
    on the same GPU, the stored moments the reference's to one bf16 ulp and almost all bit-equal (a fused
    multiply-add may move the fp32 value by an ulp across a rounding boundary)."""
    device = cuda_triton
    gen = torch.Generator(device=device).manual_seed(0)
    n = 20_000_003
    p = torch.randn(n, device=device, generator=gen)
    m = (torch.randn(n, device=device, generator=gen) * 1e-2).bfloat16()
    v = (torch.rand(n, device=device, generator=gen) * 1e-4).bfloat16()
    g = (torch.randn(n, device=device, generator=gen) * 1e-2).bfloat16()
    got = [p.clone(), m.clone(), v.clone()]
    ref = [p.clone(), m.clone(), v.clone()]
    common = {"steps": 5, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    adamw_step_([got[0]], [g], [got[1]], [got[2]], backend="triton", **common)
    adamw_step_([ref[0]], [g], [ref[1]], [ref[2]], backend="reference", **common)
    torch.cuda.synchronize()
    torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=2e-6)
    for a, b in zip(got[1:], ref[1:]):
        assert ((a.float() - b.float()).abs() <= BF16_EPS * b.float().abs()).all()
        assert (a == b).float().mean().item() > 0.999
