"""MXFP8 / MXFP4 / NVFP4 against float64 references written from the format definitions."""

from __future__ import annotations

import math

import pytest
import torch

from mcore.kernels.microscaling import (
    E2M1_VALUES,
    dequantize_mx,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    pack_fp4,
    quantize_mx,
    quantize_nvfp4,
    unpack_fp4,
)
from mcore.kernels.quantization import E4M3, FP8_MAX

EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}


def e2m1_round_float64(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value, ties to the even code, saturating at 6: by search over the 8 magnitudes."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    mag = v.double().abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # among equally near magnitudes prefer the even code
    candidates = (dist == best) & (torch.arange(8) % 2 == 0) | ((dist == best).sum(-1, keepdim=True) == 1) & (
        dist == best
    )
    code = candidates.to(torch.int64).argmax(dim=-1)
    return torch.where(torch.signbit(v), -grid[code], grid[code])


def test_e2m1_ties_saturation_and_signs():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.75, -5.0, 0.2, 0.3, 4.9, -0.0])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0, 0.0, 0.5, 4.0, -0.0]
    assert e2m1_decode(e2m1_encode(v)).tolist() == expected
    x = torch.randn(5000) * 3
    torch.testing.assert_close(e2m1_decode(e2m1_encode(x)).double(), e2m1_round_float64(x), rtol=0, atol=0)


def test_fp4_packing_puts_the_lower_index_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="must be even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_mx_scales_and_elements_match_the_spec(fmt):
    gen = torch.Generator().manual_seed(0)
    n = 32 * 5 + 6  # a partial last block
    x = torch.randn(7, n, generator=gen) * torch.logspace(-20, 20, 7).unsqueeze(1)
    x[2, 32:64] = 0.0  # an all-zero block
    t = quantize_mx(x, fmt)
    assert t.scales.dtype == torch.uint8 and t.scales.shape == (7, 6)
    x64 = x.double()
    for r in range(7):
        for b in range(6):
            block = x64[r, 32 * b : 32 * (b + 1)]
            amax = block.abs().max().item()
            e = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax)) - EMAX[fmt]))
            assert t.scales[r, b].item() == e + 127, (r, b)
    scale64 = torch.ldexp(torch.ones(7, 6, dtype=torch.float64), t.scales.long() - 127)
    scaled = x64 / scale64.repeat_interleave(32, 1)[:, :n]
    if fmt == "e2m1":
        expected = e2m1_round_float64(scaled)
        values = e2m1_decode(unpack_fp4(t.elements)).double()
    else:
        dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        expected = scaled.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).double()
        values = t.elements.double()
    torch.testing.assert_close(values, expected, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_mx(t).double(), expected * scale64.repeat_interleave(32, 1)[:, :n])


def test_e8m0_decoding_and_nan():
    s = torch.tensor([0, 127, 130, 254, 255], dtype=torch.uint8)
    out = e8m0_decode(s)
    assert out[:4].tolist() == [2.0**-127, 1.0, 8.0, 2.0**127]
    assert math.isnan(out[4].item())
    x = torch.full((1, 32), 1.0)
    x[0, 3] = float("nan")
    assert quantize_mx(x, "e2m1").scales.item() == 255


def test_nvfp4_two_level_scales_against_float64():
    gen = torch.Generator().manual_seed(1)
    n = 16 * 6 + 4
    x = torch.randn(5, n, generator=gen) * torch.logspace(-3, 3, 5).unsqueeze(1)
    t = quantize_nvfp4(x)
    x64 = x.double()
    g = x64.abs().max() / (6 * 448)
    torch.testing.assert_close(t.global_scale.double(), g, rtol=1e-7, atol=0)
    pad = torch.nn.functional.pad(x64, (0, (-n) % 16)).reshape(5, -1, 16)
    wanted = pad.abs().amax(-1) / (6 * t.global_scale.double())
    torch.testing.assert_close(t.block_scales.double(), wanted.float().clamp(max=448).to(E4M3).double(), rtol=0, atol=0)
    effective = t.block_scales.double() * t.global_scale.double()
    # a block far below the tensor's amax gets block scale 0 (under e4m3's range): its elements are zeros
    assert (effective[0] == 0).all()
    scaled = torch.where(effective.unsqueeze(-1) > 0, pad / effective.unsqueeze(-1), 0.0)
    expected = e2m1_round_float64(scaled.reshape(5, -1)[:, :n])
    torch.testing.assert_close(e2m1_decode(unpack_fp4(t.codes)).double(), expected, rtol=0, atol=0)
    rel = (t.dequantize().double() - x64).norm() / x64.norm()
    assert rel < 0.12  # 4-bit elements: a tenth of the signal's norm at most


def test_nvfp4_beats_mxfp4_on_gaussian_data():
    """The finer E4M3 block scale of NVFP4 gives a smaller error than MXFP4's power-of-two scale."""
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(2))
    err_nv = (quantize_nvfp4(x).dequantize() - x).norm()
    err_mx = (quantize_mx(x, "e2m1").dequantize() - x).norm()
    assert err_nv < err_mx


def test_bad_inputs():
    with pytest.raises(ValueError, match="element_format must be one of"):
        quantize_mx(torch.randn(4, 32), "e3m2")
    with pytest.raises(ValueError, match="last dim must be even"):
        quantize_nvfp4(torch.randn(4, 31))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantize_mx(torch.ones(4, 32, dtype=torch.int32))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_fake_quantize_is_the_round_trip_bit_for_bit(fmt):
    from mcore.kernels.microscaling import dequantize_nvfp4, fake_quantize

    x = torch.randn(9, 200, generator=torch.Generator().manual_seed(4)) * torch.logspace(-6, 6, 9).unsqueeze(1)
    x[3, :40] = 0.0
    if fmt == "nvfp4":
        expected = dequantize_nvfp4(quantize_nvfp4(x))
    else:
        expected = dequantize_mx(quantize_mx(x, "e4m3" if fmt == "mxfp8" else "e2m1"))
    torch.testing.assert_close(fake_quantize(x, fmt), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="format must be one of"):
        fake_quantize(x, "fp4")
