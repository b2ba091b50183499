"""rms_norm / layer_norm: the torch reference against float64 torch, Triton (interpreter) against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore.kernels import layer_norm, rms_norm

TRITON_NORMS = "mcore.kernels.triton.norms"
OPS = ["rms", "layer", "layer_no_bias"]


def _make(op: str, shape: tuple[int, ...], dtype: torch.dtype, device="cpu", weight_dtype=None):
    """Random x, weight, bias (None for rms / no-bias) with grads enabled, and an upstream gradient."""
    hidden = shape[-1]
    weight_dtype = weight_dtype or dtype
    x = torch.randn(shape, dtype=dtype, device=device) * 2 + 0.5
    weight = (torch.rand(hidden, dtype=torch.float32, device=device) + 0.5).to(weight_dtype)
    bias = torch.randn(hidden, dtype=weight_dtype, device=device) if op == "layer" else None
    dy = torch.randn(shape, dtype=dtype, device=device)
    return x, weight, bias, dy


def _run(op, x, weight, bias, dy, *, zero_centered=False, backend=None, eps=1e-5):
    """Forward and backward through mcore's op; returns (y, dx, dweight, dbias)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
    x_, w_, b_ = leaves
    if op == "rms":
        y = rms_norm(x_, w_, eps, zero_centered_weight=zero_centered, backend=backend)
    else:
        y = layer_norm(x_, w_, b_, eps, zero_centered_weight=zero_centered, backend=backend)
    y.backward(dy)
    return y.detach(), x_.grad, w_.grad, (b_.grad if b_ is not None else None)


def _float64(op, x, weight, bias, dy, *, zero_centered=False, eps=1e-5):
    """Independent float64 computation with torch.nn.functional and autograd."""
    x_ = x.detach().double().requires_grad_(True)
    w_ = weight.detach().double().requires_grad_(True)
    b_ = bias.detach().double().requires_grad_(True) if bias is not None else None
    scale = 1 + w_ if zero_centered else w_
    if op == "rms":
        y = F.rms_norm(x_, (x.shape[-1],), scale, eps)
    else:
        y = F.layer_norm(x_, (x.shape[-1],), scale, b_, eps)
    y.backward(dy.double())
    return y.detach(), x_.grad, w_.grad, (b_.grad if b_ is not None else None)


def _check_all(assert_close, got, want, x_dtype, w_dtype):
    y, dx, dw, db = got
    y_ref, dx_ref, dw_ref, db_ref = want
    assert y.dtype == x_dtype and dx.dtype == x_dtype and dw.dtype == w_dtype
    assert_close(y, y_ref, x_dtype)
    assert_close(dx, dx_ref, x_dtype)
    assert_close(dw, dw_ref, w_dtype)
    assert (db is None) == (db_ref is None)
    if db is not None:
        assert db.dtype == w_dtype
        assert_close(db, db_ref, w_dtype)


# ---------------------------------------------------------------- reference vs float64


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(1, 1000), (2, 3, 4, 96), (17, 257)])
def test_reference_matches_float64(op, zero_centered, shape, assert_close):
    x, w, b, dy = _make(op, shape, torch.float32)
    got = _run(op, x, w, b, dy, zero_centered=zero_centered, backend="reference")
    want = _float64(op, x, w, b, dy, zero_centered=zero_centered)
    _check_all(assert_close, got, want, torch.float32, torch.float32)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_low_precision_rounds_once(op, dtype, assert_close):
    # Inputs already in the low precision: fp32 accumulation leaves only the final rounding.
    x, w, b, dy = _make(op, (6, 5, 384), dtype)
    got = _run(op, x, w, b, dy, backend="reference")
    want = _float64(op, x, w, b, dy)
    _check_all(assert_close, got, want, dtype, dtype)


def test_reference_fp32_weight_with_bf16_input(assert_close):
    x, w, b, dy = _make("layer", (9, 200), torch.bfloat16, weight_dtype=torch.float32)
    got = _run("layer", x, w, b, dy, backend="reference")
    _check_all(assert_close, got, _float64("layer", x, w, b, dy), torch.bfloat16, torch.float32)


