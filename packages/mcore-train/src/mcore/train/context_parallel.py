"""``parallel.cp`` in the training step: each CP rank's share of a micro-batch, and what its attention needs.

Every rank of a CP group reads the same micro-batch (they share a dp rank); :meth:`CPBatches.shard` keeps this
rank's ``2`` of the ``2 * cp`` chunks of every sequence (``mcore.parallel.context_parallel``): tokens, labels and
loss mask of the same tokens, RoPE positions of those tokens inside their documents, and the ``CPContext`` the
model's attention runs over the CP group with.

Packed documents (``data.packing``: the batch carries ``cu_seqlens``) are padded one by one to a multiple of
``2 * cp`` (padding tokens have label ``-100`` and loss mask 0, so they stay out of the loss, and ``padding_mask``
True, so MoE layers leave them out of their expert counts and aux / z losses; nothing is cut), and the rows to a
common length, a multiple of :func:`~mcore.train.parallel_config.cp_granule` (the row padding is one more padding
document). The padded length changes from micro-batch to micro-batch, so pipeline stages then exchange activation
shapes (``variable_shapes``).

The loss: ``loss_tokens`` is the micro-batch's count of tokens in the loss over all its sequences (what summing
the shards' counts over the CP group gives); each rank's loss is ``cp x`` (its token-loss sum) / ``loss_tokens``,
so that DDP's average over the dp x cp group is the data-parallel mean of the micro-batch means, as without CP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mcore.parallel.context_parallel import CPSharding, pad_documents
from mcore.parallel.cp_attention import CPContext, CPGroups
from mcore.parallel.grid import ProcessGroups
from mcore.train.parallel_config import ParallelSection, cp_granule

__all__ = ["CPBatches", "pad_packed_batch"]

IGNORE_INDEX = -100
# Per-token tensors of a micro-batch and the value their padding takes.
_PADDED = {"tokens": 0, "labels": IGNORE_INDEX, "loss_mask": 0.0}
# The padding's own flag (True: a padding token), which MoE layers read to leave it out of their routing statistics.
_PADDING_MASK = "padding_mask"


@dataclass(frozen=True)
class CPBatches:
    """Cuts micro-batches into this rank's CP shard. ``granule``: row lengths are padded to a multiple of it."""

    cp: int
    rank: int
    groups: CPGroups
    comm_type: str = "p2p"
    granule: int = 2
    backend: str | None = None

    @classmethod
    def build(cls, parallel: ParallelSection, groups: ProcessGroups) -> CPBatches | None:
        """The batches of this rank of the grid (``None`` at cp = 1); collective with ``a2a+p2p`` (new groups)."""
        if parallel.cp == 1:
            return None
        from mcore.parallel.cp_groups import build_cp_groups

        a2a = parallel.cp_a2a_size if parallel.cp_comm_type == "a2a+p2p" else 1
        cp_groups = build_cp_groups(groups, a2a)
        return cls(parallel.cp, groups.cp_rank, cp_groups, parallel.cp_comm_type, cp_granule(parallel))

    def shard(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's part of a collated micro-batch (``tokens``, ``labels``, ``loss_mask`` ``[b, s]``, optional
        ``cu_seqlens``): the same keys ``[b, s' / cp]`` with ``position_ids``, ``loss_tokens`` (0-dim, the whole
        micro-batch's) and ``context_parallel``; no ``cu_seqlens`` (the documents are the sharding's). Packed rows also
        get ``padding_mask`` (bool, True on the padding added here), which the model's MoE layers read."""
        for key in _PADDED:
            if key not in batch:
                raise ValueError(f"CPBatches.shard: the micro-batch has no {key!r}; it has {sorted(batch)}")
        tensors = {key: batch[key] for key in _PADDED}
        b, s = tensors["tokens"].shape
        bounds = None
        if batch.get("cu_seqlens") is not None:
            tensors[_PADDING_MASK] = torch.zeros(b, s, dtype=torch.bool, device=tensors["tokens"].device)
            tensors, bounds = pad_packed_batch(tensors, batch["cu_seqlens"], 2 * self.cp, self.granule)
            s = tensors["tokens"].shape[1]
        elif s % self.granule:
            raise ValueError(
                f"CPBatches.shard: sequence length {s} is not a multiple of {self.granule} (2 x cp, x tp with sequence "
                "parallelism); set data.seq_length to a multiple of it"
            )
        sharding = CPSharding(b, s, self.cp, bounds)
        out: dict[str, Any] = {key: sharding.shard(t, self.rank) for key, t in tensors.items()}
        out["position_ids"] = sharding.positions(self.rank).to(tensors["tokens"].device)
        out["loss_tokens"] = tensors["loss_mask"].sum()
        out["context_parallel"] = CPContext(sharding, self.groups, self.comm_type, self.backend)
        return out


def pad_packed_batch(
    tensors: Mapping[str, torch.Tensor], cu_seqlens: torch.Tensor, multiple: int, granule: int
) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """Every document of ``[b, s]`` rows (bounds ``cu_seqlens`` over the flattened ``b * s`` tokens) padded to a
    multiple of ``multiple``, and every row to ``L``, the longest padded row rounded up to ``granule`` (a multiple of
    ``multiple``). Returns the ``[b, L]`` tensors and the new document bounds over ``b * L`` (the row padding is a
    document of its own). Padding takes the values of ``_PADDED`` (``padding_mask``: True); no token is dropped."""
    if granule % multiple:
        raise ValueError(f"pad_packed_batch: granule {granule} must be a multiple of {multiple}")
    b, s = tensors["tokens"].shape
    bounds = sorted(set(int(x) for x in cu_seqlens.tolist()) | set(range(0, b * s + 1, s)))
    if bounds[0] != 0 or bounds[-1] != b * s:
        raise ValueError(f"pad_packed_batch: cu_seqlens must run from 0 to b * s = {b * s}, got {bounds[:4]}...")
    starts, lengths = bounds[:-1], [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    padded = pad_documents(lengths, multiple)
    rows = [start // s for start in starts]
    row_total = [0] * b
    dest = []  # start of each document in the padded row
    for row, n in zip(rows, padded):
        dest.append(row_total[row])
        row_total[row] += n
    length = -(-max(row_total) // granule) * granule
    device = tensors["tokens"].device
    src = torch.arange(b * s, device=device)
    doc_of = torch.repeat_interleave(torch.arange(len(starts), device=device), torch.tensor(lengths, device=device))
    shift = torch.tensor([row * length + d - start for row, d, start in zip(rows, dest, starts)], device=device)
    index = src + shift[doc_of]  # each token's place in the padded flat [b * L]
    out = {}
    for key, t in tensors.items():
        flat = t.new_full((b * length,), True if key == _PADDING_MASK else _PADDED[key])
        out[key] = flat.index_copy_(0, index, t.reshape(-1)).view(b, length)
    new_bounds = {0}
    for row, d, n in zip(rows, dest, padded):
        new_bounds.update((row * length + d, row * length + d + n))
    new_bounds.update(row * length for row in range(b + 1))
    return out, tuple(sorted(new_bounds))
