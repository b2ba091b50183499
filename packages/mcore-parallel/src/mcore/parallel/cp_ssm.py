"""Context parallelism for a state-space mixer (Mamba-2): sequence shards traded for head shards around the scan.

The causal conv and the SSD scan run along the whole sequence in order, but every head (and every group of
heads sharing ``B`` / ``C``) is independent. So, as Megatron-Core does, the in_proj output of this rank's tokens
``[b, s_local, all local channels]`` goes through an all-to-all over the CP group to ``[b, s, channels of
heads / cp]``; the tokens, gathered in CP-rank order, are then put back in sequence order (rank ``r`` holds the
load-balanced pieces ``r`` and ``2cp - 1 - r`` of every document, :class:`~mcore.parallel.context_parallel.
CPSharding`), the conv + scan + gated norm run on whole sequences of ``heads / cp`` heads, and the inverse
permutation and all-to-all bring the output back to this rank's tokens of all heads before out_proj.

The channels of the in_proj output are blocks (``z | x | B | C | dt`` for Mamba-2) each split evenly over the CP
ranks (:func:`block_rank_index`): rank ``r`` receives ``[z_r | x_r | B_r | C_r | dt_r]``, its heads and the whole
groups they read. The all-to-all's adjoint is itself (the same exchange), so the backward is one all-to-all too.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from mcore.kernels.ssd import seq_idx_from_cu_seqlens
from mcore.parallel.context_parallel import CPSharding

__all__ = ["SequenceHeadExchange", "block_rank_index", "check_ssm_context_parallel"]


def check_ssm_context_parallel(heads: int, groups: int, cp: int, where: str = "mamba2") -> None:
    """Each CP rank takes whole groups (and their heads) of this TP rank's: ``cp`` must divide both counts."""
    if heads % cp or groups % cp:
        raise ValueError(
            f"{where} under context parallelism splits each TP rank's {heads} Mamba heads and {groups} groups over "
            f"cp={cp} ranks (whole groups per rank); use a cp dividing both (n_groups / tp and mamba_num_heads / tp)"
        )


@functools.lru_cache(maxsize=64)
def block_rank_index(blocks: tuple[int, ...], cp: int) -> torch.Tensor:
    """Long ``[sum(blocks)]``: channels reordered rank-major, each block split evenly over ``cp`` ranks (the first
    ``sum(blocks) / cp`` entries are rank 0's share of every block, in block order, and so on)."""
    starts = [0]
    for width in blocks:
        starts.append(starts[-1] + width)
    parts = []
    for rank in range(cp):
        for start, width in zip(starts, blocks):
            share = width // cp
            parts.append(torch.arange(start + rank * share, start + (rank + 1) * share))
    return torch.cat(parts)


# Small caches: packed micro-batches each have their own sharding, and the indices are token-sized device tensors
# (a few micro-batches are in flight at once under pipelining; a miss only rebuilds them).
@functools.lru_cache(maxsize=8)
def _order(sharding: CPSharding, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(gathered -> sequence order, sequence order -> gathered) indices over the flattened tokens, on ``device``
    (cached: every Mamba layer of a micro-batch uses them, in forward and backward).

    The gathered layout is ``[source rank, b, s_local]`` flattened; the sequence order ``[b, seq_len]`` flattened."""
    to_global = torch.cat([sharding.global_index(r) for r in range(sharding.cp)])
    to_gathered = torch.empty_like(to_global)
    to_gathered[to_global] = torch.arange(to_global.numel())
    return to_gathered.to(device), to_global.to(device)


@functools.lru_cache(maxsize=256)
def _rank_index(blocks: tuple[int, ...], cp: int, device: torch.device) -> torch.Tensor:
    return block_rank_index(blocks, cp).to(device)


@functools.lru_cache(maxsize=8)
def _seq_idx(sharding: CPSharding, device: torch.device) -> torch.Tensor:
    cu = torch.tensor(sharding.bounds, dtype=torch.int64, device=device)
    return seq_idx_from_cu_seqlens(cu, sharding.batch, sharding.seq_len, check_values=False)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (``[cp, ...]``); its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class SequenceHeadExchange:
    """The two exchanges of one micro-batch: :meth:`to_heads` before the conv + scan, :meth:`to_sequence` after.

    ``sharding`` is the micro-batch's CP split, ``group`` the CP group (its size ``sharding.cp``)."""

    def __init__(self, sharding: CPSharding, group: dist.ProcessGroup) -> None:
        size = dist.get_world_size(group)
        if size != sharding.cp:
            raise ValueError(f"SequenceHeadExchange: the sharding is for cp={sharding.cp}, the group has {size} ranks")
        self.sharding, self.group, self.cp = sharding, group, size
        self.rank = dist.get_rank(group)

    def to_heads(self, x: torch.Tensor, blocks: tuple[int, ...]) -> torch.Tensor:
        """``[s_local, b, sum(blocks)]`` (this rank's tokens, every channel) -> ``[b, seq_len, sum(blocks) / cp]``
        (the whole sequence in order, this rank's share of every block)."""
        s, b, width = x.shape
        sh = self.sharding
        if (s, b) != (sh.local_len, sh.batch) or width != sum(blocks) or any(w % self.cp for w in blocks):
            raise ValueError(
                f"SequenceHeadExchange.to_heads: x must be [s_local={sh.local_len}, b={sh.batch}, {sum(blocks)}] with "
                f"every block of {list(blocks)} divisible by cp={self.cp}; got {tuple(x.shape)}"
            )
        index = _rank_index(tuple(blocks), self.cp, x.device)
        send = x.index_select(2, index).view(s, b, self.cp, width // self.cp).permute(2, 1, 0, 3)  # [dest, b, s, w]
        recv = _AllToAll.apply(send, self.group)  # [source rank, b, s_local, w]: the group's tokens, my channels
        to_order, _ = _order(sh, x.device)
        ordered = recv.reshape(-1, width // self.cp).index_select(0, to_order)
        return ordered.view(b, sh.seq_len, width // self.cp)

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """``[b, seq_len, w]`` (this rank's channels, whole sequence) -> ``[b, s_local, cp * w]`` (this rank's tokens,
        the channels of every rank in rank order)."""
        sh = self.sharding
        b, seq, width = y.shape
        if (b, seq) != (sh.batch, sh.seq_len):
            raise ValueError(
                f"SequenceHeadExchange.to_sequence: y must be [b={sh.batch}, seq_len={sh.seq_len}, w], got "
                f"{tuple(y.shape)}"
            )
        _, to_gathered = _order(sh, y.device)
        send = y.reshape(-1, width).index_select(0, to_gathered).view(self.cp, b, sh.local_len, width)
        recv = _AllToAll.apply(send, self.group)  # [source rank (its channels), b, s_local, w]
        return recv.permute(1, 2, 0, 3).reshape(b, sh.local_len, self.cp * width)

    def channel_share(self, t: torch.Tensor, blocks: tuple[int, ...] | None = None) -> torch.Tensor:
        """This rank's share of a per-channel parameter (dim 0, split block by block as the exchange splits it)."""
        n = t.shape[0]
        index = _rank_index(tuple(blocks) if blocks else (n,), self.cp, t.device).view(self.cp, -1)[self.rank]
        return t.index_select(0, index)

    def seq_idx(self, device: torch.device | str) -> torch.Tensor | None:
        """``[b, seq_len]`` int32 document index of every token in sequence order, ``None`` without packing."""
        return None if self.sharding.bounds is None else _seq_idx(self.sharding, torch.device(device))
