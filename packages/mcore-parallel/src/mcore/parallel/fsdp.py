"""Fully sharded data parallelism (ZeRO-3) on torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

``FullyShardedDataParallel(module, mesh, units=...)`` shards every parameter of ``module`` over the
data-parallel mesh: each unit (a transformer layer, the embedding, the output layer) becomes its own FSDP2
group, all-gathered just before its forward (and again before its backward when ``reshard_after_forward``)
and freed after, its gradients reduce-scattered as soon as its backward is done; the rest of ``module`` (final
norm, a tied embedding) is the root group. The next unit's all-gather is issued while the current unit runs
(explicit prefetch, forward and backward).

Tensor parallelism composes underneath: a TP layer's local slice is a plain parameter to FSDP, sharded along
dim 0 over dp; the TP collectives inside the layers see the all-gathered (TP-local) tensors. The mcore
parameter attributes (``tensor_parallel``, ``partition_dim``, ``shared_embedding``, ...) are copied onto the
sharded ``DTensor`` parameters, so gradient clipping, ``finalize_model_grads`` and checkpoints keep reading them.

Precision: the sharded parameters keep the dtype the module was built with (build it in fp32: they are the
master weights the optimizer updates in place); ``param_dtype`` (bf16) is what forward and backward compute
with, ``reduce_dtype`` (fp32) what gradients are reduced and stored in. ``FullyShardedOptimizer`` (see
``sharded_optimizer``) runs AdamW on the local shards.

The wrapper keeps ``DistributedDataParallel``'s interface where the pipeline schedules, ``finalize_model_grads``
and the optimizer use it: ``no_sync()`` (gradients of micro-batches accumulate unreduced, in ``reduce_dtype``, only
with ``reduce_every_microbatch=False``: otherwise each micro-batch's gradients are reduce-scattered into the shards,
which keeps gradient memory sharded), ``finish_grad_sync()``, ``zero_grad_buffer()``, unprefixed names.

One rank (``mesh.size() == 1``): nothing is sharded, so what sharding buys elsewhere is pure cost here: each
re-gather is a cast of the fp32 parameters to bf16 plus a copy (10 bytes per parameter), each reduction a cast of
the bf16 gradient to fp32 plus a copy (14 bytes). The ``"auto"`` defaults therefore keep each unit gathered from
its forward to its backward and, under gradient accumulation, from one micro-batch to the next, and reduce once
per step (on the last micro-batch). Several ranks: ``"auto"`` reshards every unit after its forward except the
last one, whose backward is the first to run (resharding it would gather it again straight away), and reduces
every micro-batch (the ZeRO-3 memory profile).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from mcore.parallel.fsdp_wgrad import fuse_wgrad_into_shards

__all__ = [
    "AUTO",
    "FullyShardedDataParallel",
    "data_parallel_mesh",
    "full_tensor",
    "load_full_tensor_",
    "local_flat_range",
]


def data_parallel_mesh(dp_group: dist.ProcessGroup | None, device: torch.device | str) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over ``dp_group`` (``None``: this rank alone) for FSDP2.

    Collective over the whole job when ``dp_group`` is ``None`` in a job of several ranks (every rank creates its
    one-rank group). Needs ``torch.distributed`` initialised, also for one process (FSDP2 runs on a process group).
    """
    device_type = torch.device(device).type
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "fully sharded data parallelism (parallel.dp_shard) needs torch.distributed initialised, also for a "
            "single process: launch with torchrun / --nproc-per-node, or call init_process_group with world_size=1"
        )
    if dp_group is None:
        world = dist.get_world_size()
        dp_group, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
    return DeviceMesh.from_group(dp_group, device_type)


AUTO = "auto"
Auto = Literal["auto"]


def _check_setting(name: str, value: object) -> None:
    if value is not True and value is not False and value != AUTO:
        raise ValueError(f"FullyShardedDataParallel: {name} must be True, False or 'auto', got {value!r}")


def reshard_policy(setting: bool | Auto, num_units: int, dp_size: int) -> list[bool]:
    """``reshard_after_forward`` of each of ``num_units`` units (forward order) for ``setting`` at ``dp_size``."""
    if setting != AUTO:
        return [bool(setting)] * num_units
    if dp_size == 1:
        return [False] * num_units  # the shard is the whole tensor: resharding frees 2 B/param and costs a re-cast
    return [True] * (num_units - 1) + [False] * min(num_units, 1)


