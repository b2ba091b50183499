"""At one rank, the weight-gradient GEMMs of FSDP2 units accumulate straight into the fp32 gradient shards.

FSDP2 takes a parameter's gradient from its gathered (bf16) parameter: the GEMM writes a bf16 gradient, which
FSDP copies into an fp32 reduction buffer and, at one rank where there is nothing to reduce, copies again into the
fp32 gradient of the shard: 14 bytes of copies per parameter per micro-batch. ZeRO-1 instead lets the GEMM
accumulate in fp32 into its gradient buffer (``gradient_accumulation_fusion``). At one rank the shard is the whole
tensor, so the same fusion applies: each gathered parameter of the mcore linear layers gets, through
:func:`~mcore.parallel.param_attrs.attach_wgrad_buffer`, the fp32 gradient of its shard as the GEMM's target
(allocated, zeroed, at the step's first weight gradient, so gradients still live only from backward to the
optimizer step). The GEMM then returns no gradient, and FSDP has nothing to copy for that parameter; the other
parameters (norms, the embedding) keep FSDP's path, which adds into the same shard gradients when both occur (a
tied output layer's weight). Micro-batches accumulate in fp32, as under ZeRO-1.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mcore.parallel.param_attrs import attach_wgrad_buffer

__all__ = ["fuse_wgrad_into_shards"]


def _own_parameters(group: nn.Module, units: Sequence[nn.Module]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(module, attribute, sharded parameter) of the parameters that FSDP group ``group`` manages: those under it
    that no other unit nested in it holds."""
    nested = [u for u in units if u is not group and any(u is m for m in group.modules())]
    taken = {id(p) for u in nested for p in u.parameters()}
    seen: set[tuple[int, str]] = set()
    out = []
    for module in group.modules():
        for name, p in module._parameters.items():
            if p is None or id(p) in taken or (id(module), name) in seen:
                continue
            seen.add((id(module), name))
            out.append((module, name, p))
    return out


def _shard_gradient(sharded: nn.Parameter, gathered: torch.Tensor) -> torch.Tensor:
    """The fp32 gradient of ``sharded`` (its local tensor, shaped as ``gathered``), created zeroed when absent."""
    if sharded.grad is None:
        local = torch.zeros(sharded.to_local().shape, dtype=sharded.dtype, device=sharded.device)
        mesh, placements = sharded.device_mesh, sharded.placements
        sharded.grad = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=sharded.shape, stride=sharded.stride()
        )
    return sharded.grad.to_local().view(gathered.shape)


def _attach_on_forward(owner: object, entries: list[tuple[nn.Module, str, nn.Parameter]]):
    """A forward pre-hook, run after FSDP's (which gathers the group and puts the gathered parameters on the
    modules): point each gathered parameter's weight-gradient GEMMs at its shard's gradient."""

    def hook(group: nn.Module, args) -> None:
        for module, name, sharded in entries:
            gathered = module._parameters.get(name)
            if gathered is not None and gathered is not sharded:
                attach_wgrad_buffer(gathered, owner=owner, buffer=functools.partial(_shard_gradient, sharded))

    return hook


def fuse_wgrad_into_shards(owner: object, groups: Sequence[nn.Module], units: Sequence[nn.Module]) -> list:
    """Hook every FSDP group of ``groups`` (the units and the root, already ``fully_shard``-ed over a one-rank mesh)
    so that weight-gradient GEMMs accumulate into the shards' fp32 gradients while ``owner`` is alive. Returns the
    hook handles."""
    for group in groups:
        for _, name, p in _own_parameters(group, units):
            if not isinstance(p, DTensor) or p.device_mesh.size() != 1:
                raise ValueError(f"fuse_wgrad_into_shards: {name} is not a one-rank FSDP shard; call it at dp=1 only")
    return [g.register_forward_pre_hook(_attach_on_forward(owner, _own_parameters(g, units))) for g in groups]
