"""Triton kernels of the document-aware causal depthwise conv1d + SiLU, forward and backward.

Layout: ``x`` is ``[batch, seqlen, channels]`` with unit channel stride and any batch / sequence strides, so the
mixer's ``[x | B | C]`` slice of the in_proj output is read in place (no transpose, no copy). Outputs are
contiguous. Every kernel works on ``rows x cols`` tiles (positions x channels; channel-contiguous vector loads). A
narrower conv (k < 4) is run with zero taps in front (``out[t] = sum_j w_j x[t - 3 + j]`` with the first ``4 - k``
weights 0): one set of kernels. The weight ``[dim, k]`` is read in place through its strides (no padded copy: every
extra launch costs host time that a 0.1 ms op cannot hide). A tap whose source is before the row start or in another
document (``seq_idx`` differs) reads 0. Math is fp32.

Two tile forms (:class:`ConvTile` ``phased``). *Shifted*: a kernel reads the ``WIDTH = 4`` shifted full tiles its
taps need (each input element 4 times through L1/L2). *Polyphase*: a tile is four ``rows/4``-high tiles of every
fourth position, and the taps read seven of those (7/4 times); Triton cannot shift a register tile, and this needs no
shift (:mod:`mcore.kernels.triton.conv_phased` explains it). On the H200 polyphase made the forward 0.071 -> 0.054
ms. The kernels live in ``conv_shifted``, ``conv_phased`` and ``conv_common`` (what both share); this module holds
the tiles and the launches.

Byte floor (``E`` = elements of ``x``, bf16): forward reads ``x`` and writes ``y`` (4E bytes). Backward, two paths
(``BACKWARD``): "split" is (1) ``dpre = dy * silu'(pre)`` with ``pre`` recomputed from ``x``, written once in
``x``'s dtype, plus each program's ``dw`` / ``dbias`` partials (fp32): 6E; (2) ``dx[s] = sum_j w_j dpre[s + 3 - j]``
(same document): 4E. "fused" is one pass that never writes ``dpre``: reads ``x`` and ``dy`` and writes ``dx`` (6E)
and the same partials; it needs ``dpre`` at the three positions after each of its own, so it recomputes them: 4x the
SiLU derivatives on shifted tiles (slower than split), 7/4x on polyphase tiles (faster: 0.152 ms against split's
0.178). A small kernel sums the partials into the weight's and the bias' dtypes (deterministic, no atomics). Which
path and which tiles run is a measurement's choice (``benchmarks/ssm_sweep.py``), not a guess.

Each kernel has its own tiles (defaults the fastest measured; :data:`TILE_CANDIDATES` are what the sweep tries, each
default first): on the H200 the whole conv (forward + backward, GPU kernel time) went 0.482 -> 0.448 -> 0.290 ->
0.221 ms over four rounds, against 2.40 ms for transformers' torch path (10.9x); the 10E floor at the measured
4.03 TB/s copy bandwidth is 0.104 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from mcore.kernels.triton.conv_common import _conv_dw_kernel
from mcore.kernels.triton.conv_phased import (
    _conv_bwd_fused_phased_kernel,
    _conv_dpre_phased_kernel,
    _conv_dx_phased_kernel,
    _conv_fwd_phased_kernel,
)
from mcore.kernels.triton.conv_shifted import (
    _conv_bwd_fused_kernel,
    _conv_dpre_kernel,
    _conv_dx_kernel,
    _conv_fwd_kernel,
)

WIDTH = 4  # taps the kernels compute (the literal 4 in them); k < 4 gets zero taps in front, k > 4 uses torch


@dataclass(frozen=True)
class ConvTile:
    """One kernel's launch shape: ``rows x cols`` (positions x channels) register tiles at ``warps`` warps, and, for
    the kernels that reduce over positions (dpre, fused backward), ``tiles`` consecutive row tiles a program (fewer
    dw/dbias partials to sum). For the partial-summing dw kernel ``rows`` is the most programs' partials read a step."""

    rows: int
    cols: int
    warps: int
    tiles: int = 1
    # dpre kernel only: keep the dw / dbias products as [rows, cols] register sums across the program's tiles and
    # reduce over positions once at its end (any layout; 5 extra tiles of registers), instead of once a tile (cheap
    # only when a thread holds every position of its channels: cols = 8 x 32 x warps)
    defer: bool = False
    # the polyphase form (``conv_phased``): a rows-high tile is four rows/4-high tiles of every fourth position, and
    # the taps read 7 of those instead of 4 full shifted tiles
    phased: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "cols", "warps", "tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or (name != "tiles" and value & (value - 1)):
                raise ValueError(f"ConvTile.{name}={value!r}: a positive int (rows, cols, warps: a power of two)")
        for name in ("defer", "phased"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ConvTile.{name}={getattr(self, name)!r}: a bool")
        if self.phased and self.defer:
            raise ValueError("ConvTile: defer=True is for shifted dpre tiles; phased ones always defer their sums")
        if self.phased and self.rows < 2 * WIDTH:
            raise ValueError(f"ConvTile.rows={self.rows} with phased=True: at least {2 * WIDTH} (rows/4 per phase)")

    @property
    def label(self) -> str:
        label = "x".join(map(str, (self.rows, self.cols, self.warps) + ((self.tiles,) if self.tiles > 1 else ())))
        return label + ("d" if self.defer else "") + ("p" if self.phased else "")


# Defaults: the fastest of each kernel's candidates in one sweep on an H200 (2026-12-02, session 7, call 3:
# `benchmarks/results/s7-h200-2026-12-02/call3/`; each sweep's full table is there and in earlier sessions' results).
# The forward and dx kernels on polyphase tiles, 32 x 128 at 4 warps: 0.054 / 0.041 ms (shifted full tiles: 0.071 /
# 0.050 ms; any 8-warp tiling about twice as long).
FWD_TILE = ConvTile(32, 128, 4, phased=True)
DX_TILE = ConvTile(32, 128, 4, phased=True)
# The dpre kernel reduces dw / dbias over positions: on the split path its time decides. Shifted 32 x 128 tiles
# reduced once a tile took 0.34 ms (each sum crossed warps through shared memory), deferred sums over 16 tiles of 8 x
# 128 at 2 warps 0.160; narrow polyphase tiles at 1-2 warps, one tile a program, are fastest: 64 x 16 at 1 warp 0.137
# (+0.0125 for the dw kernel's 64 partials). Every 4-warp one-tile program was 2-3x slower (not understood).
DPRE_TILE = ConvTile(64, 16, 1, phased=True)
# The fused backward on polyphase tiles: dpre at 7/4 of the positions, 6E bytes, dpre never written: 32 x 32 at 2
# warps, 0.152 ms (+ the dw kernel's 128 partials) against split's dpre + dx 0.178; the shifted fused kernel, which
# recomputes dpre at 4x the positions, took 0.41.
FUSED_TILE = ConvTile(32, 32, 2, phased=True)
# The partial-summing kernel: 16 channels a program (4 warps), up to 128 programs' partials a step (all of them here).
DW_TILE = ConvTile(128, 16, 4)
# "split": dpre kernel + dx kernel (10E bytes); "fused": one pass (6E bytes). Measured at the tiles above, the whole
# conv (forward + backward, GPU kernel time): fused 0.221 ms, split 0.241 ms; HF's torch path 2.404 ms (10.9x).
BACKWARD = "fused"
BACKWARDS = ("split", "fused")
# What benchmarks/ssm_sweep.py tries for each tile constant (the default first); the tests run every one. Pruned to
# those within about 1.5x of the best in the last sweep (and the shifted defaults of before, for comparison).
_PHASED = ((32, 128, 4), (32, 64, 2), (16, 128, 2), (16, 256, 4), (64, 128, 4), (32, 128, 2), (32, 256, 4))
_SHIFTED = ((16, 256, 4), (32, 128, 4), (8, 512, 4))
TILE_CANDIDATES: dict[str, tuple[ConvTile, ...]] = {
    "FWD_TILE": tuple(ConvTile(*t, phased=True) for t in _PHASED) + tuple(ConvTile(*t) for t in _SHIFTED),
    "DX_TILE": tuple(ConvTile(*t, phased=True) for t in _PHASED) + tuple(ConvTile(*t) for t in _SHIFTED),
    "DPRE_TILE": tuple(
        ConvTile(*t, phased=True)
        for t in (
            (64, 16, 1, 1),
            (64, 32, 2, 2),
            (32, 64, 2, 2),
            (32, 32, 2, 1),
            (64, 32, 1, 1),
            (64, 32, 2, 1),
            (128, 32, 2, 1),
            (32, 32, 1, 1),
            (64, 64, 2, 1),
            (32, 64, 2, 4),
        )
    )
    # shifted tiles: deferred sums across a 16-tile loop; reduced once a tile, a thread holding every position
    + (ConvTile(8, 128, 2, 16, True), ConvTile(16, 128, 4, 16, True), ConvTile(4, 1024, 4, 16)),
    "FUSED_TILE": tuple(
        ConvTile(*t, phased=True)
        for t in (
            (32, 32, 2, 1),
            (32, 64, 2, 4),
            (64, 32, 2, 2),
            (32, 64, 2, 2),
            (64, 16, 1, 1),
            (32, 32, 1, 1),
            # not measured yet: the default's shape over 2 and 4 tiles (fewer partials)
            (32, 32, 2, 2),
            (32, 32, 2, 4),
        )
    )
    + (ConvTile(2, 512, 2, 32),),  # the shifted fused kernel (dpre at 4x the positions)
    "DW_TILE": tuple(ConvTile(*t) for t in ((128, 16, 4), (128, 32, 8), (64, 16, 2), (32, 16, 1), (32, 32, 4),
                                            (4, 16, 1))),
}  # fmt: skip


def _unit_channel_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(2) == 1 else t.contiguous()


def _grid(b: int, length: int, dim: int, tile: ConvTile) -> tuple[int, int, int]:
    return (triton.cdiv(length, tile.rows * tile.tiles), triton.cdiv(dim, tile.cols), b)


def conv_forward(x, weight, bias, seq_idx, silu: bool) -> torch.Tensor:
    """``x`` ``[b, L, dim]`` (unit channel stride), ``weight`` ``[dim, k]`` -> contiguous ``[b, L, dim]``."""
    x = _unit_channel_stride(x)
    b, length, dim = x.shape
    out = torch.empty(b, length, dim, dtype=x.dtype, device=x.device)
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else out
    tile = FWD_TILE
    kernel = _conv_fwd_phased_kernel if tile.phased else _conv_fwd_kernel
    kernel[_grid(b, length, dim, tile)](
        x, weight, bias if bias is not None else out, seq, out, length, dim, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), K=weight.shape[1], HAS_BIAS=bias is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, BL=tile.rows, BD=tile.cols, num_warps=tile.warps,
    )  # fmt: skip
    return out


