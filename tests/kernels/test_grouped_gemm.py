"""grouped_gemm: the loop reference and torch's grouped GEMM against a float64 loop, forward and backward."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.moe import grouped_gemm

# segments of 5, 0 (an expert without rows), 7 and 4 rows, then 4 rows past offsets[-1] (no expert)
OFFSETS = [5, 5, 12, 16]
ROWS, K, M = 20, 8, 16


def _float64(x, w, offsets):
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offsets):
        y[start:end] = x[start:end].double() @ w[g].double().t()
        start = end
    return y


def _inputs(dtype, device="cpu"):
    x = torch.randn(ROWS, K, device=device).to(dtype).requires_grad_(True)
    w = torch.randn(len(OFFSETS), M, K, device=device).to(dtype).requires_grad_(True)
    return x, w, torch.tensor(OFFSETS, dtype=torch.int32, device=device)


def _check(backend, dtype, device="cpu", rtol=1e-5, atol=1e-5, tail_rows=None):
    x, w, offsets = _inputs(dtype, device)
    y = grouped_gemm(x, w, offsets, backend=backend, tail_rows=tail_rows)
    assert y.dtype == dtype and y.shape == (ROWS, M)
    x64, w64 = (t.detach().cpu().double().requires_grad_(True) for t in (x, w))
    want = _float64(x64, w64, OFFSETS)
    torch.testing.assert_close(y.cpu().double(), want, rtol=rtol, atol=atol * want.abs().max().item())
    probe = torch.randn(ROWS, M, device=device).to(dtype)
    (y.float() * probe.float()).sum().backward()
    (want * probe.cpu().double()).sum().backward()
    for ours, ref in ((x, x64), (w, w64)):
        scale = ref.grad.abs().max().item()
        torch.testing.assert_close(ours.grad.cpu().double(), ref.grad, rtol=rtol, atol=atol * scale)
    assert torch.all(x.grad[OFFSETS[-1] :] == 0) and torch.all(w.grad[1] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_float64(dtype):
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    _check("reference", dtype, rtol=tol, atol=tol)


def test_torch_grouped_mm_on_cpu_matches_float64():
    # torch's grouped GEMM also runs on CPU (fp32, 16-byte aligned rows): the same backward code as on CUDA
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    _check("grouped_mm", torch.float32)


@pytest.mark.parametrize("tail_rows", [4, 7])
def test_tail_rows_hint_still_zeroes_the_unused_rows(tail_rows):
    # the plan says at most tail_rows last rows lie past offsets[-1] (here exactly 4): only those are cleared
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    _check("grouped_mm", torch.float32, tail_rows=tail_rows)
    with pytest.raises(ValueError, match="tail_rows must be an int >= 0"):
        grouped_gemm(*_inputs(torch.float32), tail_rows=-1)


def test_default_backend_off_cuda_is_the_reference(spy):
    calls = spy("mcore.kernels.grouped_gemm", "_reference_forward")
    x, w, offsets = _inputs(torch.float32)
    grouped_gemm(x, w, offsets)
    assert len(calls) == 1


def test_bad_inputs():
    x, w, offsets = _inputs(torch.float32)
    with pytest.raises(ValueError, match="same K"):
        grouped_gemm(x[:, :4], w, offsets)
    with pytest.raises(ValueError, match="offsets must be int32"):
        grouped_gemm(x, w, offsets.long())
    with pytest.raises(TypeError, match="share a float16/bfloat16/float32 dtype"):
        grouped_gemm(x, w.double(), offsets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_grouped_mm_matches_float64_without_host_sync():
    x, w, offsets = _inputs(torch.bfloat16, "cuda")
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host copy raises
    try:
        y = grouped_gemm(x, w, offsets)
        y.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check(None, torch.bfloat16, "cuda", rtol=1.6e-2, atol=1.6e-2)
    _check(None, torch.bfloat16, "cuda", rtol=1.6e-2, atol=1.6e-2, tail_rows=4)  # only the last 4 rows cleared


@pytest.mark.parametrize("backend", ["reference", "grouped_mm"])
def test_grouped_gemm_of_activation_matches_float64_and_keeps_h_only(backend):
    from mcore.kernels import swiglu
    from mcore.kernels.moe import grouped_gemm_of_activation

    if backend == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    h = torch.randn(ROWS, 2 * K, requires_grad=True)
    w = torch.randn(len(OFFSETS), M, K, requires_grad=True)
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = grouped_gemm_of_activation(h, w, offsets, swiglu, backend=backend)
    # what backward keeps: h, the weight, the offsets; not the [ROWS, K] activation
    assert sorted(tuple(t.shape) for t in saved) == sorted([(ROWS, 2 * K), (len(OFFSETS), M, K), (len(OFFSETS),)])
    h64, w64 = (t.detach().double().requires_grad_(True) for t in (h, w))
    gate, up = h64.chunk(2, dim=-1)
    want = _float64(torch.nn.functional.silu(gate) * up, w64, OFFSETS)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    probe = torch.randn(ROWS, M)
    (y * probe).sum().backward()
    (want * probe.double()).sum().backward()
    for ours, ref in ((h, h64), (w, w64)):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-5, atol=1e-5 * ref.grad.abs().max().item())
    assert torch.all(h.grad[OFFSETS[-1] :] == 0)


def test_grouped_gemm_of_activation_equals_the_unfused_composition():
    from mcore.kernels import swiglu
    from mcore.kernels.moe import grouped_gemm_of_activation

    h = torch.randn(ROWS, 2 * K, requires_grad=True)
    w = torch.randn(len(OFFSETS), M, K, requires_grad=True)
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    probe = torch.randn(ROWS, M)
    fused = grouped_gemm_of_activation(h, w, offsets, swiglu, backend="reference")
    dh, dw = torch.autograd.grad((fused * probe).sum(), (h, w))
    plain = grouped_gemm(swiglu(h), w, offsets, backend="reference")
    dh0, dw0 = torch.autograd.grad((plain * probe).sum(), (h, w))
    assert torch.equal(fused, plain) and torch.equal(dh, dh0) and torch.equal(dw, dw0)
    with pytest.raises(ValueError, match="2-D"):
        grouped_gemm_of_activation(h[0], w, offsets, swiglu)


def _wgrad_into_case(backend, dtype, accumulate, with_activation):
    """w's gradient taken into a target of the caller's (fp32): written (the target starts as NaN, so a read or an
    expert left unwritten shows) or added to a random start; against the float64 loop."""
    from mcore.kernels import swiglu
    from mcore.kernels.moe import grouped_gemm_of_activation

    width = 2 * K if with_activation else K
    x = torch.randn(ROWS, width).to(dtype).requires_grad_(True)
    w = torch.randn(len(OFFSETS), M, K).to(dtype).requires_grad_(True)
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    start = torch.randn(w.shape) if accumulate else torch.full(w.shape, float("nan"))
    target, calls = start.clone(), []
    into = lambda: calls.append(1) or (target, accumulate)  # noqa: E731
    if with_activation:
        y = grouped_gemm_of_activation(x, w, offsets, swiglu, backend=backend, wgrad_into=into)
    else:
        y = grouped_gemm(x, w, offsets, backend=backend, wgrad_into=into)
    probe = torch.randn(ROWS, M)
    (y.float() * probe).sum().backward()
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
    a64 = torch.nn.functional.silu(x64[:, :K]) * x64[:, K:] if with_activation else x64
    (_float64(a64, w64, OFFSETS) * probe.double()).sum().backward()
    assert w.grad is None and len(calls) == 1  # the gradient went into the target, asked for once
    want = w64.grad + (start.double() if accumulate else 0)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(target.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    if not accumulate:
        assert torch.all(target[1] == 0)  # the expert without rows: written as zeros
    assert torch.all(x.grad[OFFSETS[-1] :] == 0)


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "add"])
@pytest.mark.parametrize("with_activation", [False, True], ids=["gemm", "of_activation"])
@pytest.mark.parametrize(
    "backend,dtype",
    [("reference", torch.float32), ("reference", torch.bfloat16), ("grouped_mm", torch.float32),
     ("grouped_mm", torch.bfloat16)],
)  # fmt: skip
def test_weight_gradient_into_a_target_of_the_caller(backend, dtype, accumulate, with_activation):
    if backend == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    _wgrad_into_case(backend, dtype, accumulate, with_activation)


def test_wgrad_into_none_returns_the_gradient_and_a_bad_target_is_named():
    x, w, offsets = _inputs(torch.float32)
    y = grouped_gemm(x, w, offsets, wgrad_into=lambda: None)
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
    y = grouped_gemm(x, w, offsets, wgrad_into=lambda: (torch.zeros(2, 3), False))
    with pytest.raises(
        ValueError, match=r"wgrad_into must give a float tensor of w's shape \(4, 16, 8\), got \(2, 3\)"
    ):
        y.sum().backward()
