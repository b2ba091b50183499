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

    monkeypatch.setattr(conv, "FWD_TILE", conv.ConvTile(16, 32, 4))
    monkeypatch.setattr(conv, "DX_TILE", conv.ConvTile(16, 16, 2))
    monkeypatch.setattr(conv, "DPRE_TILE", conv.ConvTile(8, 32, 4, 2))
    monkeypatch.setattr(conv, "FUSED_TILE", conv.ConvTile(8, 32, 2, 2))
    monkeypatch.setattr(conv, "DW_TILE", conv.ConvTile(4, 16, 1))  # 6 partials (2 rows x 3 programs), 4 a step
    return conv


BACKWARDS = ("split", "fused")


class CountedLaunches:
    """Stands in for the Triton kernel ``name`` of ``module`` and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, monkeypatch, module, name):
        self.kernel, self.launches = getattr(module, name), 0
        monkeypatch.setattr(module, name, self)

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def mixer_slice(gen, b, length, dim, before=24, after=9, dtype=torch.float32):
    """The conv's input as the mixer has it: the xBC slice of a sequence-first in_proj output, transposed."""
    proj = torch.randn(length, b, before + dim + after, generator=gen).to(dtype)
    x = proj.transpose(0, 1)[..., before : before + dim].requires_grad_()
    assert x.stride(2) == 1 and not x.is_contiguous()
    return x


