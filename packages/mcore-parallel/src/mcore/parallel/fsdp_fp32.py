"""FSDP2 groups that keep parameters marked ``mcore_fp32_compute`` (Mamba-2's ``A_log``, ``D``, ``dt_bias``) in fp32.

FSDP2's ``MixedPrecisionPolicy`` holds for a whole group: every parameter of a unit is gathered in ``param_dtype``,
so under a bf16 policy the decay, skip and time-step bias of a Mamba-2 mixer would compute rounded to bf16, which
the model rules out (``mcore.models.layers.mamba2``). A module holding such parameters directly (the *holder*,
e.g. the mixer) therefore becomes its own FSDP group with an fp32 policy, and its children with parameters
(``in_proj``, ``conv1d``, ``norm``, ``out_proj``) one group together (``fully_shard`` of a list: gathered at the
first child's forward, freed after the last one's) with the run's policy, so that the large weights are still
gathered in bf16 and in one collective. Both nest inside the unit (the layer) the holder belongs to and follow its
``reshard_after_forward``. Nothing changes when the compute dtype is fp32 (no group is added).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from mcore.parallel.param_attrs import computes_in_fp32

__all__ = ["fp32_holders", "shard_fp32_holders"]


def fp32_holders(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` holding parameters marked fp32-compute directly, in module order; ``ValueError``
    when a holder also holds unmarked parameters directly (one FSDP group cannot gather in two dtypes) or holds
    another holder below it."""
    holders = []
    for name, sub in module.named_modules():
        own = [(n, p) for n, p in sub.named_parameters(recurse=False)]
        marked = [n for n, p in own if computes_in_fp32(p)]
        if not marked:
            continue
        unmarked = [n for n, p in own if not computes_in_fp32(p)]
        if unmarked:
            raise ValueError(
                f"FSDP: {name or type(sub).__name__} holds fp32-compute parameters {marked} beside {unmarked}; "
                "move the others into a child module (a group gathers in one dtype)"
            )
        holders.append((name, sub))
    for name, sub in holders:
        for other_name, other in holders:
            if other is not sub and any(other is m for m in sub.modules()):
                raise ValueError(f"FSDP: fp32-compute holders nest ({other_name} inside {name}); one level only")
    return [sub for _, sub in holders]


def shard_fp32_holders(
    holders: Sequence[nn.Module],
    units: Sequence[nn.Module],
    reshard: Sequence[bool],
    mesh: DeviceMesh,
    policy: MixedPrecisionPolicy,
) -> dict[int, list[FSDPModule]]:
    """``fully_shard`` each holder (fp32 policy) and its children with parameters (``policy``), before the units
    are: returns, by ``id`` of the unit holding them (``-1``: the root), the new groups in forward order (the
    holder, then its children's group, named by its first child)."""
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=policy.reduce_dtype, cast_forward_inputs=False)
    groups: dict[int, list[FSDPModule]] = {}
    for holder in holders:
        if any(holder is u for u in units):
            raise ValueError(f"FSDP: {type(holder).__name__} holds fp32-compute parameters; make its parent the unit")
        unit_index = next((i for i, u in enumerate(units) if any(holder is m for m in u.modules())), None)
        key = -1 if unit_index is None else id(units[unit_index])
        after_forward = False if unit_index is None else reshard[unit_index]
        children = [c for c in holder.children() if any(True for _ in c.parameters())]
        made: list[FSDPModule] = []
        if children:
            fully_shard(children if len(children) > 1 else children[0], mesh=mesh,
                        reshard_after_forward=after_forward, mp_policy=policy)  # fmt: skip
        fully_shard(holder, mesh=mesh, reshard_after_forward=after_forward, mp_policy=fp32)
        made.append(holder)
        if children:
            made.append(children[0])
        groups.setdefault(key, []).extend(made)
    return groups
