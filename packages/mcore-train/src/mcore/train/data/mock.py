"""Random-token samples for benchmarks: no files, any size, the same layout as the real datasets."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mcore.train.data.samples import build_sample
from mcore.train.data.validation import check_index, check_int


class MockGPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of uniformly random token ids in ``[0, vocab_size)``.

    Sample ``i`` is drawn from a generator seeded by ``(seed, i)``, so it is the same whatever order samples are
    read in (resume, several loader workers). With ``packing=True`` each sample is cut into documents whose
    lengths are uniform in ``[1, 2 * mean_document_length - 1]`` (default mean: a quarter of ``seq_length``), for
    benchmarking document-aware attention.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_length: int,
        num_samples: int,
        seed: int = 0,
        packing: bool = False,
        mean_document_length: int | None = None,
    ) -> None:
        self.vocab_size = check_int("vocab_size", vocab_size, 1)
        self.seq_length = check_int("seq_length", seq_length, 1)
        self.num_samples = check_int("num_samples", num_samples, 0)
        self.seed = check_int("seed", seed, 0)
        if not isinstance(packing, bool):
            raise TypeError(f"packing must be a bool, got {packing!r}")
        if packing:
            if mean_document_length is None:
                mean_document_length = max(1, self.seq_length // 4)
            mean_document_length = check_int("mean_document_length", mean_document_length, 1)
        elif mean_document_length is not None:
            raise ValueError("mean_document_length only applies with packing=True")
        self.packing = packing
        self.mean_document_length = mean_document_length

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = check_index(index, self.num_samples, "mock samples")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, index]))
        window = rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
        starts: list[int] = [0]
        if self.packing:
            # Enough lengths to cover the window whatever they come out as (each is at least 1).
            lengths = rng.integers(1, 2 * self.mean_document_length, size=self.seq_length + 1)
            starts = np.concatenate(([0], np.cumsum(lengths))).tolist()
        return build_sample(window, starts, packing=self.packing)

    def describe(self) -> dict[str, Any]:
        """A JSON-serializable description of the mock data."""
        return {
            "type": type(self).__name__,
            "vocab_size": self.vocab_size,
            "seq_length": self.seq_length,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "packing": self.packing,
            "mean_document_length": self.mean_document_length,
        }
