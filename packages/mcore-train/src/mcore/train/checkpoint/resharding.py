"""Which ranges of which saved TP slices make up one rank's slice at a different TP size.

A TP-sharded tensor is, along its ``partition_dim``, a concatenation of *blocks* (one block for most
weights; ``[gate; up]`` has two), each split evenly over the TP ranks. Rank ``r`` of ``T`` holds, for
every block ``k`` of full size ``B_k``, the rows ``[r B_k / T, (r+1) B_k / T)`` of that block, one block
after the other. Loading at a different TP size therefore maps each block range of the new rank onto
the saved ranks that hold it; this module computes that mapping as a list of :class:`Piece` copies,
without touching any tensor data.

Vocabulary padding: embedding and output rows beyond ``vocab_size`` are padding whose count depends on
TP. Rows that exist in both layouts are copied (so a same-layout resume is exact); rows the new layout
has beyond the saved padded size are left to the caller to zero (:attr:`ReadPlan.zero_fill`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.train.checkpoint.format import TensorMeta
from mcore.train.errors import CheckpointError


@dataclass(frozen=True)
class Piece:
    """Copy ``saved_tp_rank``'s local tensor ``[src]`` into the new local tensor ``[dst]``."""

    saved_tp_rank: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


@dataclass(frozen=True)
class ReadPlan:
    """The copies that assemble one new local tensor, and whether padding rows must be zeroed first."""

    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    zero_fill: bool


@dataclass(frozen=True)
class Target:
    """The tensor to fill: its partitioning at the new layout (full sizes, as in :class:`TensorMeta`)."""

    full_shape: tuple[int, ...]
    partition_dim: int | None
    partition_blocks: tuple[int, ...] | None
    tp_size: int
    tp_rank: int
    vocab_padded_dim: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if self.partition_dim is not None:
            for block in self.blocks:
                if block % self.tp_size:
                    raise ValueError(
                        f"block of size {block} along dim {self.partition_dim} cannot be split over tp={self.tp_size}"
                    )

    @property
    def blocks(self) -> tuple[int, ...]:
        if self.partition_dim is None:
            return ()
        return self.partition_blocks or (self.full_shape[self.partition_dim],)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] //= self.tp_size
        return tuple(shape)


def plan_read(name: str, saved: TensorMeta, saved_tp: int, target: Target) -> ReadPlan:
    """Plan how to fill ``target``'s local slice from a tensor saved with ``saved`` at TP size ``saved_tp``.

    Raises :class:`CheckpointError` when the saved tensor has a different shape than the model expects
    (beyond vocabulary padding), naming the tensor and both shapes.
    """
    _check_compatible(name, saved, target)
    if saved.partition_dim is None and target.partition_dim is None:
        full = tuple(slice(0, min(a, b)) for a, b in zip(saved.shape, target.full_shape))
        zero = any(a < b for a, b in zip(saved.shape, target.full_shape))
        return ReadPlan(target.local_shape, (Piece(0, full, full),), zero)

    dim = target.partition_dim if target.partition_dim is not None else saved.partition_dim
    # A side that is not partitioned behaves as TP size 1 with the other side's block structure.
    new_tp, new_rank = (target.tp_size, target.tp_rank) if target.partition_dim is not None else (1, 0)
    old_tp = saved_tp if saved.partition_dim is not None else 1
    if target.partition_dim is not None:
        new_blocks = target.blocks
    else:
        new_blocks = _blocks_like(saved.blocks, target.full_shape[dim])
    if saved.partition_dim is not None:
        old_blocks = saved.blocks
    else:
        old_blocks = _blocks_like(target.blocks, saved.shape[dim])
    if len(new_blocks) != len(old_blocks):
        raise CheckpointError(
            f"tensor {name!r}: saved with {len(old_blocks)} partition block(s) {list(old_blocks)}, the model "
            f"expects {len(new_blocks)} {list(new_blocks)} (a checkpoint of a different model shape?)"
        )
    for b in old_blocks:
        if b % old_tp:
            raise CheckpointError(f"tensor {name!r}: saved block of size {b} is not divisible by saved tp={old_tp}")

    other_dims = [slice(0, min(a, b)) for a, b in zip(saved.shape, target.full_shape)]
    pieces: list[Piece] = []
    zero_fill = False
    new_offset = 0
    old_offset = 0
    for new_block, old_block in zip(new_blocks, old_blocks):
        new_chunk = new_block // new_tp
        old_chunk = old_block // old_tp
        start, stop = new_rank * new_chunk, (new_rank + 1) * new_chunk
        readable_stop = min(stop, old_block)
        if readable_stop < stop:
            zero_fill = True
        for s in range(old_tp):
            lo, hi = max(start, s * old_chunk), min(readable_stop, (s + 1) * old_chunk)
            if lo >= hi:
                continue
            src = list(other_dims)
            dst = list(other_dims)
            src[dim] = slice(old_offset + lo - s * old_chunk, old_offset + hi - s * old_chunk)
            dst[dim] = slice(new_offset + lo - start, new_offset + hi - start)
            pieces.append(Piece(s, tuple(src), tuple(dst)))
        new_offset += new_chunk
        old_offset += old_chunk
    if any(a < b for i, (a, b) in enumerate(zip(saved.shape, target.full_shape)) if i != dim):
        zero_fill = True
    return ReadPlan(target.local_shape, tuple(pieces), zero_fill)


def _blocks_like(other_blocks: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Blocks for the unpartitioned side: the partitioned side's blocks when they cover the same size."""
    if len(other_blocks) > 1 and sum(other_blocks) == size:
        return other_blocks
    return (size,)


def _check_compatible(name: str, saved: TensorMeta, target: Target) -> None:
    if len(saved.shape) != len(target.full_shape):
        raise CheckpointError(
            f"tensor {name!r}: checkpoint shape {list(saved.shape)} does not match the model's "
            f"{list(target.full_shape)} (a checkpoint of a different model shape?)"
        )
    if (
        saved.partition_dim is not None
        and target.partition_dim is not None
        and saved.partition_dim != target.partition_dim
    ):
        raise CheckpointError(
            f"tensor {name!r}: saved split along dim {saved.partition_dim}, the model splits dim "
            f"{target.partition_dim}; the checkpoint comes from an incompatible model"
        )
    vocab_dim = target.vocab_padded_dim if target.vocab_padded_dim is not None else saved.vocab_padded_dim
    for d, (a, b) in enumerate(zip(saved.shape, target.full_shape)):
        if d == vocab_dim:
            continue
        if a != b:
            raise CheckpointError(
                f"tensor {name!r}: checkpoint shape {list(saved.shape)} does not match the model's "
                f"{list(target.full_shape)} in dim {d} (a checkpoint of a different model shape?)"
            )
    if vocab_dim is not None:
        saved_vocab = saved.vocab_size if saved.vocab_size is not None else saved.shape[vocab_dim]
        target_vocab = target.vocab_size if target.vocab_size is not None else target.full_shape[vocab_dim]
        if saved_vocab != target_vocab:
            raise CheckpointError(
                f"tensor {name!r}: checkpoint vocabulary has {saved_vocab} entries, the model {target_vocab}; "
                f"use the tokenizer the checkpoint was trained with"
            )
        if saved.shape[vocab_dim] < saved_vocab or target.full_shape[vocab_dim] < target_vocab:
            raise CheckpointError(f"tensor {name!r}: padded vocabulary dim is smaller than vocab_size")