def conv_backward(dy, x, weight, bias, seq_idx, silu: bool):
    """``(dx, dweight, dbias or None)`` in the dtypes of ``x``, ``weight`` and ``bias``; ``dx`` contiguous. Runs the
    :data:`BACKWARD` path, then the partial-summing kernel."""
    if BACKWARD not in BACKWARDS:
        raise ValueError(f"mcore.kernels.triton.conv.BACKWARD={BACKWARD!r}: must be one of {BACKWARDS}")
    x, dy = _unit_channel_stride(x), _unit_channel_stride(dy)
    b, length, dim = x.shape
    k = weight.shape[1]
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else x
    dx = torch.empty(b, length, dim, dtype=x.dtype, device=x.device)
    tile = FUSED_TILE if BACKWARD == "fused" else DPRE_TILE
    grid = _grid(b, length, dim, tile)
    part = torch.empty(b * grid[0], 5, dim, dtype=torch.float32, device=x.device)
    ws = weight.stride(0), weight.stride(1)
    args = (x, weight, bias if bias is not None else x, seq, dy)
    sizes = (length, dim, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), *ws)
    flags = dict(K=k, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=silu)
    launch = dict(BL=tile.rows, BD=tile.cols, TILES=tile.tiles, num_warps=tile.warps)
    if BACKWARD == "fused":
        kernel = _conv_bwd_fused_phased_kernel if tile.phased else _conv_bwd_fused_kernel
        kernel[grid](*args, dx, part, *sizes, **flags, **launch)
    else:
        dpre = torch.empty_like(dx)
        if tile.phased:
            _conv_dpre_phased_kernel[grid](*args, dpre, part, *sizes, **flags, **launch)
        else:
            _conv_dpre_kernel[grid](*args, dpre, part, *sizes, **flags, **launch, DEFER=tile.defer)
        dx_kernel = _conv_dx_phased_kernel if DX_TILE.phased else _conv_dx_kernel
        dx_kernel[_grid(b, length, dim, DX_TILE)](
            dpre, weight, seq, dx, length, dim, *ws, K=k, HAS_SEQ=seq_idx is not None, BL=DX_TILE.rows,
            BD=DX_TILE.cols, num_warps=DX_TILE.warps,
        )  # fmt: skip
    dw = torch.empty(dim, k, dtype=weight.dtype, device=x.device)
    db = torch.empty_like(bias) if bias is not None else None
    # One step for every partial when they fit the tile (a 1-tile dpre program leaves 128 a sequence of 4096).
    step = min(DW_TILE.rows, triton.next_power_of_2(part.shape[0]))
    _conv_dw_kernel[(triton.cdiv(dim, DW_TILE.cols),)](
        part, dw, db if db is not None else dw, part.shape[0], dim, dw.stride(0), dw.stride(1), K=k,
        HAS_BIAS=bias is not None, BD=DW_TILE.cols, BP=step, num_warps=DW_TILE.warps,
    )  # fmt: skip
    return dx, dw, db
