"""adamw_step_: both backends against torch.optim.AdamW run in float64, Triton (interpreter) against the reference.

Tolerances. Our update runs in fp32: each step rounds the decayed parameter, the two moments, the square
root, two divisions and the subtraction once each (a relative 6e-8 per rounding), and the float64 reference
rounds nothing. The parameter's error is therefore a few fp32 ulps of its magnitude per step, the moments'
a few ulps of theirs; after ``STEPS`` = 4 steps that stays below ~20 ulps, so ``rtol = atol = 2e-6``
(``atol`` relative to the tensor's largest magnitude; the largest error observed is 2.2e-7 of that scale),
while a misplaced term (eps outside the square root, a missing bias correction, the decay applied after
the update, the multiplier skipped) moves results by 1e-3 or more. Triton against the reference: the same
fp32 operations in the same order, except that the compiler may fuse a multiply-add (one rounding fewer),
so they agree to 2 ulps per step.
"""

from __future__ import annotations

import pytest
import torch

from mcore.kernels import adamw_step_

TRITON_ADAMW = "mcore.kernels.triton.adamw"
STEPS = 4
BETAS = (0.9, 0.95)
EPS = 1e-5
# Learning rate and gradient multiplier (a clip coefficient: < 1) of each step: both change between steps.
LRS = (3e-2, 1e-2, 2e-2, 5e-3)
MULTIPLIERS = (0.37, 0.81, 0.05, 0.6)
# Flat sizes around the 4096-element block (odd, one element, block +- 1, several blocks) and a 2-D shape.
SHAPES = [(1,), (7,), (4095,), (4097,), (3, 33), (2 * 4096 + 5,)]
# Per-tensor gradient scales: on the small ones eps is comparable to sqrt(v), so its placement matters.
GRAD_SCALES = (1.0, 3e-5, 0.5, 1e-4, 2.0, 1e-2)
RTOL = ATOL = 2e-6


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    expected = expected.detach().to(actual.device, torch.float64)
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach().to(torch.float64), expected, rtol=rtol, atol=atol * scale)


def _bf16_within_one_ulp(out: torch.Tensor, master: torch.Tensor) -> None:
    """``out`` is ``master`` rounded to bf16, up to the direction of the last bit.

    Triton's CPU interpreter converts fp32 to bf16 by truncation while the compiled kernel (and torch)
    rounds to nearest even, so under the interpreter the two may differ by one bf16 ulp; the gpu test
    checks exact equality.
    """
    assert out.dtype == torch.bfloat16
    assert ((out.float() - master).abs() <= torch.finfo(torch.bfloat16).eps * master.abs()).all()


