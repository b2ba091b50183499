"""The tiny English corpus shipped inside the package, for the no-argument ``mcore-train`` demo."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

import numpy as np

from mcore.train.data.builder import DatasetSplits, build_gpt_datasets_from_corpora
from mcore.train.data.memory import InMemoryIndexedDataset
from mcore.train.tokenizer import ByteTokenizer

CORPUS_PACKAGE = "mcore.train.assets"
CORPUS_FILE = "tiny_corpus.txt"
CORPUS_NAME = "embedded:tiny_corpus"


def embedded_corpus_text() -> str:
    """The corpus as one string (documents separated by blank lines)."""
    return resources.files(CORPUS_PACKAGE).joinpath(CORPUS_FILE).read_text(encoding="utf-8")


def embedded_corpus_documents() -> list[str]:
    """The corpus split into its documents (paragraphs), each ending with a newline."""
    return [part.strip("\n") + "\n" for part in embedded_corpus_text().split("\n\n") if part.strip()]


def embedded_indexed_dataset() -> InMemoryIndexedDataset:
    """The corpus tokenized with ``ByteTokenizer``, end-of-document token after each document."""
    tokenizer = ByteTokenizer()
    eod = np.array([tokenizer.eod_id], dtype=np.uint16)
    docs = [np.concatenate((tokenizer.encode_array(doc), eod)) for doc in embedded_corpus_documents()]
    return InMemoryIndexedDataset.from_documents(docs, dtype=np.uint16)


def embedded_corpus_dataset(
    seq_length: int,
    num_samples: int | Sequence[int],
    *,
    seed: int = 1234,
    split: str | Sequence[float] = "95,5,0",
    packing: bool = False,
    eod_mask_loss: bool = False,
) -> DatasetSplits:
    """Train / valid / test datasets of the embedded corpus, tokenized with ``ByteTokenizer`` (vocab 259).

    ``num_samples`` is ``(train, valid, test)``; with one int only a train split is built. The corpus is
    tokenized in memory at each call (well under a second), so nothing is cached on disk.
    """
    return build_gpt_datasets_from_corpora(
        [(1.0, CORPUS_NAME, embedded_indexed_dataset())],
        seq_length=seq_length,
        num_samples=num_samples,
        seed=seed,
        split=split,
        packing=packing,
        eod_id=ByteTokenizer.eod_id,
        eod_mask_loss=eod_mask_loss,
    )
