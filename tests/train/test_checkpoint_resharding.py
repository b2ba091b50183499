"""Resharding plans against a brute-force reference: split a random full tensor, reassemble at another TP."""

from __future__ import annotations

import itertools

import pytest
import torch

from mcore.train.checkpoint.format import TensorMeta
from mcore.train.checkpoint.resharding import Target, plan_read
from mcore.train.errors import CheckpointError


def _shard(full: torch.Tensor, dim: int, blocks: list[int], tp: int, rank: int) -> torch.Tensor:
    """Reference TP slice: every block split into ``tp`` equal chunks, this rank's chunks concatenated."""
    parts = torch.split(full, blocks, dim=dim)
    return torch.cat([torch.chunk(p, tp, dim=dim)[rank] for p in parts], dim=dim)


def _assemble(plan, saved_shards: list[torch.Tensor]) -> torch.Tensor:
    out = torch.full(plan.local_shape, float("nan"), dtype=saved_shards[0].dtype)
    if plan.zero_fill:
        out.zero_()
    for piece in plan.pieces:
        out[piece.dst] = saved_shards[piece.saved_tp_rank][piece.src]
    return out


CASES = [
    # (full shape, partition dim, blocks)
    ((24, 5), 0, None),
    ((5, 24), 1, None),
    ((48, 3), 0, (24, 24)),  # fused [gate; up]
    ((40, 3), 0, (16, 8, 16)),  # three unequal blocks
]


@pytest.mark.parametrize("shape,dim,blocks", CASES)
@pytest.mark.parametrize("old_tp,new_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2)])
def test_reshard_matches_reference_split(shape, dim, blocks, old_tp, new_tp):
    full = torch.randn(shape, dtype=torch.float64)
    block_list = list(blocks) if blocks else [shape[dim]]
    saved = [_shard(full, dim, block_list, old_tp, r) for r in range(old_tp)]
    meta = TensorMeta(shape=shape, dtype="float64", partition_dim=dim, partition_blocks=blocks)
    for rank in range(new_tp):
        target = Target(full_shape=shape, partition_dim=dim, partition_blocks=blocks, tp_size=new_tp, tp_rank=rank)
        plan = plan_read("w", meta, old_tp, target)
        got = _assemble(plan, saved)
        assert torch.equal(got, _shard(full, dim, block_list, new_tp, rank))
        assert not plan.zero_fill


@pytest.mark.parametrize("old_tp,new_tp", list(itertools.product([1, 2, 4], [1, 2, 4])))
def test_vocab_padding_changes_with_tp(old_tp, new_tp):
    vocab, hidden, multiple = 70, 3, 8
    old_rows = -(-vocab // (multiple * old_tp)) * multiple * old_tp
    new_rows = -(-vocab // (multiple * new_tp)) * multiple * new_tp
    real = torch.randn(vocab, hidden, dtype=torch.float64)
    saved_full = torch.cat([real, torch.randn(old_rows - vocab, hidden, dtype=torch.float64)])
    saved = [torch.chunk(saved_full, old_tp)[r] for r in range(old_tp)]
    meta = TensorMeta(shape=(old_rows, hidden), dtype="float64", partition_dim=0, vocab_padded_dim=0, vocab_size=vocab)
    pieces = []
    for rank in range(new_tp):
        target = Target(
            full_shape=(new_rows, hidden),
            partition_dim=0,
            partition_blocks=None,
            tp_size=new_tp,
            tp_rank=rank,
            vocab_padded_dim=0,
            vocab_size=vocab,
        )
        pieces.append(_assemble(plan_read("emb", meta, old_tp, target), saved))
    got = torch.cat(pieces)
    assert got.shape == (new_rows, hidden)
    assert torch.equal(got[:vocab], real)
    common = min(old_rows, new_rows)
    assert torch.equal(got[vocab:common], saved_full[vocab:common])  # padding present in both layouts is kept
    assert torch.all(got[common:] == 0)  # padding only the new layout has starts at zero


def test_unpartitioned_saved_tensor_is_sliced_for_a_partitioned_target():
    full = torch.randn(12, 4)
    meta = TensorMeta(shape=(12, 4), dtype="float32")
    for rank in range(3):
        target = Target(full_shape=(12, 4), partition_dim=0, partition_blocks=(6, 6), tp_size=3, tp_rank=rank)
        got = _assemble(plan_read("w", meta, 1, target), [full])
        assert torch.equal(got, _shard(full, 0, [6, 6], 3, rank))


def test_partitioned_saved_tensor_is_gathered_for_a_replicated_target():
    full = torch.randn(3, 16)
    saved = [_shard(full, 1, [16], 4, r) for r in range(4)]
    meta = TensorMeta(shape=(3, 16), dtype="float32", partition_dim=1)
    target = Target(full_shape=(3, 16), partition_dim=None, partition_blocks=None, tp_size=2, tp_rank=1)
    assert torch.equal(_assemble(plan_read("w", meta, 4, target), saved), full)


def test_replicated_both_sides_is_a_plain_copy():
    full = torch.randn(7)
    meta = TensorMeta(shape=(7,), dtype="float32")
    target = Target(full_shape=(7,), partition_dim=None, partition_blocks=None, tp_size=4, tp_rank=3)
    assert torch.equal(_assemble(plan_read("norm", meta, 4, target), [full] * 4), full)


@pytest.mark.parametrize(
    "saved_shape,target_shape,match",
    [
        ((8, 4), (8, 6), "different model shape"),
        ((8, 4), (16, 4), "different model shape"),
        ((8,), (8, 1), "different model shape"),
    ],
)
def test_shape_mismatch_raises_checkpoint_error(saved_shape, target_shape, match):
    meta = TensorMeta(shape=saved_shape, dtype="float32", partition_dim=0)
    target = Target(full_shape=target_shape, partition_dim=0, partition_blocks=None, tp_size=1, tp_rank=0)
    with pytest.raises(CheckpointError, match=match):
        plan_read("layers.0.w", meta, 1, target)


def test_vocab_size_mismatch_names_the_tokenizer():
    meta = TensorMeta(shape=(64, 4), dtype="float32", partition_dim=0, vocab_padded_dim=0, vocab_size=60)
    target = Target(
        full_shape=(64, 4),
        partition_dim=0,
        partition_blocks=None,
        tp_size=1,
        tp_rank=0,
        vocab_padded_dim=0,
        vocab_size=50,
    )
    with pytest.raises(CheckpointError, match="vocabulary has 60 entries, the model 50"):
        plan_read("embedding.weight", meta, 1, target)


def test_block_count_mismatch_raises():
    meta = TensorMeta(shape=(8, 2), dtype="float32", partition_dim=0, partition_blocks=(4, 4))
    target = Target(full_shape=(8, 2), partition_dim=0, partition_blocks=(2, 2, 4), tp_size=2, tp_rank=0)
    with pytest.raises(CheckpointError, match="partition block"):
        plan_read("w", meta, 2, target)
