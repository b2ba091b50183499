"""Blends (weights honoured, deterministic), splits (disjoint, complete) and the file-based dataset builder."""

from __future__ import annotations

import numpy as np
import pytest

from mcore.train.data import (
    BlendedDataset,
    DataError,
    GPTSampleDataset,
    IndexedDatasetWriter,
    InMemoryIndexedDataset,
    blending_indices,
    build_gpt_datasets,
    build_mock_datasets,
    parse_blend,
    parse_split,
    samples_per_dataset,
    split_document_ranges,
)

# Token ids tell the source apart: dataset d uses ids in [d * 10_000, d * 10_000 + 10_000).
SPAN = 10_000


def _docs(seed: int, source: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [source * SPAN + rng.integers(0, SPAN, size=int(rng.integers(5, 80))) for _ in range(count)]


def _write(prefix: str, docs: list[np.ndarray]) -> str:
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
    return prefix


def test_blend_weights_are_honoured_within_one_percent_over_10k_samples(tmp_path):
    weights = [0.55, 0.3, 0.15]
    prefixes = [_write(str(tmp_path / f"d{d}"), _docs(seed=d, source=d, count=60)) for d in range(3)]
    blend = " ".join(f"{w} {p}" for w, p in zip(weights, prefixes))
    n = 10_000
    splits = build_gpt_datasets(blend, seq_length=16, num_samples=n, seed=123, split="1")
    assert isinstance(splits.train, BlendedDataset) and splits.valid is None and splits.test is None
    # Identify each sample's source from its token ids, not from the blend's own bookkeeping.
    sources = np.array([int(splits.train[i]["tokens"][0]) // SPAN for i in range(n)])
    for d, w in enumerate(weights):
        realized = float((sources == d).mean())
        assert abs(realized - w) <= 0.01 * w, (d, realized, w)
    # Every prefix of the stream tracks the weights to within one sample per dataset.
    running = np.stack([np.cumsum(sources == d) for d in range(3)], axis=1)
    expected = np.outer(np.arange(1, n + 1), weights)
    assert np.abs(running - expected).max() <= 1.0


@pytest.mark.parametrize("num_datasets", [2, 3, 7])
def test_every_prefix_tracks_random_weights_within_the_documented_bound(num_datasets):
    rng = np.random.default_rng(num_datasets)
    weights = rng.dirichlet(np.ones(num_datasets)) * rng.uniform(0.5, 20)  # unnormalized on purpose
    fractions = weights / weights.sum()
    n = 20_000
    dataset_index, sample_index = blending_indices(list(weights), n)
    running = np.stack([np.cumsum(dataset_index == d) for d in range(num_datasets)], axis=1)
    deviation = np.abs(running - np.outer(np.arange(1, n + 1), fractions))
    bound = 0.5 + fractions * (num_datasets - 2) / 2
    assert (deviation <= bound + 1e-9).all()
    # Each dataset's samples are taken in order 0, 1, 2, ...
    for d in range(num_datasets):
        np.testing.assert_array_equal(sample_index[dataset_index == d], np.arange(int(running[-1, d])))


def test_blended_sample_k_of_dataset_d_is_that_datasets_kth_sample():
    rng = np.random.default_rng(0)
    corpora = [InMemoryIndexedDataset.from_documents(_docs(seed=10 + d, source=d, count=30)) for d in range(2)]
    weights = [float(w) for w in rng.dirichlet([1, 1])]
    counts = samples_per_dataset(weights, 500)
    parts = [
        GPTSampleDataset(c, seq_length=12, num_samples=k, seed=3, name=f"c{d}")
        for d, (c, k) in enumerate(zip(corpora, counts))
    ]
    blended = BlendedDataset(parts, weights, 500)
    seen = [0, 0]
    for i in range(500):
        d = int(blended.dataset_index[i])
        assert blended.dataset_sample_index[i] == seen[d]
        np.testing.assert_array_equal(blended[i]["tokens"].numpy(), parts[d][seen[d]]["tokens"].numpy())
        seen[d] += 1
    assert seen == counts


def test_blending_is_deterministic_and_prefix_stable():
    a_index, a_sample = blending_indices([3, 2, 5], 1000)
    b_index, b_sample = blending_indices([0.3, 0.2, 0.5], 1700)
    np.testing.assert_array_equal(a_index, b_index[:1000])
    np.testing.assert_array_equal(a_sample, b_sample[:1000])


def test_blend_errors():
    ds = GPTSampleDataset(InMemoryIndexedDataset.from_documents([[1, 2, 3, 4]]), seq_length=2, num_samples=3, seed=0)
    with pytest.raises(ValueError, match="2 datasets needs 2 weights"):
        BlendedDataset([ds, ds], [1.0], 4)
    with pytest.raises(ValueError, match="weight 1 must be finite and > 0"):
        BlendedDataset([ds, ds], [1.0, -1.0], 4)
    with pytest.raises(ValueError, match="has 3 samples but .* takes 5 .* num_samples >= 5"):
        BlendedDataset([ds, ds], [0.5, 0.5], 10)


def test_parse_blend_forms():
    assert parse_blend("data/a") == [(1.0, "data/a")]
    assert parse_blend("0.25 a 0.75 b") == [(0.25, "a"), (0.75, "b")]
    assert parse_blend(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    assert parse_blend([(1, "a"), (3, "b")]) == [(0.25, "a"), (0.75, "b")]
    with pytest.raises(ValueError, match="alternates weights and prefixes"):
        parse_blend("0.3 a 0.7")
    with pytest.raises(ValueError, match="empty"):
        parse_blend([])


def test_splits_are_disjoint_and_cover_every_document(tmp_path):
    docs = _docs(seed=5, source=0, count=200)
    # Make every document recognizable by its first id.
    for k, doc in enumerate(docs):
        doc[0] = k
        doc[1:] = np.maximum(doc[1:], 200)
    prefix = _write(str(tmp_path / "s"), docs)
    splits = build_gpt_datasets(prefix, seq_length=8, num_samples=(400, 100, 50), seed=1, split="90,7,3", packing=True)
    owners = []
    for ds in (splits.train, splits.valid, splits.test):
        firsts = set()
        for i in range(len(ds)):
            sample = ds[i]
            starts = sample["cu_seqlens"][:-1].long()
            firsts |= {int(t) for t in sample["tokens"][starts] if int(t) < 200}
        owners.append(firsts)
    assert not (owners[0] & owners[1]) and not (owners[0] & owners[2]) and not (owners[1] & owners[2])
    assert owners[0] <= set(range(0, 180)) and owners[1] <= set(range(180, 194)) and owners[2] <= set(range(194, 200))
    assert len(splits.train) == 400 and len(splits.valid) == 100 and len(splits.test) == 50


def test_split_ranges():
    assert parse_split("98,2,0") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    assert split_document_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    ranges = split_document_ranges(7, [1, 1, 1])
    assert ranges[0][0] == 0 and ranges[-1][1] == 7
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match="non-negative"):
        parse_split("98,-2")
    with pytest.raises(ValueError, match="comma-separated numbers"):
        parse_split("train=98")
    with pytest.raises(ValueError, match="1 to 3 parts"):
        parse_split("1,1,1,1")


def test_empty_split_with_samples_asked_is_a_clear_error(tmp_path):
    prefix = _write(str(tmp_path / "tiny"), _docs(seed=6, source=0, count=10))
    with pytest.raises(DataError, match=r"valid split of '100,0,0' holds none of its 10 documents"):
        build_gpt_datasets(prefix, seq_length=8, num_samples=(10, 5), seed=0, split="100,0,0")


def test_missing_data_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"missing\.bin and .*missing\.idx not found"):
        build_gpt_datasets(str(tmp_path / "missing"), seq_length=8, num_samples=10, seed=0)


def test_mock_splits_differ():
    splits = build_mock_datasets(vocab_size=100, seq_length=16, num_samples=(5, 5, 0), seed=0)
    assert splits.test is None
    assert not np.array_equal(splits.train[0]["tokens"].numpy(), splits.valid[0]["tokens"].numpy())
