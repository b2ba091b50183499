"""swiglu / geglu: the torch reference against float64 torch, Triton (interpreter) against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore.kernels import geglu, swiglu

TRITON_ACTIVATIONS = "mcore.kernels.triton.activations"
# name -> (mcore call, float64 activation of the gate)
ACTIVATIONS = {
    "swiglu": (lambda x, be: swiglu(x, backend=be), F.silu),
    "geglu_tanh": (lambda x, be: geglu(x, backend=be), lambda g: F.gelu(g, approximate="tanh")),
    "geglu_erf": (lambda x, be: geglu(x, approximate="none", backend=be), lambda g: F.gelu(g, approximate="none")),
}


def _run(name, x, dy, backend):
    x_ = x.detach().clone().requires_grad_(True)
    y = ACTIVATIONS[name][0](x_, backend)
    y.backward(dy)
    return y.detach(), x_.grad


def _float64(name, x, dy):
    x_ = x.detach().double().requires_grad_(True)
    gate, up = x_.chunk(2, dim=-1)
    y = ACTIVATIONS[name][1](gate) * up
    y.backward(dy.double())
    return y.detach(), x_.grad


def _inputs(shape, dtype, device="cpu", scale=2.0):
    x = torch.randn(shape, dtype=torch.float32, device=device).mul_(scale).to(dtype)
    dy = torch.randn(shape[:-1] + (shape[-1] // 2,), dtype=dtype, device=device)
    return x, dy


def _check(assert_close, got, want, dtype):
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


# ---------------------------------------------------------------- reference vs float64


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 4, 2 * 257)])
def test_reference_matches_float64(name, dtype, shape, assert_close):
    x, dy = _inputs(shape, dtype)
    _check(assert_close, _run(name, x, dy, "reference"), _float64(name, x, dy), dtype)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_reference_large_magnitudes(name, assert_close):
    # Saturated gates (|g| up to ~50): no overflow in sigmoid / tanh / erf and their derivatives.
    x, dy = _inputs((64, 2 * 64), torch.float32, scale=15.0)
    _check(assert_close, _run(name, x, dy, "reference"), _float64(name, x, dy), torch.float32)


# ---------------------------------------------------------------- Triton (interpreter) vs reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 2 * 1000), (2, 3, 4, 2 * 96), (37, 2 * 300), (5, 2 * 3), (3, 2 * 2500)])
def test_triton_matches_reference(name, dtype, shape, interpreter, assert_close):
    x, dy = _inputs(shape, dtype, interpreter)
    _check(assert_close, _run(name, x, dy, "triton"), _run(name, x, dy, "reference"), dtype)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_triton_against_float64_with_large_magnitudes(name, interpreter, assert_close):
    x, dy = _inputs((16, 2 * 200), torch.float32, interpreter, scale=15.0)
    _check(assert_close, _run(name, x, dy, "triton"), _float64(name, x, dy), torch.float32)


@pytest.mark.parametrize("layout", ["transposed", "strided_last_dim", "broadcast_grad"])
def test_triton_non_contiguous(layout, interpreter, assert_close):
    base = torch.randn(5, 3, 2 * 2 * 40, device=interpreter)
    if layout == "transposed":
        x, dy = base[..., :80].transpose(0, 1), torch.randn(5, 3, 40, device=interpreter).transpose(0, 1)
    elif layout == "strided_last_dim":
        x, dy = base[..., ::2], torch.randn(5, 3, 80, device=interpreter)[..., ::2]
    else:
        x, dy = base[..., :80], torch.randn(40, device=interpreter).expand(5, 3, 40)
    assert not x.is_contiguous() and not dy.is_contiguous()
    _check(assert_close, _run("swiglu", x, dy, "triton"), _float64("swiglu", x, dy), torch.float32)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_input(backend, request):
    if backend == "triton":
        request.getfixturevalue("interpreter")
    x = torch.randn(0, 4, 10, requires_grad=True)
    y = swiglu(x, backend=backend)
    y.sum().backward()
    assert y.shape == (0, 4, 5) and x.grad.shape == x.shape


def test_dispatch_env_and_keyword(monkeypatch, interpreter, spy):
    calls = spy(TRITON_ACTIVATIONS, "glu_forward")
    x = torch.randn(4, 16)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    swiglu(x)
    geglu(x)
    assert [c[0][1] for c in calls] == ["silu", "gelu_tanh"]
    geglu(x, backend="reference")
    assert len(calls) == 2


# ---------------------------------------------------------------- bad input


def _bad_cases():
    x = torch.randn(4, 16)
    return [
        ("odd last dim", lambda be: swiglu(x[:, :15], backend=be), ValueError, r"\(4, 15\)"),
        ("0-d", lambda be: geglu(torch.tensor(1.0), backend=be), ValueError, r"\(\)"),
        ("float64", lambda be: swiglu(x.double(), backend=be), TypeError, "float64"),
        ("int", lambda be: geglu(x.long(), backend=be), TypeError, "int64"),
        ("not a tensor", lambda be: swiglu(x.tolist(), backend=be), TypeError, "list"),
        ("approximate", lambda be: geglu(x, approximate="exact", backend=be), ValueError, "'exact'"),
    ]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case, backend, forbid):
    _, call, error, pattern = case
    for name in ("glu_forward", "glu_backward"):
        forbid(TRITON_ACTIVATIONS, name)
    with pytest.raises(error, match=pattern):
        call(backend)


# ---------------------------------------------------------------- compiled Triton on CUDA


@pytest.mark.gpu
class TestCuda:
    @pytest.mark.parametrize("name", sorted(ACTIVATIONS))
    @pytest.mark.parametrize("shape", [(2, 512, 2 * 4096), (1000, 2 * 1000), (7, 2 * 14336)])
    def test_bf16_triton_matches_reference(self, name, shape, cuda_triton, assert_close):
        x, dy = _inputs(shape, torch.bfloat16, cuda_triton)
        _check(assert_close, _run(name, x, dy, "triton"), _run(name, x, dy, "reference"), torch.bfloat16)

    @pytest.mark.parametrize("name", sorted(ACTIVATIONS))
    def test_fp32_against_float64(self, name, cuda_triton, assert_close):
        x, dy = _inputs((300, 2 * 700), torch.float32, cuda_triton, scale=6.0)
        _check(assert_close, _run(name, x, dy, "triton"), _float64(name, x, dy), torch.float32)
