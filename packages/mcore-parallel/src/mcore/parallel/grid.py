"""The rank grid: which global ranks share a tensor-, pipeline-, data-, context- or expert-parallel group.

Ranks are laid out as in Megatron-Core with the order ``tp-cp-ep-dp-pp`` (``tp`` varies fastest):

* the dense grid uses ``tp-cp-dp-pp``: ``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``;
* the expert grid uses ``etp-ep-edp-pp`` over the same ranks (``edp = world / (etp * ep * pp)``), so both
  grids agree on the pipeline groups.

``rank_groups`` is a pure function of the config (testable without spawning); ``build_process_groups``
turns it into the ``dist.ProcessGroup`` objects of the calling rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import torch.distributed as dist

__all__ = [
    "GROUP_KINDS",
    "ParallelConfig",
    "ProcessGroups",
    "build_process_groups",
    "rank_groups",
]

# Every kind of group ``rank_groups`` returns, in the order ``build_process_groups`` creates them.
GROUP_KINDS = ("tp", "pp", "dp", "cp", "dp_cp", "tp_cp", "embedding", "ep", "etp", "expert_dp")


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of each kind of parallelism.

    ``dp`` is derived from the world size when omitted (``resolve``); ``etp`` (expert tensor parallelism)
    defaults to ``tp``. ``vpp`` is the number of model chunks per pipeline stage (interleaved schedule).
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("etp", "dp"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ParallelConfig.{f.name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"ParallelConfig.{f.name} must be >= 1, got {value}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"ParallelConfig.vpp={self.vpp} needs pipeline parallelism (pp > 1), got pp=1; set vpp=1 or pp >= 2"
            )

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (``etp``, or ``tp`` when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the dense model: ``tp * pp * cp``."""
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        """``tp * pp * cp * dp``; only defined once ``dp`` is known."""
        if self.dp is None:
            raise ValueError("ParallelConfig.world_size needs dp; call resolve(world_size) first")
        return self.model_parallel_size * self.dp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert grid: ``world / (etp * ep * pp)``."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    def resolve(self, world_size: int) -> ParallelConfig:
        """Return a copy with ``dp`` (and ``etp``) filled in for ``world_size``; errors name the numbers."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        mp = self.model_parallel_size
        if world_size % mp != 0:
            raise ValueError(
                f"world size {world_size} not divisible by tp*pp*cp = {mp} "
                f"(tp={self.tp}, pp={self.pp}, cp={self.cp}); choose sizes whose product divides {world_size}"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"ParallelConfig.dp={self.dp} but world size {world_size} / (tp*pp*cp = {mp}) = {dp}; "
                f"leave dp unset or set it to {dp}"
            )
        etp = self.expert_tp
        expert_mp = etp * self.ep * self.pp
        if world_size % expert_mp != 0:
            raise ValueError(
                f"world size {world_size} not divisible by etp*ep*pp = {expert_mp} "
                f"(etp={etp}, ep={self.ep}, pp={self.pp}); the expert grid must tile the world"
            )
        return replace(self, dp=dp, etp=etp)

    def check_model(
        self,
        *,
        num_layers: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        num_experts: int | None = None,
    ) -> None:
        """Raise ``ValueError`` when a model of these sizes cannot be split by this config."""
        if num_attention_heads is not None and num_attention_heads % self.tp != 0:
            raise ValueError(f"num_attention_heads={num_attention_heads} not divisible by tp={self.tp}")
        if num_key_value_heads is not None and num_key_value_heads % self.tp != 0:
            raise ValueError(
                f"num_key_value_heads={num_key_value_heads} not divisible by tp={self.tp}; "
                "use a tp that divides the number of KV heads"
            )
        if num_layers is not None and num_layers % (self.pp * self.vpp) != 0:
            raise ValueError(
                f"num_layers={num_layers} not divisible by pp*vpp = {self.pp * self.vpp} "
                f"(pp={self.pp}, vpp={self.vpp}); give the pipeline an explicit layout instead"
            )
        if num_experts is not None and num_experts % self.ep != 0:
            raise ValueError(f"num_experts={num_experts} not divisible by ep={self.ep}")


def _orthogonal_groups(sizes: Sequence[int], members: Sequence[bool]) -> list[list[int]]:
    """Groups of ranks that differ only in the dimensions flagged in ``members``.

    ``sizes`` lists the grid dimensions fastest first (rank = i0 + s0 * (i1 + s1 * (i2 + ...))). Groups are
    enumerated with the first non-member dimension varying fastest, and the ranks inside a group with the
    first member dimension varying fastest (Megatron's ``generate_masked_orthogonal_rank_groups`` order).
    """
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    inner = [i for i, m in enumerate(members) if m]
    outer = [i for i, m in enumerate(members) if not m]

    def combos(dims: list[int]):
        # itertools.product varies its last argument fastest; we want the first dimension fastest
        for idx in itertools.product(*(range(sizes[d]) for d in reversed(dims))):
            yield sum(i * strides[d] for i, d in zip(idx, reversed(dims)))

    return [[base + off for off in combos(inner)] for base in combos(outer)]


def rank_groups(config: ParallelConfig, world_size: int) -> dict[str, list[list[int]]]:
    """Every group of each kind in ``GROUP_KINDS`` for ``world_size`` ranks (pure; no process groups)."""
    cfg = config.resolve(world_size)
    dense = (cfg.tp, cfg.cp, cfg.dp, cfg.pp)  # tp-cp-dp-pp
    expert = (cfg.etp, cfg.ep, cfg.expert_dp, cfg.pp)  # etp-ep-edp-pp

    def dense_groups(*kinds: str) -> list[list[int]]:
        return _orthogonal_groups(dense, [k in kinds for k in ("tp", "cp", "dp", "pp")])

    def expert_groups(*kinds: str) -> list[list[int]]:
        return _orthogonal_groups(expert, [k in kinds for k in ("etp", "ep", "edp", "pp")])

    pp_groups = dense_groups("pp")
    return {
        "tp": dense_groups("tp"),
        "pp": pp_groups,
        "dp": dense_groups("dp"),
        "cp": dense_groups("cp"),
        "dp_cp": dense_groups("dp", "cp"),
        "tp_cp": dense_groups("tp", "cp"),
        # the word embedding lives on the first stage and its tied output copy on the last
        "embedding": [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups],
        "ep": expert_groups("ep"),
        "etp": expert_groups("etp"),
        "expert_dp": expert_groups("edp"),
    }


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of one rank and its coordinates in the grid.

    A group of size 1 is ``None`` (modules treat ``None`` as "no parallelism of that kind"), so
    ``ProcessGroups.single()`` and a one-rank world behave the same. ``group_ranks[kind]`` lists the global
    ranks of this rank's group of each kind; ``pp_prev_rank`` / ``pp_next_rank`` are global ranks of the
    neighbouring pipeline stages (wrapping around, as Megatron does).
    """

    config: ParallelConfig
    rank: int = 0
    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    dp_cp: dist.ProcessGroup | None = None
    tp_cp: dist.ProcessGroup | None = None
    embedding: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    etp: dist.ProcessGroup | None = None
    expert_dp: dist.ProcessGroup | None = None
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    dp_cp_rank: int = 0
    tp_cp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    expert_dp_rank: int = 0
    pp_prev_rank: int = 0
    pp_next_rank: int = 0
    group_ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def single(cls) -> ProcessGroups:
        """The all-size-1 value, usable without ``torch.distributed``."""
        return cls(config=ParallelConfig().resolve(1), group_ranks={k: (0,) for k in GROUP_KINDS})

    @property
    def tp_size(self) -> int:
        return self.config.tp

    @property
    def pp_size(self) -> int:
        return self.config.pp

    @property
    def dp_size(self) -> int:
        return self.config.dp

    @property
    def cp_size(self) -> int:
        return self.config.cp

    @property
    def dp_cp_size(self) -> int:
        return self.config.dp * self.config.cp

    @property
    def tp_cp_size(self) -> int:
        return self.config.tp * self.config.cp

    @property
    def ep_size(self) -> int:
        return self.config.ep

    @property
    def etp_size(self) -> int:
        return self.config.expert_tp

    @property
    def expert_dp_size(self) -> int:
        return self.config.expert_dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.config.pp - 1


def build_process_groups(
    config: ParallelConfig, backend: str | None = None, *, ranks: Sequence[int] | None = None
) -> ProcessGroups | None:
    """Create every process group of ``config`` and return the calling rank's ``ProcessGroups``.

    Collective: every rank of the world must call it with the same arguments (``dist.new_group`` is).
    ``backend`` defaults to the world's backend (NCCL on CUDA, gloo on CPU). ``ranks`` lays the grid over
    a subset of the world (grid rank ``i`` is global rank ``ranks[i]``); world ranks outside it get
    ``None``. Identical rank lists of different kinds share one ``ProcessGroup``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_process_groups needs torch.distributed: call dist.init_process_group first, "
            "or use ProcessGroups.single() in a single process"
        )
    world = dist.get_world_size()
    if ranks is None:
        ranks = list(range(world))
    else:
        ranks = [int(r) for r in ranks]
        bad = [r for r in ranks if not 0 <= r < world]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"ranks must be distinct global ranks in [0, {world}), got {ranks}")
    cfg = config.resolve(len(ranks))
    table = {kind: [[ranks[i] for i in g] for g in groups] for kind, groups in rank_groups(cfg, len(ranks)).items()}

    me = dist.get_rank()
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    mine: dict[str, dist.ProcessGroup | None] = {}
    my_ranks: dict[str, tuple[int, ...]] = {}
    for kind in GROUP_KINDS:
        mine[kind] = None
        for group in table[kind]:
            key = tuple(group)
            if len(key) > 1 and key not in created:
                # every rank creates every group in the same order: new_group is collective over the world
                created[key] = dist.new_group(list(key), backend=backend)
            if me in key:
                my_ranks[kind] = key
                mine[kind] = created.get(key)
    if me not in ranks:
        return None

    coords = {f"{kind}_rank": my_ranks[kind].index(me) for kind in GROUP_KINDS if kind != "embedding"}
    pp_ranks = my_ranks["pp"]
    return ProcessGroups(
        config=cfg,
        rank=me,
        group_ranks=my_ranks,
        pp_prev_rank=pp_ranks[(coords["pp_rank"] - 1) % len(pp_ranks)],
        pp_next_rank=pp_ranks[(coords["pp_rank"] + 1) % len(pp_ranks)],
        **mine,
        **coords,
    )
