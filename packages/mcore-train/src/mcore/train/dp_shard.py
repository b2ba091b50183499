"""``parallel.dp_shard``: this rank's model chunks fully sharded over data parallelism (FSDP2) and their optimizer.

Each transformer layer is one FSDP unit, as are the embedding and the output layer when they are not tied; a tied
embedding stays in the chunk's root unit with the final norm, because the output layer that multiplies by it runs
outside the embedding's forward. The embedding unit is not gathered for its backward (its weight gradient needs
only the token ids). At dp=1, ``parallel.gradient_accumulation_fusion`` lets the linear layers' weight-gradient
GEMMs accumulate in fp32 straight into the gradient shards, as under ZeRO-1 (``mcore.parallel.fsdp_wgrad``). The
chunks are built in fp32 (the shards are the master weights) and compute in ``train.precision`` through FSDP's
mixed-precision policy, reducing gradients in fp32. A run of one process without a launcher gets a one-rank
process group (FSDP2 needs one), created here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mcore.models.gpt import GPTModel
from mcore.parallel.fsdp import FullyShardedDataParallel, data_parallel_mesh
from mcore.parallel.grid import ProcessGroups
from mcore.train.config import Config
from mcore.train.errors import UserError

__all__ = ["fully_shard_chunks"]


def _units(chunk: GPTModel) -> tuple[list[nn.Module], list[tuple[nn.Module, str, nn.Module, str]]]:
    """The FSDP units of ``chunk`` in forward order, and its tied output layer (kept outside the module tree)."""
    # GPTModel keeps a tied output layer in the tuple _tied_output, outside the module tree (see GPTModel.__init__)
    tied_output = getattr(chunk, "_tied_output", ())
    units: list[nn.Module] = []
    if hasattr(chunk, "embedding") and not tied_output and chunk.pre_process:
        units.append(chunk.embedding)
    units.extend(chunk.layers.values())
    if hasattr(chunk, "output"):
        units.append(chunk.output)
    tied = [(tied_output[0], "weight", chunk.embedding, "weight")] if tied_output else []
    return units, tied


def _kv_cache_in(chunk: GPTModel, dtype: torch.dtype, batch_size: int, max_length: int):
    cache = type(chunk).make_kv_cache(chunk, batch_size, max_length)
    for store in (cache.keys, cache.values):
        for index, tensor in store.items():
            store[index] = tensor.to(dtype)
    return cache


def fully_shard_chunks(
    chunks: Sequence[GPTModel],
    groups: ProcessGroups,
    config: Config,
    compute_dtype: torch.dtype,
    device: torch.device,
) -> list[FullyShardedDataParallel]:
    """Wrap every chunk in :class:`FullyShardedDataParallel` over the data-parallel group (collective)."""
    for i, chunk in enumerate(chunks):
        wrong = sorted({str(p.dtype) for p in chunk.parameters() if p.dtype != torch.float32})
        if wrong:
            raise UserError(f"parallel.dp_shard: chunk {i} holds {wrong} parameters; the shards must be fp32 masters")
    if not dist.is_initialized():
        # one process (no launcher): FSDP2 still runs on a process group, so make the one-rank group here
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = data_parallel_mesh(groups.dp_cp, device)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    wrapped = []
    for chunk in chunks:
        if compute_dtype != torch.float32:
            # GPTModel.make_kv_cache takes the parameters' dtype, fp32 here; the cache must hold what attention
            # computes with (generation after training)
            chunk.make_kv_cache = functools.partial(_kv_cache_in, chunk, compute_dtype)
        units, tied = _units(chunk)
        wrapped.append(
            FullyShardedDataParallel(
                chunk,
                mesh,
                units=units,
                param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                reduce_dtype=torch.float32,
                reshard_after_forward=config.parallel.dp_shard_reshard_after_forward,
                reduce_every_microbatch=config.parallel.dp_shard_reduce_every_microbatch,
                tied=tied,
                no_backward_gather=[u for u in units if u is getattr(chunk, "embedding", None)],
                gradient_accumulation_fusion=config.parallel.gradient_accumulation_fusion,
            )
        )
    return wrapped
