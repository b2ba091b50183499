"""The Triton causal conv1d (+ SiLU) against float64 ``F.conv1d`` run on each document alone: forward, dx, dw and
dbias, on the layout the Mamba-2 mixer hands it (the ``[x | B | C]`` slice of a sequence-first in_proj output, read
in place), conv widths 2-4 (zero taps in front), several programs along both tile axes (small tiles patched in)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore.kernels import causal_conv1d


def per_document_reference(x, w, bias, activation, bounds_per_row):
    """float64 ``F.conv1d`` over each document of each row separately (zero history at every document start)."""
    x, w = x.double(), w.double()
    bias = None if bias is None else bias.double()
    dim, k = w.shape
    rows = []
    for r, bounds in enumerate(bounds_per_row):
        parts = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            seg = x[r : r + 1, lo:hi].transpose(1, 2)
            out = F.conv1d(seg, w[:, None, :], bias, padding=k - 1, groups=dim)[..., : hi - lo]
            parts.append(F.silu(out) if activation == "silu" else out)
        rows.append(torch.cat(parts, dim=2).transpose(1, 2))
    return torch.cat(rows, dim=0)


def seq_idx_for(bounds_per_row, length):
    seq = torch.zeros(len(bounds_per_row), length, dtype=torch.int64)
    for r, bounds in enumerate(bounds_per_row):
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seq[r, lo:hi] = i
    return seq


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough that the test shapes span several programs (and dw/db partials) on every axis."""
    from mcore.kernels.triton import conv

    monkeypatch.setattr(conv, "BLOCK_L", 8)
    monkeypatch.setattr(conv, "BLOCK_D", 16)
    monkeypatch.setattr(conv, "DPRE_TILES", 2)
    monkeypatch.setattr(conv, "DPRE_BLOCK_L", 4)
    monkeypatch.setattr(conv, "DPRE_BLOCK_D", 32)
    return conv


CASES = [
    # k, bias, activation, documents (cuts per row)
    (4, True, "silu", [[], []]),
    (4, True, "silu", [[5, 17], [1, 2, 30]]),
    (4, False, None, [[9], []]),
    (3, True, "silu", [[4], [20]]),
    (2, False, "silu", [[], [13]]),
]


@pytest.mark.parametrize("k,bias,activation,cuts", CASES)
def test_triton_conv_on_the_mixer_layout_equals_float64_f_conv1d(interpreter, spy, small_tiles, k, bias, activation,
                                                                 cuts):  # fmt: skip
    b, length, dim, before, after = 2, 37, 40, 24, 9  # length and dim not multiples of the tiles
    gen = torch.Generator().manual_seed(k * 10 + len(cuts[0]) + len(cuts[1]))
    # in_proj's output is [seq, batch, width]; the mixer transposes it to [batch, seq, width] and slices xBC.
    proj = torch.randn(length, b, before + dim + after, generator=gen)
    x = proj.transpose(0, 1)[..., before : before + dim].requires_grad_()
    assert x.stride(2) == 1 and not x.is_contiguous()
    w = torch.randn(dim, k, generator=gen).requires_grad_()
    bb = torch.randn(dim, generator=gen).requires_grad_() if bias else None
    bounds = [[0, *c, length] for c in cuts]
    seq_idx = seq_idx_for(bounds, length) if any(cuts) else None
    launched = spy("mcore.kernels.triton.conv", "conv_forward"), spy("mcore.kernels.triton.conv", "conv_backward")
    out = causal_conv1d(x, w, bb, activation=activation, seq_idx=seq_idx, backend="triton")
    ref = per_document_reference(x, w, bb, activation, bounds)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn(out.shape, generator=gen)
    leaves = [t for t in (x, w, bb) if t is not None]
    grads = torch.autograd.grad(out, leaves, gy)
    ref_grads = torch.autograd.grad(ref, leaves, gy.double())
    for name, mine, theirs in zip(("dx", "dw", "dbias"), grads, ref_grads):
        assert mine.dtype == torch.float32 and mine.shape == theirs.shape, name
        torch.testing.assert_close(
            mine.double(), theirs.double(), rtol=1e-5, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert [len(calls) for calls in launched] == [1, 1]


def test_triton_conv_reads_a_strided_weight_in_place(interpreter, small_tiles):
    from mcore.kernels.conv import TRITON_MAX_TAPS

    assert TRITON_MAX_TAPS == small_tiles.WIDTH
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 21, 24, generator=gen, requires_grad=True)
    w = torch.randn(3, 24, generator=gen).t().requires_grad_()  # [dim, k] with strides (1, dim)
    bias = torch.randn(24, generator=gen, requires_grad=True)
    out = causal_conv1d(x, w, bias, backend="triton")
    ref = per_document_reference(x, w, bias, "silu", [[0, 21]])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn(out.shape, generator=gen)
    for mine, theirs in zip(torch.autograd.grad(out, [x, w, bias], gy), torch.autograd.grad(ref, [x, w, bias], gy)):
        torch.testing.assert_close(mine.double(), theirs.double(), rtol=1e-5, atol=1e-4)


def test_convs_wider_than_the_kernels_use_the_torch_backend(interpreter, spy):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 12, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    launched = spy("mcore.kernels.triton.conv", "conv_forward")
    out = causal_conv1d(x, w, None, backend="triton")
    torch.testing.assert_close(out, per_document_reference(x, w, None, "silu", [[0, 12]]), rtol=1e-12, atol=1e-12)
    assert launched == []


@pytest.mark.gpu
def test_triton_conv_bf16_on_cuda_mixer_layout_equals_float64(cuda_triton):
    length, before, dim, after = 4096, 8192, 10240, 8320  # Nemotron-H-8B's in_proj split: z | xBC | dt (+ slack)
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(1, length, before + dim + after, generator=gen).to("cuda", torch.bfloat16)
    x = proj[..., before : before + dim].requires_grad_()
    w = (torch.randn(dim, 4, generator=gen) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
    bias = torch.randn(dim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    bounds = [[0, 1000, 1001, 3000, length]]
    seq_idx = seq_idx_for(bounds, length).cuda()
    out = causal_conv1d(x, w, bias, seq_idx=seq_idx)
    ref = per_document_reference(x, w, bias, "silu", bounds)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    gy = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(out, [x, w, bias], gy)
    ref_grads = torch.autograd.grad(ref, [x, w, bias], gy.double())
    for name, mine, theirs in zip(("dx", "dw", "dbias"), grads, ref_grads):
        scale = theirs.abs().max().item()
        torch.testing.assert_close(
            mine.double(), theirs.double(), rtol=2e-2, atol=2e-2 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
