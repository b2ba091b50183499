"""Fused operand-and-transpose fp8 casts (``quantize_dual``) against float64 references, under the Triton
interpreter and on CUDA; the weight cast cache of the fp8 linears."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.fp8_casts import quantize_dual
from mcore.kernels.fp8_weight_cache import WeightCastCache
from mcore.kernels.low_precision_linear import FP8_RECIPES, LowPrecisionLinear, Recipe
from mcore.kernels.quantization import E4M3, E5M2, FP8_MAX, quantize_fp8
from tests.kernels.test_quantization import round_fp8_float64

GRANULARITIES = ("tensor", "row", "1x128", "128x128")
SHAPES = [(200, 300), (128, 256), (3, 130), (257, 129)]  # partial 128-blocks along each dimension, tiny ones


def _float64_groups(x64: torch.Tensor, granularity: str) -> list[tuple[slice, slice]]:
    rows, cols = x64.shape
    if granularity == "tensor":
        return [(slice(None), slice(None))]
    if granularity == "row":
        return [(slice(r, r + 1), slice(None)) for r in range(rows)]
    step_r = 1 if granularity == "1x128" else 128
    return [(slice(r, r + step_r), slice(c, c + 128)) for r in range(0, rows, step_r) for c in range(0, cols, 128)]


def float64_quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values as float64, per-element dequantization scale)`` of ``x`` along its last dim, written from the
    recipe: per group multiplier ``fp32(fmax / amax)`` (1 for an all-zero group), ``x * m`` rounded to fp32 (the
    kernels' math), then to the fp8 grid with saturation."""
    x64 = x.double()
    values = torch.empty_like(x64)
    scales = torch.empty_like(x64)
    for rs, cs in _float64_groups(x64, granularity):
        group = x64[rs, cs]
        amax = group.abs().max()
        mult = torch.tensor(FP8_MAX[dtype] / amax.item() if amax > 0 else 1.0).float().double()
        values[rs, cs] = round_fp8_float64((group * mult).float().double(), dtype)
        scales[rs, cs] = (1.0 / mult).float().double()
    return values, scales


def _inputs(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-2, 2, shape[0])[:, None]
    x[0, : min(3, shape[1])] = 0.0  # zeros, and an all-zero group where the row is short
    return x.to(dtype)


def _dequantized_scale(q) -> torch.Tensor:
    from mcore.kernels.quantization import expand_scale

    return expand_scale(q.scale, q.granularity, q.data.shape).double().expand(q.data.shape)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_dual_casts_match_float64_both_ways(interpreter, granularity, dtype):
    for shape in SHAPES:
        x = _inputs(shape)
        for backend in ("triton", "reference"):
            q, q_t = quantize_dual(x, dtype, granularity, backend=backend)
            for got, src in ((q, x), (q_t, x.t())):
                values, scales = float64_quantize(src, dtype, granularity)
                assert got.data.shape == src.shape and got.data.is_contiguous()
                torch.testing.assert_close(got.data.double(), values, rtol=0, atol=0)
                torch.testing.assert_close(_dequantized_scale(got), scales, rtol=0, atol=0)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_dual_casts_are_the_bits_of_the_single_casts(interpreter, granularity):
    """From bf16, with negative values that round to zero (-0): the bits of ``quantize_fp8`` of x and of x^T."""
    x = _inputs((130, 384), torch.bfloat16, seed=1)
    x[5, 7] = -1e-30
    q, q_t = quantize_dual(x, E4M3, granularity, backend="triton")
    for got, transpose in ((q, False), (q_t, True)):
        want = quantize_fp8(x, E4M3, granularity, transpose=transpose, backend="reference")
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), transpose
        assert got.scale.shape == want.scale.shape and torch.equal(got.scale, want.scale)
    alone, none = quantize_dual(x, E4M3, granularity, transposed=False, backend="triton")
    assert none is None and torch.equal(alone.data.view(torch.uint8), q.data.view(torch.uint8))


