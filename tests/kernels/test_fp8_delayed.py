"""Delayed scaling's amax ring (``fp8_delayed.AmaxHistory``): every call scaled by the max (or the most recent) of
the last ``length`` amaxes of a plain Python model of the history, on the torch path and inside the Triton cast
(interpreter on CPU, the real kernel on CUDA), the same bits both ways, over enough calls to wrap the ring."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.fp8_casts import quantize_dual
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
    with pytest.raises(ValueError, match=r"overflow must be one of \('saturate', 'recast'\), got 'clip'"):
        AmaxHistory(4, "max", "clip")


# ------------------------------------------------------------------------------ overflow="recast"
def _bits(q):
    return q.data.cpu().view(torch.uint8), q.scale.reshape(()).cpu()


def _same(got, want) -> bool:
    """The same fp8 bytes and scale bits (``None`` matches ``None``: no transpose asked)."""
    if got is None or want is None:
        return got is want
    (data, scale), (ref_data, ref_scale) = _bits(got), _bits(want)
    return torch.equal(data, ref_data) and torch.equal(scale, ref_scale)


def _current(x, dtype, transposed, amax=None):
    """The current-scaling cast (from ``amax``, default the measured one), on the torch path."""
    amax = None if amax is None else amax.reshape(()).cpu()
    return quantize_dual(x.cpu(), dtype, "tensor", transposed=transposed, amax=amax, backend="reference")


def _with_amax(gen, shape, amax: float, device) -> torch.Tensor:
    """Fresh normal values scaled so that their max |x| is exactly ``amax`` (a power of two: exact in bf16)."""
    x = torch.randn(*shape, generator=gen)
    return (x / x.abs().max() * amax).to(torch.bfloat16).to(device)


def _error(q, x) -> float:
    """The largest error of the dequantized ``q`` against ``x``."""
    return (q.data.float().cpu() * q.scale.cpu() - x.float().cpu()).abs().max().item()


BACKENDS = [("reference", None), ("triton", "interpreter")]


def _device(request, fixture):
    return torch.device("cpu") if fixture is None else request.getfixturevalue(fixture)


@pytest.mark.parametrize("backend, fixture", BACKENDS)
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("dtype, compute", [(E4M3, "max"), (E5M2, "most_recent")])
def test_recast_of_a_doubling_tensor_is_the_current_scaling_cast(request, backend, fixture, transposed, dtype, compute):
    """The amax doubles every call, so every delayed cast after the first overflows: saturated, the elements above
    half the amax clip (errors up to half the amax); recast, none does (every error within half an fp8 step of the
    top binade), and data and scale are the current-scaling cast's, bit for bit."""
    device = _device(request, fixture)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    mbits = {E4M3: 3, E5M2: 2}[dtype]
    saturate, recast = AmaxHistory(3, compute), AmaxHistory(3, compute, overflow="recast")
    for i in range(5):
        amax = 2.0**i
        x = _with_amax(gen, (70, 90), amax, device)
        q, q_t = recast.quantize(x, dtype, transposed=transposed, backend=backend)
        sat, _ = saturate.quantize(x, dtype, transposed=transposed, backend=backend)
        want, want_t = _current(x, dtype, transposed)
        assert _same(q, want) and _same(q_t, want_t), i
        assert _error(q, x) <= amax * 2.0 ** -(mbits + 1) * (1 + 1e-6), i  # rounding only: nothing saturated
        if i:
            assert _error(sat, x) > amax / 4, i  # saturated at the history's amax, half of this one
    assert torch.equal(recast.history, saturate.history)


@pytest.mark.parametrize("backend, fixture", BACKENDS)
@pytest.mark.parametrize("dtype, compute", [(E4M3, "max"), (E5M2, "most_recent"), (E5M2, "max")])
def test_recast_follows_saturate_where_nothing_overflows_and_keeps_the_ring(request, backend, fixture, dtype, compute):
    """Amaxes rising and falling: a cast whose own amax stays within the history's is the plain delayed cast, one
    that exceeds it the current-scaling cast; the ring (history contents and count) is the same in both modes."""
    device = _device(request, fixture)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    saturate, recast = AmaxHistory(2, compute), AmaxHistory(2, compute, overflow="recast")
    overflowed = []
    # 3, 0, 1: the last one exceeds the most recent amax but not the max of two
    for i, exponent in enumerate([0, -1, -3, 2, 1, 3, 0, 1, -2, 4]):
        x = _with_amax(gen, (48, 80), 2.0**exponent, device)
        used = recast.scale_amax()
        pair = recast.quantize(x, dtype, transposed=i % 2 == 0, backend=backend)
        plain = saturate.quantize(x, dtype, transposed=i % 2 == 0, backend=backend)
        over = used is not None and 2.0**exponent > used.item()
        want = _current(x, dtype, i % 2 == 0) if over else plain
        assert all(_same(g, w) for g, w in zip(pair, want, strict=True)), (i, over)
        assert torch.equal(recast.history, saturate.history) and recast.count == saturate.count == i + 1
        overflowed.append(over)
    assert 2 < sum(overflowed) < len(overflowed) - 2  # both kinds of call were tested


@pytest.mark.parametrize("backend, fixture", BACKENDS)
def test_recast_decides_on_the_reduced_amax(request, backend, fixture):
    """Tensor parallelism: ``reduce`` max-es the record with another rank's amax. A local amax that never grows
    is recast when the other rank's grows (from the reduced amax); one that grows is not when the other rank's is
    larger still (the plain delayed cast)."""
    device = _device(request, fixture)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))

    other_rank = {}
    reduce = lambda t: t.clamp_(min=other_rank["amax"])  # noqa: E731  (the MAX all-reduce with that rank's amax)
    for local, other, recast_expected in (([1.0] * 4, [1.0, 3.0, 9.0, 27.0], True), ([1, 2, 4, 8], [64.0] * 4, False)):
        history = AmaxHistory(2, "max", overflow="recast")
        for i, (mine, theirs) in enumerate(zip(local, other, strict=True)):
            other_rank["amax"] = theirs
            x = _with_amax(gen, (40, 64), float(mine), device)
            q, q_t = history.quantize(x, E4M3, transposed=True, reduce=reduce, backend=backend)
            reduced = torch.tensor(max(mine, theirs))
            assert history.history[history.count - 1].item() == reduced.item()  # the record holds the reduced amax
            amax = reduced if recast_expected or i == 0 else torch.tensor(64.0)
            want, want_t = _current(x, E4M3, True, amax)
            assert _same(q, want) and _same(q_t, want_t), (recast_expected, i)


@pytest.mark.gpu
@pytest.mark.parametrize("compute", ["max", "most_recent"])
def test_cuda_recast_is_the_reference_bits(cuda_triton, compute):
    gen = torch.Generator().manual_seed(7)
    got_history, want_history = AmaxHistory(4, compute, "recast"), AmaxHistory(4, compute, "recast")
    for exponent in [0, 1, -1, 3, 2, 5, -4]:
        x = _with_amax(gen, (300, 520), 2.0**exponent, torch.device("cpu"))
        got = got_history.quantize(x.to(cuda_triton), E4M3, transposed=True)
        want = want_history.quantize(x, E4M3, transposed=True, backend="reference")
        assert all(_same(g, w) for g, w in zip(got, want, strict=True)), exponent
    assert torch.equal(got_history.history.cpu(), want_history.history)
