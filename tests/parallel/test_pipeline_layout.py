"""Stage layouts: which layers each pipeline rank and model chunk holds."""

from __future__ import annotations

import itertools

import pytest

from mcore.parallel.pipeline import balanced_layout, stage_layer_ranges, virtual_stage_index


def test_even_split_without_interleaving():
    assert stage_layer_ranges(8, 4) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]


def test_interleaved_chunk_c_of_rank_r_is_virtual_stage_c_times_pp_plus_r():
    ranges = stage_layer_ranges(16, 4, vpp=2)
    assert ranges[0] == [(0, 2), (8, 10)]
    assert ranges[3] == [(6, 8), (14, 16)]
    for r in range(4):
        for c in range(2):
            s = virtual_stage_index(r, c, 4)
            assert ranges[r][c] == (2 * s, 2 * s + 2)


def test_every_layer_is_held_exactly_once():
    for layers, pp, vpp, layout in [(12, 3, 2, None), (10, 4, 1, [1, 4, 4, 1]), (7, 2, 2, [0, 3, 3, 1])]:
        ranges = stage_layer_ranges(layers, pp, vpp, layout)
        held = sorted(i for rank in ranges for start, end in rank for i in range(start, end))
        assert held == list(range(layers))


def test_layout_puts_fewer_layers_on_the_first_and_last_stage():
    assert stage_layer_ranges(10, 4, layout=[1, 4, 4, 1]) == [[(0, 1)], [(1, 5)], [(5, 9)], [(9, 10)]]
    # a stage may hold only the embedding (or only the output layer)
    assert stage_layer_ranges(4, 2, layout=[0, 4]) == [[(0, 0)], [(0, 4)]]


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((10, 4), ValueError, r"num_layers=10 is not divisible by pp\*vpp=4\*1=4, .* layout="),
        ((12, 4, 2), ValueError, r"num_layers=12 is not divisible by pp\*vpp=4\*2=8"),
        ((10, 4, 1, [1, 4, 4]), ValueError, r"layout has 3 entries but pp\*vpp=4\*1=4"),
        ((10, 4, 1, [1, 4, 4, 2]), ValueError, r"sums to 11 layers but num_layers=10"),
        ((10, 2, 1, [11, -1]), ValueError, r"layout\[1\] must be >= 0 layers, got -1"),
        ((10, 2, 1, [5.0, 5]), TypeError, r"layout\[0\] must be an int"),
        ((10, 0), ValueError, r"pp must be >= 1, got 0"),
        ((10, 2, True), TypeError, r"vpp must be an int"),
    ],
)
def test_invalid_layouts_name_the_numbers(args, error, message):
    with pytest.raises(error, match=message):
        stage_layer_ranges(*args)


def _rank_costs(layout, pp, first, last):
    costs = [0.0] * pp
    for v, n in enumerate(layout):
        costs[v % pp] += n
    costs[0] += first
    costs[pp - 1] += last
    return costs


def test_balanced_layout_moves_layers_off_the_output_stage():
    # Llama-3-8B layer shape with 4 layers: the 128k-vocabulary output layer costs ~2.4 layers
    assert balanced_layout(4, 2, last_stage_extra=2.4) == [3, 1]
    # interleaved: the rank with the output layer gets fewer layers, and its last chunk (with the output) none
    assert balanced_layout(4, 2, 2, last_stage_extra=2.4) == [2, 1, 1, 0]
    assert balanced_layout(8, 4) == [2, 2, 2, 2]  # nothing extra: the even split
    layout = balanced_layout(30, 4, 2, first_stage_extra=0.5, last_stage_extra=3.0)
    assert sum(layout) == 30 and len(layout) == 8
    ranges = stage_layer_ranges(30, 4, 2, layout)
    assert sorted(i for rank in ranges for a, b in rank for i in range(a, b)) == list(range(30))


@pytest.mark.parametrize(("layers", "pp"), [(4, 2), (7, 3), (9, 4), (12, 3)])
@pytest.mark.parametrize(("first", "last"), [(0.0, 2.4), (0.3, 1.0), (1.5, 0.0), (0.0, 7.0)])
def test_balanced_layout_minimizes_the_heaviest_rank(layers, pp, first, last):
    """Against every split of the layers over the ranks (vpp=1)."""
    got = max(_rank_costs(balanced_layout(layers, pp, first_stage_extra=first, last_stage_extra=last), pp, first, last))
    best = min(
        max(_rank_costs(split, pp, first, last))
        for split in itertools.product(range(layers + 1), repeat=pp)
        if sum(split) == layers
    )
    assert got == pytest.approx(best)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"last_stage_extra": -1.0}, "last_stage_extra must be a number >= 0"), ({"first_stage_extra": "x"}, "first")],
)
def test_balanced_layout_rejects_bad_extras(kwargs, message):
    with pytest.raises(ValueError, match=message):
        balanced_layout(4, 2, **kwargs)


def _brute_force_max_load(costs, parts, extras):
    """The lowest heaviest-part load over every contiguous split (small cases only)."""
    import itertools

    n, best = len(costs), float("inf")
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        bounds = (0, *cuts, n)
        load = max(sum(costs[bounds[j] : bounds[j + 1]]) + extras[j] for j in range(parts))
        best = min(best, load)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_layout_with_unequal_layer_costs_is_the_best_contiguous_split(seed):
    import random

    rng = random.Random(seed)
    n, pp, vpp = rng.randint(3, 8), rng.choice([2, 3]), rng.choice([1, 2])
    costs = [rng.choice([1.0, 2.5, 0.4]) for _ in range(n)]
    costs[0] += 0.1  # never all equal
    extra = rng.uniform(0, 3)
    layout = balanced_layout(n, pp, vpp, last_stage_extra=extra, layer_costs=costs)
    assert len(layout) == pp * vpp and sum(layout) == n and min(layout) >= 0
    extras = [0.0] * (pp * vpp)
    extras[-1] = extra
    starts = [0]
    for k in layout:
        starts.append(starts[-1] + k)
    got = max(sum(costs[starts[j] : starts[j + 1]]) + extras[j] for j in range(pp * vpp))
    assert got == pytest.approx(_brute_force_max_load(costs, pp * vpp, extras))


def test_balanced_layout_with_equal_costs_is_the_uniform_one():
    for n, pp, vpp, extra in [(8, 2, 1, 2.4), (12, 3, 2, 1.1), (4, 2, 2, 2.4)]:
        plain = balanced_layout(n, pp, vpp, last_stage_extra=extra)
        assert balanced_layout(n, pp, vpp, last_stage_extra=2 * extra, layer_costs=[2.0] * n) == plain


def test_balanced_layout_rejects_bad_layer_costs():
    with pytest.raises(ValueError, match="layer_costs has 3 entries but num_layers=4"):
        balanced_layout(4, 2, layer_costs=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"layer_costs\[1\] must be a number > 0"):
        balanced_layout(2, 2, layer_costs=[1.0, 0.0])
