"""Shift a context-parallel sequence left by ``k`` tokens inside each document (multi-token prediction's ``t[i+k]``).

Without CP, ``y[i] = x[i + k]`` is a roll along the row with the positions past each document's end filled. Under
CP (:class:`~mcore.parallel.context_parallel.CPSharding`) a rank holds pieces ``r`` and ``2cp - 1 - r`` of every
document, so the last ``k`` outputs of a piece need the first ``k`` tokens of the pieces after it in the document:
piece ``c + 1`` is on rank ``c + 1`` (``c < cp - 1``), on this rank itself (``c = cp - 1``) or on rank ``2cp - 2 - c``
(``c >= cp``); when ``k`` exceeds a piece's length they come from several later pieces, and never from further than
their first ``min(k, piece length)`` tokens. So every rank contributes those *heads* of its pieces and one
all-gather over the CP group hands every rank all of them: ``cp x pieces x min(k, piece length)`` elements, not the
sequence. A piece's length depends only on its document, so every rank's heads have the same shape.

The output is one ``index_select`` from ``[local tokens; gathered heads; fill]``; autograd carries the gradient back
through the selection and the all-gather (whose backward reduce-scatters: the gradient of a head goes to its owner).
Token ids need no gradient; a float tensor (hidden states) gets one.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from mcore.parallel.comm import gather_from_sequence_parallel_region
from mcore.parallel.context_parallel import CPSharding

__all__ = ["shift_left"]


def shift_left(
    x: torch.Tensor, k: int, sharding: CPSharding, group: dist.ProcessGroup | None, fill: float | int = 0
) -> torch.Tensor:
    """This rank's shard of ``y``, ``y[d, i] = x[d, i + k]`` for position ``i`` of document ``d`` when ``i + k`` is in
    the document, else ``fill``. ``x`` is the rank's shard ``[batch, local_len, ...]``; ``group`` the CP group
    (``None`` only at cp 1)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"shift_left: k must be an int >= 1, got {k!r}")
    if x.dim() < 2 or tuple(x.shape[:2]) != (sharding.batch, sharding.local_len):
        raise ValueError(
            f"shift_left: x must be [batch={sharding.batch}, local_len={sharding.local_len}, ...], got {tuple(x.shape)}"
        )
    cp = 1 if group is None else dist.get_world_size(group)
    if cp != sharding.cp:
        raise ValueError(f"shift_left: the sharding is for cp={sharding.cp}, the group has {cp} ranks")
    rank = 0 if group is None else dist.get_rank(group)
    head_index, index = _indices(sharding, rank, k)
    flat = x.flatten(0, 1)
    heads = flat.index_select(0, head_index.to(x.device))
    gathered = heads if cp == 1 else gather_from_sequence_parallel_region(heads, group)
    filler = flat.new_full((1, *flat.shape[1:]), fill)
    source = torch.cat([flat, gathered, filler])
    return source.index_select(0, index.to(x.device)).view(x.shape)


@functools.lru_cache(maxsize=256)
def _indices(sharding: CPSharding, rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local flat index of this rank's heads, index of every output into ``[local; gathered heads; fill]``)."""
    local_len, cp = sharding.local_len, sharding.cp
    pieces = sharding.pieces(rank)
    lengths = [length for _, _, length, _, _ in pieces]  # the same on every rank (piece i: document i // 2)
    head_len = [min(k, n) for n in lengths]
    head_start = [0, *torch.tensor(head_len).cumsum(0).tolist()]
    per_rank = head_start[-1]
    head_index = torch.cat(
        [row * local_len + start + torch.arange(h) for (row, start, _, _, _), h in zip(pieces, head_len)]
    )
    gathered_at, fill_at = sharding.batch * local_len, sharding.batch * local_len + cp * per_rank
    doc_len = [length for _, _, length in sharding.documents()]
    index = torch.full((sharding.batch * local_len,), fill_at, dtype=torch.long)
    for row, start, n, doc, first in pieces:
        j = torch.arange(n)
        target = first + j + k  # position in the document of the token each output takes
        out_at = row * local_len + start + j
        inside = j + k < n
        index[out_at[inside]] = out_at[inside] + k
        later = ~inside & (target < doc_len[doc])
        chunk, offset = target[later] // n, target[later] % n
        owner = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
        piece = 2 * doc + (chunk >= cp).long()  # the owner's pieces: (chunk owner, chunk 2cp - 1 - owner) per document
        starts = torch.tensor(head_start[:-1])[piece]
        index[out_at[later]] = gathered_at + owner * per_rank + starts + offset
    return head_index, index
