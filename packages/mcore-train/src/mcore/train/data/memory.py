"""A tokenized corpus held in memory, with the reading interface of ``IndexedDataset``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mcore.train.data.indexed import resolve_token_dtype
from mcore.train.data.validation import check_index, check_span


class InMemoryIndexedDataset:
    """Documents of token ids in one flat array; reads like ``IndexedDataset`` (one sequence per document).

    For corpora small enough to tokenize at start-up (the embedded demo corpus, tests), where writing ``.bin/.idx``
    files would only add I/O.
    """

    def __init__(self, tokens: np.ndarray, sequence_lengths: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        lengths = np.asarray(sequence_lengths)
        if tokens.ndim != 1 or lengths.ndim != 1:
            raise ValueError(f"tokens and sequence_lengths must be 1-D, got shapes {tokens.shape} and {lengths.shape}")
        if tokens.size and tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens must be integers, got dtype {tokens.dtype}")
        if lengths.size and (lengths.dtype.kind not in "iu" or int(lengths.min()) < 0):
            raise ValueError("sequence_lengths must be non-negative integers")
        total = int(lengths.sum(dtype=np.int64))
        if total != tokens.size:
            raise ValueError(f"sequence_lengths sum to {total} but tokens holds {tokens.size} ids")
        # A read-only view: the caller's array keeps its flags, and readers cannot modify the corpus.
        self._tokens = tokens.view()
        self._tokens.flags.writeable = False
        self._lengths = lengths.astype(np.int32)
        self._lengths.flags.writeable = False
        self._starts = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(self._lengths[:-1], dtype=np.int64, out=self._starts[1:])

    @classmethod
    def from_documents(
        cls, documents: Iterable[Sequence[int] | np.ndarray], dtype: Any = np.int32
    ) -> InMemoryIndexedDataset:
        """Build from an iterable of token-id sequences, stored as ``dtype`` (checked to hold every id)."""
        resolved = resolve_token_dtype(dtype)
        info = np.iinfo(resolved)
        arrays = [np.asarray(doc) for doc in documents]
        for k, doc in enumerate(arrays):
            if doc.ndim != 1:
                raise ValueError(f"document {k} must be a 1-D sequence of token ids, got shape {doc.shape}")
            if doc.size and (int(doc.min()) < info.min or int(doc.max()) > info.max):
                raise ValueError(f"document {k} holds ids outside [{info.min}, {info.max}] of dtype {resolved}")
        lengths = np.array([doc.size for doc in arrays], dtype=np.int64)
        flat = np.concatenate(arrays).astype(resolved) if arrays else np.zeros(0, resolved)
        return cls(flat, lengths)

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype of the tokens."""
        return self._tokens.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 ``[n]``: tokens per sequence."""
        return self._lengths

    @property
    def document_indices(self) -> np.ndarray:
        """int64 ``[n + 1]``: each document is one sequence."""
        return np.arange(len(self._lengths) + 1, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return int(self._tokens.size)

    def __len__(self) -> int:
        return int(self._lengths.shape[0])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``index`` (to its end when ``length`` is ``None``)."""
        i = check_index(index, len(self), "sequences")
        length = check_span(i, int(self._lengths[i]), offset, length)
        start = int(self._starts[i]) + offset
        return self._tokens[start : start + length]

    def __repr__(self) -> str:
        return f"InMemoryIndexedDataset(sequences={len(self)}, tokens={self.num_tokens}, dtype={self.dtype})"
