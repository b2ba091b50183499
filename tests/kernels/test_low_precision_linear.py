"""FP8 GEMMs against float64 products of the dequantized operands; low-precision linears through autograd."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.fp8_casts import quantize_fp8_pair
from mcore.kernels.fp8_gemm import blockwise_scales, scaled_matmul
from mcore.kernels.low_precision_linear import (
    EMULATED_RECIPES,
    FP8_RECIPES,
    RECIPES,
    AmaxHistory,
    LowPrecisionLinear,
    Recipe,
    recipe_shape_problem,
)
from mcore.kernels.quantization import E4M3, E5M2, quantize_fp8

PAIRS = [("tensor", "tensor"), ("row", "row"), ("1x128", "128x128"), ("1x128", "1x128")]
# relative error (Frobenius) of y, dx, dW against float64 F.linear: fp8 e4m3 ~ 2^-4 per element, averaged down
TOLERANCE = {"tensorwise": 0.08, "delayed": 0.08, "rowwise": 0.08, "blockwise": 0.08, "mxfp8": 0.08}
TOLERANCE.update(mxfp4=0.3, nvfp4=0.25)


def _operands(m, n, k, gen, device="cpu"):
    a = torch.randn(m, k, generator=gen).to(device) * torch.logspace(-1, 1, k, device=device)
    b = torch.randn(n, k, generator=gen).to(device)
    return a, b


@pytest.mark.parametrize("pair", PAIRS)
def test_reference_gemm_is_the_float64_product_of_the_dequantized_operands(pair):
    gen = torch.Generator().manual_seed(0)
    a, b = _operands(40, 136, 256, gen)
    qa = quantize_fp8(a, E4M3, pair[0])
    qb = quantize_fp8(b, E5M2, pair[1])
    out = scaled_matmul(qa, qb, out_dtype=torch.float32)
    expected = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    # and the quantization error of the whole product is what fp8 allows
    assert (out.double() - a.double() @ b.double().t()).norm() / (a.double() @ b.double().t()).norm() < 0.1


def test_gemm_rejects_mismatched_operands():
    a = quantize_fp8(torch.randn(4, 32))
    with pytest.raises(ValueError, match="must share K"):
        scaled_matmul(a, quantize_fp8(torch.randn(4, 16)))
    with pytest.raises(ValueError, match="unsupported scale pair"):
        scaled_matmul(a, quantize_fp8(torch.randn(4, 32), granularity="row"))


@pytest.mark.parametrize("k", [128, 384, 512, 640])
def test_blockwise_scales_are_in_the_layouts_torchs_block_scaled_mm_checks(k):
    """torch's ``_scaled_mm_v2`` rules (CUDA-only code, so checked here by shape and stride): 1x128 scales
    ``[R, K/128]`` R-major; 128x128 scales of b ``[round_up(K/128, 4), N/128]`` with strides ``(1, round_up)``."""
    gen = torch.Generator().manual_seed(4)
    m, n, kb = 48, 256, k // 128
    a = quantize_fp8(torch.randn(m, k, generator=gen), E4M3, "1x128")
    for granularity in ("128x128", "1x128"):
        b = quantize_fp8(torch.randn(n, k, generator=gen), E4M3, granularity)
        scale_a, scale_b = blockwise_scales(a, b)
        assert scale_a.shape == (m, kb) and (scale_a.stride() == (1, m) or kb == 1) and scale_a.stride(0) == 1
        assert torch.equal(scale_a, a.scale)
        if granularity == "1x128":
            assert scale_b.shape == (n, kb) and scale_b.stride(0) == 1 and (kb == 1 or scale_b.stride(1) == n)
            assert torch.equal(scale_b, b.scale)
            continue
        padded = -(-kb // 4) * 4
        assert scale_b.shape == (padded, n // 128) and scale_b.stride() == (1, padded)
        assert torch.equal(scale_b[:kb], b.scale.t())  # the padding rows follow the real K blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("m, n, k", [(256, 384, 512), (128, 256, 384), (256, 128, 128)])
def test_cuda_scaled_mm_equals_the_reference(pair, m, n, k):
    """Also K/128 = 3 and 1 (the 128x128 scales' padded column) and a single N block."""
    gen = torch.Generator().manual_seed(0)
    a, b = _operands(m, n, k, gen, "cuda")
    qa, qb = quantize_fp8(a, E4M3, pair[0]), quantize_fp8(b, E4M3, pair[1])
    fast = scaled_matmul(qa, qb, out_dtype=torch.bfloat16, backend="scaled_mm")  # torch's kernels, no fallback
    ref = scaled_matmul(qa, qb, out_dtype=torch.float32, backend="reference")
    torch.testing.assert_close(fast.float(), ref, rtol=1.6e-2, atol=1.6e-2 * ref.abs().max().item())


def test_a_block_pair_torch_refuses_falls_back_to_the_triton_gemm(interpreter, monkeypatch, caplog):
    import mcore.kernels.fp8_gemm as fp8_gemm

    def refuse(a, b, out_dtype, out=None):
        raise ValueError("Invalid scaling configuration.")

    monkeypatch.setattr(fp8_gemm, "_blockwise_cuda", refuse)
    monkeypatch.setattr(fp8_gemm, "_CUBLAS_REFUSED", set())
    monkeypatch.setattr(fp8_gemm, "_choose", lambda a, b, backend: backend or fp8_gemm.CUDA_BACKEND)  # as on CUDA
    gen = torch.Generator().manual_seed(7)
    a, b = _operands(128, 128, 256, gen)
    qa, qb = _stand_in(quantize_fp8(a, E4M3, "1x128")), _stand_in(quantize_fp8(b, E4M3, "1x128"))
    with caplog.at_level("WARNING", logger="mcore.kernels"):
        got = scaled_matmul(qa, qb, out_dtype=torch.float32)
    assert {("1x128", "1x128")} == fp8_gemm._CUBLAS_REFUSED and "using mcore's Triton GEMM" in caplog.text
    want = scaled_matmul(qa, qb, out_dtype=torch.float32, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with pytest.raises(ValueError, match="Invalid scaling"):
        scaled_matmul(qa, qb, backend="scaled_mm")  # asked for torch's kernel: no fallback


def _stand_in(q):
    """``q`` with its fp8 values held in fp16 (exact: fp16 holds every e4m3 and e5m2 value): the interpreter's dot
    does not take fp8."""
    return type(q)(q.data.to(torch.float16), q.scale, q.granularity)


@pytest.mark.parametrize("b_granularity", ["128x128", "1x128"])
@pytest.mark.parametrize("m, n, k", [(200, 256, 384), (64, 136, 320)])  # partial tiles along every dimension
def test_triton_block_scaled_gemm_math_under_the_interpreter(interpreter, b_granularity, m, n, k):
    gen = torch.Generator().manual_seed(5)
    a, b = _operands(m, n, k, gen)
    qa, qb = quantize_fp8(a, E5M2, "1x128"), quantize_fp8(b, E4M3, b_granularity)
    got = scaled_matmul(_stand_in(qa), _stand_in(qb), out_dtype=torch.float32, backend="triton")
    want = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with pytest.raises(ValueError, match="block-scaled pairs only"):
        scaled_matmul(quantize_fp8(a), quantize_fp8(b), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b_granularity", ["128x128", "1x128"])
@pytest.mark.parametrize("a_format", [E4M3, E5M2])
def test_cuda_triton_block_scaled_gemm_equals_the_reference(cuda_triton, b_granularity, a_format):
    """Real fp8 dots (mixed formats upcast); the default backend takes it for an e5m2 operand, refused by cuBLAS."""
    gen = torch.Generator().manual_seed(6)
    a, b = _operands(384, 256, 640, gen, "cuda")
    qa, qb = quantize_fp8(a, a_format, "1x128"), quantize_fp8(b, E4M3, b_granularity)
    ref = scaled_matmul(qa, qb, out_dtype=torch.float32, backend="reference")
    for backend in ("triton", None):
        fast = scaled_matmul(qa, qb, out_dtype=torch.bfloat16, backend=backend)
        torch.testing.assert_close(fast.float(), ref, rtol=1.6e-2, atol=1.6e-2 * ref.abs().max().item())
    if a_format == E5M2:
        with pytest.raises(ValueError, match="e4m3 operands only"):
            scaled_matmul(qa, qb, backend="scaled_mm")


def _float64_linear(x, w, b, g):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y = torch.nn.functional.linear(x64, w64, None if b is None else b.detach().double())
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad


@pytest.mark.parametrize("name", FP8_RECIPES + EMULATED_RECIPES)  # bitnet: test_bitnet.py
def test_linear_through_autograd_tracks_float64(name):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, 256, generator=gen).requires_grad_()
    w = (torch.randn(384, 256, generator=gen) * 0.05).requires_grad_()
    b = torch.randn(384, generator=gen).requires_grad_()
    g = torch.randn(2, 64, 384, generator=gen)
    w_before = w.detach().clone()
    layer = LowPrecisionLinear(Recipe(name))
    y = layer(x, w, b)
    y.backward(g)
    y64, dx64, dw64 = _float64_linear(x, w, b, g)
    for got, want in ((y, y64), (x.grad, dx64), (w.grad, dw64)):
        rel = (got.detach().double() - want).norm() / want.norm()
        assert rel < TOLERANCE[name], (name, rel.item())
    assert w.grad.dtype == w.dtype and torch.equal(w.detach(), w_before)
    torch.testing.assert_close(b.grad, g.sum((0, 1)))


def test_linear_is_not_the_high_precision_linear():
    """The recipe really quantizes: the result differs from fp32 by more than rounding noise."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(32, 128, generator=gen), torch.randn(64, 128, generator=gen)
    exact = x @ w.t()
    for name in RECIPES:
        assert (LowPrecisionLinear(Recipe(name))(x, w) - exact).abs().max() > 1e-3, name


def test_tensorwise_keeps_only_fp8_tensors_for_backward():
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    y = LowPrecisionLinear(Recipe("tensorwise"))(x, w)
    saved = [t for t in y.grad_fn.saved_tensors if t.dim() == 2]
    assert {t.dtype for t in saved} == {E4M3}


def test_delayed_history_uses_the_window_max():
    h = AmaxHistory(length=2, compute="max")
    assert h.scale_amax() is None  # nothing recorded yet: the caller measures the current amax
    for recorded, expected in ((3.0, 3.0), (1.0, 3.0), (2.0, 2.0), (0.5, 2.0)):
        h.record(torch.tensor(recorded))
        assert h.scale_amax().item() == expected  # the window of the last two: [3], [3, 1], [1, 2], [2, 0.5]
    recent = AmaxHistory(length=4, compute="most_recent")
    recent.record(torch.tensor(5.0))
    recent.record(torch.tensor(1.0))
    assert recent.scale_amax().item() == 1.0


def test_pair_reports_the_amax_of_the_input(interpreter):
    x = torch.randn(40, 72) * 3
    for backend in ("reference", "triton"):
        for amax in (None, torch.tensor(2.0)):
            out = torch.full((), -1.0)
            quantize_fp8_pair(x, E4M3, amax=amax, amax_out=out, backend=backend)
            assert out.item() == x.abs().max().item(), (backend, amax)


def test_delayed_scaling_lags_by_one_call():
    layer = LowPrecisionLinear(Recipe("delayed", amax_history_len=1))
    w = torch.randn(16, 32)
    layer(torch.randn(4, 32), w)
    big = torch.randn(4, 32) * 1000
    # scaled with the previous (small) amax: the large input saturates, so the output is far off
    err = (layer(big, w) - big @ w.t()).norm() / (big @ w.t()).norm()
    assert err > 0.5


def test_delayed_recast_follows_an_input_that_outgrew_its_history():
    """The same jump with ``delayed_overflow="recast"``: the large input is cast again from its own amax, so the
    output is the current-scaling one's (fp8 rounding only); every operand's history is told to recast."""
    layer = LowPrecisionLinear(Recipe("delayed", amax_history_len=1, delayed_overflow="recast"))
    current = LowPrecisionLinear(Recipe("tensorwise", grad_format="e5m2"))
    assert {h.overflow for h in layer.histories.values()} == {"recast"}
    w = torch.randn(16, 32)
    layer(torch.randn(4, 32), w)
    big = torch.randn(4, 32) * 1000
    assert torch.equal(layer(big, w), current(big, w))
    err = (layer(big, w) - big @ w.t()).norm() / (big @ w.t()).norm()
    assert err < 0.1


@pytest.mark.parametrize(
    "recipe, shape, rule",
    [
        ("tensorwise", (64, 40), "K=40 must be a multiple of 16"),
        ("blockwise", (128, 192), "K=192 must be a multiple of 128"),
        ("blockwise", (64, 128), "N=64 must be a multiple of 128"),
        ("nvfp4", (32, 24), "in_features \\(K\\)=24 must be a multiple of 16"),
        ("mxfp4", (48, 64), "out_features \\(N\\)=48 must be a multiple of 32"),
    ],
)
def test_shape_rules_name_the_dimension(recipe, shape, rule):
    problem = recipe_shape_problem(Recipe(recipe), *shape)
    assert problem is not None and __import__("re").search(rule, problem)
    assert recipe_shape_problem(Recipe(recipe), 256, 256) is None


def test_bad_recipe_fields():
    with pytest.raises(ValueError, match="Recipe.name must be one of"):
        Recipe("fp8")
    with pytest.raises(ValueError, match="unknown fp8 format"):
        Recipe("rowwise", grad_format="e4m4")
    with pytest.raises(ValueError, match="amax_history_len"):
        Recipe("delayed", amax_history_len=0)
    with pytest.raises(ValueError, match=r"Recipe.delayed_overflow must be one of \('saturate', 'recast'\), got 'x'"):
        Recipe("delayed", delayed_overflow="x")
    with pytest.raises(ValueError, match="delayed_overflow='recast' applies to the 'delayed' recipe only.*'rowwise'"):
        Recipe("rowwise", delayed_overflow="recast")
    assert Recipe().delayed_overflow == "saturate"
    # gradient formats by default: e5m2 under a delayed (history) scale, e4m3 where the tensor's own amax scales it
    assert [Recipe(n).grad_format for n in FP8_RECIPES] == ["e4m3", "e5m2", "e4m3", "e4m3"]
    with pytest.raises(ValueError, match="does not match weight"):
        LowPrecisionLinear(Recipe())(torch.randn(2, 8), torch.randn(4, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise", "blockwise"])
def test_cuda_linear_equals_the_reference_path(name):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 1024, generator=gen).cuda().bfloat16()
    w = (torch.randn(768, 1024, generator=gen) * 0.03).cuda().bfloat16()
    g = torch.randn(512, 768, generator=gen).cuda().bfloat16()
    outs = []
    for backend in (None, "reference"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = LowPrecisionLinear(Recipe(name), backend=backend)(xi, wi)
        y.backward(g)
        outs.append((y.float(), xi.grad.float(), wi.grad.float()))
    for fast, ref in zip(*outs, strict=True):
        torch.testing.assert_close(fast, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pair_measures_the_amax_while_casting(cuda_triton):
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) * 3
    out = torch.zeros((), device="cuda")
    q, q_t = quantize_fp8_pair(x, E4M3, amax=torch.tensor(2.0, device="cuda"), amax_out=out, backend="triton")
    assert out.item() == x.float().abs().max().item()
    ref = quantize_fp8(x, E4M3, amax=torch.tensor(2.0, device="cuda"), backend="reference")
    assert torch.equal(q.data.float(), ref.data.float()) and torch.equal(q_t.data.float(), ref.data.float().t())
