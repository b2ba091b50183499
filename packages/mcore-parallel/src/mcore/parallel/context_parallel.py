"""Context parallelism: how sequences are split over the ranks of a CP group, and which pieces see which.

Each document (a whole row when nothing is packed) is cut into ``2 * cp`` equal pieces and rank ``r``
keeps pieces ``r`` and ``2cp - 1 - r``: under the causal mask the early piece has little to attend to and
the late one much, so every rank gets the same work. A rank's local row is, document after document,
``[piece r, piece 2cp-1-r]``; its RoPE positions are the pieces' positions inside their document
(:meth:`CPSharding.positions`), so rotary embeddings see the true positions.

Packed documents must have lengths divisible by ``2 * cp``: :func:`pad_documents` pads each one (padding
tokens take ``ignore_index`` labels, so they stay out of the loss) and never cuts one; a length that does
not divide raises instead of being truncated.

The attention of local queries against any set of pieces (the peer's K/V in a ring step, the whole
gathered sequence after an all-gather or all-to-all) is an
:class:`~mcore.kernels.attention_layout.AttentionLayout` built by :func:`pieces_layout`; the communication
patterns live in :mod:`mcore.parallel.cp_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from mcore.kernels.attention_layout import AttentionLayout

# (row, start in the (local or gathered) row, length, document id, position of the first token in its document)
Piece = tuple[int, int, int, int, int]


@dataclasses.dataclass(frozen=True)
class CPSharding:
    """The split of ``[batch, seq_len]`` tokens (documents by ``bounds`` over ``batch * seq_len``) over ``cp`` ranks."""

    batch: int
    seq_len: int
    cp: int
    bounds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "seq_len", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CPSharding: {name} must be an int >= 1, got {value!r}")
        if self.bounds is not None:
            object.__setattr__(self, "bounds", tuple(int(x) for x in self.bounds))
            b = self.bounds
            if b[0] != 0 or b[-1] != self.batch * self.seq_len or any(y < x for x, y in zip(b, b[1:])):
                raise ValueError(
                    f"CPSharding: bounds must rise from 0 to batch * seq_len = {self.batch * self.seq_len}, got "
                    f"{list(b[:8])}{'...' if len(b) > 8 else ''}"
                )
            missing = sorted(set(range(0, self.batch * self.seq_len + 1, self.seq_len)) - set(b))
            if missing:
                raise ValueError(f"CPSharding: documents cannot cross rows; bounds lack the row boundaries {missing}")
        for doc, (row, start, length) in enumerate(self.documents()):
            if length % (2 * self.cp):
                raise ValueError(
                    f"CPSharding: document {doc} (row {row}, tokens {start}..{start + length}) has {length} tokens, "
                    f"not a multiple of 2 * cp = {2 * self.cp}; pad each document with pad_documents() (padding "
                    "labels are ignored by the loss) rather than cutting it"
                )

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp

    def documents(self) -> list[tuple[int, int, int]]:
        """``(row, start in row, length)`` of every non-empty document."""
        if self.bounds is None:
            return [(row, 0, self.seq_len) for row in range(self.batch)]
        s = self.seq_len
        return [(lo // s, lo % s, hi - lo) for lo, hi in zip(self.bounds, self.bounds[1:]) if hi > lo]

    def pieces(self, rank: int, offset: int = 0) -> tuple[Piece, ...]:
        """The pieces rank ``rank`` holds, their starts in its local row shifted by ``offset``."""
        return _pieces(self, rank, offset)

    def gathered_pieces(self, ranks: list[int] | tuple[int, ...]) -> tuple[Piece, ...]:
        """Pieces of the local rows of ``ranks`` concatenated in that order (an all-gather's or all-to-all's view)."""
        return tuple(p for i, r in enumerate(ranks) for p in self.pieces(r, i * self.local_len))

    def global_index(self, rank: int) -> torch.Tensor:
        """Long ``[batch * local_len]``: the flattened ``batch * seq_len`` token of each local token."""
        return _global_index(self, rank)

    def positions(self, rank: int) -> torch.Tensor:
        """Long ``[batch, local_len]``: each local token's position inside its document (for RoPE)."""
        pos = torch.empty(self.batch, self.local_len, dtype=torch.long)
        for row, start, length, _, first in self.pieces(rank):
            pos[row, start : start + length] = torch.arange(first, first + length)
        return pos

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` (``[..., batch, seq_len, ...]`` with ``batch`` at ``dim - 1``)."""
        self._check_shape(x, dim, self.seq_len)
        flat = x.flatten(dim - 1, dim)
        local = flat.index_select(dim - 1, self.global_index(rank).to(x.device))
        return local.unflatten(dim - 1, (self.batch, self.local_len))

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard` from every rank's shard (rank order)."""
        if len(shards) != self.cp:
            raise ValueError(f"CPSharding.unshard: expected {self.cp} shards, got {len(shards)}")
        for shard in shards:
            self._check_shape(shard, dim, self.local_len)
        flat = [s.flatten(dim - 1, dim) for s in shards]
        out = torch.empty_like(torch.cat(flat, dim=dim - 1))
        index = torch.cat([self.global_index(r) for r in range(self.cp)]).to(out.device)
        out.index_copy_(dim - 1, index, torch.cat(flat, dim=dim - 1))
        return out.unflatten(dim - 1, (self.batch, self.seq_len))

    def _check_shape(self, x: torch.Tensor, dim: int, length: int) -> None:
        if dim < 1 or x.dim() <= dim or x.shape[dim - 1] != self.batch or x.shape[dim] != length:
            raise ValueError(
                f"CPSharding: expected [batch={self.batch}, seq={length}] at dims {dim - 1}, {dim}, "
                f"got shape {tuple(x.shape)}"
            )


