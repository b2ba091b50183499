"""clamped_swiglu (GPT-OSS's expert activation): the torch reference against float64 torch written from the formula
(Hugging Face's ``_apply_gate`` on de-interleaved columns), Triton (interpreter) against it, with inputs well past
the clamps so both clamp branches and their gradients are exercised."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.clamped_swiglu import clamped_swiglu

ALPHA, LIMIT = 1.702, 7.0
TRITON_ACTIVATIONS = "mcore.kernels.triton.activations"


def _inputs(shape, dtype, device="cpu", scale=6.0):
    x = torch.randn(shape, device=device).mul_(scale).to(dtype)
    dy = torch.randn(shape[:-1] + (shape[-1] // 2,), device=device).to(dtype)
    return x, dy


def _run(x, dy, backend, alpha=ALPHA, limit=LIMIT):
    x_ = x.detach().clone().requires_grad_(True)
    y = clamped_swiglu(x_, alpha, limit, backend=backend)
    y.backward(dy)
    return y.detach(), x_.grad


def _float64(x, dy, alpha=ALPHA, limit=LIMIT):
    x_ = x.detach().double().requires_grad_(True)
    gate, up = x_.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    y = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    y.backward(dy.double())
    return y.detach(), x_.grad


def _check(assert_close, got, want, dtype):
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 5, 2 * 129)])
def test_reference_matches_float64(dtype, shape, assert_close):
    x, dy = _inputs(shape, dtype)
    assert (x[..., : shape[-1] // 2] > LIMIT).any() or shape == (1, 2)
    _check(assert_close, _run(x, dy, "reference"), _float64(x, dy), dtype)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_clamps_cut_the_gradient_outside_and_keep_it_on_the_bounds(backend, request):
    if backend == "triton":
        request.getfixturevalue("interpreter")
    # gate above the limit: no gate gradient; up outside [-limit, limit]: no up gradient; on the bounds: kept
    x = torch.tensor([[9.0, 7.0, -3.0, 0.5, 8.0, -7.0, -9.0, 2.0]])
    dy = torch.ones(1, 4)
    _, grad = _run(x, dy, backend)
    _, want = _float64(x, dy)
    torch.testing.assert_close(grad.double(), want, rtol=1e-6, atol=1e-7)
    assert grad[0, 0] == 0 and grad[0, 1] != 0  # gate 9 clamped, gate 7 on the bound
    assert grad[0, 4] == 0 and grad[0, 6] == 0 and grad[0, 5] != 0  # up 8 and -9 clamped, -7 on the bound


def test_triton_backend_is_the_gated_activation_kernels(interpreter, spy):
    # one kernel body for SwiGLU and its clamped form: both passes launch it with the constexpr activation
    forward, backward = spy(TRITON_ACTIVATIONS, "glu_forward"), spy(TRITON_ACTIVATIONS, "glu_backward")
    x, dy = _inputs((4, 2 * 8), torch.float32)
    _run(x, dy, "triton")
    assert [call[0][1:] for call in forward] == [("clamped_silu", ALPHA, LIMIT)]
    assert [call[0][2:] for call in backward] == [("clamped_silu", ALPHA, LIMIT)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 1000), (37, 2 * 300), (2, 3, 2 * 96)])
def test_triton_matches_reference(dtype, shape, interpreter, assert_close):
    x, dy = _inputs(shape, dtype, interpreter)
    _check(assert_close, _run(x, dy, "triton"), _run(x, dy, "reference"), dtype)


def test_triton_against_float64(interpreter, assert_close):
    x, dy = _inputs((16, 2 * 200), torch.float32, interpreter, scale=10.0)
    _check(assert_close, _run(x, dy, "triton", 1.0, 3.0), _float64(x, dy, 1.0, 3.0), torch.float32)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: clamped_swiglu(torch.randn(4, 15), ALPHA, LIMIT), ValueError, r"\(4, 15\)"),
        (lambda: clamped_swiglu(torch.randn(4, 16).double(), ALPHA, LIMIT), TypeError, "float64"),
        (lambda: clamped_swiglu(torch.randn(4, 16), 0.0, LIMIT), ValueError, "alpha"),
        (lambda: clamped_swiglu(torch.randn(4, 16), ALPHA, float("inf")), ValueError, "limit"),
    ],
)
def test_bad_input(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.gpu
class TestCuda:
    @pytest.mark.parametrize("shape", [(4096, 2 * 2880), (7, 2 * 2880)])
    def test_bf16_triton_matches_reference(self, shape, cuda_triton, assert_close):
        x, dy = _inputs(shape, torch.bfloat16, cuda_triton)
        _check(assert_close, _run(x, dy, "triton"), _run(x, dy, "reference"), torch.bfloat16)

    def test_fp32_against_float64(self, cuda_triton, assert_close):
        x, dy = _inputs((300, 2 * 700), torch.float32, cuda_triton)
        _check(assert_close, _run(x, dy, "triton"), _float64(x, dy), torch.float32)
