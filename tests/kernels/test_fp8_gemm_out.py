"""``scaled_matmul(..., out=)``: the product written into a given tensor (the fp8 weight gradient into main_grad),
equal to the returned product in that dtype, the tensor not read (NaN-filled here); bad ``out`` is one error."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.fp8_gemm import scaled_matmul
from mcore.kernels.quantization import quantize_fp8

PAIRS = [("tensor", "tensor"), ("row", "row"), ("1x128", "128x128"), ("1x128", "1x128")]


def _operands(ga, gb, device, m=128, n=256, k=256):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    b = torch.randn(n, k, generator=g).to(device, torch.bfloat16)
    return quantize_fp8(a, "e4m3", ga), quantize_fp8(b, "e4m3", gb)


def _check(pair, device, dtype):
    qa, qb = _operands(*pair, device)
    expected = scaled_matmul(qa, qb, out_dtype=dtype)
    out = torch.full(expected.shape, float("nan"), dtype=dtype, device=device)
    result = scaled_matmul(qa, qb, out=out)
    assert result.data_ptr() == out.data_ptr() and out.dtype == dtype
    assert torch.equal(out, expected), pair


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_out_equals_the_returned_product(pair, dtype):
    _check(pair, "cpu", dtype)


def test_a_bad_out_is_one_error():
    qa, qb = _operands("tensor", "tensor", "cpu")
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of shape \(128, 256\)"):
        scaled_matmul(qa, qb, out=torch.empty(256, 128))
    with pytest.raises(ValueError, match="contiguous"):
        scaled_matmul(qa, qb, out=torch.empty(256, 128).t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_cuda_out_equals_the_returned_product(pair, dtype):
    _check(pair, "cuda", dtype)
