"""Rank grid: every group of every kind, computed without spawning, against Megatron-Core's RankGenerator
and against hand-derived layouts; invalid configs raise errors that name the numbers."""

from __future__ import annotations

import itertools
import warnings

import pytest

from mcore.parallel import GROUP_KINDS, ParallelConfig, ProcessGroups, rank_groups


def _megatron_groups(cfg: ParallelConfig) -> dict[str, list[list[int]]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        RankGenerator = pytest.importorskip("megatron.core.parallel_state").RankGenerator  # noqa: N806
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=cfg.tp, ep=1, dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, order=order)
    expert = RankGenerator(tp=cfg.etp, ep=cfg.ep, dp=cfg.expert_dp, pp=cfg.pp, cp=1, order=order)
    pp_groups = dense.get_ranks("pp")
    return {
        "tp": dense.get_ranks("tp"),
        "pp": pp_groups,
        "dp": dense.get_ranks("dp"),
        "cp": dense.get_ranks("cp"),
        "dp_cp": dense.get_ranks("dp-cp"),
        "tp_cp": dense.get_ranks("tp-cp"),
        "embedding": [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups],
        "ep": expert.get_ranks("ep"),
        "etp": expert.get_ranks("tp"),
        "expert_dp": expert.get_ranks("dp"),
    }


def _all_configs(world: int):
    for tp, pp, cp, ep, etp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2), (1, 2, 4), (None, 1, 2)):
        try:
            yield ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp).resolve(world)
        except ValueError:
            continue


@pytest.mark.parametrize("world", [8, 16])
def test_every_group_matches_megatron_rank_generator(world):
    configs = list(_all_configs(world))
    assert len(configs) > 40
    for cfg in configs:
        ours = rank_groups(cfg, world)
        assert set(ours) == set(GROUP_KINDS)
        assert ours == _megatron_groups(cfg), cfg


@pytest.mark.parametrize("world", [8, 16])
def test_every_rank_sits_once_in_each_kind_with_consistent_coordinates(world):
    for cfg in _all_configs(world):
        groups = rank_groups(cfg, world)
        for kind in GROUP_KINDS:
            if kind == "embedding":
                continue
            flat = sorted(r for g in groups[kind] for r in g)
            assert flat == list(range(world)), (cfg, kind)
        # the documented dense formula: rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))
        for rank in range(world):
            tp_r = rank % cfg.tp
            cp_r = (rank // cfg.tp) % cfg.cp
            dp_r = (rank // (cfg.tp * cfg.cp)) % cfg.dp
            pp_r = rank // (cfg.tp * cfg.cp * cfg.dp)
            for kind, index in (("tp", tp_r), ("cp", cp_r), ("dp", dp_r), ("pp", pp_r)):
                (g,) = [g for g in groups[kind] if rank in g]
                assert g.index(rank) == index, (cfg, kind, rank)


def test_world8_layout_written_out():
    g = rank_groups(ParallelConfig(tp=2, pp=2), 8)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == g["dp"] and g["tp_cp"] == g["tp"]
    assert g["cp"] == [[r] for r in range(8)]


def test_world16_layout_with_cp_and_experts_written_out():
    cfg = ParallelConfig(tp=2, cp=2, pp=2, ep=2, etp=1).resolve(16)
    assert cfg.dp == 2 and cfg.expert_dp == 4
    g = rank_groups(cfg, 16)
    assert g["tp"][:2] == [[0, 1], [2, 3]]
    assert g["cp"][:3] == [[0, 2], [1, 3], [4, 6]]
    assert g["dp"][:3] == [[0, 4], [1, 5], [2, 6]]
    assert g["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["tp_cp"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["pp"][:2] == [[0, 8], [1, 9]]
    # expert grid etp-ep-edp-pp with etp=1, ep=2: ep pairs neighbours, edp strides by 2
    assert g["etp"][:2] == [[0], [1]]
    assert g["ep"][:2] == [[0, 1], [2, 3]]
    assert g["expert_dp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_embedding_group_is_first_and_last_stage():
    g = rank_groups(ParallelConfig(tp=1, pp=4), 8)
    assert g["pp"][0] == [0, 2, 4, 6]
    assert g["embedding"][0] == [0, 6]
    assert rank_groups(ParallelConfig(tp=2), 8)["embedding"] == [[r] for r in range(8)]


def test_resolve_derives_dp_and_etp():
    cfg = ParallelConfig(tp=2, pp=2).resolve(16)
    assert (cfg.dp, cfg.etp, cfg.world_size) == (4, 2, 16)
    assert ParallelConfig(tp=2, pp=2, dp=4).resolve(16) == cfg


@pytest.mark.parametrize(
    ("kwargs", "world", "exc", "pattern"),
    [
        ({"tp": 2, "pp": 2}, 6, ValueError, r"world size 6 not divisible by tp\*pp\*cp = 4"),
        ({"tp": 2, "cp": 3}, 8, ValueError, r"world size 8 not divisible by tp\*pp\*cp = 6 \(tp=2, pp=1, cp=3\)"),
        ({"tp": 2, "dp": 3}, 8, ValueError, r"dp=3 but world size 8 / \(tp\*pp\*cp = 2\) = 4"),
        ({"tp": 1, "ep": 3}, 8, ValueError, r"world size 8 not divisible by etp\*ep\*pp = 3"),
        ({"tp": 2, "ep": 4, "etp": 4}, 8, ValueError, r"etp\*ep\*pp = 16"),
    ],
)
def test_invalid_world_sizes_name_the_numbers(kwargs, world, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ParallelConfig(**kwargs).resolve(world)
    with pytest.raises(exc, match=pattern):
        rank_groups(ParallelConfig(**kwargs), world)


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"tp": 0}, ValueError, r"tp must be >= 1, got 0"),
        ({"pp": -2}, ValueError, r"pp must be >= 1, got -2"),
        ({"tp": 2.0}, TypeError, r"tp must be an int, got float 2.0"),
        ({"cp": True}, TypeError, r"cp must be an int, got bool"),
        ({"vpp": 2}, ValueError, r"vpp=2 needs pipeline parallelism \(pp > 1\), got pp=1"),
        ({"etp": 0}, ValueError, r"etp must be >= 1, got 0"),
    ],
)
def test_invalid_fields_raise_at_construction(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ParallelConfig(**kwargs)


def test_check_model_names_the_numbers():
    cfg = ParallelConfig(tp=4, pp=2, vpp=2)
    cfg.check_model(num_layers=8, num_attention_heads=32, num_key_value_heads=8)
    with pytest.raises(ValueError, match="num_attention_heads=6 not divisible by tp=4"):
        cfg.check_model(num_attention_heads=6)
    with pytest.raises(ValueError, match="num_key_value_heads=2 not divisible by tp=4"):
        cfg.check_model(num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"num_layers=6 not divisible by pp\*vpp = 4"):
        cfg.check_model(num_layers=6)


def test_single_is_all_size_one_without_distributed():
    g = ProcessGroups.single()
    assert all(getattr(g, k) is None for k in GROUP_KINDS)
    assert (g.tp_size, g.pp_size, g.dp_size, g.dp_cp_size, g.expert_dp_size) == (1, 1, 1, 1, 1)
    assert g.is_first_stage and g.is_last_stage and g.tp_rank == 0