def _param_attributes(module: nn.Module) -> dict[str, dict]:
    """The Python attributes mcore sets on each parameter (layout flags), by name, to carry over to the shards."""
    return {name: dict(p.__dict__) for name, p in module.named_parameters()}


class FullyShardedDataParallel(nn.Module):
    """Shard ``module`` over ``mesh`` with FSDP2, ``units`` each as its own group (in forward order).

    ``tied``: ``(user, attribute, owner, attribute)`` for a parameter that a module outside the module tree uses
    (a tied output layer multiplying by the embedding's weight): before each of ``user``'s forwards its attribute
    is pointed at ``owner``'s current (all-gathered) parameter. ``owner`` must not be one of the ``units``.

    ``reshard_after_forward`` and ``reduce_every_microbatch``: ``True``, ``False`` or ``"auto"`` (see the module
    docstring: by the mesh size); ``reshard_after_forward`` applies to the units, the root is never resharded
    after its forward (FSDP2's rule). ``no_backward_gather``: units whose backward needs none of their parameters
    (an embedding: its weight gradient is a scatter of the output gradient), not gathered again for it.
    ``gradient_accumulation_fusion``: at one rank, the mcore linear layers' weight-gradient GEMMs accumulate in
    fp32 straight into the shards' gradients (``fsdp_wgrad``); no effect on several ranks, where FSDP must reduce.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        *,
        units: Sequence[nn.Module] = (),
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        reshard_after_forward: bool | Auto = AUTO,
        prefetch: bool = True,
        reduce_every_microbatch: bool | Auto = AUTO,
        tied: Sequence[tuple[nn.Module, str, nn.Module, str]] = (),
        no_backward_gather: Sequence[nn.Module] = (),
        gradient_accumulation_fusion: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (
            ("reshard_after_forward", reshard_after_forward),
            ("reduce_every_microbatch", reduce_every_microbatch),
        ):
            _check_setting(name, value)
        _check_arguments(module, mesh, units, tied, no_backward_gather)
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
                raise TypeError(f"FullyShardedDataParallel: {name} must be a float torch.dtype or None, got {dtype}")
        self.module = module
        self.mesh = mesh
        self.dp_size = mesh.size()
        auto_reduce = self.dp_size > 1  # one rank: reduce once per step, nothing is saved by reducing earlier
        self.reduce_every_microbatch = auto_reduce if reduce_every_microbatch == AUTO else reduce_every_microbatch
        attributes = _param_attributes(module)
        # inputs are not cast: hidden states arrive in the compute dtype already, and the rotary tables stay fp32
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
        kwargs = dict(mesh=mesh, mp_policy=policy)
        with_params = [unit for unit in units if any(True for _ in unit.parameters())]
        self.reshard_after_forward = reshard_policy(reshard_after_forward, len(with_params), self.dp_size)
        sharded: list[FSDPModule] = [
            fully_shard(unit, reshard_after_forward=reshard, **kwargs)
            for unit, reshard in zip(with_params, self.reshard_after_forward, strict=True)
        ]
        fully_shard(module, reshard_after_forward=False, **kwargs)  # FSDP2 keeps the root gathered regardless
        for unit in no_backward_gather:
            if isinstance(unit, FSDPModule) and hasattr(unit, "set_unshard_in_backward"):
                unit.set_unshard_in_backward(False)
        for name, p in module.named_parameters():
            for key, value in attributes[name].items():
                setattr(p, key, value)
        if prefetch:
            _set_prefetch(sharded)
        # a forward without backward (evaluation, generation) would leave the units kept gathered, and the module
        # would show their gathered parameters instead of the shards (to checkpoints, to the next step)
        self._fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        module.register_forward_hook(self._reshard_unless_training)
        self.gradient_accumulation_fusion = gradient_accumulation_fusion and self.dp_size == 1
        if self.gradient_accumulation_fusion:
            fuse_wgrad_into_shards(self, self._fsdp_modules, with_params)
        self._hook_handles = [user.register_forward_pre_hook(_tie(attr, owner, src)) for user, attr, owner, src in tied]
        for user, attr, owner, src in tied:
            user._parameters[attr] = getattr(owner, src)  # the sharded parameter until the first forward

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _reshard_unless_training(self, module: nn.Module, args, output) -> None:
        if not torch.is_grad_enabled():
            self.reshard()

    def reshard(self) -> None:
        """Free every gathered unit: the module's parameters are the shards again (no-op where they are)."""
        for m in self._fsdp_modules:
            m.reshard()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate this micro-batch's gradients unreduced (only with ``reduce_every_microbatch=False``); on one
        rank the units also stay gathered after this backward, for the next micro-batch's forward."""
        if self.reduce_every_microbatch:
            yield
            return
        keep_gathered = self.dp_size == 1
        self.module.set_requires_gradient_sync(False)
        if keep_gathered:
            self.module.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            if keep_gathered:
                self.module.set_reshard_after_backward(True)

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP2's end-of-backward callback has already waited for the reduce-scatters."""

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _check_arguments(module, mesh, units, tied, no_backward_gather) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise TypeError(f"FullyShardedDataParallel: mesh must be a 1-D DeviceMesh (data_parallel_mesh), got {mesh}")
    inside = {id(m) for m in module.modules()}
    for i, unit in enumerate(units):
        if id(unit) not in inside or unit is module:
            raise ValueError(f"FullyShardedDataParallel: units[{i}] ({type(unit).__name__}) is not a submodule")
    for i, unit in enumerate(no_backward_gather):
        if not any(unit is u for u in units):
            raise ValueError(f"FullyShardedDataParallel: no_backward_gather[{i}] ({type(unit).__name__}) is not a unit")
    for _, _, owner, _ in tied:
        if any(owner is u for u in units):
            raise ValueError(
                f"FullyShardedDataParallel: the owner of a tied parameter ({type(owner).__name__}) must stay in "
                "the root group, not be a unit (its user runs outside that unit's forward)"
            )