def test_eps_is_used():
    # Tiny inputs make the result depend on eps: x / sqrt(mean(x^2) + eps).
    x = torch.randn(4, 64) * 1e-3
    w = torch.rand(64) + 0.5
    y_small = rms_norm(x, w, 1e-12, backend="reference")
    y_large = rms_norm(x, w, 1e-2, backend="reference")
    torch.testing.assert_close(y_large, F.rms_norm(x.double(), (64,), w.double(), 1e-2).float())
    assert not torch.allclose(y_small, y_large)


# ---------------------------------------------------------------- Triton (interpreter) vs reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(1, 1000), (2, 3, 4, 96), (37, 1000), (5, 33)])
def test_triton_matches_reference(op, dtype, shape, interpreter, assert_close):
    x, w, b, dy = _make(op, shape, dtype, device=interpreter)
    got = _run(op, x, w, b, dy, backend="triton")
    want = _run(op, x, w, b, dy, backend="reference")
    _check_all(assert_close, got, want, dtype, dtype)


@pytest.mark.parametrize("op", OPS)
def test_triton_zero_centered_weight(op, interpreter, assert_close):
    x, w, b, dy = _make(op, (3, 7, 160), torch.float32, device=interpreter)
    w = w - 1  # centred around zero, as stored for Gemma
    got = _run(op, x, w, b, dy, zero_centered=True, backend="triton")
    want = _float64(op, x, w, b, dy, zero_centered=True)
    _check_all(assert_close, got, want, torch.float32, torch.float32)


def test_triton_mixed_weight_dtype(interpreter, assert_close):
    x, w, b, dy = _make("layer", (11, 130), torch.bfloat16, device=interpreter, weight_dtype=torch.float32)
    got = _run("layer", x, w, b, dy, backend="triton")
    _check_all(assert_close, got, _run("layer", x, w, b, dy, backend="reference"), torch.bfloat16, torch.float32)


@pytest.mark.parametrize("layout", ["transposed", "strided_last_dim", "broadcast_grad"])
def test_triton_non_contiguous(layout, interpreter, assert_close):
    base = torch.randn(6, 4, 2 * 80, device=interpreter)
    w = torch.rand(80, device=interpreter) + 0.5
    if layout == "transposed":
        x, dy = base[..., :80].transpose(0, 1), torch.randn(6, 4, 80, device=interpreter).transpose(0, 1)
    elif layout == "strided_last_dim":
        x, dy = base[..., ::2], torch.randn(6, 4, 160, device=interpreter)[..., 1::2]
    else:
        x, dy = base[..., :80], torch.randn(80, device=interpreter).expand(6, 4, 80)
    assert not x.is_contiguous() and not dy.is_contiguous()
    got = _run("rms", x, w, None, dy, backend="triton")
    want = _float64("rms", x, w, None, dy)
    _check_all(assert_close, got, want, torch.float32, torch.float32)


def test_triton_backward_many_tiles_per_program(interpreter, assert_close, spy):
    # 4 rows per tile at hidden 1000 -> 50 tiles over the few interpreter programs: each program walks
    # several tiles and the partial dweight/dbias rows must be summed.
    calls = spy(TRITON_NORMS, "norm_backward")
    x, w, b, dy = _make("layer", (199, 1000), torch.float32, device=interpreter)
    got = _run("layer", x, w, b, dy, backend="triton")
    assert len(calls) == 1
    _check_all(assert_close, got, _float64("layer", x, w, b, dy), torch.float32, torch.float32)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_rows(backend, request):
    if backend == "triton":
        request.getfixturevalue("interpreter")
    x = torch.randn(0, 3, 64, requires_grad=True)
    w = torch.rand(64, requires_grad=True)
    y = rms_norm(x, w, backend=backend)
    y.sum().backward()
    assert y.shape == (0, 3, 64)
    assert torch.equal(w.grad, torch.zeros(64))


# ---------------------------------------------------------------- dispatcher