def _problem(shapes, grad_dtype, model_dtype, device="cpu", seed=0):
    """Fresh random masters and moments (the moments as after a few earlier steps) and model-param buffers."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(device) for s in shapes]
    exp_avgs = [(torch.randn(s, generator=gen) * 0.1 * k).to(device) for s, k in zip(shapes, GRAD_SCALES)]
    exp_avg_sqs = [(torch.rand(s, generator=gen) * 0.01 * k * k).to(device) for s, k in zip(shapes, GRAD_SCALES)]
    models = [None if model_dtype is None else torch.empty(s, dtype=model_dtype, device=device) for s in shapes]
    grads = [
        [(torch.randn(s, generator=gen) * k).to(device, grad_dtype) for s, k in zip(shapes, GRAD_SCALES)]
        for _ in range(STEPS)
    ]
    return params, exp_avgs, exp_avg_sqs, models, grads


def _run_ours(params, exp_avgs, exp_avg_sqs, models, grads, weight_decay, backend, first_step=3):
    """STEPS calls of adamw_step_ on clones, continuing a run at ``first_step``; returns the updated tensors."""
    p, m, v = ([t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs))
    out = [None if t is None else t.clone() for t in models]
    device = params[0].device
    for k in range(STEPS):
        adamw_step_(
            p, grads[k], m, v,
            steps=first_step + k, lr=LRS[k], beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=weight_decay,
            grad_multiplier=torch.tensor(MULTIPLIERS[k], device=device), model_params=out, backend=backend,
        )  # fmt: skip
    return p, m, v, out


def _run_torch_float64(params, exp_avgs, exp_avg_sqs, grads, weight_decay, first_step=3):
    """torch.optim.AdamW in float64 from the same state, the gradients multiplied in float64."""
    p = [t.detach().double().clone() for t in params]
    opt = torch.optim.AdamW(p, lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False)
    for q, m, v in zip(p, exp_avgs, exp_avg_sqs):
        opt.state[q] = {
            "step": torch.tensor(float(first_step - 1), dtype=torch.float64),
            "exp_avg": m.double().clone(),
            "exp_avg_sq": v.double().clone(),
        }
    for k in range(STEPS):
        multiplier = float(torch.tensor(MULTIPLIERS[k], dtype=torch.float32))  # the fp32 value the kernel reads
        for q, g in zip(p, grads[k]):
            q.grad = g.double() * multiplier
        opt.param_groups[0]["lr"] = LRS[k]
        opt.step()
    return p, [opt.state[q]["exp_avg"] for q in p], [opt.state[q]["exp_avg_sq"] for q in p]


CASES = [  # (grad dtype, model-param dtype)
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16),
    (torch.float16, None),
    (torch.float32, torch.float32),
]


def _check_against_float64(backend, grad_dtype, model_dtype, weight_decay):
    params, exp_avgs, exp_avg_sqs, models, grads = _problem(SHAPES, grad_dtype, model_dtype)
    p, m, v, out = _run_ours(params, exp_avgs, exp_avg_sqs, models, grads, weight_decay, backend)
    p64, m64, v64 = _run_torch_float64(params, exp_avgs, exp_avg_sqs, grads, weight_decay)
    for i in range(len(SHAPES)):
        assert p[i].dtype == m[i].dtype == v[i].dtype == torch.float32
        assert not torch.equal(p[i], params[i])  # it moved
        _assert_close(p[i], p64[i])
        _assert_close(m[i], m64[i])
        _assert_close(v[i], v64[i])
        if model_dtype is torch.bfloat16 and backend == "triton":
            _bf16_within_one_ulp(out[i], p[i])
        elif model_dtype is not None:
            assert out[i].dtype == model_dtype and torch.equal(out[i], p[i].to(model_dtype)), i
    return p, m, v, out


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize(("grad_dtype", "model_dtype"), CASES)
def test_reference_matches_torch_adamw_in_float64(grad_dtype, model_dtype, weight_decay):
    _check_against_float64("reference", grad_dtype, model_dtype, weight_decay)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize(("grad_dtype", "model_dtype"), CASES)
def test_triton_matches_torch_adamw_in_float64_and_the_reference(grad_dtype, model_dtype, weight_decay, interpreter):
    got = _check_against_float64("triton", grad_dtype, model_dtype, weight_decay)
    params, exp_avgs, exp_avg_sqs, models, grads = _problem(SHAPES, grad_dtype, model_dtype)
    want = _run_ours(params, exp_avgs, exp_avg_sqs, models, grads, weight_decay, "reference")
    for ours, ref in zip(got[:3], want[:3]):
        for a, b in zip(ours, ref):
            _assert_close(a, b, rtol=2 * STEPS * 6e-8, atol=2 * STEPS * 6e-8)


def test_first_step_from_zero_state_matches_torch_fp32_adamw():
    """From a fresh (zero) state, as an optimizer starts: against torch's own fp32 foreach AdamW."""
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    ours = [t.clone() for t in params]
    theirs = [t.clone() for t in params]
    m, v = [torch.zeros_like(t) for t in params], [torch.zeros_like(t) for t in params]
    opt = torch.optim.AdamW(theirs, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.05, foreach=True)
    for step in range(1, 3):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        adamw_step_(ours, grads, m, v, steps=step, lr=1e-2, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.05)
        for t, g in zip(theirs, grads):
            t.grad = g
        opt.step()
    for i, t in enumerate(theirs):
        _assert_close(ours[i], t)
        _assert_close(m[i], opt.state[t]["exp_avg"])
        _assert_close(v[i], opt.state[t]["exp_avg_sq"])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mixed_entries_noncontiguous_grad_and_empty_tensor(backend, request):
    """A ``None`` model-param entry, a transposed gradient and a 0-element tensor in one call."""
    if backend == "triton":
        request.getfixturevalue("interpreter")
    gen = torch.Generator().manual_seed(3)
    shapes = [(33, 17), (0,), (100,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(17, 33, generator=gen).t(), torch.empty(0), torch.randn(100, generator=gen)]
    assert not grads[0].is_contiguous()
    models = [torch.empty(33, 17, dtype=torch.float16), torch.empty(0, dtype=torch.bfloat16), None]
    p, m, v = [t.clone() for t in params], [torch.zeros_like(t) for t in params], [torch.zeros_like(t) for t in params]
    adamw_step_(p, grads, m, v, steps=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
                model_params=models, backend=backend)  # fmt: skip
    ref = [t.clone() for t in params]
    opt = torch.optim.AdamW(ref, lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, foreach=False)
    for t, g in zip(ref, grads):
        t.grad = g.contiguous()
    opt.step()
    for i in (0, 2):
        _assert_close(p[i], ref[i])
    assert torch.equal(models[0], p[0].half())


def test_empty_list_launches_nothing(forbid, interpreter):
    forbid(TRITON_ADAMW, "adamw_step")
    adamw_step_([], [], [], [], steps=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, backend="triton")
    adamw_step_([], [], [], [], steps=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, model_params=[])


def test_cpu_tensors_use_the_reference_and_the_env_selects_triton(spy, interpreter, monkeypatch):
    calls = spy(TRITON_ADAMW, "adamw_step")
    p, g = torch.randn(10), torch.randn(10)
    args = ([p], [g], [torch.zeros(10)], [torch.zeros(10)])
    kwargs = {"steps": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    monkeypatch.delenv("MCORE_KERNELS_BACKEND", raising=False)
    adamw_step_(*args, **kwargs)
    assert calls == []
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    adamw_step_(*args, **kwargs)
    assert len(calls) == 1


def _valid():
    return {
        "params": [torch.zeros(4), torch.zeros(2, 3)],
        "grads": [torch.zeros(4), torch.zeros(6)],
        "exp_avgs": [torch.zeros(4), torch.zeros(6)],
        "exp_avg_sqs": [torch.zeros(4), torch.zeros(3, 2)],
        "steps": 1,
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        ({"grads": [torch.zeros(4)]}, ValueError, r"one entry per param, got lengths \{'params': 2, 'grads': 1"),
        ({"exp_avgs": [torch.zeros(4), torch.zeros(5)]}, ValueError,
         r"exp_avgs\[1\] has shape \(5,\) \(5 elements\) but params\[1\] has shape \(2, 3\) \(6 elements\)"),
        ({"grads": [torch.zeros(4, dtype=torch.float64), torch.zeros(6)]}, TypeError,
         r"grads\[0\] must be float32, bfloat16, float16, got torch.float64"),
        ({"params": [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(2, 3)]}, TypeError,
         r"params\[0\] must be float32, got torch.bfloat16"),
        ({"model_params": [None, torch.zeros(6, dtype=torch.int32)]}, TypeError, r"model_params\[1\] must be float32"),
        ({"model_params": [torch.zeros(4, device="meta"), None]}, ValueError,
         r"model_params\[0\] is on meta but params\[0\] is on cpu"),
        ({"exp_avg_sqs": [torch.zeros(4), torch.zeros(3, 2).t()]}, ValueError,
         r"exp_avg_sqs\[1\] .* must be contiguous"),
        ({"grads": (torch.zeros(4), "x")}, TypeError, r"grads\[1\] must be a torch.Tensor, got str"),
        ({"params": torch.zeros(4)}, TypeError, "params must be a list of tensors, got Tensor"),
        ({"grad_multiplier": torch.ones(2)}, ValueError,
         r"one-element float32 tensor, got torch.float32 of shape \(2,\)"),
        ({"grad_multiplier": torch.ones((), dtype=torch.float64)}, ValueError, "one-element float32 tensor"),
        ({"grad_multiplier": 0.5}, TypeError, "grad_multiplier must be a one-element fp32 tensor or None, got float"),
        ({"grad_multiplier": torch.ones((), device="meta")}, ValueError, "grad_multiplier is on meta but params"),
        ({"steps": 0}, ValueError, "steps must be an int >= 1"),
        ({"steps": 1.0}, ValueError, "steps must be an int >= 1"),
        ({"lr": -1.0}, ValueError, "lr must be a finite number >= 0.0, got -1.0"),
        ({"beta2": 1.0}, ValueError, r"beta2 must be a finite number in \[0.0, 1.0\), got 1.0"),
        ({"eps": float("nan")}, ValueError, "eps must be a finite number"),
        ({"weight_decay": True}, ValueError, "weight_decay must be a finite number >= 0.0, got True"),
    ],
)  # fmt: skip
def test_bad_inputs_raise_clear_errors(change, error, pattern):
    kwargs = {**_valid(), **change}
    with pytest.raises(error, match=pattern):
        adamw_step_(
            kwargs.pop("params"), kwargs.pop("grads"), kwargs.pop("exp_avgs"), kwargs.pop("exp_avg_sqs"), **kwargs
        )


@pytest.mark.gpu
class TestCuda:
    def test_100m_elements_against_float64_and_torch_fused(self, cuda_triton):
        """~100M elements over a few tensors of odd sizes: the compiled kernel against float64 torch, torch's
        fused fp32 AdamW (the production baseline it replaces) and the reference backend on the same GPU."""
        device = cuda_triton
        shapes = [(8192, 8192), (33_554_431,), (4096 + 3,), (1,)]
        gen = torch.Generator(device=device).manual_seed(0)
        params = [torch.randn(s, device=device, generator=gen) for s in shapes]
        m = [torch.randn(s, device=device, generator=gen) * 1e-2 for s in shapes]
        v = [torch.rand(s, device=device, generator=gen) * 1e-4 for s in shapes]
        grads = [[torch.randn(s, device=device, generator=gen) * 1e-2 for s in shapes] for _ in range(STEPS)]
        got_p, got_m, got_v = [t.clone() for t in params], [t.clone() for t in m], [t.clone() for t in v]
        ref_p, ref_m, ref_v = [t.clone() for t in params], [t.clone() for t in m], [t.clone() for t in v]
        out = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
        fused = [t.clone() for t in params]
        torch_fused = torch.optim.AdamW(fused, lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=0.1, fused=True)
        for q, a, b in zip(fused, m, v):
            step = torch.tensor(2.0, device=device)
            torch_fused.state[q] = {"step": step, "exp_avg": a.clone(), "exp_avg_sq": b.clone()}
        p64 = [t.double() for t in params]
        opt64 = torch.optim.AdamW(p64, lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=0.1, foreach=False)
        for q, a, b in zip(p64, m, v):
            opt64.state[q] = {"step": torch.tensor(2.0, dtype=torch.float64), "exp_avg": a.double(),
                              "exp_avg_sq": b.double()}  # fmt: skip
        for k in range(STEPS):
            mult = torch.tensor(MULTIPLIERS[k], device=device)
            common = {"steps": 3 + k, "lr": LRS[k], "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
                      "weight_decay": 0.1, "grad_multiplier": mult}  # fmt: skip
            adamw_step_(got_p, grads[k], got_m, got_v, model_params=out, backend="triton", **common)
            adamw_step_(ref_p, grads[k], ref_m, ref_v, backend="reference", **common)
            for q, g in zip(fused, grads[k]):
                q.grad = g * mult
            for q, g in zip(p64, grads[k]):
                q.grad = g.double() * float(mult)
            for opt in (torch_fused, opt64):
                opt.param_groups[0]["lr"] = LRS[k]
                opt.step()
        torch.cuda.synchronize()
        for i in range(len(shapes)):
            _assert_close(got_p[i], p64[i])
            _assert_close(got_m[i], opt64.state[p64[i]]["exp_avg"])
            _assert_close(got_v[i], opt64.state[p64[i]]["exp_avg_sq"])
            _assert_close(got_p[i], fused[i])
            _assert_close(got_p[i], ref_p[i], rtol=2 * STEPS * 6e-8, atol=2 * STEPS * 6e-8)
            _assert_close(got_m[i], ref_m[i], rtol=2 * STEPS * 6e-8, atol=2 * STEPS * 6e-8)
            _assert_close(got_v[i], ref_v[i], rtol=2 * STEPS * 6e-8, atol=2 * STEPS * 6e-8)
            assert torch.equal(out[i], got_p[i].to(torch.bfloat16)), i  # compiled: round to nearest even

    def test_cuda_tensors_dispatch_to_triton(self, cuda_triton, spy, monkeypatch):
        monkeypatch.delenv("MCORE_KERNELS_BACKEND", raising=False)
        calls = spy(TRITON_ADAMW, "adamw_step")
        p = torch.randn(10, device=cuda_triton)
        adamw_step_([p], [torch.randn(10, device=cuda_triton)], [torch.zeros_like(p)], [torch.zeros_like(p)],
                    steps=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)  # fmt: skip
        assert len(calls) == 1
