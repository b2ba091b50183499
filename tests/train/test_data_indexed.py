"""The .bin/.idx reader and writer against Megatron-Core's own IndexedDataset / IndexedDatasetBuilder."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from mcore.train.data import (
    DataError,
    IndexedDataset,
    IndexedDatasetWriter,
    InMemoryIndexedDataset,
    bin_path,
    idx_path,
    token_dtype_for_vocab,
)

DTYPES = [np.uint16, np.int32]


def _random_documents(rng: np.random.Generator, dtype, count: int = 40) -> list[np.ndarray]:
    high = 65535 if dtype == np.uint16 else 2_000_000_000
    docs = [rng.integers(0, high, size=int(rng.integers(1, 300)), dtype=np.int64) for _ in range(count)]
    docs[7] = np.zeros(0, dtype=np.int64)  # an empty document is legal in the format
    docs[3][:2] = [0, high]  # both ends of the dtype's range
    return docs


@pytest.mark.parametrize("dtype", DTYPES)
def test_ours_written_megatron_reads(tmp_path, dtype):
    rng = np.random.default_rng(1)
    docs = _random_documents(rng, dtype)
    prefix = str(tmp_path / "ours")
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    theirs = MegatronIndexedDataset(prefix)
    assert theirs.index.dtype == dtype
    assert len(theirs) == len(docs)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    np.testing.assert_array_equal(theirs.sequence_lengths, [d.size for d in docs])
    for k, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[k].astype(np.int64), doc)
    np.testing.assert_array_equal(theirs.get(5, offset=3, length=4).astype(np.int64), docs[5][3:7])
    # The files are exactly the two Megatron names; no temporary is left behind.
    assert sorted(os.listdir(tmp_path)) == ["ours.bin", "ours.idx"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_written_ours_reads(tmp_path, dtype):
    rng = np.random.default_rng(2)
    docs = _random_documents(rng, dtype)
    prefix = str(tmp_path / "theirs")
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype=dtype)
    for doc in docs[:20]:
        builder.add_document(torch.from_numpy(doc), [doc.size])
    # Documents made of several sequences (Megatron's sentence splitting): boundaries are sequence indices.
    for doc in docs[20:]:
        half = doc.size // 2
        builder.add_item(torch.from_numpy(doc[:half]))
        builder.add_item(torch.from_numpy(doc[half:]))
        builder.end_document()
    builder.finalize(idx_path(prefix))

    ours = IndexedDataset(prefix)
    theirs = MegatronIndexedDataset(prefix)
    assert ours.dtype == np.dtype(dtype)
    assert len(ours) == len(theirs) == 20 + 2 * 20
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    assert ours.sequence_modes is None
    for k in range(len(ours)):
        np.testing.assert_array_equal(ours[k], theirs[k])
    for k in (0, 21, 45):
        size = int(ours.sequence_lengths[k])
        offset, length = size // 3, size // 3
        np.testing.assert_array_equal(ours.get(k, offset, length), theirs.get(k, offset, length))
    np.testing.assert_array_equal(ours[-1], theirs[len(theirs) - 1])
    assert ours.num_tokens == sum(d.size for d in docs)


def test_multimodal_modes_are_read(tmp_path):
    prefix = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16, multimodal=True)
    builder.add_item(torch.tensor([1, 2, 3]), mode=0)
    builder.add_item(torch.tensor([4, 5]), mode=1)
    builder.end_document()
    builder.finalize(idx_path(prefix))
    ours = IndexedDataset(prefix)
    np.testing.assert_array_equal(ours.sequence_modes, [0, 1])
    np.testing.assert_array_equal(ours[1], [4, 5])


def test_empty_dataset_round_trip(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetWriter(prefix).finalize()
    ours = IndexedDataset(prefix)
    assert len(ours) == 0 and ours.num_tokens == 0
    assert os.path.getsize(bin_path(prefix)) == 0  # Megatron's reader cannot mmap this; preprocess refuses it


def test_pickle_reopens_by_path(tmp_path):
    prefix = str(tmp_path / "p")
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        writer.add_document([5, 6, 7])
        writer.add_document(torch.tensor([8, 9]))
    ours = IndexedDataset(prefix)
    payload = pickle.dumps(ours)
    assert len(payload) < 200  # the path, not the data
    clone = pickle.loads(payload)
    np.testing.assert_array_equal(clone[1], [8, 9])


def test_in_memory_dataset_reads_like_the_file(tmp_path):
    rng = np.random.default_rng(3)
    docs = _random_documents(rng, np.uint16, count=15)
    prefix = str(tmp_path / "m")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    on_disk = IndexedDataset(prefix)
    in_memory = InMemoryIndexedDataset.from_documents(docs, dtype=np.uint16)
    np.testing.assert_array_equal(in_memory.sequence_lengths, on_disk.sequence_lengths)
    np.testing.assert_array_equal(in_memory.document_indices, on_disk.document_indices)
    for k in range(len(docs)):
        np.testing.assert_array_equal(in_memory[k], on_disk[k])
        size = docs[k].size
        np.testing.assert_array_equal(in_memory.get(k, size // 2), on_disk.get(k, size // 2))


def test_token_dtype_follows_megatron():
    assert token_dtype_for_vocab(259) == np.uint16
    assert token_dtype_for_vocab(65499) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    assert token_dtype_for_vocab(128256) == np.int32


def _write(prefix: str, docs, dtype=np.uint16) -> None:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)


def test_missing_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"nothere\.bin and .*nothere\.idx not found"):
        IndexedDataset(tmp_path / "nothere")
    _write(str(tmp_path / "half"), [[1, 2]])
    os.remove(bin_path(str(tmp_path / "half")))
    with pytest.raises(DataError, match=r"half\.bin not found"):
        IndexedDataset(tmp_path / "half")


def test_corrupt_files_are_rejected(tmp_path):
    prefix = str(tmp_path / "c")
    _write(prefix, [[1, 2, 3], [4, 5, 6, 7]])
    raw_idx = Path(idx_path(prefix)).read_bytes()
    raw_bin = Path(bin_path(prefix)).read_bytes()

    with open(bin_path(prefix), "wb") as f:
        f.write(raw_bin[:-2])
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(prefix)
    with open(bin_path(prefix), "wb") as f:
        f.write(raw_bin)

    with open(idx_path(prefix), "wb") as f:
        f.write(raw_idx[:-3])
    with pytest.raises(DataError, match="does not match its header"):
        IndexedDataset(prefix)

    with open(idx_path(prefix), "wb") as f:
        f.write(b"NOTANIDX\x00" + raw_idx[9:])
    with pytest.raises(DataError, match="not a Megatron .idx"):
        IndexedDataset(prefix)

    with open(idx_path(prefix), "wb") as f:
        f.write(raw_idx[:17] + struct.pack("<B", 42) + raw_idx[18:])
    with pytest.raises(DataError, match="unknown dtype code 42"):
        IndexedDataset(prefix)

    with open(idx_path(prefix), "wb") as f:
        f.write(raw_idx[:9] + struct.pack("<Q", 2) + raw_idx[17:])
    with pytest.raises(DataError, match="version 2"):
        IndexedDataset(prefix)


def test_writer_rejects_ids_outside_the_dtype_and_writes_nothing(tmp_path):
    prefix = str(tmp_path / "w")
    with pytest.raises(ValueError, match=r"outside the range \[0, 65535\].*int32"), IndexedDatasetWriter(prefix) as w:
        w.add_document([1, 70000])
    with pytest.raises(ValueError, match="outside the range"), IndexedDatasetWriter(prefix) as w:
        w.add_document([-1])
    with pytest.raises(TypeError, match="integers"), IndexedDatasetWriter(prefix) as w:
        w.add_document(np.array([1.5]))
    with pytest.raises(ValueError, match="token dtype must be one of"):
        IndexedDatasetWriter(prefix, dtype=np.float32)
    assert os.listdir(tmp_path) == []


def test_failed_rewrite_keeps_the_previous_files(tmp_path):
    prefix = str(tmp_path / "keep")
    _write(prefix, [[1, 2, 3]])
    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetWriter(prefix) as writer:
        writer.add_document([9, 9])
        raise RuntimeError("boom")
    np.testing.assert_array_equal(IndexedDataset(prefix)[0], [1, 2, 3])
    assert sorted(os.listdir(tmp_path)) == ["keep.bin", "keep.idx"]


def test_out_of_range_reads_raise(tmp_path):
    prefix = str(tmp_path / "r")
    _write(prefix, [[1, 2, 3]])
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexError, match="out of range"):
        ds[1]
    with pytest.raises(IndexError, match="exceeds sequence 0 of 3"):
        ds.get(0, offset=2, length=2)
    with pytest.raises(TypeError, match="must be an int"):
        ds["0"]
