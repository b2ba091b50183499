"""GPT sample building: coverage per epoch, shifted labels, document boundaries, packing, masking, mock data.

The corpus gives every token a unique id (its position in the corpus), so the tests can tell from a sample's ids
exactly which document positions it holds, independently of how the dataset built it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore.train.data import (
    IGNORE_INDEX,
    GPTSampleDataset,
    InMemoryIndexedDataset,
    MockGPTDataset,
    build_sample,
    collate_gpt_batch,
)


class Corpus:
    """Documents of random lengths whose token ids are 0, 1, 2, ... over the whole corpus."""

    def __init__(self, seed: int, num_docs: int, max_len: int, min_len: int = 1) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(min_len, max_len + 1, size=num_docs)
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)))
        docs = [np.arange(self.starts[k], self.starts[k + 1]) for k in range(num_docs)]
        self.indexed = InMemoryIndexedDataset.from_documents(docs, dtype=np.int32)
        self.total = int(self.starts[-1])

    def doc_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, ids, side="right") - 1

    def is_doc_start(self, ids: np.ndarray) -> np.ndarray:
        return self.starts[self.doc_of(ids)] == ids


def _windows(ds: GPTSampleDataset) -> list[np.ndarray]:
    return [ds.window(i)[0].astype(np.int64) for i in range(len(ds))]


def _samples_covering_epochs(corpus: Corpus, seq_length: int, epochs: int) -> int:
    """Samples that start before the end of ``epochs`` epochs: exactly the shuffle groups of those epochs."""
    return -(-(epochs * corpus.total) // seq_length)


@pytest.mark.parametrize("seq_length", [7, 64])
def test_every_token_is_an_input_once_per_epoch(seq_length):
    corpus = Corpus(seed=0, num_docs=50, max_len=40)
    epochs = 3
    n = _samples_covering_epochs(corpus, seq_length, epochs)
    ds = GPTSampleDataset(corpus.indexed, seq_length=seq_length, num_samples=n, seed=11)
    inputs = np.concatenate([ds[i]["tokens"].numpy() for i in range(n)])
    counts = np.bincount(inputs, minlength=corpus.total)
    # Inputs cover stream positions [0, n * s): `epochs` full epochs plus fewer than s tokens of the next one.
    overflow = n * seq_length - epochs * corpus.total
    assert 0 <= overflow < seq_length
    assert counts.min() == epochs and counts.max() <= epochs + 1
    assert int((counts == epochs + 1).sum()) == overflow
    # Epochs are not mixed: the first epoch's worth of the shuffled samples already covers every token.
    first = _samples_covering_epochs(corpus, seq_length, 1)
    counts = np.bincount(inputs[: first * seq_length], minlength=corpus.total)
    assert counts.min() == 1 and int((counts == 2).sum()) == first * seq_length - corpus.total


def test_documents_are_whole_and_concatenated_in_order():
    corpus = Corpus(seed=1, num_docs=30, max_len=25)
    ds = GPTSampleDataset(corpus.indexed, seq_length=32, num_samples=100, seed=5)
    for i in range(len(ds)):
        sample = ds[i]
        window = ds.window(i)[0].astype(np.int64)
        np.testing.assert_array_equal(sample["tokens"].numpy(), window[:-1])
        np.testing.assert_array_equal(sample["labels"].numpy(), window[1:])
        # Consecutive ids either continue a document or jump from a document's last token to another's first.
        step = np.diff(window)
        jump = step != 1
        assert corpus.is_doc_start(window[1:][jump]).all()
        assert (window[:-1][jump] + 1 == corpus.starts[corpus.doc_of(window[:-1][jump]) + 1]).all()
        # Without packing positions run 0..s-1 and no boundaries are passed on.
        np.testing.assert_array_equal(sample["position_ids"].numpy(), np.arange(32))
        assert "cu_seqlens" not in sample
        assert sample["loss_mask"].dtype == torch.float32 and bool((sample["loss_mask"] == 1).all())


def test_epoch_order_is_a_fresh_permutation_each_epoch():
    corpus = Corpus(seed=2, num_docs=40, max_len=30)
    s = 16
    n = _samples_covering_epochs(corpus, s, 2)
    ds = GPTSampleDataset(corpus.indexed, seq_length=s, num_samples=n, seed=3)
    unshuffled = np.argsort(ds.shuffle_index)  # position of unshuffled sample j in the shuffled order
    stream = np.concatenate([ds.window(int(p))[0][:-1] for p in unshuffled])
    first_ids = stream[corpus.is_doc_start(stream)]
    order = corpus.doc_of(first_ids)
    epoch0, epoch1 = order[:40], order[40:80]
    assert sorted(epoch0) == list(range(40)) and sorted(epoch1) == list(range(40))
    assert not np.array_equal(epoch0, epoch1)
    assert not np.array_equal(epoch0, np.arange(40))


def test_order_is_a_function_of_the_seed_only():
    corpus = Corpus(seed=3, num_docs=60, max_len=50)
    a = _windows(GPTSampleDataset(corpus.indexed, seq_length=24, num_samples=200, seed=7))
    b = _windows(GPTSampleDataset(corpus.indexed, seq_length=24, num_samples=200, seed=7))
    c = _windows(GPTSampleDataset(corpus.indexed, seq_length=24, num_samples=200, seed=8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert sum(np.array_equal(x, y) for x, y in zip(a, c)) < 10
    # Shuffled: the samples do not come in stream order.
    firsts = np.array([w[0] for w in a[:50]])
    assert (np.diff(firsts) < 0).any()


def test_more_samples_extend_without_changing_the_prefix():
    corpus = Corpus(seed=4, num_docs=25, max_len=60)
    short = GPTSampleDataset(corpus.indexed, seq_length=40, num_samples=37, seed=1)
    long = GPTSampleDataset(corpus.indexed, seq_length=40, num_samples=500, seed=1)
    assert long.num_epochs > short.num_epochs
    for i in range(len(short)):
        np.testing.assert_array_equal(short.window(i)[0], long.window(i)[0])


def test_document_subset_and_empty_documents():
    corpus = Corpus(seed=5, num_docs=30, max_len=20, min_len=0)
    assert (corpus.lengths == 0).any()
    subset = np.arange(10, 20)
    ds = GPTSampleDataset(corpus.indexed, seq_length=8, num_samples=60, seed=2, documents=subset)
    ids = np.concatenate(_windows(ds))
    assert set(np.unique(corpus.doc_of(ids))) <= set(subset.tolist())
    assert ds.tokens_per_epoch == int(corpus.lengths[10:20].sum())


def test_samples_longer_than_the_corpus_wrap_over_epochs():
    corpus = Corpus(seed=6, num_docs=3, max_len=5)
    s = 4 * corpus.total + 3
    ds = GPTSampleDataset(corpus.indexed, seq_length=s, num_samples=5, seed=0)
    for i in range(5):
        window = ds.window(i)[0]
        assert window.size == s + 1
        assert np.bincount(window[: 4 * corpus.total], minlength=corpus.total).min() >= 3


def test_packing_restarts_positions_and_marks_documents():
    corpus = Corpus(seed=7, num_docs=40, max_len=30)
    s = 48
    ds = GPTSampleDataset(corpus.indexed, seq_length=s, num_samples=40, seed=9, packing=True)
    for i in range(len(ds)):
        sample = ds[i]
        tokens = sample["tokens"].numpy().astype(np.int64)
        starts = np.flatnonzero(corpus.is_doc_start(tokens))
        expected_bounds = np.unique(np.concatenate(([0], starts, [s])))
        cu = sample["cu_seqlens"]
        assert cu.dtype == torch.int32
        np.testing.assert_array_equal(cu.numpy(), expected_bounds)
        positions = sample["position_ids"].numpy()
        for a, b in zip(expected_bounds[:-1], expected_bounds[1:]):
            np.testing.assert_array_equal(positions[a:b], np.arange(b - a))
        # Each segment holds tokens of one document.
        for a, b in zip(expected_bounds[:-1], expected_bounds[1:]):
            assert len(set(corpus.doc_of(tokens[a:b]).tolist())) == 1


def test_collate_builds_batch_cu_seqlens_over_flattened_tokens():
    corpus = Corpus(seed=8, num_docs=30, max_len=20)
    s = 16
    ds = GPTSampleDataset(corpus.indexed, seq_length=s, num_samples=12, seed=4, packing=True)
    samples = [ds[i] for i in range(4)]
    batch = collate_gpt_batch(samples)
    assert batch["tokens"].shape == (4, s) and batch["tokens"].dtype == torch.int64
    cu = batch["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 4 * s
    assert bool((cu[1:] > cu[:-1]).all())
    assert set(range(0, 4 * s + 1, s)) <= set(cu.tolist())
    flat = batch["tokens"].reshape(-1).numpy()
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert len(set(corpus.doc_of(flat[a:b]).tolist())) == 1
    assert batch["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
    # The batch's segments are the samples' segments shifted by b * s.
    expected = np.unique(np.concatenate([samples[b]["cu_seqlens"].numpy() + b * s for b in range(4)]))
    np.testing.assert_array_equal(cu.numpy(), expected)

    plain = collate_gpt_batch(
        [GPTSampleDataset(corpus.indexed, seq_length=s, num_samples=2, seed=4)[i] for i in (0, 1)]
    )
    assert set(plain) == {"tokens", "labels", "loss_mask", "position_ids"}
    with pytest.raises(ValueError, match="packed and unpacked"):
        collate_gpt_batch([samples[0], GPTSampleDataset(corpus.indexed, seq_length=s, num_samples=1, seed=4)[0]])


def test_eod_mask_loss_masks_the_prediction_after_eod():
    rng = np.random.default_rng(9)
    eod = 99
    docs = [np.concatenate((rng.integers(0, 90, size=int(rng.integers(3, 12))), [eod])) for _ in range(20)]
    corpus = InMemoryIndexedDataset.from_documents(docs)
    ds = GPTSampleDataset(corpus, seq_length=32, num_samples=10, seed=0, eod_id=eod, eod_mask_loss=True)
    seen_eod = False
    for i in range(len(ds)):
        sample = ds[i]
        at_eod = sample["tokens"] == eod
        seen_eod |= bool(at_eod.any())
        assert bool((sample["loss_mask"][at_eod] == 0).all()) and bool((sample["loss_mask"][~at_eod] == 1).all())
        assert bool((sample["labels"][at_eod] == IGNORE_INDEX).all())
        window = ds.window(i)[0]
        np.testing.assert_array_equal(sample["labels"][~at_eod].numpy(), window[1:][~at_eod.numpy()])
    assert seen_eod
    with pytest.raises(ValueError, match="needs eod_id"):
        GPTSampleDataset(corpus, seq_length=8, num_samples=1, seed=0, eod_mask_loss=True)


def test_build_sample_ignores_boundaries_that_do_not_split_inputs():
    window = np.arange(10, 21)  # s = 10
    sample = build_sample(window, [0, 4, 10, 4], packing=True)
    np.testing.assert_array_equal(sample["cu_seqlens"].numpy(), [0, 4, 10])
    np.testing.assert_array_equal(sample["position_ids"].numpy(), [0, 1, 2, 3, 0, 1, 2, 3, 4, 5])


def test_mock_dataset_is_deterministic_per_index():
    ds = MockGPTDataset(vocab_size=1000, seq_length=64, num_samples=50, seed=3)
    again = MockGPTDataset(vocab_size=1000, seq_length=64, num_samples=50, seed=3)
    other = MockGPTDataset(vocab_size=1000, seq_length=64, num_samples=50, seed=4)
    for i in (0, 17, 49):
        assert torch.equal(ds[i]["tokens"], again[i]["tokens"])
        assert not torch.equal(ds[i]["tokens"], other[i]["tokens"])
        assert torch.equal(ds[i]["labels"][:-1], ds[i]["tokens"][1:])
    values = torch.cat([ds[i]["tokens"] for i in range(50)])
    assert int(values.min()) >= 0 and int(values.max()) < 1000
    assert len(torch.unique(values)) > 900  # uniform over the vocabulary, not a constant
    with pytest.raises(IndexError):
        ds[50]


def test_mock_dataset_packing():
    ds = MockGPTDataset(vocab_size=50, seq_length=128, num_samples=8, seed=1, packing=True, mean_document_length=20)
    batch = collate_gpt_batch([ds[i] for i in range(8)])
    cu = batch["cu_seqlens"]
    assert cu[-1] == 8 * 128 and len(cu) > 8 * 3
    segments = (cu[1:] - cu[:-1]).float()
    assert 10 < float(segments.mean()) < 25  # document lengths average near 20 (cut at sample ends)
    flat_positions = batch["position_ids"].reshape(-1)
    assert bool((flat_positions[cu[:-1].long()] == 0).all())
    default = MockGPTDataset(vocab_size=50, seq_length=400, num_samples=1, packing=True)
    assert default.mean_document_length == 100
    with pytest.raises(ValueError, match="mean_document_length only applies with packing=True"):
        MockGPTDataset(vocab_size=50, seq_length=8, num_samples=1, mean_document_length=4)


def test_bad_arguments_name_the_problem():
    corpus = Corpus(seed=10, num_docs=5, max_len=5)
    with pytest.raises(ValueError, match="seq_length must be >= 1, got 0"):
        GPTSampleDataset(corpus.indexed, seq_length=0, num_samples=1, seed=0)
    with pytest.raises(TypeError, match="num_samples must be an int, got float"):
        GPTSampleDataset(corpus.indexed, seq_length=4, num_samples=1.5, seed=0)
    with pytest.raises(ValueError, match="documents must index the 5 sequences"):
        GPTSampleDataset(corpus.indexed, seq_length=4, num_samples=1, seed=0, documents=[0, 5])
    empty = InMemoryIndexedDataset.from_documents([[], []])
    with pytest.raises(ValueError, match="hold no tokens"):
        GPTSampleDataset(empty, seq_length=4, num_samples=1, seed=0)
    ds = GPTSampleDataset(corpus.indexed, seq_length=4, num_samples=3, seed=0)
    with pytest.raises(IndexError, match="out of range for 3 samples"):
        ds[3]
