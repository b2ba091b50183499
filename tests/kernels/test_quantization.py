"""FP8 quantization against float64 references (rounding, saturation, scales, block edges); Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.fp8_casts import quantize_fp8_pair
from mcore.kernels.quantization import (
    E4M3,
    E5M2,
    FP8_MAX,
    block_amax,
    quantize_fp8,
)

FORMATS = {E4M3: (3, -6), E5M2: (2, -14)}  # mantissa bits, smallest normal exponent
GRANULARITIES = ("tensor", "row", "1x128", "128x128")


def round_fp8_float64(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 values to the fp8 grid, nearest with ties to even, saturating: written from the format."""
    mbits, min_exp = FORMATS[dtype]
    v = v.double()
    _, e = torch.frexp(v.abs())  # |v| = m 2^e, m in [0.5, 1): floor(log2 |v|) = e - 1
    ulp = torch.ldexp(torch.ones_like(v), torch.clamp(e - 1, min=min_exp) - mbits)
    return (torch.round(v / ulp) * ulp).clamp(-FP8_MAX[dtype], FP8_MAX[dtype])  # torch.round: half to even


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Ties, subnormals, the largest values and beyond, both signs."""
    mbits, min_exp = FORMATS[dtype]
    fmax = FP8_MAX[dtype]
    sub = 2.0 ** (min_exp - mbits)
    vals = [
        0.0,
        1.0,
        1.0 + 2**-mbits / 2,
        1.0 + 3 * 2**-mbits / 2,
        sub,
        sub / 2,
        1.5 * sub,
        3 * sub / 2,
        fmax,
        fmax * 1.03,
    ]
    vals += [fmax * 1.5, 1e30, 2.0**min_exp, 2.0**min_exp * (1 - 2**-6), 0.3, 100.7]
    t = torch.tensor(vals, dtype=torch.float64)
    return torch.cat([t, -t])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_unscaled_rounding_and_saturation_match_the_format(dtype):
    x = torch.cat([edge_values(dtype), torch.randn(4000, dtype=torch.float64) * 40]).float()
    q = quantize_fp8(x.reshape(1, -1), dtype, "tensor", amax=torch.tensor(FP8_MAX[dtype]), backend="reference")
    assert q.scale.item() == 1.0
    torch.testing.assert_close(q.data.double().reshape(-1), round_fp8_float64(x, dtype), rtol=0, atol=0)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scales_and_values_against_float64(granularity, dtype):
    gen = torch.Generator().manual_seed(1)
    # rows of very different magnitudes, and a shape with partial blocks on both edges
    x = torch.randn(200, 300, generator=gen) * torch.logspace(-3, 3, 200).unsqueeze(1)
    q = quantize_fp8(x, dtype, granularity, backend="reference")
    x64 = x.double()
    if granularity == "tensor":
        amax = x64.abs().amax()
    elif granularity == "row":
        amax = x64.abs().amax(dim=1, keepdim=True)
    else:
        amax = block_amax(x, granularity).double()  # the max of fp32 values is exact in fp32
    torch.testing.assert_close(q.scale.double(), amax / FP8_MAX[dtype], rtol=2e-7, atol=0)
    # the element values: x times the fp32 multiplier, rounded to the format
    multiplier = (FP8_MAX[dtype] / amax).float().double()
    if granularity in ("1x128", "128x128"):
        from mcore.kernels.quantization import expand_scale

        multiplier = expand_scale(multiplier, granularity, x.shape)
    expected = round_fp8_float64((x64 * multiplier).float(), dtype)
    torch.testing.assert_close(q.data.double(), expected, rtol=0, atol=0)
    # every group's largest element lands on the format's largest value
    assert q.data.double().abs().max().item() == FP8_MAX[dtype]
    rel = (q.dequantize().double() - x64).abs() / x64.abs().clamp(min=1e-30)
    bound = 2.0 ** -(FORMATS[dtype][0] + 1) * 1.001
    big = x64.abs() * multiplier >= 2.0 ** FORMATS[dtype][1]  # normal range of the format: relative bound holds
    assert rel[big].max().item() <= bound


def test_block_edges_use_only_their_own_elements():
    x = torch.zeros(130, 260)
    x[129, 259] = 7.0  # alone in the last (partial) 128x128 block and in its 1x128 group
    x[0, 0] = 1000.0
    q = quantize_fp8(x, E4M3, "128x128", backend="reference")
    assert q.scale.shape == (2, 3)
    assert q.scale[1, 2].item() == pytest.approx(7.0 / 448.0, rel=1e-7)
    assert q.data[129, 259].float().item() == 448.0
    q1 = quantize_fp8(x, E4M3, "1x128", backend="reference")
    assert q1.scale.shape == (130, 3)
    assert q1.scale[129, 2].item() == pytest.approx(7.0 / 448.0, rel=1e-7)
    assert q1.scale[5, 1].item() == 1.0  # all-zero group: scale 1, zeros out


def test_delayed_amax_saturates_and_nan_stays_nan():
    x = torch.tensor([[1.0, -8.0, 2.0, float("nan")]])
    q = quantize_fp8(x, E4M3, "tensor", amax=torch.tensor(2.0), backend="reference")
    assert q.data.float()[0, :3].tolist() == [224.0, -448.0, 448.0]
    assert torch.isnan(q.data.float()[0, 3])


def test_transpose_quantizes_along_the_other_dimension():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 48, generator=gen) * torch.logspace(-2, 2, 48)
    for granularity in GRANULARITIES:
        fused = quantize_fp8(x, E5M2, granularity, transpose=True, backend="reference")
        explicit = quantize_fp8(x.t().contiguous(), E5M2, granularity, backend="reference")
        assert fused.data.shape == (48, 64) and fused.data.is_contiguous()
        assert torch.equal(fused.data.float(), explicit.data.float()) and torch.equal(fused.scale, explicit.scale)


def test_amax_reduce_is_applied_before_the_scale():
    x = torch.randn(4, 32)
    seen = []

    def reduce(t):
        seen.append(t.shape)
        t.fill_(100.0)

    q = quantize_fp8(x, E4M3, "row", amax_reduce=reduce, backend="reference")
    assert seen == [torch.Size([4, 1])]
    torch.testing.assert_close(q.scale, torch.full((4, 1), 100.0 / 448.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(granularity="2x2"), "granularity must be one of"),
        (dict(dtype="e3m4"), "unknown fp8 format"),
        (dict(granularity="row", amax=torch.tensor(1.0)), "amax= is a single value"),
        (dict(granularity="1x128", amax_reduce=lambda t: None), "block scales"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_fp8(torch.randn(4, 4), **kwargs)


def test_bad_input_shape_and_dtype():
    with pytest.raises(ValueError, match="must be 2-D"):
        quantize_fp8(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_fp8(torch.randn(2, 4).double())


# ------------------------------------------------------------------------------------- Triton (interpreter)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("transpose", [False, True])
def test_triton_equals_reference(interpreter, granularity, transpose):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(136, 200, generator=gen) * torch.logspace(-2, 2, 200)).to(torch.float16)
    x[3, 5] = float("nan")  # its group keeps multiplier 1 and scale 1 (the H200 run found a NaN scale here)
    for dtype in (E4M3, E5M2):
        ref = quantize_fp8(x, dtype, granularity, transpose=transpose, backend="reference")
        tri = quantize_fp8(x, dtype, granularity, transpose=transpose, backend="triton")
        assert tri.data.is_contiguous() and tri.data.shape == ref.data.shape
        # the interpreter casts a NaN to fp8 as 384 (the GPU keeps NaN: test_cuda_kernels_equal_reference)
        keep = ~ref.data.float().isnan()
        assert torch.equal(tri.data.float()[keep], ref.data.float()[keep]) and keep.sum() == x.numel() - 1
        assert torch.equal(tri.scale, ref.scale) and not tri.scale.isnan().any()


def test_triton_pair_equals_reference(interpreter):
    x = torch.cat([edge_values(E4M3).float(), torch.randn(308) * 50]).reshape(4, -1)
    amax = torch.tensor(60.0)
    q, q_t = quantize_fp8_pair(x, E4M3, amax=amax, backend="triton")
    ref = quantize_fp8(x, E4M3, amax=amax, backend="reference")
    assert torch.equal(q.data.float(), ref.data.float())
    assert torch.equal(q_t.data.float(), ref.data.float().t())
    assert q_t.data.is_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_cuda_kernels_equal_reference(cuda_triton, granularity):
    x = torch.randn(1000, 1536, device="cuda", dtype=torch.bfloat16) * 3
    x[3, 5] = float("nan")
    for transpose in (False, True):
        for dtype in (E4M3, E5M2):
            ref = quantize_fp8(x, dtype, granularity, transpose=transpose, backend="reference")
            tri = quantize_fp8(x, dtype, granularity, transpose=transpose, backend="triton")
            torch.testing.assert_close(tri.data.float(), ref.data.float(), rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(tri.scale, ref.scale, rtol=0, atol=0, equal_nan=True)


def _tiny_group_input(granularity: str) -> torch.Tensor:
    """Random values, except one group (of ``granularity``) of zeros and a few values near 1e-37: an amax below
    ``amax_floor`` (where ``fmax / amax`` overflows fp32), in fp32 and bf16 alike."""
    x = torch.randn(136, 256, generator=torch.Generator().manual_seed(8))
    region = {"tensor": (slice(None), slice(None)), "row": (5, slice(None)), "1x128": (5, slice(0, 128)),
              "128x128": (slice(0, 128), slice(0, 128))}[granularity]  # fmt: skip
    x[region] = 0.0
    x[5, 3], x[5, 7], x[9 if granularity in ("tensor", "128x128") else 5, 100] = 1e-37, -3e-38, 2e-38
    return x


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_group_of_zeros_and_tiny_values_quantizes_finite(interpreter, granularity):
    """The H200's 500-step block-wise run turned NaN at step 22; a group whose amax is below ``fmax * FLT_MIN`` made
    ``fmax / amax`` inf and its zeros ``0 * inf = NaN``. With the floor every scale is a normal fp32 number, the
    values dequantize to themselves within the format's rounding, and Triton gives the reference's bits."""
    from mcore.kernels.fp8_casts import quantize_dual
    from mcore.kernels.quantization import amax_floor

    x = _tiny_group_input(granularity)
    for dtype in (E4M3, E5M2):
        assert amax_floor(FP8_MAX[dtype]) > FP8_MAX[dtype] / 3.4e38  # the floor is above the overflow point
        results = {}
        for backend in ("reference", "triton"):
            q = quantize_fp8(x, dtype, granularity, backend=backend)
            dual, dual_t = quantize_dual(x, dtype, granularity, backend=backend)
            results[backend] = (q, dual, dual_t)
            for got in (q, dual, dual_t):
                assert not got.data.float().isnan().any(), (backend, dtype, granularity)
                assert (got.scale >= torch.finfo(torch.float32).tiny).all() and got.scale.isfinite().all()
            # (x^T's row and 1x128 groups run along x's columns, where random values dwarf the tiny ones)
            pairs = [(q.dequantize(), x), (dual.dequantize(), x)]
            if granularity in ("tensor", "128x128"):
                pairs.append((dual_t.dequantize(), x.t()))
            for got, ref in pairs:
                tiny = (ref != 0) & (ref.abs() < 1e-30)
                assert tiny.sum() == 3
                rel = ((got - ref).abs() / ref.abs())[tiny]
                assert rel.max().item() <= 2.0 ** -(FORMATS[dtype][0] + 1) * 1.001, (backend, dtype, granularity)
        for ref, tri in zip(results["reference"], results["triton"], strict=True):
            assert torch.equal(tri.data.view(torch.uint8), ref.data.view(torch.uint8))
            assert torch.equal(tri.scale, ref.scale)


def test_abs_max_is_the_amax_without_the_abs_temporary():
    from mcore.kernels.quantization import abs_max

    x = torch.randn(40, 72, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16) * 5
    # fp32 out of the one reduction, the bits of the bf16 amax (a max is exact)
    assert abs_max(x).dtype == abs_max(x, 1).dtype == torch.float32
    assert torch.equal(abs_max(x), x.abs().amax().float())
    assert torch.equal(abs_max(x.t(), 1), x.t().abs().amax(1, True).float())
    x[3, 5] = float("nan")
    assert abs_max(x).isnan() and abs_max(x, 1)[3].isnan() and not abs_max(x, 1)[4].isnan()