def _both_block_paths(x, granularity, monkeypatch):
    """``quantize_dual`` of ``x`` through the fused block kernel and through two single casts (``DUAL_PATH``)."""
    import mcore.kernels.fp8_casts as fp8_casts

    out = {}
    for path in ("fused", "two_casts"):
        monkeypatch.setitem(fp8_casts.DUAL_PATH, granularity, path)
        out[path] = [quantize_dual(x, dtype, granularity, backend="triton") for dtype in (E4M3, E5M2)]
    return out


def _same_bits(a, b) -> bool:
    """Equal bits except that NaNs (whose bit patterns may differ) only need to be NaN in both."""
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    bits_a, bits_b = a.view(torch.uint8).clone(), b.view(torch.uint8).clone()
    bits_a[nan_a], bits_b[nan_b] = 0, 0  # through uint8 views: CUDA has no float8 masked_fill_ (torch 2.11)
    return torch.equal(nan_a, nan_b) and torch.equal(bits_a, bits_b)


def _cast_tile_cases():
    from mcore.kernels.triton.quant_fused import TILE_CANDIDATES

    return [(name, tile) for name, tiles in TILE_CANDIDATES.items() for tile in tiles]


@pytest.mark.parametrize(
    "name,tile", _cast_tile_cases(), ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v
)
def test_every_sweep_candidate_cast_tile_gives_the_single_casts_bits(interpreter, monkeypatch, name, tile):
    """Each launch shape ``fp8.py --sweep-casts`` may make the default: the fused casts it shapes (tensor- and
    row-wise through ``quantize_dual``; 1x128 and 128x128 through the block kernel itself), on partial tiles of
    every candidate along both axes, give the reference single casts' bits."""
    import mcore.kernels.fp8_casts as fp8_casts
    from mcore.kernels.triton import quant_fused

    monkeypatch.setattr(quant_fused, name, tile)
    for granularity in ("1x128", "128x128"):
        monkeypatch.setitem(fp8_casts.DUAL_PATH, granularity, "fused")
    x = _inputs((257, 300), torch.bfloat16, seed=4)
    for granularity in ("1x128", "128x128") if name == "BLOCK_TILE" else ("tensor", "row"):
        q, q_t = quantize_dual(x, E4M3, granularity, backend="triton")
        for got, transpose in ((q, False), (q_t, True)):
            want = quantize_fp8(x, E4M3, granularity, transpose=transpose, backend="reference")
            assert _same_bits(got.data, want.data), (granularity, transpose)
            assert torch.equal(got.scale.reshape(want.scale.shape), want.scale), (granularity, transpose)


@pytest.mark.parametrize("granularity", ["1x128", "128x128"])
def test_the_fused_block_kernel_and_two_single_casts_give_the_same_bits(interpreter, granularity, monkeypatch):
    """``DUAL_PATH`` picks the faster of the two by measurement: whichever runs, the bits are the same."""
    x = _inputs((130, 384), torch.bfloat16, seed=3)
    x[5, 7] = -1e-30
    paths = _both_block_paths(x, granularity, monkeypatch)
    for fused, single in zip(paths["fused"], paths["two_casts"], strict=True):
        for a, b in zip(fused, single, strict=True):
            assert _same_bits(a.data, b.data) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("granularity", ["1x128", "128x128"])
