"""The context-parallel groups of a whole rank grid, as :func:`~mcore.parallel.cp_attention.context_parallel_attention`
takes them.

``new_cp_groups`` (in ``cp_attention``) builds the groups of one CP group; a job has ``world / cp`` of them and
``dist.new_group`` is collective over the world, so every rank must create every group in the same order. This
module does that from the grid (:func:`mcore.parallel.grid.rank_groups`).
"""

from __future__ import annotations

import torch.distributed as dist

from mcore.parallel.cp_attention import CPGroups
from mcore.parallel.grid import ProcessGroups, rank_groups

__all__ = ["build_cp_groups"]


def build_cp_groups(groups: ProcessGroups, a2a_size: int = 1, backend: str | None = None) -> CPGroups:
    """This rank's :class:`CPGroups`; with ``a2a_size > 1`` (``a2a+p2p``) the a2a groups (``a2a_size`` consecutive
    CP ranks) and p2p rings (the same position in every a2a group) of every CP group are created (collective:
    every rank of the world calls it with the same arguments). ``groups.cp`` must be set (cp > 1)."""
    cp = groups.cp_size
    if groups.cp is None or cp < 2:
        raise ValueError(f"build_cp_groups: the grid has no CP group (cp={cp}); context parallelism needs cp > 1")
    if not isinstance(a2a_size, int) or a2a_size < 1 or cp % a2a_size:
        raise ValueError(f"build_cp_groups: a2a_size must be a positive divisor of cp={cp}, got {a2a_size!r}")
    if a2a_size == 1:
        return CPGroups(groups.cp)
    world = dist.get_world_size()
    table = rank_groups(groups.config, world)["cp"]
    mine = list(groups.group_ranks["cp"])
    if mine not in table:
        raise ValueError(
            f"build_cp_groups: this rank's CP group {mine} is not one of the grid's over the {world}-rank world; "
            "the grid must span the whole world"
        )
    me = dist.get_rank()
    a2a = p2p = None
    for cp_ranks in table:  # the same order on every rank: new_group is collective
        for first in range(0, cp, a2a_size):
            members = cp_ranks[first : first + a2a_size]
            group = dist.new_group(members, backend=backend)
            a2a = group if me in members else a2a
        for inner in range(a2a_size):
            members = cp_ranks[inner::a2a_size]
            group = dist.new_group(members, backend=backend)
            p2p = group if me in members else p2p
    return CPGroups(groups.cp, a2a, p2p, a2a_size)
