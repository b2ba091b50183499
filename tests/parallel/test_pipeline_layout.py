"""Stage layouts: which layers each pipeline rank and model chunk holds."""

from __future__ import annotations

import pytest

from mcore.parallel.pipeline import stage_layer_ranges, virtual_stage_index


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
