"""The process's place in the job: rank, device, ``torch.distributed`` and the parallel process groups.

``torch.distributed`` is initialised only when ``WORLD_SIZE > 1`` (gloo on CPU, NCCL on CUDA); a
single-process run needs none. When the caller already initialised it (tests, notebooks) it is used as is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mcore.parallel.grid import ParallelConfig, ProcessGroups, build_process_groups
from mcore.parallel.random import model_parallel_seed
from mcore.train.config import Config
from mcore.train.errors import UserError


@dataclass
class Runtime:
    """Where this process runs and which groups it belongs to.

    ``control_group`` carries small CPU tensors for coordination (stop flags, checkpoint commits, the
    straggler report) without touching the GPU stream: a gloo group when the main backend is NCCL, the
    world group otherwise (``None`` in a single process).

    Used as a context manager it shuts down on leaving the block, as a failure when the block raised.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    groups: ProcessGroups
    control_group: dist.ProcessGroup | None
    owns_process_group: bool = False

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait for every rank (no-op in a single process)."""
        if self.distributed:
            dist.barrier(group=self.control_group)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown(failed=exc_type is not None)

    def shutdown(self, *, failed: bool = False) -> None:
        """Destroy the process group if this runtime created it.

        After a failure on this rank (``failed``) the group is left alone when there are other ranks: they may
        be blocked in a collective or a point-to-point with this one, and destroying NCCL communicators waits
        on them, so the job would hang instead of ending. Exiting lets the launcher stop the other ranks (and
        the process group's destructor aborts the communicators).
        """
        if failed and self.distributed:
            return
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def choose_device(requested: str, local_rank: int) -> torch.device:
    """``auto``: this rank's CUDA device when CUDA is available, else the CPU."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is available; use train.device=cpu or auto")
    if torch.cuda.is_available() and requested in ("auto", "cuda"):
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_runtime(config: Config, *, timeout_s: float = 1800.0) -> Runtime:
    """Join the job described by the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and build groups."""
    owns = False
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = choose_device(config.train.device, local_rank)
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = choose_device(config.train.device, local_rank)
        if world > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
            owns = True
    try:
        parallel = ParallelConfig(
            tp=config.parallel.tp,
            pp=config.parallel.pp,
            vpp=config.parallel.vpp,
            dp=config.parallel.dp,
            ep=config.parallel.ep,
            etp=config.parallel.etp,
            cp=config.parallel.cp,
        ).resolve(world)
    except ValueError as exc:
        raise UserError(f"parallel layout does not fit {world} process(es): {exc}") from None
    if world > 1:
        groups = build_process_groups(parallel)
        backend = dist.get_backend()
        control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    else:
        groups = ProcessGroups.single()
        control = None
    model_parallel_seed(config.train.seed, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank)
    return Runtime(rank, world, local_rank, device, groups, control, owns)
