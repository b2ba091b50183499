"""Expert-parallel parameters in checkpoints: saved whole, so that any ``parallel.ep`` loads them.

An MoE layer's expert weights (``experts.gate_up`` [E/ep, 2F/etp, H], ``experts.down`` [E/ep, H, F/etp]; marked
``expert_parallel``) hold, on ep rank ``r``, global experts ``[r E/ep, (r+1) E/ep)``. At save time each is
all-gathered over the ep group along dim 0 (every rank joins; the dp-rank-0 writers then hold all ``E``
experts), and its metadata records the full ``E`` rows: the file is the one an ep=1 run writes, its TP slices
resharded by the usual rules. At load time a rank reads the full-``E`` tensor of its TP slice and keeps its own
experts' rows. The same holds for the optimizer states (``master``, ``exp_avg``, ``exp_avg_sq``) of those
parameters. Expert TP that differs from TP (``parallel.etp != parallel.tp``) puts the FFN slices on other
ranks than the TP shards and is refused by the config.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore.parallel.comm import all_gather_into
from mcore.parallel.grid import ProcessGroups
from mcore.train.checkpoint.format import TensorMeta

__all__ = ["expert_split", "full_expert_meta", "gather_experts", "local_experts"]


def expert_split(param: torch.Tensor, groups: ProcessGroups) -> tuple[int, int]:
    """``(ep size, ep rank)`` over which ``param``'s dim 0 is split: ``(1, 0)`` for any other parameter."""
    if getattr(param, "expert_parallel", False) and groups.ep_size > 1:
        return groups.ep_size, groups.ep_rank
    return 1, 0


def gather_experts(tensor: torch.Tensor, param: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """All experts of ``tensor`` (``param``'s local value or one of its optimizer states): collective over ep for
    an expert-parallel parameter (every ep rank must call it in the same order), ``tensor`` itself otherwise."""
    ep, _ = expert_split(param, groups)
    if ep == 1:
        return tensor
    local = tensor.detach().contiguous()
    full = torch.empty((ep * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    all_gather_into(full, local, groups.ep)
    return full


def full_expert_meta(meta: TensorMeta, param: torch.Tensor, groups: ProcessGroups) -> TensorMeta:
    """``meta`` with dim 0 counting every expert (``E`` instead of this rank's ``E / ep``)."""
    ep, _ = expert_split(param, groups)
    if ep == 1:
        return meta
    return dataclasses.replace(meta, shape=(meta.shape[0] * ep, *meta.shape[1:]))


def local_experts(full: torch.Tensor, param: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """This ep rank's experts (rows of dim 0) of the all-experts tensor ``full``."""
    ep, rank = expert_split(param, groups)
    if ep == 1:
        return full
    local = full.shape[0] // ep
    return full.narrow(0, rank * local, local)
