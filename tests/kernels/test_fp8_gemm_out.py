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


def test_a_refused_fp32_output_is_remembered_and_run_in_bf16(monkeypatch):
    """The row- and block-wise CUDA GEMMs ask for fp32 output (the weight gradient into main_grad) where torch
    takes it; a refusal is remembered for that scale pair, and the GEMM runs in bf16, cast to what was asked."""
    from mcore.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "_OUT_DTYPE_REFUSED", set())
    asked = []

    def run(dtype, target):
        assert target is None  # no out given: nothing to write into
        asked.append(dtype)
        if dtype == torch.float32:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling")
        return torch.full((2, 3), 1.5, dtype=dtype)

    out = fp8_gemm._native_or_bf16("row", torch.float32, run)
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((2, 3), 1.5))
    assert asked == [torch.float32, torch.bfloat16] and ("row", torch.float32) in fp8_gemm._OUT_DTYPE_REFUSED
    fp8_gemm._native_or_bf16("row", torch.float32, run)  # remembered: bf16 asked at once
    assert asked[2:] == [torch.bfloat16]
    asked.clear()
    fp8_gemm._native_or_bf16("1x128128x128", torch.float32, run)  # another pair tries fp32 on its own
    assert asked == [torch.float32, torch.bfloat16]

    def broken(dtype, target):
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    with pytest.raises(RuntimeError, match="EXECUTION_FAILED"):  # a bf16 failure is not swallowed
        fp8_gemm._native_or_bf16("row", torch.bfloat16, broken)


def test_an_out_of_the_native_dtype_is_written_by_the_gemm_itself(monkeypatch):
    """The fp32 weight gradient goes into main_grad as the GEMM's own output (no product temporary, no copy);
    after a refused fp32 output the bf16 product is copied into it instead."""
    from mcore.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "_OUT_DTYPE_REFUSED", set())
    targets = []

    def run(dtype, target):
        targets.append(target)
        if target is not None:
            return target.fill_(2.5)
        return torch.full((2, 3), 2.5, dtype=dtype)

    out = torch.full((2, 3), float("nan"))
    assert fp8_gemm._native_or_bf16("1x1281x128", torch.float32, run, out) is out
    assert targets == [out] and torch.equal(out, torch.full((2, 3), 2.5))

    def refusing(dtype, target):
        if dtype == torch.float32:
            raise RuntimeError("fp32 output not supported")
        return run(dtype, target)

    targets.clear()
    out = torch.full((2, 3), float("nan"))
    assert fp8_gemm._native_or_bf16("1x1281x128", torch.float32, refusing, out) is out
    assert targets == [None] and torch.equal(out, torch.full((2, 3), 2.5))  # bf16 product copied in
    bf16_out = torch.full((2, 3), float("nan"), dtype=torch.bfloat16)
    targets.clear()
    fp8_gemm._native_or_bf16("row", torch.bfloat16, run, bf16_out)  # bf16 out: the kernel's own dtype
    assert targets == [bf16_out]
