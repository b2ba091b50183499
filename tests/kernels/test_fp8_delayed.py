"""Delayed scaling's amax ring (``fp8_delayed.AmaxHistory``): every call scaled by the max (or the most recent) of
the last ``length`` amaxes of a plain Python model of the history, on the torch path and inside the Triton cast
(interpreter on CPU, the real kernel on CUDA), the same bits both ways, over enough calls to wrap the ring."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.fp8_delayed import AmaxHistory
from mcore.kernels.quantization import E4M3, E5M2, FP8_MAX, quantize_fp8, scale_from_amax


def _expected_amax(previous: list[float], length: int, compute: str) -> float | None:
    if not previous:
        return None
    return previous[-1] if compute == "most_recent" else max(previous[-length:])


def _run(device, backend, length, compute, dtype, calls=9, transposed=True):
    gen = torch.Generator().manual_seed(length * 10 + len(compute))
    factors = [0.5, 40.0, 3.0, 0.01, 7.0, 900.0, 1.0, 2.0, 0.2, 5.0, 0.3][:calls]
    history, previous, out = AmaxHistory(length, compute), [], []
    for factor in factors:
        x = (torch.randn(48, 80, generator=gen) * factor).to(torch.bfloat16).to(device)
        q, q_t = history.quantize(x, dtype, transposed=transposed, backend=backend)
        want = _expected_amax(previous, length, compute)
        measured = x.float().abs().max()
        amax = measured if want is None else torch.tensor(want)
        _, scale = scale_from_amax(amax.reshape(()).cpu(), FP8_MAX[dtype])
        assert q.scale.reshape(()).cpu().item() == scale.item(), (factor, want)
        ref = quantize_fp8(x.cpu(), dtype, "tensor", amax=amax.reshape(()).cpu(), backend="reference")
        assert torch.equal(q.data.cpu().view(torch.uint8), ref.data.view(torch.uint8))
        if transposed:
            assert torch.equal(q_t.data.cpu().view(torch.uint8), ref.data.t().contiguous().view(torch.uint8))
        else:
            assert q_t is None
        previous.append(measured.item())
        out.append((q.data.cpu().view(torch.uint8), q.scale.cpu()))
    assert history.count == len(factors)
    return out


@pytest.mark.parametrize("length, compute", [(1, "max"), (3, "max"), (4, "most_recent")])
def test_reference_history_follows_the_window(length, compute):
    _run(torch.device("cpu"), "reference", length, compute, E4M3)


@pytest.mark.parametrize("length, compute, dtype", [(1, "max", E4M3), (3, "max", E5M2), (2, "most_recent", E4M3)])
def test_triton_history_is_the_reference_bits(interpreter, length, compute, dtype):
    got = _run(interpreter, "triton", length, compute, dtype, transposed=length != 2)
    want = _run(interpreter, "reference", length, compute, dtype, transposed=length != 2)
    for (data, scale), (ref_data, ref_scale) in zip(got, want, strict=True):
        assert torch.equal(data, ref_data) and torch.equal(scale, ref_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("length, compute", [(1, "max"), (16, "max"), (3, "most_recent")])
def test_cuda_history_is_the_reference_bits(cuda_triton, length, compute):
    got = _run(cuda_triton, None, length, compute, E4M3, calls=11)
    want = _run(torch.device("cpu"), "reference", length, compute, E4M3, calls=11)
    for (data, scale), (ref_data, ref_scale) in zip(got, want, strict=True):
        assert torch.equal(data, ref_data) and torch.equal(scale, ref_scale)


def test_reduce_is_applied_to_the_recorded_amax():
    """Tensor parallelism: the recorded slot is reduced in place (here: doubled), so the next call scales by it."""
    history = AmaxHistory(2, "max")
    x = torch.randn(32, 64)
    history.quantize(x, E4M3, transposed=False, reduce=lambda t: t.mul_(2.0), backend="reference")
    assert history.scale_amax().item() == 2 * x.abs().max().item()


def test_bad_history_arguments():
    with pytest.raises(ValueError, match="length must be >= 1"):
        AmaxHistory(0, "max")
    with pytest.raises(ValueError, match="compute must be one of"):
        AmaxHistory(4, "mean")
