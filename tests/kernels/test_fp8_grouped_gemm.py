"""fp8_grouped_gemm: row-wise / jagged scales against float64, the reference GEMMs against float64 products of the
dequantized operands, autograd against the float64 grouped GEMM, the Triton jagged cast against its reference."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.activations import swiglu
from mcore.kernels.fp8_grouped_gemm import (
    SCALED_GROUPED_MM,
    fp8_grouped_gemm,
    fp8_grouped_gemm_of_activation,
    jagged_transpose_quantize,
    quantize_expert_weights,
    quantize_expert_weights_dual,
    row_groups,
)
from mcore.kernels.quantization import E4M3

# experts of 32, 0 (no rows), 48 and 16 rows, then 16 rows past offsets[-1] (no expert): multiples of 16
OFFSETS = [32, 32, 80, 96]
ROWS, K, N = 112, 64, 48


def _float64_grouped(x, w, offsets):
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets):
        y[start:end] = x[start:end].double() @ w[e].double().t()
        start = end
    return y


def _inputs(device="cpu", dtype=torch.float32, seed=0, rows=ROWS):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, K, generator=gen) * torch.logspace(-1, 1, K)).to(device, dtype).requires_grad_()
    w = (torch.randn(len(OFFSETS), N, K, generator=gen) * 0.1).to(device, dtype).requires_grad_()
    return x, w, torch.tensor(OFFSETS, dtype=torch.int32, device=device)


def test_row_groups_name_each_rows_expert():
    groups = row_groups(torch.tensor(OFFSETS, dtype=torch.int32), ROWS)
    want = [0] * 32 + [2] * 48 + [3] * 16 + [4] * 16  # 4 = no expert
    assert groups.tolist() == want


def test_jagged_scales_are_the_amax_of_each_experts_rows():
    x, _, offsets = _inputs()
    t = x.detach()
    t[OFFSETS[-1] :] = 1e6  # rows of no expert: they must not enter any scale
    data, scale = jagged_transpose_quantize(t, offsets, row_groups(offsets, ROWS), "reference")
    assert data.shape == (K, ROWS) and data.dtype == E4M3 and scale.shape == (len(OFFSETS) + 1, K)
    start = 0
    for e, end in enumerate([*OFFSETS, ROWS]):
        if end == start or e == len(OFFSETS):
            assert torch.all(scale[e] == 1.0)  # no rows: the all-zero group's scale
            continue
        amax = t[start:end].double().abs().amax(0)
        torch.testing.assert_close(scale[e].double(), amax / 448.0, rtol=1e-6, atol=0)
        # every element of the expert dequantizes to itself within e4m3's relative step (2^-3 / 2)
        deq = data[:, start:end].double() * scale[e].double().unsqueeze(1)
        assert ((deq - t[start:end].double().t()).abs() <= amax.unsqueeze(1) * 2**-4 + 1e-12).all()
        start = end


def test_triton_jagged_cast_equals_the_reference(interpreter):
    x, _, offsets = _inputs(seed=1)
    t = x.detach().to(torch.float16)[:104]  # 104 rows: the transposed rows get padded to 16 bytes
    groups = row_groups(offsets, t.shape[0])
    t[OFFSETS[-1] :] *= 1000  # rows of no expert: left out of every scale by both
    ref = jagged_transpose_quantize(t, offsets, groups, "reference")
    tri = jagged_transpose_quantize(t, offsets, groups, SCALED_GROUPED_MM)  # the CUDA path's Triton kernels
    assert tri[0].shape == (K, 112) and torch.all(tri[0][:, 104:].float() == 0)  # tokens padded to 16
    assert torch.equal(tri[0][:, :104].float(), ref[0].float()) and torch.equal(tri[1], ref[1])


def test_expert_weights_quantized_along_their_reduction_dims():
    _, w, _ = _inputs()
    w = w.detach()
    for transpose, dim in ((False, 2), (True, 1)):
        q = quantize_expert_weights(w, transpose=transpose, backend="reference")
        amax = w.double().abs().amax(dim)  # [E, N] along K, [E, K] along N
        torch.testing.assert_close(q.scale.double(), amax / 448.0, rtol=1e-6, atol=0)
        deq = q.data.double() * q.scale.double().unsqueeze(-1)
        want = w.double().transpose(1, 2) if transpose else w.double()
        assert ((deq - want).abs() <= amax.unsqueeze(-1) * 2**-4 + 1e-12).all()


def test_triton_dual_expert_weight_cast_is_the_bits_of_the_two_single_casts(interpreter):
    """The CUDA path's one pass per expert for ``w`` and ``w^T``, written into the stacked outputs."""
    _, w, _ = _inputs(seed=7)
    w = w.detach().to(torch.float16)
    q, q_t = quantize_expert_weights_dual(w, SCALED_GROUPED_MM)
    for got, transpose in ((q, False), (q_t, True)):
        want = quantize_expert_weights(w, transpose=transpose, backend="reference")
        assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("tail_rows", [None, 16])
