"""Tile-size sweep of the Triton SSD and conv1d kernels on one shape (``ssm_throughput.py --sweep``): each
alternative of the module-level tile constants is set, timed (forward + backward, median), and the defaults are
restored, so that the next run can take the best. Also what ``ssm_throughput.py`` reports as ``ssd_parts_ms``: each
Triton SSD kernel alone at the current tiles."""

from __future__ import annotations

from collections.abc import Callable

import torch

# module constant -> the values tried (the current default among them)
SSD_TILES = {
    "INTRA_ROWS": (32, 64, 128),
    "INTRA_WARPS": (4, 8),
    "DCB_TILE": (2048, 4096, 8192),
    "DCB_WARPS": (4, 8),
    "STATE_BLOCK": (128, 256, 512, 1024),
}
STATES_ROWS = (32, 64, 128)  # mcore.kernels.triton.ssd_states.ROWS
# mcore.kernels.triton.conv: (BLOCK_L, BLOCK_D, NUM_WARPS) of the forward and dx kernels, and
# (DPRE_BLOCK_L, DPRE_BLOCK_D, DPRE_WARPS, DPRE_TILES) of the dpre kernel; the defaults first
CONV_CONSTANTS = ("BLOCK_L", "BLOCK_D", "NUM_WARPS", "DPRE_BLOCK_L", "DPRE_BLOCK_D", "DPRE_WARPS", "DPRE_TILES")
CONV_TILES = (
    (32, 128, 8, 4, 1024, 4, 16),
    (32, 128, 4, 4, 1024, 4, 16),
    (64, 128, 8, 4, 1024, 4, 16),
    (16, 256, 4, 4, 1024, 4, 16),
    (32, 128, 8, 8, 1024, 4, 8),
    (32, 128, 8, 4, 2048, 8, 16),
    (32, 128, 8, 2, 1024, 4, 32),
    (32, 128, 8, 32, 128, 8, 1),  # the dpre tile of the first GPU run (sums across warps), one tile a program
)


def ssd_kernel_calls(s: dict, device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The Triton SSD launches (intra-chunk output, state passing, chunk states, inter-chunk output; forward and
    backward each) on random inputs of shape ``s``."""
    from mcore.kernels.triton import ssd as kernels
    from mcore.kernels.triton import ssd_states as states

    b, length, h, p, g, n, q = (s[k] for k in ("batch", "seq", "heads", "head_dim", "groups", "state", "chunk"))
    nc = -(-length // q)
    gen = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(b, nc * q, h, p, generator=gen).to(device, dtype)
    dt = (torch.rand(b, nc * q, h, generator=gen) * 0.1).to(device)
    cs = torch.cumsum(-dt.view(b, nc, q, h), dim=2).reshape(b, nc * q, h).contiguous()
    cb = torch.randn(b, nc, g, q, q, generator=gen).to(device)
    dy = torch.randn(x.shape, generator=gen).to(device)
    local = torch.randn(b, nc, h, p * n, generator=gen).to(device)
    carry = torch.rand(b, nc, h, generator=gen).to(device)
    incoming, _ = kernels.state_forward(local, carry, None)
    dfinal = local[:, 0].contiguous()
    B = torch.randn(b, nc * q, g, n, generator=gen).to(device, dtype)
    return {
        "intra_fwd": lambda: kernels.intra_forward(x, dt, cs, None, cb),
        "intra_bwd": lambda: kernels.intra_backward(dy, x, dt, cs, None, cb),
        "state_fwd": lambda: kernels.state_forward(local, carry, None),
        "state_bwd": lambda: kernels.state_backward(carry, incoming, local, dfinal),
        "chunk_state_fwd": lambda: states.chunk_state_forward(x, dt, B, q),
        "chunk_state_bwd": lambda: states.chunk_state_backward(local, x, dt, B, q),
        "inter_fwd": lambda: states.inter_forward(B, incoming, dt, h, p),
        "inter_bwd": lambda: states.inter_backward(dy, B, incoming, dt),
    }


def sweep(s: dict, conv_step: Callable[[], object], device: torch.device, dtype: torch.dtype, measure,
          iters: int, parts: tuple[str, ...] = ("ssd", "conv"), conv_measure=None) -> dict:  # fmt: skip
    """``{"ssd": {constant: {value: ms}}, "conv": {"BLxBDxWARPSxTILES": ms}}`` for the ``parts`` asked; which
    kernels a constant affects is summed; ``conv_step`` runs the conv forward + backward with whatever tiles are
    set, timed by ``conv_measure`` (default ``measure``; on CUDA the benchmark passes GPU kernel time: its host
    overhead would hide the tiles' differences)."""
    out: dict = {}
    if "ssd" in parts:
        out["ssd"] = _ssd_sweep(s, device, dtype, measure, iters)
    if "conv" in parts:
        out["conv"] = _conv_sweep(conv_step, conv_measure or measure, iters)
    return out


def _ssd_sweep(s: dict, device: torch.device, dtype: torch.dtype, measure, iters: int) -> dict:
    from mcore.kernels.triton import ssd as tssd

    calls = ssd_kernel_calls(s, device, dtype)
    intra, state = ("intra_fwd", "intra_bwd"), ("state_fwd", "state_bwd")
    affected = {"INTRA_ROWS": intra, "INTRA_WARPS": intra, "DCB_TILE": intra[1:], "DCB_WARPS": intra[1:],
                "STATE_BLOCK": state}  # fmt: skip
    out: dict = {}
    for name, values in SSD_TILES.items():
        default = getattr(tssd, name)
        out[name] = {}
        try:
            for value in values:
                setattr(tssd, name, value)
                out[name][str(value)] = sum(measure(calls[k], iters) * 1e3 for k in affected[name])
        finally:
            setattr(tssd, name, default)
    from mcore.kernels.triton import ssd_states as tstates

    default = tstates.ROWS
    out["states.ROWS"] = {}
    try:
        for value in STATES_ROWS:
            tstates.ROWS = value
            parts = ("chunk_state_fwd", "chunk_state_bwd", "inter_fwd")
            out["states.ROWS"][str(value)] = sum(measure(calls[k], iters) * 1e3 for k in parts)
    finally:
        tstates.ROWS = default
    return out


def _conv_sweep(conv_step: Callable[[], object], measure, iters: int) -> dict:
    from mcore.kernels.triton import conv as tconv

    out: dict = {}
    default = [getattr(tconv, name) for name in CONV_CONSTANTS]
    try:
        for values in CONV_TILES:
            for name, value in zip(CONV_CONSTANTS, values, strict=True):
                setattr(tconv, name, value)
            out["x".join(map(str, values))] = measure(conv_step, iters) * 1e3
    finally:
        for name, value in zip(CONV_CONSTANTS, default, strict=True):
            setattr(tconv, name, value)
    return out
