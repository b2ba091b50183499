"""The embedded demo corpus: reproducible, shipped as package data, tokenized with the byte tokenizer."""

from __future__ import annotations

import numpy as np

from mcore.train.assets.generate_corpus import NUM_DOCUMENTS, generate
from mcore.train.data import (
    build_data_loader,
    embedded_corpus_dataset,
    embedded_corpus_documents,
    embedded_corpus_text,
    embedded_indexed_dataset,
    split_document_ranges,
)
from mcore.train.tokenizer import ByteTokenizer


def test_shipped_corpus_is_the_generated_one():
    text = embedded_corpus_text()
    assert text == generate()
    assert 50_000 < len(text.encode("utf-8")) < 400_000
    docs = embedded_corpus_documents()
    assert len(docs) == NUM_DOCUMENTS
    assert all(doc.strip() and doc.endswith("\n") and "\n\n" not in doc for doc in docs)


def test_indexed_corpus_is_bytes_plus_eod():
    tok = ByteTokenizer()
    indexed = embedded_indexed_dataset()
    docs = embedded_corpus_documents()
    assert len(indexed) == len(docs)
    for k in (0, 123, len(docs) - 1):
        assert indexed[k].tolist() == tok.encode(docs[k]) + [tok.eod_id]
    assert indexed.num_tokens == sum(len(d.encode("utf-8")) + 1 for d in docs)


def test_samples_decode_to_text_of_their_own_split():
    tok = ByteTokenizer()
    docs = embedded_corpus_documents()
    (train_start, train_end), (valid_start, valid_end), _ = split_document_ranges(len(docs), "95,5,0")
    splits = embedded_corpus_dataset(128, (200, 20, 0), seed=1234, split="95,5,0")
    assert splits.test is None and len(splits.train) == 200 and len(splits.valid) == 20
    for dataset, own in ((splits.train, docs[train_start:train_end]), (splits.valid, docs[valid_start:valid_end])):
        for i in range(len(dataset)):
            window, _ = dataset.window(i)
            for piece in np.split(window, np.flatnonzero(window == tok.eod_id)):
                fragment = tok.decode(piece[piece != tok.eod_id].tolist())
                # Each piece between eod tokens lies inside one document of the sample's own split.
                assert any(fragment in doc for doc in own), fragment


def test_embedded_batches_for_the_demo():
    splits = embedded_corpus_dataset(256, 64, seed=7, packing=True)
    batch = next(iter(build_data_loader(splits.train, micro_batch_size=8)))
    assert batch["tokens"].shape == (8, 256)
    assert int(batch["tokens"].max()) < ByteTokenizer.vocab_size
    assert batch["cu_seqlens"][-1] == 8 * 256