def test_rows_past_the_last_offset_stay_out_of_the_gradients(tail_rows):
    """Whatever the output gradient holds in the rows of no expert (NaN here), dx there is zero and dw as with
    zeros there: those rows are never masked, only left out."""
    grads = []
    for poison in (0.0, float("nan")):
        x, w, offsets = _inputs(seed=8)
        y = fp8_grouped_gemm(x, w, offsets, tail_rows=tail_rows)
        dy = torch.randn(ROWS, N, generator=torch.Generator().manual_seed(9))
        dy[OFFSETS[-1] :] = poison
        y.backward(dy)
        assert torch.all(y[OFFSETS[-1] :] == 0) and torch.all(x.grad[OFFSETS[-1] :] == 0)
        grads.append((x.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_reference_forward_is_the_float64_product_of_the_dequantized_operands():
    x, w, offsets = _inputs()
    y = fp8_grouped_gemm(x, w, offsets, backend="reference")
    from mcore.kernels.quantization import quantize_fp8

    qx = quantize_fp8(x.detach(), E4M3, "row")
    qw = quantize_expert_weights(w.detach(), transpose=False, backend="reference")
    want = _float64_grouped(qx.dequantize(torch.float64), qw.data.double() * qw.scale.double()[..., None], OFFSETS)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert torch.all(y[OFFSETS[-1] :] == 0)


def test_autograd_tracks_the_float64_grouped_gemm_and_really_quantizes():
    x, w, offsets = _inputs(seed=2)
    y = fp8_grouped_gemm(x, w, offsets)  # CPU: the reference
    probe = torch.randn(ROWS, N, generator=torch.Generator().manual_seed(5))
    (y * probe).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = _float64_grouped(x64, w64, OFFSETS)
    (want * probe.double()).sum().backward()
    for got, ref in ((y, want), (x.grad, x64.grad), (w.grad, w64.grad)):
        rel = ((got.detach().double() - ref).norm() / ref.norm()).item()
        assert 1e-4 < rel < 0.08, rel  # fp8 error: present, and what e4m3 allows
    assert torch.all(x.grad[OFFSETS[-1] :] == 0) and torch.all(w.grad[1] == 0)  # no expert / an empty expert


def test_bad_inputs_are_named():
    x, w, offsets = _inputs()
    with pytest.raises(ValueError, match="same K"):
        fp8_grouped_gemm(x[:, :32], w, offsets)
    with pytest.raises(ValueError, match="needs CUDA"):
        fp8_grouped_gemm(x, w, offsets, backend=SCALED_GROUPED_MM)


def _gemm_case(with_activation: bool, device="cpu", dtype=torch.float32, seed=10, wgrad_into=None, backend=None):
    """Forward and backward of a fresh random case (``h`` [ROWS, 2K] through SwiGLU, or ``x``): (y, d input, w)."""
    gen = torch.Generator().manual_seed(seed)
    x, w, offsets = _inputs(device, dtype, seed=seed)
    if with_activation:
        x = torch.randn(ROWS, 2 * K, generator=gen).to(device, dtype).requires_grad_()
        y = fp8_grouped_gemm_of_activation(x, w, offsets, swiglu, backend=backend, wgrad_into=wgrad_into)
    else:
        y = fp8_grouped_gemm(x, w, offsets, backend=backend, wgrad_into=wgrad_into)
    y.backward(torch.randn(ROWS, N, generator=gen).to(device, dtype))
    return y.detach(), x.grad, w


@pytest.mark.parametrize("with_activation", [False, True], ids=["gemm", "of_activation"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "add"])
def test_weight_gradient_into_a_target_equals_the_returned_one(accumulate, with_activation):
    """Written: the NaN-filled target ends as the returned gradient, bit for bit (so it is never read, and the
    empty expert 1 gets zeros); added: target + that gradient. Output and input gradient unchanged."""
    y0, dx0, w0 = _gemm_case(with_activation)
    assert torch.any(w0.grad[0] != 0) and torch.all(w0.grad[1] == 0)
    start = torch.randn(w0.shape, generator=torch.Generator().manual_seed(11)) if accumulate else None
    target, calls = torch.full(w0.shape, float("nan")) if start is None else start.clone(), []
    y, dx, w = _gemm_case(with_activation, wgrad_into=lambda: calls.append(1) or (target, accumulate))
    assert w.grad is None and calls == [1]  # asked once, the gradient is in the target
    assert torch.equal(y, y0) and torch.equal(dx, dx0)
    assert torch.equal(target, start + w0.grad if accumulate else w0.grad)


def test_wgrad_into_none_returns_the_gradient_and_a_writer_or_a_bad_target_is_named():
    _, _, w = _gemm_case(False, wgrad_into=lambda: None)
    assert w.grad is not None and w.grad.shape == w.shape
    with pytest.raises(ValueError, match=r"fp8_grouped_gemm: wgrad_into gave a writer function"):
        _gemm_case(False, wgrad_into=lambda: lambda dy, x: None)
    with pytest.raises(ValueError, match=r"fp8_grouped_gemm: wgrad_into must give a float tensor of w's shape"):
        _gemm_case(True, wgrad_into=lambda: (torch.zeros(2, 3), False))


def test_of_activation_equals_fp8_gemm_of_the_activation_and_keeps_h_only():
    x, w, offsets = _inputs(seed=12)
    h = torch.randn(ROWS, 2 * K, generator=torch.Generator().manual_seed(13), requires_grad=True)
    probe = torch.randn(ROWS, N, generator=torch.Generator().manual_seed(14))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused = fp8_grouped_gemm_of_activation(h, w, offsets, swiglu)
    # kept: h, the offsets and w^T's fp8 cast with its scales; not the [ROWS, K] activation
    want = [(ROWS, 2 * K), (len(OFFSETS),), (len(OFFSETS), K, N), (len(OFFSETS), K)]
    assert sorted(tuple(t.shape) for t in saved) == sorted(want)
    dh, dw = torch.autograd.grad((fused * probe).sum(), (h, w))
    plain = fp8_grouped_gemm(swiglu(h), w, offsets)
    dh0, dw0 = torch.autograd.grad((plain * probe).sum(), (h, w))
    assert torch.equal(fused, plain) and torch.equal(dh, dh0) and torch.equal(dw, dw0)
    assert torch.any(dh != 0) and torch.all(dh[OFFSETS[-1] :] == 0)
    with pytest.raises(ValueError, match="fp8_grouped_gemm_of_activation: h must be a 2-D"):
        fp8_grouped_gemm_of_activation(h[0], w, offsets, swiglu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, tail_rows", [(ROWS, None), (104, None), (ROWS, 16)])  # 104: not a multiple of 16
def test_cuda_scaled_grouped_mm_equals_the_reference_path(cuda_triton, rows, tail_rows):
    outs = []
    for backend in (None, "reference"):
        x, w, offsets = _inputs("cuda", torch.bfloat16, seed=3, rows=rows)
        y = fp8_grouped_gemm(x, w, offsets, backend=backend, tail_rows=tail_rows)
        dy = torch.randn(rows, N, generator=torch.Generator().manual_seed(6)).cuda().bfloat16()
        dy[OFFSETS[-1] :] = float("nan")  # rows of no expert: left out, never masked
        y.backward(dy)
        outs.append((y.float(), x.grad.float(), w.grad.float()))
    assert torch.all(outs[0][0][OFFSETS[-1] :] == 0) and torch.all(outs[0][1][OFFSETS[-1] :] == 0)
    for fast, ref in zip(*outs, strict=True):
        torch.testing.assert_close(fast, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_grouped_gemm_needs_no_host_sync(cuda_triton):
    x, w, offsets = _inputs("cuda", torch.bfloat16, seed=4)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8_grouped_gemm(x, w, offsets).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.all(w.grad[1] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_activation", [False, True], ids=["gemm", "of_activation"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "add"])
def test_cuda_weight_gradient_into_an_fp32_target_is_the_bf16_product(cuda_triton, accumulate, with_activation):
    """torch._scaled_grouped_mm's bf16 weight gradient copied (NaN target: not read) or added into fp32."""
    kw = dict(device="cuda", dtype=torch.bfloat16)
    y0, dx0, w0 = _gemm_case(with_activation, **kw)
    start = torch.randn(w0.shape, device="cuda") if accumulate else torch.full(w0.shape, float("nan"), device="cuda")
    target = start.clone()
    y, dx, w = _gemm_case(with_activation, wgrad_into=lambda: (target, accumulate), **kw)
    assert w.grad is None and torch.equal(y, y0) and torch.equal(dx, dx0)
    assert torch.equal(target, start + w0.grad.float() if accumulate else w0.grad.float())