@pytest.mark.parametrize("shape", [(130, 384), (256, 512), (384, 1152)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_block_scales_are_stored_as_cublas_reads_them_and_pass_without_a_copy(
    interpreter, granularity, shape, monkeypatch
):
    """Both block paths write their scales in ``empty_block_scale``'s layouts (1x128 R-major; 128x128 rows padded
    to 4 groups with ones), so ``blockwise_scales`` hands cuBLAS views of the same memory; the values stay those
    of the torch reference (K/128 = 3, 4 and 9: padded, unpadded and padded past one 16-byte group)."""
    from mcore.kernels.fp8_gemm import blockwise_scales

    x = _inputs(shape, torch.bfloat16, seed=6)
    for path, casts in _both_block_paths(x, granularity, monkeypatch).items():
        q, q_t = casts[0]
        for got, source in ((q, x), (q_t, x.t())):
            want = quantize_fp8(source, E4M3, granularity, backend="reference")
            assert torch.equal(got.scale, want.scale), (path, granularity)
            rows, groups = got.scale.shape
            if granularity == "1x128":
                assert got.scale.stride() == (1, rows), (path, got.scale.stride())
                scale_a, _ = blockwise_scales(got, got)
                assert scale_a.data_ptr() == got.scale.data_ptr() and scale_a.stride() == (1, rows)
                continue
            padded = -(-groups // 4) * 4
            assert got.scale.stride() == (padded, 1), (path, got.scale.stride())
            _, scale_b = blockwise_scales(quantize_fp8(torch.randn(64, got.shape[1]), E4M3, "1x128"), got)
            assert scale_b.data_ptr() == got.scale.data_ptr()
            assert scale_b.shape == (padded, rows) and scale_b.stride() == (1, padded)
            assert torch.equal(scale_b[:groups], want.scale.t()) and torch.all(scale_b[groups:] == 1)


def test_reference_block_scales_are_copied_into_the_cublas_layouts():
    """The torch reference's scales are plain row-major: ``blockwise_scales`` copies them into the layouts."""
    from mcore.kernels.fp8_gemm import blockwise_scales

    gen = torch.Generator().manual_seed(8)
    a = quantize_fp8(torch.randn(96, 384, generator=gen), E4M3, "1x128", backend="reference")
    b = quantize_fp8(torch.randn(256, 384, generator=gen), E4M3, "128x128", backend="reference")
    scale_a, scale_b = blockwise_scales(a, b)
    assert scale_a.stride() == (1, 96) and torch.equal(scale_a, a.scale)
    assert scale_b.shape == (4, 2) and scale_b.stride() == (1, 4)
    assert torch.equal(scale_b[:3], b.scale.t()) and torch.all(scale_b[3] == 1)


def test_dual_path_runs_what_it_says(interpreter, monkeypatch):
    from mcore.kernels.triton import quant_fused, quantization

    calls = []
    monkeypatch.setattr(quant_fused, "block_dual", lambda *a, **k: calls.append("fused") or _raise())
    monkeypatch.setattr(quantization, "quantize_blocks", lambda *a, **k: calls.append("single") or _raise())
    x = _inputs((128, 128), torch.bfloat16)
    for granularity, want in (("1x128", "single"), ("128x128", "fused")):
        with pytest.raises(_Ran):
            quantize_dual(x, E4M3, granularity, backend="triton")
        assert calls.pop() == want, granularity


class _Ran(Exception):
    pass


def _raise():
    raise _Ran


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_row_reductions_scale_each_side_by_its_own_amax(interpreter, backend):
    """``reduce_q`` sees the row amaxes, ``reduce_t`` the column amaxes (what another rank might raise)."""
    x = _inputs((64, 256))
    seen = {}

    def double(name):
        def reduce(t):
            seen[name] = t.reshape(-1).clone()
            t.mul_(2.0)

        return reduce

    q, q_t = quantize_dual(x, E4M3, "row", reduce_q=double("q"), reduce_t=double("t"), backend=backend)
    torch.testing.assert_close(seen["q"], x.abs().amax(1), rtol=0, atol=0)
    torch.testing.assert_close(seen["t"], x.abs().amax(0), rtol=0, atol=0)
    base, base_t = quantize_dual(x, E4M3, "row", backend=backend)
    torch.testing.assert_close(q.scale, base.scale * 2)
    torch.testing.assert_close(q_t.scale, base_t.scale * 2)
    tensor, _ = quantize_dual(x, E4M3, "tensor", reduce_t=double("tensor"), backend=backend)
    assert seen["tensor"].item() == x.abs().max().item()
    torch.testing.assert_close(tensor.scale, x.abs().max() * 2 / 448)
    with pytest.raises(ValueError, match="block scales must not span ranks"):
        quantize_dual(x, E4M3, "1x128", reduce_q=double("q"), backend=backend)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_delayed_scaling_casts_with_the_given_amax_and_measures_the_current(interpreter, backend):
    x = _inputs((96, 160))
    out = torch.zeros((), dtype=torch.float32)
    q, q_t = quantize_dual(x, E5M2, "tensor", amax=torch.tensor(3.0), amax_out=out, backend=backend)
    assert out.item() == x.abs().max().item()
    mult = torch.tensor(57344 / 3.0).float().double()  # scaled by the given amax: the larger values saturate
    torch.testing.assert_close(q.data.double(), round_fp8_float64((x.double() * mult).float(), E5M2), rtol=0, atol=0)
    assert q.scale.item() == torch.tensor(3.0 / 57344).item() and torch.equal(q_t.data.float(), q.data.float().t())
    with pytest.raises(ValueError, match="amax_out is one element"):
        quantize_dual(x, E4M3, "row", amax_out=out, backend=backend)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_nan_keeps_its_groups_scale_at_one_and_spares_the_others(interpreter, granularity):
    x = _inputs((130, 256))
    x[3, 5] = float("nan")
    got = quantize_dual(x, E4M3, granularity, backend="triton")
    want = quantize_dual(x, E4M3, granularity, backend="reference")
    for g, w, (r, c) in zip(got, want, ((3, 5), (5, 3)), strict=True):
        assert torch.equal(g.scale, w.scale)
        assert w.data[r, c].float().isnan() and w.data.float().isnan().sum() == 1
        # the interpreter's fp32 -> fp8 conversion turns NaN into a number (the GPU's keeps it: the CUDA test)
        g.data[r, c] = w.data[r, c] = 0
        assert torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8))


def test_linear_on_the_fused_casts_equals_the_reference_casts(interpreter, monkeypatch):
    """Each fp8 recipe's linear, forward and backward, casting through the Triton kernels (interpreter) and
    through torch: the same fp8 operands, so the same outputs and gradients."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 64, 256, generator=gen)
    w = torch.randn(384, 256, generator=gen) * 0.05
    g = torch.randn(2, 64, 384, generator=gen)
    for name in FP8_RECIPES:
        outs = []
        for backend in ("triton", "reference"):
            monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
            layer = LowPrecisionLinear(Recipe(name))
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            for _ in range(2):  # delayed: the second call scales by the first's history
                xi.grad = wi.grad = None
                y = layer(xi, wi)
                y.backward(g)
            outs.append((y.detach(), xi.grad, wi.grad))
        for fast, ref in zip(*outs, strict=True):
            torch.testing.assert_close(fast, ref, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_backward_keeps_only_fp8_operands(name):
    x = torch.randn(16, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)
    y = LowPrecisionLinear(Recipe(name))(x, w)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None and t.dim() == 2 and t.numel() > 256]
    assert len(saved) == 2 and {t.dtype for t in saved} == {E4M3}, [t.dtype for t in saved]
    with torch.no_grad():  # no backward: no transposes cast, none kept
        assert LowPrecisionLinear(Recipe(name))(x, w).grad_fn is None


def test_weight_cache_casts_once_per_step_and_refreshes_on_invalidate():
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 128, generator=gen) * 0.1).requires_grad_()
    xs = [torch.randn(32, 128, generator=gen) for _ in range(3)]
    cache = WeightCastCache()
    cached, plain = LowPrecisionLinear(Recipe("rowwise"), weight_cache=cache), LowPrecisionLinear(Recipe("rowwise"))

    def grads(layer):
        w.grad = None
        ys = [layer(x, w) for x in xs]  # three micro-batches of one step
        sum(y.square().sum() for y in ys).backward()
        return torch.stack([y.detach() for y in ys]), w.grad.clone()

    want = grads(plain)
    got = grads(cached)
    assert (cache.misses, cache.hits) == (1, 2)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    w.data.mul_(1.5)  # an update autograd's version counter does not see (like the Triton optimizer's)
    assert torch.equal(grads(cached)[0], got[0])  # stale until the owner says the weights changed...
    cache.invalidate()
    assert len(cache) == 0
    for a, b in zip(grads(cached), grads(plain), strict=True):  # ...then cast afresh
        assert torch.equal(a, b)
    with torch.no_grad():
        w.add_(0.01)  # an in-place torch op moves the version counter: a miss without invalidate
    misses = cache.misses
    for a, b in zip(grads(cached), grads(plain), strict=True):
        assert torch.equal(a, b)
    assert cache.misses == misses + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_cuda_dual_casts_are_the_bits_of_the_reference(granularity):
    x = _inputs((1000, 1536), torch.bfloat16, seed=6).cuda()
    x[1, 1] = -1e-30
    x[700, 1000] = float("nan")
    for dtype in (E4M3, E5M2):
        got = quantize_dual(x, dtype, granularity, backend="triton")
        want = quantize_dual(x, dtype, granularity, backend="reference")
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.data.float(), w.data.float(), rtol=0, atol=0, equal_nan=True)
            # NaN's bit patterns may differ; every other value's may not. Masked through uint8 views: CUDA has no
            # masked_fill_ for float8 (torch 2.11, H200 2026-12-01)
            g_bits, w_bits = g.data.view(torch.uint8).clone(), w.data.view(torch.uint8).clone()
            g_bits[g.data.float().isnan()] = 0
            w_bits[w.data.float().isnan()] = 0
            assert torch.equal(g_bits, w_bits), (granularity, dtype)
            assert torch.equal(g.scale, w.scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("granularity", ["1x128", "128x128"])
def test_cuda_fused_block_kernel_and_two_single_casts_give_the_same_bits(granularity, monkeypatch):
    x = _inputs((1000, 1536), torch.bfloat16, seed=7).cuda()
    x[1, 1], x[700, 1000] = -1e-30, float("nan")
    paths = _both_block_paths(x, granularity, monkeypatch)
    for fused, single in zip(paths["fused"], paths["two_casts"], strict=True):
        for a, b in zip(fused, single, strict=True):
            assert _same_bits(a.data, b.data) and torch.equal(a.scale, b.scale), granularity


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "name,tile", _cast_tile_cases(), ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v
)
def test_cuda_every_sweep_candidate_cast_tile_gives_the_reference_bits(name, tile, monkeypatch):
    """The compiled kernels at each candidate launch shape (what the sweep may make the default)."""
    import mcore.kernels.fp8_casts as fp8_casts
    from mcore.kernels.triton import quant_fused

    monkeypatch.setattr(quant_fused, name, tile)
    for granularity in ("1x128", "128x128"):
        monkeypatch.setitem(fp8_casts.DUAL_PATH, granularity, "fused")
    x = _inputs((1000, 1536), torch.bfloat16, seed=8).cuda()
    x[1, 1] = -1e-30
    for granularity in ("1x128", "128x128") if name == "BLOCK_TILE" else ("tensor", "row"):
        got = quantize_dual(x, E4M3, granularity, backend="triton")
        want = quantize_dual(x, E4M3, granularity, backend="reference")
        for g, w in zip(got, want, strict=True):
            assert _same_bits(g.data, w.data) and torch.equal(g.scale, w.scale), (granularity, tile)


def test_rounding_is_explicit_under_the_interpreter_and_the_cast_instructions_on_a_gpu(monkeypatch):
    """The interpreter's cast rounds ties away from zero, so the kernels round to the fp8 grid themselves there (the
    format's mantissa bits and smallest normal exponent); on a GPU ``cvt.rn`` rounds to nearest even, torch's bits
    (the CUDA twins above check them), so the kernels only saturate (``MBITS = 0``)."""
    pytest.importorskip("triton")
    from mcore.kernels.triton.quantization import rounding_bits

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert rounding_bits(E4M3) == {"MBITS": 3, "MIN_EXP": -6}
    assert rounding_bits(E5M2) == {"MBITS": 2, "MIN_EXP": -14}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert rounding_bits(E4M3) == rounding_bits(E5M2) == {"MBITS": 0, "MIN_EXP": 0}