def test_dispatch_env_and_keyword(monkeypatch, interpreter, spy):
    calls = spy(TRITON_NORMS, "norm_forward")
    x, w = torch.randn(3, 64), torch.rand(64)
    monkeypatch.delenv("MCORE_KERNELS_BACKEND", raising=False)
    rms_norm(x, w)  # CPU tensors, nothing requested -> reference
    assert len(calls) == 0
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    rms_norm(x, w)
    layer_norm(x, w, None)
    assert len(calls) == 2
    rms_norm(x, w, backend="reference")  # the keyword beats the environment
    assert len(calls) == 2
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "reference")
    rms_norm(x, w, backend="triton")
    assert len(calls) == 3
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        rms_norm(x, w, backend="cuda")


# ---------------------------------------------------------------- bad input


def _bad_cases():
    x = torch.randn(4, 32)
    w = torch.rand(32)
    return [
        ("x float64", lambda be: rms_norm(x.double(), w, backend=be), TypeError, "float64"),
        ("weight int", lambda be: rms_norm(x, torch.ones(32, dtype=torch.int32), backend=be), TypeError, "int32"),
        ("x not a tensor", lambda be: rms_norm([1.0, 2.0], w, backend=be), TypeError, "list"),
        ("weight shape", lambda be: rms_norm(x, torch.rand(31), backend=be), ValueError, r"\(32,\).*\(31,\)"),
        ("weight 2-D", lambda be: rms_norm(x, torch.rand(1, 32), backend=be), ValueError, r"\(1, 32\)"),
        ("bias shape", lambda be: layer_norm(x, w, torch.rand(16), backend=be), ValueError, "bias"),
        ("0-d x", lambda be: rms_norm(torch.tensor(1.0), torch.rand(1), backend=be), ValueError, "last dim"),
        ("device", lambda be: rms_norm(x, torch.rand(32, device="meta"), backend=be), ValueError, "meta"),
        ("eps", lambda be: layer_norm(x, w, None, -1e-5, backend=be), ValueError, "eps"),
    ]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case, backend, forbid):
    _, call, error, pattern = case
    for name in ("norm_forward", "norm_backward"):
        forbid(TRITON_NORMS, name)
    with pytest.raises(error, match=pattern):
        call(backend)


def test_triton_rejects_rows_wider_than_registers(interpreter):
    x, w = torch.randn(1, 65537), torch.rand(65537)
    with pytest.raises(ValueError, match="65536.*65537.*reference"):
        rms_norm(x, w, backend="triton")


# ---------------------------------------------------------------- compiled Triton on CUDA


@pytest.mark.gpu
class TestCuda:
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize("shape", [(2, 512, 4096), (4096, 128), (3, 5, 1000), (1, 8192)])
    def test_bf16_triton_matches_reference(self, op, shape, cuda_triton, assert_close):
        x, w, b, dy = _make(op, shape, torch.bfloat16, device=cuda_triton)
        got = _run(op, x, w, b, dy, backend="triton")
        want = _run(op, x, w, b, dy, backend="reference")
        _check_all(assert_close, got, want, torch.bfloat16, torch.bfloat16)

    def test_fp32_against_float64(self, cuda_triton, assert_close):
        x, w, b, dy = _make("layer", (300, 2048), torch.float32, device=cuda_triton)
        got = _run("layer", x, w, b, dy, zero_centered=True, backend="triton")
        want = _float64("layer", x, w, b, dy, zero_centered=True)
        _check_all(assert_close, got, want, torch.float32, torch.float32)

    def test_cuda_tensors_dispatch_to_triton(self, cuda_triton, spy, monkeypatch):
        monkeypatch.delenv("MCORE_KERNELS_BACKEND", raising=False)
        calls = spy(TRITON_NORMS, "norm_forward")
        x = torch.randn(8, 256, device=cuda_triton, dtype=torch.bfloat16)
        rms_norm(x, torch.rand(256, device=cuda_triton, dtype=torch.bfloat16))
        assert len(calls) == 1
