"""fp8_block_grouped_gemm: the Triton kernels (interpreter) against the reference, both against float64 products
of the dequantized block-scaled operands, wgrad_into, the activation form, and the 128-multiple refusals."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.activations import swiglu
from mcore.kernels.fp8_block_grouped_gemm import fp8_block_grouped_gemm, fp8_block_grouped_gemm_of_activation
from mcore.kernels.quantization import E4M3, Quantized, quantize_fp8

# experts of 128, 0 (no rows), 256 and 128 rows (uneven, multiples of 128), then 64 rows past offsets[-1]
OFFSETS = [128, 128, 384, 512]
ROWS, K, N = 576, 256, 128
# fp32 accumulation of the same fp8 products against float64 (K or 512 tokens): relative to the largest value
EXACT = {"rtol": 1e-5}


@pytest.fixture
def on(request):
    """``backend`` of the parametrized test, the Triton interpreter required (else skipped) for ``"triton"``."""
    backend = request.param
    if backend == "triton":
        request.getfixturevalue("interpreter")
    return backend


def _inputs(seed=0, rows=ROWS, k=K, n=N, offsets=OFFSETS):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-1, 1, k)).requires_grad_()
    w = (torch.randn(len(offsets), n, k, generator=gen) * 0.1).requires_grad_()
    return x, w, torch.tensor(offsets, dtype=torch.int32)


def _close(got, want):
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), **EXACT)


def _run(backend, seed=1, wgrad_into=None, with_activation=False):
    """Forward and backward of a fresh random case: (y, d input, w)."""
    gen = torch.Generator().manual_seed(seed + 100)
    x, w, offsets = _inputs(seed)
    if with_activation:
        x = torch.randn(ROWS, 2 * K, generator=gen).requires_grad_()
        y = fp8_block_grouped_gemm_of_activation(x, w, offsets, swiglu, backend=backend, wgrad_into=wgrad_into)
    else:
        y = fp8_block_grouped_gemm(x, w, offsets, backend=backend, wgrad_into=wgrad_into)
    dy = torch.randn(ROWS, N, generator=gen)
    dy[OFFSETS[-1] :] = float("nan")  # rows of no expert: never read into any gradient
    y.backward(dy)
    return y.detach(), x.grad, w, dy


def _float64_case(x, w, dy):
    """y, dx and dw from the dequantized block-scaled operands, per expert in float64."""
    deq = lambda t, g, **kw: quantize_fp8(t, E4M3, g, backend="reference", **kw).dequantize(torch.float64)  # noqa: E731
    xq, dyq = deq(x, "1x128"), deq(dy, "1x128")
    dy_t, x_t = deq(dy, "1x128", transpose=True), deq(x, "1x128", transpose=True)
    y, dx = torch.zeros(ROWS, N, dtype=torch.float64), torch.zeros(ROWS, K, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    for e, (start, end) in enumerate(zip([0, *OFFSETS[:-1]], OFFSETS, strict=True)):
        we = deq(w[e], "128x128")
        y[start:end] = xq[start:end] @ we.t()
        dx[start:end] = dyq[start:end] @ deq(w[e].t(), "128x128").t()
        dw[e] = dy_t[:, start:end] @ x_t[:, start:end].t()
    return y, dx, dw


@pytest.mark.parametrize("on", ["reference", "triton"], indirect=True)
def test_forward_and_gradients_are_the_float64_products_of_the_dequantized_operands(on):
    y, dx, w, dy = _run(on)
    x, _, _ = _inputs(1)
    want_y, want_dx, want_dw = _float64_case(x.detach(), w.detach(), torch.nan_to_num(dy, nan=0.0))
    _close(y, want_y), _close(dx, want_dx), _close(w.grad, want_dw)
    assert torch.all(y[OFFSETS[-1] :] == 0) and torch.all(dx[OFFSETS[-1] :] == 0)  # no expert
    assert torch.all(w.grad[1] == 0) and torch.all(w.grad[0] != 0)  # the empty expert, a real one


@pytest.mark.parametrize("with_activation", [False, True], ids=["gemm", "of_activation"])
def test_triton_equals_the_reference(with_activation, interpreter):
    """Identical fp8 operands: only the accumulation order differs (fp32 over 128-wide steps)."""
    ref = _run("reference", seed=3, with_activation=with_activation)
    tri = _run("triton", seed=3, with_activation=with_activation)
    for got, want in ((tri[0], ref[0]), (tri[1], ref[1]), (tri[2].grad, ref[2].grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_quantization_is_real_and_tracks_the_float64_gemm():
    y, dx, w, dy = _run("reference", seed=4)
    x, _, _ = _inputs(4)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.zeros(ROWS, N, dtype=torch.float64)
    for e, (start, end) in enumerate(zip([0, *OFFSETS[:-1]], OFFSETS, strict=True)):
        want[start:end] = x64[start:end] @ w64[e].t()
    want.backward(torch.nan_to_num(dy, nan=0.0).double())
    for got, ref in ((y, want), (dx, x64.grad), (w.grad, w64.grad)):
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert 1e-4 < rel < 0.05, rel  # fp8 error: present, and within what e4m3 block scales give


@pytest.mark.parametrize("on", ["reference", "triton"], indirect=True)
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "add"])
def test_weight_gradient_into_a_target_equals_the_returned_one(accumulate, on):
    """Written: the NaN-filled target ends as the returned gradient (never read; the empty expert gets zeros);
    added: target + that gradient. Output and input gradient unchanged."""
    y0, dx0, w0, _ = _run(on, seed=5)
    start = torch.randn(w0.shape, generator=torch.Generator().manual_seed(11)) if accumulate else None
    target, calls = torch.full(w0.shape, float("nan")) if start is None else start.clone(), []
    y, dx, w, _ = _run(on, seed=5, wgrad_into=lambda: calls.append(1) or (target, accumulate))
    assert w.grad is None and calls == [1]
    assert torch.equal(y, y0) and torch.equal(dx, dx0)
    assert torch.equal(target, start + w0.grad if accumulate else w0.grad)
    with pytest.raises(ValueError, match="wgrad_into gave a writer function"):
        _run(on, wgrad_into=lambda: lambda dy, x: None)


def test_of_activation_equals_the_gemm_of_the_activation():
    _, w, offsets = _inputs(seed=6)
    h = torch.randn(ROWS, 2 * K, generator=torch.Generator().manual_seed(7), requires_grad=True)
    probe = torch.randn(ROWS, N, generator=torch.Generator().manual_seed(8))
    fused = fp8_block_grouped_gemm_of_activation(h, w, offsets, swiglu)
    dh, dw = torch.autograd.grad((fused * probe).sum(), (h, w))
    plain = fp8_block_grouped_gemm(swiglu(h), w, offsets)
    dh0, dw0 = torch.autograd.grad((plain * probe).sum(), (h, w))
    assert torch.equal(fused, plain) and torch.equal(dh, dh0) and torch.equal(dw, dw0)
    assert torch.any(dh != 0) and torch.all(dh[OFFSETS[-1] :] == 0)
    with pytest.raises(ValueError, match="fp8_block_grouped_gemm_of_activation: h must be a 2-D"):
        fp8_block_grouped_gemm_of_activation(h[0], w, offsets, swiglu)


def test_shapes_off_the_128_grid_are_named():
    x, w, offsets = _inputs(offsets=[128, 228, 512])
    with pytest.raises(ValueError, match=r"row count must be a multiple of 128, got \[128, 100, 284\].*align=128"):
        fp8_block_grouped_gemm(x, w, offsets)
    x, w, offsets = _inputs(k=192)
    with pytest.raises(ValueError, match="K=192 must be a multiple of 128"):
        fp8_block_grouped_gemm(x, w, offsets)
    x, w, offsets = _inputs(n=64)
    with pytest.raises(ValueError, match="N=64 must be a multiple of 128"):
        fp8_block_grouped_gemm_of_activation(x, w, offsets, torch.relu)


def test_weight_blocks_transposed_are_the_cast_of_the_transposed_weight():
    """dgrad's ``w[e]^T`` is the forward cast transposed: the same bits as casting ``w[e]^T`` itself."""
    from mcore.kernels.fp8_block_grouped_gemm import _block_weights

    _, w, _ = _inputs(seed=9)
    qw, qw_t = _block_weights(w.detach(), "reference", need_t=True)
    for e in range(w.shape[0]):
        direct = quantize_fp8(w[e].detach().t().contiguous(), E4M3, "128x128", backend="reference")
        assert isinstance(qw_t, Quantized) and qw_t.data.dtype == E4M3
        assert torch.equal(qw_t.data[e].view(torch.uint8), direct.data.view(torch.uint8))
        assert torch.equal(qw_t.scale[e], direct.scale)


