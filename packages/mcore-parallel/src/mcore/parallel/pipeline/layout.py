"""Which transformer layers each pipeline stage holds.

A model of ``num_layers`` layers is cut into ``pp * vpp`` *virtual stages*, contiguous in layer order. With
interleaving (``vpp > 1``) rank ``r`` holds ``vpp`` model chunks and chunk ``c`` is virtual stage ``c * pp + r``
(Megatron-Core's interleaving): a micro-batch travels rank 0, 1, ..., pp-1, then back to rank 0 for the next chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["stage_layer_ranges", "virtual_stage_index"]


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def virtual_stage_index(pp_rank: int, chunk: int, pp: int) -> int:
    """The virtual stage held by model chunk ``chunk`` of pipeline rank ``pp_rank`` (``chunk * pp + pp_rank``)."""
    return chunk * pp + pp_rank


def stage_layer_ranges(
    num_layers: int, pp: int, vpp: int = 1, layout: Sequence[int] | None = None
) -> list[list[tuple[int, int]]]:
    """Split ``num_layers`` layers over ``pp`` ranks with ``vpp`` model chunks each.

    Returns ``ranges[pp_rank][chunk] = (start, end)``, the half-open range of global layer indices of that chunk.

    ``layout`` gives the number of layers of each virtual stage, in virtual-stage order (``pp * vpp`` entries
    summing to ``num_layers``; entry ``c * pp + r`` is chunk ``c`` of rank ``r``). Use it to put fewer layers on
    the first and last stage, which also carry the embedding and the output layer; a stage may hold 0 layers.
    Without ``layout`` the split is even and ``num_layers`` must be divisible by ``pp * vpp``.
    """
    _check_positive_int("num_layers", num_layers)
    _check_positive_int("pp", pp)
    _check_positive_int("vpp", vpp)
    stages = pp * vpp
    if layout is None:
        if num_layers % stages != 0:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by pp*vpp={pp}*{vpp}={stages}, so the layers cannot be "
                f"split evenly; choose num_layers a multiple of {stages}, change pp/vpp, or pass "
                f"layout=[layers of each of the {stages} virtual stages] summing to {num_layers}"
            )
        counts = [num_layers // stages] * stages
    else:
        counts = list(layout)
        if len(counts) != stages:
            raise ValueError(
                f"layout has {len(counts)} entries but pp*vpp={pp}*{vpp}={stages} virtual stages need one entry "
                f"each (layers of virtual stage c*pp+r = chunk c of rank r)"
            )
        for i, n in enumerate(counts):
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"layout[{i}] must be an int number of layers, got {type(n).__name__} ({n!r})")
            if n < 0:
                raise ValueError(f"layout[{i}] must be >= 0 layers, got {n}")
        if sum(counts) != num_layers:
            raise ValueError(
                f"layout {counts} sums to {sum(counts)} layers but num_layers={num_layers}; "
                f"the entries must add up to num_layers"
            )
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    return [
        [(starts[virtual_stage_index(r, c, pp)], starts[virtual_stage_index(r, c, pp) + 1]) for c in range(vpp)]
        for r in range(pp)
    ]
