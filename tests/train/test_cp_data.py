"""The CP shard of a micro-batch (``mcore.train.context_parallel``), without processes: packed documents padded one
by one to a multiple of 2 x cp and never cut, padding out of the loss, the shards of all CP ranks together holding
every token once with its label and mask, positions restarting in every document, the whole micro-batch's loss
token count on every rank."""

from __future__ import annotations

import pytest
import torch

from mcore.train.context_parallel import CPBatches, pad_packed_batch
from mcore.train.data import collate_gpt_batch
from mcore.train.data.mock import MockGPTDataset


def _packed_batch(seq_length=30, batch=3, seed=0):
    data = MockGPTDataset(vocab_size=1000, seq_length=seq_length, num_samples=batch, seed=seed, packing=True)
    return collate_gpt_batch([data[i] for i in range(batch)])


@pytest.mark.parametrize("cp,granule", [(2, 4), (3, 6), (4, 8), (2, 8)])
def test_documents_are_padded_to_2cp_and_never_cut(cp, granule):
    batch = _packed_batch()
    tensors = {k: batch[k] for k in ("tokens", "labels", "loss_mask")}
    out, bounds = pad_packed_batch(tensors, batch["cu_seqlens"], 2 * cp, granule)
    b, s = batch["tokens"].shape
    length = out["tokens"].shape[1]
    assert length % granule == 0 and length >= s
    assert all((hi - lo) % (2 * cp) == 0 for lo, hi in zip(bounds, bounds[1:]))
    assert set(range(0, b * length + 1, length)) <= set(bounds)
    old = batch["cu_seqlens"].tolist()
    assert len(old) >= 2 * b + 2, "the mock batch should hold several documents per row"
    flat_in = {k: batch[k].reshape(-1) for k in tensors}
    flat_out = {k: out[k].reshape(-1) for k in tensors}
    for row in range(b):
        docs = [(lo, hi) for lo, hi in zip(old, old[1:]) if row * s <= lo < (row + 1) * s]
        padded = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if row * length <= lo < (row + 1) * length]
        assert len(padded) in (len(docs), len(docs) + 1)  # one more: the row's trailing padding
        for (lo, hi), (p_lo, p_hi) in zip(docs, padded):
            n = hi - lo
            assert p_hi - p_lo == -(-n // (2 * cp)) * (2 * cp)  # the next multiple of 2 x cp
            for key in tensors:  # the document whole and in place, then padding out of the loss
                assert torch.equal(flat_out[key][p_lo : p_lo + n], flat_in[key][lo:hi]), key
            assert (flat_out["labels"][p_lo + n : p_hi] == -100).all()
            assert (flat_out["loss_mask"][p_lo + n : p_hi] == 0).all()
        for p_lo, p_hi in padded[len(docs) :]:
            assert (flat_out["loss_mask"][p_lo:p_hi] == 0).all() and (flat_out["labels"][p_lo:p_hi] == -100).all()
    assert out["loss_mask"].sum() == batch["loss_mask"].sum()
    assert (out["labels"] != -100).sum() == (batch["labels"] != -100).sum()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_the_shards_of_all_ranks_hold_every_token_once(packed, cp):
    batch = _packed_batch(seq_length=32) if packed else _unpacked_batch(32)
    shards = [CPBatches(cp, r, groups=None, granule=2 * cp).shard(batch) for r in range(cp)]
    sharding = shards[0]["context_parallel"].sharding
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert all(s[key].shape == (batch["tokens"].shape[0], sharding.seq_len // cp) for s in shards)
    whole = {key: sharding.unshard([s[key] for s in shards]) for key in ("tokens", "labels", "loss_mask")}
    if packed:
        tensors = {k: batch[k] for k in ("tokens", "labels", "loss_mask")}
        want, _ = pad_packed_batch(tensors, batch["cu_seqlens"], 2 * cp, 2 * cp)
    else:
        want = batch
    for key, value in whole.items():
        assert torch.equal(value, want[key]), key
    positions = sharding.unshard([s["position_ids"] for s in shards])
    for row, start, length in sharding.documents():
        assert torch.equal(positions[row, start : start + length], torch.arange(length))
    for s in shards:
        assert s["loss_tokens"] == batch["loss_mask"].sum()
        assert "cu_seqlens" not in s and s["context_parallel"].sharding == sharding


def _unpacked_batch(seq_length):
    data = MockGPTDataset(vocab_size=1000, seq_length=seq_length, num_samples=2, seed=1)
    return collate_gpt_batch([data[i] for i in range(2)])


def test_a_row_length_cp_cannot_split_is_refused():
    with pytest.raises(ValueError, match="sequence length 30 is not a multiple of 4"):
        CPBatches(2, 0, groups=None, granule=4).shard(_unpacked_batch(30))
    with pytest.raises(ValueError, match="has no 'loss_mask'"):
        CPBatches(2, 0, groups=None, granule=4).shard({"tokens": torch.zeros(1, 8), "labels": torch.zeros(1, 8)})
