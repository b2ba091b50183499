"""Weighted blends of datasets with Megatron's deterministic, error-minimizing interleaving."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mcore.train.data.validation import check_index, check_int


def normalize_weights(weights: Sequence[float], count: int | None = None) -> list[float]:
    """Weights as fractions summing to 1; each must be finite and positive."""
    values = list(weights)
    if not values:
        raise ValueError("a blend needs at least one weight")
    if count is not None and len(values) != count:
        raise ValueError(f"a blend of {count} datasets needs {count} weights, got {len(values)}: {values}")
    for k, w in enumerate(values):
        if not isinstance(w, int | float | np.integer | np.floating) or isinstance(w, bool):
            raise TypeError(f"blend weight {k} must be a number, got {type(w).__name__} {w!r}")
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"blend weight {k} must be finite and > 0, got {w}")
    total = float(sum(values))
    return [float(w) / total for w in values]


def blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset serves each blended sample, and which of that dataset's samples it is.

    The ``k``-th sample of dataset ``d`` (weight ``w_d``, normalized) is due at ``(k + 1/2) / w_d``, and samples are
    served in order of due time, ties to the lower dataset index (the Sainte-Lague / Webster apportionment
    sequence). After any prefix of ``m`` samples, dataset ``d`` has served ``w_d * m`` samples to within
    ``1/2 + w_d * (D - 2) / 2`` for ``D`` datasets (1/2 for two), and sample ``i``'s source does not depend on
    ``num_samples``. This tracks the weights as closely as Megatron's greedy "most-behind dataset next" loop, but
    is one vectorized merge instead of a Python loop per sample (runs consume 10^7 - 10^8 samples).
    Returns ``(dataset_index int16 [num_samples], dataset_sample_index int64 [num_samples])``.
    """
    fractions = normalize_weights(weights)
    num_samples = check_int("num_samples", num_samples, 0)
    count = len(fractions)
    if count > np.iinfo(np.int16).max:
        raise ValueError(f"a blend of more than {np.iinfo(np.int16).max} datasets is not supported")
    # Enough due times per dataset for any prefix of num_samples: it serves at most w_d * n + 1/2 + D/2 of them.
    keys, owners, ranks = [], [], []
    for d, fraction in enumerate(fractions):
        candidates = int(math.ceil(fraction * num_samples + count)) + 1
        k = np.arange(candidates, dtype=np.int64)
        keys.append((k + 0.5) / fraction)
        owners.append(np.full(candidates, d, dtype=np.int16))
        ranks.append(k)
    # Stable sort of the dataset-major concatenation: equal due times keep the lower dataset first.
    order = np.argsort(np.concatenate(keys), kind="stable")[:num_samples]
    dataset_index = np.concatenate(owners)[order]
    sample_index = np.concatenate(ranks)[order]
    return dataset_index, sample_index


def samples_per_dataset(weights: Sequence[float], num_samples: int) -> list[int]:
    """How many samples each dataset contributes to a blend of ``num_samples`` (size each dataset this large)."""
    dataset_index, _ = blending_indices(weights, num_samples)
    return np.bincount(dataset_index, minlength=len(list(weights))).tolist()


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights`` (see ``blending_indices``).

    Each dataset keeps its own shuffled order; the blend only decides which dataset serves the next sample, so the
    sample order is as deterministic and resumable as the datasets'.
    """

    def __init__(
        self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], num_samples: int
    ) -> None:
        if not datasets:
            raise ValueError("BlendedDataset needs at least one dataset")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights, len(self.datasets))
        self.num_samples = check_int("num_samples", num_samples, 0)
        self._dataset_index, self._sample_index = blending_indices(self.weights, self.num_samples)
        needed = np.bincount(self._dataset_index, minlength=len(self.datasets))
        for d, (dataset, count) in enumerate(zip(self.datasets, needed.tolist())):
            if len(dataset) < count:
                raise ValueError(
                    f"blended dataset {d} has {len(dataset)} samples but the blend of {self.num_samples} samples "
                    f"at weight {self.weights[d]:.4f} takes {count} from it; build it with num_samples >= {count} "
                    "(samples_per_dataset gives the exact numbers)"
                )

    @property
    def dataset_index(self) -> np.ndarray:
        """int16 ``[num_samples]``: the dataset that serves each sample."""
        return self._dataset_index

    @property
    def dataset_sample_index(self) -> np.ndarray:
        """int64 ``[num_samples]``: the index of each sample within its dataset."""
        return self._sample_index

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Any:
        index = check_index(index, self.num_samples, "blended samples")
        return self.datasets[int(self._dataset_index[index])][int(self._sample_index[index])]

    def describe(self) -> dict[str, Any]:
        """A JSON-serializable description of the blend and its datasets."""
        parts = [d.describe() if hasattr(d, "describe") else {"type": type(d).__name__} for d in self.datasets]
        return {
            "type": type(self).__name__,
            "num_samples": self.num_samples,
            "weights": self.weights,
            "datasets": parts,
        }
