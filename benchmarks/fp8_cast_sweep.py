"""Tile sweep of the fused fp8 casts (``fp8.py --sweep-casts``): each launch-shape constant of
``mcore.kernels.triton.quant_fused`` (its candidates: ``TILE_CANDIDATES``, the default first) is set, the fused
operand-and-transpose casts it shapes are timed on one tensor, and the defaults are restored, so that the next run
can take the best. The amax and dual-cast tiles shape the tensor- and row-wise casts (their two passes), the block
tile the 1x128 and 128x128 ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# quant_fused constant -> the granularities whose fused q + q^T cast it shapes
CAST_SWEEP = {
    "AMAX_TILE": ("tensor", "row"),
    "CAST_TILE": ("tensor", "row"),
    "BLOCK_TILE": ("1x128", "128x128"),
}


def label(tile: tuple[int, ...]) -> str:
    return "x".join(map(str, tile))


def sweep_casts(x: torch.Tensor, time_cast: Callable[[torch.Tensor, str], float]) -> dict[str, Any]:
    """``{constant: {label: ms or error}, "best": {constant: label}}``: each constant's candidates, in
    :data:`CAST_SWEEP` order with the constants before it at their fastest, timed as the summed ``time_cast(x,
    granularity)`` (ms) of the granularities it shapes; a candidate that fails (does not build, say) is recorded
    and loses. The module's defaults are restored."""
    from mcore.kernels.triton import quant_fused as qf

    saved = {name: getattr(qf, name) for name in CAST_SWEEP}
    out: dict[str, Any] = {}
    best: dict[str, tuple[int, ...]] = {}
    try:
        for name, granularities in CAST_SWEEP.items():
            out[name] = {}
            for tile in qf.TILE_CANDIDATES[name]:
                setattr(qf, name, tile)
                try:
                    out[name][label(tile)] = float(sum(time_cast(x, g) for g in granularities))
                except Exception as exc:  # recorded in the sweep's table
                    out[name][label(tile)] = f"error: {type(exc).__name__}: {exc}"[:300]
            timed = {t: out[name][label(t)] for t in qf.TILE_CANDIDATES[name]}
            timed = {t: ms for t, ms in timed.items() if isinstance(ms, float)}
            if timed:
                best[name] = min(timed, key=timed.get)
            setattr(qf, name, best.get(name, saved[name]))
    finally:
        for name, value in saved.items():
            setattr(qf, name, value)
    out["best"] = {name: label(tile) for name, tile in best.items()}
    return out


def apply_tiles(best: dict[str, str]) -> dict[str, str]:
    """Set ``quant_fused``'s constants to the labels in ``best`` (a sweep's ``"best"``: ``{constant: "AxBxC"}``)
    for the rest of this process; returns every swept constant's label now in force."""
    from mcore.kernels.triton import quant_fused as qf

    for name, value in best.items():
        if name not in CAST_SWEEP:
            raise KeyError(f"apply_tiles: {name!r} is not a swept constant; expected one of {sorted(CAST_SWEEP)}")
        tile = tuple(int(v) for v in value.split("x"))
        if tile not in qf.TILE_CANDIDATES[name]:
            raise ValueError(f"apply_tiles: {name}={value} is not among its candidates {qf.TILE_CANDIDATES[name]}")
        setattr(qf, name, tile)
    return {name: label(getattr(qf, name)) for name in CAST_SWEEP}
