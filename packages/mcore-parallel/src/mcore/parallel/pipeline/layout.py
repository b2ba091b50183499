"""Which transformer layers each pipeline stage holds.

A model of ``num_layers`` layers is cut into ``pp * vpp`` *virtual stages*, contiguous in layer order. With
interleaving (``vpp > 1``) rank ``r`` holds ``vpp`` model chunks and chunk ``c`` is virtual stage ``c * pp + r``
(Megatron-Core's interleaving): a micro-batch travels rank 0, 1, ..., pp-1, then back to rank 0 for the next chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_layout", "stage_layer_ranges", "virtual_stage_index"]


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


def _fill(count: int, extras: Sequence[float]) -> list[int]:
    """Hand out ``count`` equal items one by one to the bin of lowest load (its items + its extra; ties: the
    lowest index): the integer split minimizing the heaviest bin."""
    n = [0] * len(extras)
    for _ in range(count):
        i = min(range(len(extras)), key=lambda j: (n[j] + extras[j], j))
        n[i] += 1
    return n


def balanced_layout(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    *,
    first_stage_extra: float = 0.0,
    last_stage_extra: float = 0.0,
    layer_costs: Sequence[float] | None = None,
) -> list[int]:
    """A ``layout`` for :func:`stage_layer_ranges` that evens out the work of the pipeline ranks.

    The first virtual stage also runs the embedding and the last one the output layer and the loss; their cost
    is given in units of one transformer layer (``last_stage_extra=2.4``: the output layer costs 2.4 layers, as
    for a Llama-3-8B layer shape with its 128k vocabulary). Layers go to the ranks so that the heaviest rank is as
    light as possible, then each rank's layers to its ``vpp`` chunks the same way (the chunk carrying the
    output layer gets fewer). The pipeline runs at the pace of its heaviest rank, so this matters most when the
    output layer is large relative to a layer (big vocabularies, few layers per stage).

    ``layer_costs`` (one per layer, in the same unit as the extras) is for models whose layers differ (hybrids of
    attention and Mamba, MoE and dense layers): the contiguous split of the layers into the ``pp * vpp`` virtual
    stages that makes the heaviest virtual stage lightest (with ``vpp > 1`` this balances chunks, and so ranks
    up to one chunk's imbalance). Equal costs give the same layout as without them.
    """
    _check_positive_int("num_layers", num_layers)
    _check_positive_int("pp", pp)
    _check_positive_int("vpp", vpp)
    for name, extra in (("first_stage_extra", first_stage_extra), ("last_stage_extra", last_stage_extra)):
        if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not extra >= 0:
            raise ValueError(f"{name} must be a number >= 0 (cost in transformer layers), got {extra!r}")
    if layer_costs is not None:
        costs = _check_costs(layer_costs, num_layers)
        if len(set(costs)) > 1:
            extras = [0.0] * (pp * vpp)
            extras[0] += first_stage_extra
            extras[-1] += last_stage_extra
            return _contiguous_partition(costs, extras)
        first_stage_extra, last_stage_extra = first_stage_extra / costs[0], last_stage_extra / costs[0]
    rank_extra = [0.0] * pp
    rank_extra[0] += first_stage_extra
    rank_extra[pp - 1] += last_stage_extra
    per_rank = _fill(num_layers, rank_extra)
    layout = [0] * (pp * vpp)
    for r in range(pp):
        chunk_extra = [0.0] * vpp
        if r == 0:
            chunk_extra[0] += first_stage_extra
        if r == pp - 1:
            chunk_extra[vpp - 1] += last_stage_extra
        for c, n in enumerate(_fill(per_rank[r], chunk_extra)):
            layout[virtual_stage_index(r, c, pp)] = n
    return layout


def _check_costs(layer_costs: Sequence[float], num_layers: int) -> list[float]:
    costs = list(layer_costs)
    if len(costs) != num_layers:
        raise ValueError(f"layer_costs has {len(costs)} entries but num_layers={num_layers}; give one per layer")
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, int | float) or not c > 0:
            raise ValueError(f"layer_costs[{i}] must be a number > 0, got {c!r}")
    return [float(c) for c in costs]


def _contiguous_partition(costs: list[float], extras: list[float]) -> list[int]:
    """Layers per part of the contiguous split of ``costs`` into ``len(extras)`` parts (part ``j`` also carries
    ``extras[j]``) minimising the heaviest part: dynamic programming over (parts used, layers placed)."""
    n, parts = len(costs), len(extras)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: lowest possible heaviest load placing the first i layers into the first j parts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        for i in range(n + 1):
            for k in range(i + 1):  # part j takes layers k..i-1 (possibly none)
                load = max(best[j - 1][k], prefix[i] - prefix[k] + extras[j - 1])
                if load < best[j][i]:
                    best[j][i], cut[j][i] = load, k
    counts, i = [0] * parts, n
    for j in range(parts, 0, -1):
        counts[j - 1] = i - cut[j][i]
        i = cut[j][i]
    return counts