def _cuda_case(backend: str, dtype: torch.dtype, with_activation: bool, seed: int = 12):
    """The CPU-made random case on the GPU in ``dtype``: (y, d input, d w) through ``backend``."""
    gen = torch.Generator().manual_seed(seed)
    k_in = 2 * K if with_activation else K
    x = (torch.randn(ROWS, k_in, generator=gen) * torch.logspace(-1, 1, k_in)).to("cuda", dtype).requires_grad_()
    w = (torch.randn(len(OFFSETS), N, K, generator=gen) * 0.1).to("cuda", dtype).requires_grad_()
    offsets = torch.tensor(OFFSETS, dtype=torch.int32, device="cuda")
    dy = torch.randn(ROWS, N, generator=gen).to("cuda", dtype)
    dy[OFFSETS[-1] :] = float("nan")  # rows of no expert: never read
    if with_activation:
        y = fp8_block_grouped_gemm_of_activation(x, w, offsets, swiglu, backend=backend)
    else:
        y = fp8_block_grouped_gemm(x, w, offsets, backend=backend)
    y.backward(dy)
    return y.detach().float(), x.grad.float(), w.grad.float()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_activation", [False, True], ids=["gemm", "of_activation"])
def test_cuda_triton_equals_the_reference(cuda_triton, dtype, with_activation):
    """The compiled Triton grouped kernels (never run on a GPU before session 15's test) against the reference
    path on the same GPU and inputs: identical fp8 operands, so fp32 agrees to accumulation order and bf16 to its
    output rounding; rows of no expert zero."""
    tri = _cuda_case("triton", dtype, with_activation)
    ref = _cuda_case("reference", dtype, with_activation)
    assert torch.all(tri[0][OFFSETS[-1] :] == 0) and torch.all(tri[1][OFFSETS[-1] :] == 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(tri, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
