"""GPT training samples cut from a tokenized corpus: shuffled documents, concatenated over epochs.

How sample ``i`` is found (all indices are pure functions of the seed, rebuilt in milliseconds, never cached):

1. **Document stream.** Epoch ``e`` is a permutation of the documents (sequences of the indexed dataset with at
   least one token); the epochs are concatenated into one token stream. Permutations are the argsort of uniform
   keys drawn from one random stream, ``n`` keys per epoch, so epoch ``e``'s order does not depend on how many
   epochs are built.
2. **Samples.** Unshuffled sample ``j`` is the ``seq_length + 1`` stream tokens starting at ``j * seq_length``;
   consecutive samples share one token, so each stream token is an input exactly once (as in Megatron).
3. **Shuffle.** Samples are shuffled within the epoch they start in (again by random keys, one per sample), and
   the epochs follow each other. Sample ``i`` therefore depends only on ``(corpus, documents, seq_length, seed)``
   and ``i``: asking for more samples (a longer run) extends the sequence without changing its prefix, and a
   resumed run that skips the consumed samples sees exactly what the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mcore.train.data.errors import DataError
from mcore.train.data.indexed import TokenDocuments
from mcore.train.data.samples import build_sample
from mcore.train.data.validation import check_index, check_int

_DOCUMENT_STREAM = 0
_SAMPLE_STREAM = 1
# Bounds the random keys drawn at once while building the document stream (memory, not results).
_KEYS_PER_CHUNK = 1 << 22


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stream]))


class GPTSampleDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length`` tokens from the documents of ``indexed`` (layout: ``samples.py``).

    Each sequence of ``indexed`` is one document (as in Megatron's ``GPTDataset``). ``documents`` restricts the
    corpus to a subset of sequence indices (a train/valid/test split); by default all are used. With
    ``packing=True`` each sample carries its document boundaries (``cu_seqlens``) and restarting position ids;
    otherwise attention spans documents. ``eod_mask_loss`` (needs ``eod_id``) masks the prediction after each
    end-of-document token.
    """

    def __init__(
        self,
        indexed: TokenDocuments,
        *,
        seq_length: int,
        num_samples: int,
        seed: int,
        documents: Sequence[int] | np.ndarray | range | None = None,
        packing: bool = False,
        eod_id: int | None = None,
        eod_mask_loss: bool = False,
        name: str = "gpt",
    ) -> None:
        self.seq_length = check_int("seq_length", seq_length, 1)
        self.num_samples = check_int("num_samples", num_samples, 0)
        self.seed = check_int("seed", seed, 0)
        if not isinstance(packing, bool):
            raise TypeError(f"packing must be a bool, got {packing!r}")
        if eod_mask_loss and eod_id is None:
            raise ValueError("eod_mask_loss=True needs eod_id, the id of the end-of-document token")
        self.packing = packing
        self.eod_id = eod_id
        self.eod_mask_loss = eod_mask_loss
        self.name = name
        self._indexed = indexed

        n_sequences = len(indexed)
        docs = np.arange(n_sequences, dtype=np.int64) if documents is None else np.asarray(documents, dtype=np.int64)
        if docs.ndim != 1:
            raise ValueError(f"documents must be a 1-D list of sequence indices, got shape {docs.shape}")
        if docs.size and (int(docs.min()) < 0 or int(docs.max()) >= n_sequences):
            raise ValueError(
                f"documents must index the {n_sequences} sequences of {name!r}, got indices from "
                f"{int(docs.min())} to {int(docs.max())}"
            )
        lengths = np.asarray(indexed.sequence_lengths, dtype=np.int64)[docs]
        # Empty documents contribute no tokens and would only add zero-length segments.
        keep = lengths > 0
        self._docs, self._doc_lengths = docs[keep], lengths[keep]
        self.tokens_per_epoch = int(self._doc_lengths.sum())
        if self.num_samples > 0 and self.tokens_per_epoch == 0:
            raise DataError(
                f"dataset {name!r}: the {docs.size} selected documents hold no tokens, so no sample of "
                f"{self.seq_length} tokens can be built (check the data file and the split)"
            )
        self._build_indices()

    def _build_indices(self) -> None:
        s, total, n = self.seq_length, self.tokens_per_epoch, self.num_samples
        if n == 0:
            self._shuffle_index = np.zeros(0, dtype=np.int64)
            self._stream_docs = np.zeros(0, dtype=np.int64)
            self._stream_starts = np.zeros(1, dtype=np.int64)
            self.num_epochs = 0
            return
        # Sample j starts in epoch (j * s) // total. Position n - 1 falls into the group of the last needed epoch,
        # and that whole epoch group must exist for its permutation to be the one a longer run would use.
        last_epoch = ((n - 1) * s) // total
        num_unshuffled = _ceil_div((last_epoch + 1) * total, s)
        sample_ids = np.arange(num_unshuffled, dtype=np.int64)
        epoch_of_sample = (sample_ids * s) // total
        keys = _rng(self.seed, _SAMPLE_STREAM).random(num_unshuffled)
        self._shuffle_index = np.lexsort((keys, epoch_of_sample))[:n].astype(np.int64)

        # The largest sample id used needs stream tokens up to (id + 1) * s inclusive.
        tokens_needed = (int(self._shuffle_index.max()) + 1) * s + 1
        self.num_epochs = _ceil_div(tokens_needed, total)
        num_docs = self._docs.size
        rng = _rng(self.seed, _DOCUMENT_STREAM)
        epochs_per_chunk = max(1, _KEYS_PER_CHUNK // num_docs)
        orders = []
        for first in range(0, self.num_epochs, epochs_per_chunk):
            rows = min(epochs_per_chunk, self.num_epochs - first)
            orders.append(np.argsort(rng.random((rows, num_docs)), axis=1, kind="stable").reshape(-1))
        order = np.concatenate(orders)
        # Sequence ids fit int32 in any realistic corpus; the stream holds one per document per epoch.
        id_dtype = np.int32 if len(self._indexed) < np.iinfo(np.int32).max else np.int64
        self._stream_docs = self._docs[order].astype(id_dtype)
        self._stream_starts = np.zeros(order.size + 1, dtype=np.int64)
        np.cumsum(self._doc_lengths[order], out=self._stream_starts[1:])

    def __len__(self) -> int:
        return self.num_samples

    @property
    def shuffle_index(self) -> np.ndarray:
        """int64 ``[num_samples]``: the unshuffled sample (stream offset / ``seq_length``) at each position."""
        return self._shuffle_index

    def window(self, index: int) -> tuple[np.ndarray, list[int]]:
        """The ``seq_length + 1`` tokens of sample ``index`` and the positions where documents start in them."""
        index = check_index(index, self.num_samples, f"samples of {self.name!r}")
        need = self.seq_length + 1
        position = int(self._shuffle_index[index]) * self.seq_length
        k = int(np.searchsorted(self._stream_starts, position, side="right")) - 1
        offset = position - int(self._stream_starts[k])
        pieces, starts, filled = [], [], 0
        while filled < need:
            doc_length = int(self._stream_starts[k + 1] - self._stream_starts[k])
            if offset == 0:
                starts.append(filled)
            take = min(doc_length - offset, need - filled)
            pieces.append(self._indexed.get(int(self._stream_docs[k]), offset, take))
            filled += take
            k += 1
            offset = 0
        return np.concatenate(pieces), starts

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window, starts = self.window(index)
        return build_sample(window, starts, packing=self.packing, eod_id=self.eod_id, eod_mask_loss=self.eod_mask_loss)

    def describe(self) -> dict[str, Any]:
        """A JSON-serializable description of what defines the sample order (for checkpoints and logs)."""
        return {
            "type": type(self).__name__,
            "name": self.name,
            "seq_length": self.seq_length,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "documents": int(self._docs.size),
            "tokens_per_epoch": self.tokens_per_epoch,
            "epochs": self.num_epochs,
            "packing": self.packing,
            "eod_mask_loss": self.eod_mask_loss,
        }

    def __repr__(self) -> str:
        return (
            f"GPTSampleDataset({self.name!r}, samples={self.num_samples}, seq_length={self.seq_length}, "
            f"documents={self._docs.size}, epochs={self.num_epochs}, packing={self.packing})"
        )