@functools.lru_cache(maxsize=512)
def _pieces(sharding: CPSharding, rank: int, offset: int) -> tuple[Piece, ...]:
    if not 0 <= rank < sharding.cp:
        raise ValueError(f"CPSharding: rank must be in [0, {sharding.cp}), got {rank}")
    n = 2 * sharding.cp
    cursor = [offset] * sharding.batch
    pieces = []
    for doc, (row, _, length) in enumerate(sharding.documents()):
        size = length // n
        for chunk in (rank, n - 1 - rank):
            pieces.append((row, cursor[row], size, doc, chunk * size))
            cursor[row] += size
    return tuple(pieces)


@functools.lru_cache(maxsize=512)
def _global_index(sharding: CPSharding, rank: int) -> torch.Tensor:
    index = torch.empty(sharding.batch * sharding.local_len, dtype=torch.long)
    starts = {doc: (row, start) for doc, (row, start, _) in enumerate(sharding.documents())}
    for row, local_start, length, doc, first in sharding.pieces(rank):
        _, doc_start = starts[doc]
        lo = row * sharding.local_len + local_start
        index[lo : lo + length] = torch.arange(length) + row * sharding.seq_len + doc_start + first
    return index


@functools.lru_cache(maxsize=1024)
def pieces_layout(
    q_pieces: tuple[Piece, ...],
    k_pieces: tuple[Piece, ...],
    batch: int,
    q_len: int,
    k_len: int,
    causal: bool,
    window_size: int | None,
) -> AttentionLayout:
    """Layout of queries ``q_pieces`` against keys ``k_pieces``: pieces of one document, where some pair is allowed."""
    by_doc: dict[int, list[Piece]] = {}
    for piece in k_pieces:
        by_doc.setdefault(piece[3], []).append(piece)
    pairs = []
    for row, q_start, q_n, doc, q_pos in q_pieces:
        for _, k_start, k_n, _, k_pos in by_doc.get(doc, ()):
            if causal and k_pos > q_pos + q_n - 1:
                continue  # every key after every query
            if window_size is not None and k_pos + k_n - 1 <= q_pos - window_size:
                continue  # every key left of every query's window
            pairs.append((row, q_start, q_n, q_pos, k_start, k_n, k_pos))
    return AttentionLayout(batch, q_len, k_len, causal, window_size, tuple(pairs))


def pad_documents(lengths: list[int], multiple: int) -> list[int]:
    """Each document length rounded up to ``multiple`` (``2 * cp``); nothing is ever cut."""
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_documents: multiple must be an int >= 1, got {multiple!r}")
    if any(not isinstance(n, int) or n < 0 for n in lengths):
        raise ValueError(f"pad_documents: lengths must be ints >= 0, got {lengths[:8]}")
    return [-(-n // multiple) * multiple for n in lengths]


def pad_packed_row(
    tokens: torch.Tensor, labels: torch.Tensor, lengths: list[int], multiple: int, pad_id: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Pad every document of one packed row to a multiple of ``multiple``: ``(tokens, labels, padded lengths)``.

    Padding tokens are ``pad_id`` with label ``ignore_index``, so the loss skips them; the row grows by the
    padding (the caller packs rows to leave room for it, e.g. ``seq_len`` a multiple of ``multiple`` and
    documents cut by the data pipeline, never here).
    """
    if tokens.dim() != 1 or labels.shape != tokens.shape:
        raise ValueError(f"pad_packed_row: tokens and labels must be 1-D and alike, got {tuple(tokens.shape)}, "
                         f"{tuple(labels.shape)}")  # fmt: skip
    if sum(lengths) != tokens.numel():
        raise ValueError(f"pad_packed_row: lengths sum to {sum(lengths)}, but the row has {tokens.numel()} tokens")
    padded = pad_documents(lengths, multiple)
    out_tokens, out_labels, start = [], [], 0
    for n, m in zip(lengths, padded):
        out_tokens += [tokens[start : start + n], tokens.new_full((m - n,), pad_id)]
        out_labels += [labels[start : start + n], labels.new_full((m - n,), ignore_index)]
        start += n
    return torch.cat(out_tokens), torch.cat(out_labels), padded
