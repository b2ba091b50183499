"""Expert-parallel parameters in checkpoints: saved whole over ep (and over etp when it differs from tp), so that
any ``parallel.ep`` / ``parallel.etp`` loads them.

An MoE layer's expert weights (``experts.gate_up`` [E/ep, 2F/etp, H], ``experts.down`` [E/ep, H, F/etp]; marked
``expert_parallel``) hold, on ep rank ``r``, global experts ``[r E/ep, (r+1) E/ep)``. At save time each is
all-gathered over the ep group along dim 0 (every rank joins; the dp-rank-0 writers then hold all ``E`` experts)
and its metadata records the full ``E`` rows. With expert tensor parallelism equal to tensor parallelism
(``etp`` unset, the default) the FFN slices follow the TP shard files like any TP-split weight. With ``etp !=
tp`` (etp > 1) the etp slices live on other ranks than the TP shards: they are all-gathered over the etp group too
(block by block, so ``gate_up`` stays ``[gate; up]``) and saved unsplit, in the tp-rank-0 files. At load time a
rank reads its FFN slice (over tp, or etp when that differs) of all experts and keeps its own experts' rows. The
same holds for the optimizer states (``master``, ``exp_avg``, ``exp_avg_sq``) of those parameters.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore.parallel.comm import all_gather_into
from mcore.parallel.grid import ProcessGroups
from mcore.parallel.param_attrs import tp_split
from mcore.train.checkpoint.format import TensorMeta

__all__ = [
    "expert_split",
    "expert_tp",
    "full_expert_meta",
    "gather_experts",
    "local_experts",
    "saved_unsplit_over_etp",
]


def _is_expert(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def expert_split(param: torch.Tensor, groups: ProcessGroups) -> tuple[int, int]:
    """``(ep size, ep rank)`` over which ``param``'s dim 0 is split: ``(1, 0)`` for any other parameter."""
    if _is_expert(param) and groups.ep_size > 1:
        return groups.ep_size, groups.ep_rank
    return 1, 0


def saved_unsplit_over_etp(param: torch.Tensor, groups: ProcessGroups) -> bool:
    """Whether ``param`` is an expert weight split over an etp group other than tp (saved gathered over etp)."""
    return _is_expert(param) and tp_split(param) is not None and groups.etp_size != groups.tp_size


def expert_tp(param: torch.Tensor, groups: ProcessGroups) -> tuple[int, int]:
    """``(size, rank)`` of the tensor-parallel split ``param`` follows: etp for expert weights, else tp."""
    if _is_expert(param) and tp_split(param) is not None:
        return groups.etp_size, groups.etp_rank
    return groups.tp_size, groups.tp_rank


def _gather(local: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    """All-gather ``local`` over ``group`` along ``dim`` (rank order), collective."""
    moved = local.movedim(dim, 0).contiguous()
    full = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    all_gather_into(full, moved, group)
    return full.movedim(0, dim)


def _gather_over_etp(local: torch.Tensor, param: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    split = tp_split(param)
    etp, dim = groups.etp_size, split.dim
    blocks = split.blocks or (local.shape[dim] * etp,)
    pieces = local.split([b // etp for b in blocks], dim=dim)  # this rank's slice of each block
    return torch.cat([_gather(p, groups.etp, etp, dim) for p in pieces], dim=dim)


def gather_experts(tensor: torch.Tensor, param: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """All experts (and, with etp != tp, the whole FFN) of ``tensor`` (``param``'s local value or one of its
    optimizer states): collective over etp / ep for an expert-parallel parameter (every rank of those groups must
    call it in the same order), ``tensor`` itself otherwise."""
    out = tensor.detach()
    if saved_unsplit_over_etp(param, groups):
        out = _gather_over_etp(out, param, groups)
    ep, _ = expert_split(param, groups)
    return out if ep == 1 else _gather(out, groups.ep, ep, 0)


def full_expert_meta(meta: TensorMeta, param: torch.Tensor, groups: ProcessGroups) -> TensorMeta:
    """``meta`` with dim 0 counting every expert (``E`` instead of this rank's ``E / ep``), and unsplit (the full
    FFN width, no partition) for an expert weight saved gathered over etp."""
    if not _is_expert(param):
        return meta
    shape = list(meta.shape)
    shape[0] *= expert_split(param, groups)[0]
    if saved_unsplit_over_etp(param, groups):
        split = tp_split(param)
        shape[split.dim] = param.shape[split.dim] * groups.etp_size
        return dataclasses.replace(meta, shape=tuple(shape), partition_dim=None, partition_blocks=None)
    return dataclasses.replace(meta, shape=tuple(shape))


def local_experts(full: torch.Tensor, param: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """This ep rank's experts (rows of dim 0) of the all-experts tensor ``full``."""
    ep, rank = expert_split(param, groups)
    if ep == 1:
        return full
    local = full.shape[0] // ep
    return full.narrow(0, rank * local, local)
