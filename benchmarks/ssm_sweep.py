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
# mcore.kernels.triton.conv: each tile constant (its candidates: conv.TILE_CANDIDATES, the default first), the kernel
# whose GPU time decides it, and the backward path that launches that kernel
CONV_KERNELS = {
    "FWD_TILE": ("_conv_fwd_kernel", "split"),
    "DX_TILE": ("_conv_dx_kernel", "split"),
    "DPRE_TILE": ("_conv_dpre_kernel", "split"),
    "FUSED_TILE": ("_conv_bwd_fused_kernel", "fused"),
    "DW_TILE": ("_conv_dw_kernel", "split"),
}


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
          iters: int, parts: tuple[str, ...] = ("ssd", "conv"), conv_kernel_ms=None) -> dict:  # fmt: skip
    """``{"ssd": {constant: {value: ms}}, "conv": ...}`` (see :func:`_conv_sweep`) for the ``parts`` asked; which
    kernels an SSD constant affects is summed; ``conv_step`` runs the conv forward + backward with whatever tiles are
    set, ``conv_kernel_ms(step, iters)`` gives ``{kernel name: ms}`` of one step (on CUDA the benchmark passes the
    profiler's GPU kernel times: host overhead would hide the tiles' differences; by default ``{"*": wall ms}``, one
    number standing for every kernel)."""
    out: dict = {}
    if "ssd" in parts:
        out["ssd"] = _ssd_sweep(s, device, dtype, measure, iters)
    if "conv" in parts:
        out["conv"] = _conv_sweep(conv_step, conv_kernel_ms or (lambda fn, n: {"*": measure(fn, n) * 1e3}), iters)
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


def _conv_sweep(conv_step: Callable[[], object], kernel_ms, iters: int) -> dict:
    """Each conv tile constant's candidates timed by its own kernel's ms (``{constant: {label: ms or error}}``), then
    the whole step on each backward path with every kernel at its fastest tile (``"BACKWARD": {path: ms}``), and
    ``"best"``: what to make the defaults (``{constant: label, "BACKWARD": path}``). The defaults are restored."""
    from mcore.kernels.triton import conv as tconv

    saved = {name: getattr(tconv, name) for name in (*CONV_KERNELS, "BACKWARD")}
    out: dict = {}
    best: dict = {}
    try:
        for name, (kernel, path) in CONV_KERNELS.items():
            tconv.BACKWARD = path
            out[name] = {}
            for tile in tconv.TILE_CANDIDATES[name]:
                setattr(tconv, name, tile)
                out[name][tile.label] = _conv_ms(conv_step, kernel_ms, iters, kernel)
            setattr(tconv, name, saved[name])
            timed = {t: out[name][t.label] for t in tconv.TILE_CANDIDATES[name]}
            timed = {t: ms for t, ms in timed.items() if isinstance(ms, float)}
            if timed:
                best[name] = min(timed, key=timed.get)
        for name, tile in best.items():
            setattr(tconv, name, tile)
        out["BACKWARD"] = {}
        for path in tconv.BACKWARDS:
            tconv.BACKWARD = path
            out["BACKWARD"][path] = _conv_ms(conv_step, kernel_ms, iters, None)
    finally:
        for name, value in saved.items():
            setattr(tconv, name, value)
    paths = {p: ms for p, ms in out["BACKWARD"].items() if isinstance(ms, float)}
    out["best"] = {name: tile.label for name, tile in best.items()}
    if paths:
        out["best"]["BACKWARD"] = min(paths, key=paths.get)
    return out


def _conv_ms(conv_step: Callable[[], object], kernel_ms, iters: int, kernel: str | None) -> float | str:
    """GPU ms of ``kernel`` in one conv step (all kernels when ``None``), or the error that stopped it (a tile that
    does not build on this GPU loses; the sweep goes on)."""
    try:
        times = kernel_ms(conv_step, iters)
    except Exception as exc:  # recorded in the sweep's table
        return f"error: {type(exc).__name__}: {exc}"[:500]
    if kernel is None:
        return float(sum(times.values()))
    if kernel in times or "*" in times:
        return float(times.get(kernel, times.get("*")))
    return f"error: {kernel} did not run (kernels: {sorted(times)})"