def check_against_float64(x, w, bb, activation, bounds, gen, tol):
    """Forward, dx, dw and dbias of the Triton conv against float64 ``F.conv1d`` per document; ``tol`` is
    ``(rtol, atol)`` of ``y`` and relative to each gradient's largest magnitude for the gradients."""
    length = x.shape[1]
    seq_idx = seq_idx_for(bounds, length) if any(len(bd) > 2 for bd in bounds) else None
    out = causal_conv1d(x, w, bb, activation=activation, seq_idx=seq_idx, backend="triton")
    assert out.dtype == x.dtype
    ref = per_document_reference(x, w, bb, activation, bounds)
    torch.testing.assert_close(out.double(), ref, rtol=tol[0], atol=tol[1])
    gy = torch.randn(out.shape, generator=gen).to(x.dtype)
    leaves = [t for t in (x, w, bb) if t is not None]
    grads = torch.autograd.grad(out, leaves, gy)
    ref_grads = torch.autograd.grad(ref, leaves, gy.double())
    for name, mine, theirs in zip(("dx", "dw", "dbias"), grads, ref_grads):
        assert mine.dtype == x.dtype and mine.shape == theirs.shape, name
        scale = theirs.abs().max().item()
        torch.testing.assert_close(
            mine.double(), theirs.double(), rtol=tol[0], atol=tol[1] * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


CASES = [
    # k, bias, activation, documents (cuts per row)
    (4, True, "silu", [[], []]),
    (4, True, "silu", [[5, 17], [1, 2, 30]]),
    (4, False, None, [[9], []]),
    (3, True, "silu", [[4], [20]]),
    (2, False, "silu", [[], [13]]),
]


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("k,bias,activation,cuts", CASES)
def test_triton_conv_on_the_mixer_layout_equals_float64_f_conv1d(interpreter, spy, small_tiles, monkeypatch, backward,
                                                                 k, bias, activation, cuts):  # fmt: skip
    monkeypatch.setattr(small_tiles, "BACKWARD", backward)
    b, length, dim = 2, 37, 40  # length and dim not multiples of the tiles
    gen = torch.Generator().manual_seed(k * 10 + len(cuts[0]) + len(cuts[1]))
    x = mixer_slice(gen, b, length, dim)
    w = torch.randn(dim, k, generator=gen).requires_grad_()
    bb = torch.randn(dim, generator=gen).requires_grad_() if bias else None
    bounds = [[0, *c, length] for c in cuts]
    launched = [spy("mcore.kernels.triton.conv", name) for name in ("conv_forward", "conv_backward")]
    kernels = {name: CountedLaunches(monkeypatch, small_tiles, name) for name in ("_conv_bwd_fused_kernel",
                                                                                 "_conv_dpre_kernel")}  # fmt: skip
    check_against_float64(x, w, bb, activation, bounds, gen, (1e-5, 1e-5))
    assert [len(calls) for calls in launched] == [1, 1]
    assert kernels["_conv_bwd_fused_kernel"].launches == (backward == "fused")
    assert kernels["_conv_dpre_kernel"].launches == (backward == "split")


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("k,bias,activation,cuts", CASES)
def test_polyphase_tiles_equal_float64_f_conv1d(interpreter, small_tiles, monkeypatch, backward, k, bias, activation,
                                                cuts):  # fmt: skip
    """The polyphase forward, dpre, dx and fused backward kernels: documents cut inside a phase row and across
    programs (8-row tiles: 2 positions a phase), several row tiles a program."""
    for name, tile in (("FWD_TILE", (8, 32, 2)), ("DX_TILE", (8, 16, 2)), ("DPRE_TILE", (8, 32, 2, 2)),
                       ("FUSED_TILE", (8, 32, 2, 2))):  # fmt: skip
        monkeypatch.setattr(small_tiles, name, small_tiles.ConvTile(*tile, phased=True))
    monkeypatch.setattr(small_tiles, "BACKWARD", backward)
    names = ("fwd", "dpre", "dx") if backward == "split" else ("fwd", "bwd_fused")
    launched = [CountedLaunches(monkeypatch, small_tiles, f"_conv_{n}_phased_kernel") for n in names]
    b, length, dim = 2, 37, 40
    gen = torch.Generator().manual_seed(k * 10 + len(cuts[0]) + len(cuts[1]) + 1)
    x = mixer_slice(gen, b, length, dim)
    w = torch.randn(dim, k, generator=gen).requires_grad_()
    bb = torch.randn(dim, generator=gen).requires_grad_() if bias else None
    check_against_float64(x, w, bb, activation, [[0, *c, length] for c in cuts], gen, (1e-5, 1e-5))
    assert [kernel.launches for kernel in launched] == [1] * len(names)


def test_a_polyphase_tile_needs_two_positions_a_phase():
    from mcore.kernels.triton import conv

    with pytest.raises(ValueError, match=r"ConvTile.rows=4 with phased=True: at least 8"):
        conv.ConvTile(4, 128, 4, phased=True)
    with pytest.raises(ValueError, match=r"defer=True is for shifted dpre tiles"):
        conv.ConvTile(32, 128, 4, 2, True, phased=True)


# fp16 / bf16 inputs (fp32 math in the kernels; outputs and, on the split path, dpre rounded to the input dtype). The
# conv has no tl.dot, so the interpreter's wrong bf16 dot does not apply: bf16 is checked here too.
LOW_PRECISION = [(torch.float16, (2e-3, 2e-3)), (torch.bfloat16, (2e-2, 2e-2))]


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("dtype,tol", LOW_PRECISION, ids=["fp16", "bf16"])
def test_triton_conv_in_half_precision_equals_float64(interpreter, small_tiles, monkeypatch, backward, dtype, tol):
    monkeypatch.setattr(small_tiles, "BACKWARD", backward)
    gen = torch.Generator().manual_seed(11)
    x = mixer_slice(gen, 2, 37, 40, dtype=dtype)
    w = (torch.randn(40, 4, generator=gen) * 0.5).to(dtype).requires_grad_()
    bb = torch.randn(40, generator=gen).to(dtype).requires_grad_()
    check_against_float64(x, w, bb, "silu", [[0, 6, 30, 37], [0, 37]], gen, tol)


def _tile_cases():
    from mcore.kernels.triton.conv import TILE_CANDIDATES

    return [(name, tile) for name, tiles in TILE_CANDIDATES.items() for tile in tiles]


@pytest.mark.parametrize("name,tile", _tile_cases(), ids=lambda v: getattr(v, "label", v))
def test_every_sweep_candidate_tile_equals_float64(interpreter, monkeypatch, name, tile):
    """Each tile the GPU sweep may pick (a document boundary, ragged edges), on the backward path that runs it."""
    from mcore.kernels.triton import conv

    monkeypatch.setattr(conv, name, tile)
    # Streaming tiles: two programs along positions. Looping ones: 3 row tiles and a ragged 4th in one program (the
    # halos across programs are the small-tile tests' part). dw: more partials than it reads a step (2-row programs).
    rows = tile.rows * min(tile.tiles, 3) if name != "DW_TILE" else 2 * tile.rows
    length = rows + 5
    gen = torch.Generator().manual_seed(3)
    x = mixer_slice(gen, 1, length, 40)
    w = torch.randn(40, 4, generator=gen).requires_grad_()
    bb = torch.randn(40, generator=gen).requires_grad_()
    monkeypatch.setattr(conv, "BACKWARD", "fused" if name == "FUSED_TILE" else "split")
    if name == "DW_TILE":
        monkeypatch.setattr(conv, "DPRE_TILE", conv.ConvTile(2, 64, 2))
    check_against_float64(x, w, bb, "silu", [[0, rows - 1, length]], gen, (1e-5, 1e-5))


def test_each_tile_default_is_its_first_sweep_candidate():
    """The sweep reports a constant's candidates in order and restores the default; the first is the default, so a
    sweep's table reads as "the default, then the alternatives"."""
    from mcore.kernels.triton import conv

    for name, tiles in conv.TILE_CANDIDATES.items():
        assert tiles[0] == getattr(conv, name), name
        assert len(set(tiles)) == len(tiles), name


def test_an_unknown_backward_path_or_a_bad_tile_is_one_clear_error(interpreter, monkeypatch):
    from mcore.kernels.triton import conv

    monkeypatch.setattr(conv, "BACKWARD", "fast")
    x = torch.randn(1, 8, 16, requires_grad=True)
    out = causal_conv1d(x, torch.randn(16, 4), None, backend="triton")
    with pytest.raises(ValueError, match=r"BACKWARD='fast'.*'split', 'fused'"):
        out.sum().backward()
    with pytest.raises(ValueError, match=r"ConvTile.cols=96"):
        conv.ConvTile(4, 96, 4)
    with pytest.raises(ValueError, match=r"ConvTile.tiles=0"):
        conv.ConvTile(4, 128, 4, 0)
    with pytest.raises(ValueError, match=r"ConvTile.defer='yes'"):
        conv.ConvTile(4, 128, 4, 2, "yes")


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


def _cuda_cases():
    """Each backward path at its default tiles, and the split path at every deferred-reduction dpre tile and every
    polyphase tile (the sweep may make one the default: the compiled kernel, not only the interpreter's, must be right
    at the real shape)."""
    from mcore.kernels.triton.conv import TILE_CANDIDATES

    picked = [(name, t) for name, tiles in TILE_CANDIDATES.items() for t in tiles if t.defer or t.phased]
    path = {"FUSED_TILE": "fused"}
    return [(b, None, None) for b in BACKWARDS] + [(path.get(name, "split"), name, t) for name, t in picked]


@pytest.mark.gpu
@pytest.mark.parametrize("backward,name,tile", _cuda_cases(), ids=lambda v: getattr(v, "label", v))
def test_triton_conv_bf16_on_cuda_mixer_layout_equals_float64(cuda_triton, monkeypatch, backward, name, tile):
    from mcore.kernels.triton import conv

    monkeypatch.setattr(conv, "BACKWARD", backward)
    if tile is not None:
        monkeypatch.setattr(conv, name, tile)
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