def _set_prefetch(sharded: Sequence[FSDPModule]) -> None:
    """Each unit's forward issues the next unit's gather, its backward the previous unit's."""
    for i, unit in enumerate(sharded):
        if i + 1 < len(sharded):
            unit.set_modules_to_forward_prefetch([sharded[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([sharded[i - 1]])


def _tie(attr: str, owner: nn.Module, src: str):
    def hook(user: nn.Module, args) -> None:
        user._parameters[attr] = getattr(owner, src)

    return hook


# ---- reading and writing sharded parameters as whole (TP-local) tensors -----------------------------------------


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t``: all-gathered over its mesh for a ``DTensor`` (collective), else ``t``."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def local_flat_range(p: torch.Tensor) -> tuple[int, int]:
    """The range ``[lo, hi)`` of ``p.view(-1)`` that this rank's shard holds (the whole tensor if not a DTensor).

    FSDP2 shards dim 0 as ``torch.chunk`` does (``ceil(rows / dp)`` rows per rank, the last ranks may hold fewer
    or none), so a shard is one contiguous flat range of the full tensor.
    """
    if not isinstance(p, DTensor):
        return 0, p.numel()
    if tuple(p.placements) != (Shard(0),):
        raise ValueError(f"local_flat_range: expected a DTensor sharded as (Shard(0),), got {p.placements}")
    rows = p.shape[0] if p.dim() > 0 else 1
    row_size = p.numel() // rows if rows else 0
    per_rank = -(-rows // p.device_mesh.size())
    rank = p.device_mesh.get_local_rank()
    lo, hi = min(rank * per_rank, rows) * row_size, min((rank + 1) * per_rank, rows) * row_size
    local = p.to_local()
    if local.numel() != hi - lo:
        raise RuntimeError(f"local_flat_range: shard of {hi - lo} elements expected, the DTensor holds {local.numel()}")
    return lo, hi


@torch.no_grad()
def load_full_tensor_(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor ``full`` into ``p``: into this rank's shard for a ``DTensor``, else all of it."""
    if tuple(full.shape) != tuple(p.shape):
        raise ValueError(f"load_full_tensor_: tensor of shape {tuple(full.shape)} for a parameter of {tuple(p.shape)}")
    if not isinstance(p, DTensor):
        p.data.copy_(full.to(device=p.device, dtype=p.dtype))
        return
    lo, hi = local_flat_range(p)
    local = p.to_local()
    local.view(-1).copy_(full.reshape(-1)[lo:hi].to(device=local.device, dtype=local.dtype))
