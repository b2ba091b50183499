"""From data files (or an in-memory corpus) to the train / valid / test datasets of a run."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mcore.train.data.blended import BlendedDataset, normalize_weights, samples_per_dataset
from mcore.train.data.errors import EmptySplitError
from mcore.train.data.gpt_dataset import GPTSampleDataset
from mcore.train.data.indexed import IndexedDataset, TokenDocuments
from mcore.train.data.mock import MockGPTDataset
from mcore.train.data.splits import SPLIT_NAMES, split_document_ranges
from mcore.train.data.validation import check_int

Blend = str | os.PathLike | Sequence[str | os.PathLike] | Sequence[tuple[float, str | os.PathLike]]


@dataclass(frozen=True)
class DatasetSplits:
    """The datasets of a run; a split asked for zero samples is ``None``."""

    train: torch.utils.data.Dataset | None
    valid: torch.utils.data.Dataset | None
    test: torch.utils.data.Dataset | None


def parse_blend(blend: Blend) -> list[tuple[float, str]]:
    """Normalize a blend to ``[(weight, prefix), ...]`` with weights summing to 1.

    Accepted: one prefix; Megatron's ``"0.3 PREFIX_A 0.7 PREFIX_B"``; a list of prefixes (equal weights); a list
    alternating weights and prefixes; a list of ``(weight, prefix)`` pairs.
    """
    if isinstance(blend, str | os.PathLike):
        items: list = os.fspath(blend).split()
    elif isinstance(blend, Sequence):
        items = list(blend)
    else:
        raise TypeError(f"a data blend must be a prefix, a string or a list, got {type(blend).__name__}")
    if not items:
        raise ValueError("the data blend is empty; give at least one dataset prefix (PREFIX for PREFIX.bin/.idx)")
    if all(isinstance(item, tuple) for item in items):
        pairs = []
        for item in items:
            if len(item) != 2:
                raise ValueError(f"blend entries must be (weight, prefix) pairs, got {item!r}")
            pairs.append((item[0], os.fspath(item[1])))
    elif all(isinstance(item, str | os.PathLike) for item in items):
        strings = [os.fspath(item) for item in items]
        if _is_number(strings[0]):
            if len(strings) % 2 or not all(_is_number(w) for w in strings[0::2]):
                raise ValueError(
                    f"a weighted blend alternates weights and prefixes ('0.3 PREFIX_A 0.7 PREFIX_B'), got {blend!r}"
                )
            pairs = [(float(w), p) for w, p in zip(strings[0::2], strings[1::2])]
        else:
            pairs = [(1.0, p) for p in strings]
    else:
        raise TypeError(f"a data blend mixes (weight, prefix) pairs and plain entries: {blend!r}")
    weights = normalize_weights([w for w, _ in pairs])
    return [(w, p) for w, (_, p) in zip(weights, pairs)]


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _check_num_samples(num_samples: int | Sequence[int]) -> tuple[int, int, int]:
    values = [num_samples] if isinstance(num_samples, int | np.integer) else list(num_samples)
    if not 1 <= len(values) <= 3:
        raise ValueError(f"num_samples needs 1 to 3 counts (train, valid, test), got {num_samples!r}")
    checked = [check_int(f"num_samples[{SPLIT_NAMES[k]}]", v, 0) for k, v in enumerate(values)]
    return tuple(checked + [0] * (3 - len(checked)))  # type: ignore[return-value]


def build_gpt_datasets_from_corpora(
    corpora: Sequence[tuple[float, str, TokenDocuments]],
    *,
    seq_length: int,
    num_samples: int | Sequence[int],
    seed: int,
    split: str | Sequence[float] = "969,30,1",
    packing: bool = False,
    eod_id: int | None = None,
    eod_mask_loss: bool = False,
) -> DatasetSplits:
    """Split each ``(weight, name, corpus)`` by documents and blend the splits.

    ``num_samples`` is ``(train, valid, test)`` (missing trailing counts are 0). Each corpus is split the same way
    (contiguous document ranges, ``split_document_ranges``); with several corpora each split is a
    ``BlendedDataset`` whose parts are sized exactly to what the blend takes from them.
    """
    counts = _check_num_samples(num_samples)
    weights = normalize_weights([w for w, _, _ in corpora])
    ranges = [split_document_ranges(len(corpus), split) for _, _, corpus in corpora]
    result = []
    for k, name in enumerate(SPLIT_NAMES):
        if counts[k] == 0:
            result.append(None)
            continue
        per_corpus = samples_per_dataset(weights, counts[k]) if len(corpora) > 1 else [counts[k]]
        parts = []
        for (_, corpus_name, corpus), corpus_ranges, n in zip(corpora, ranges, per_corpus):
            start, end = corpus_ranges[k]
            if end <= start:
                raise EmptySplitError(
                    f"dataset {corpus_name!r}: the {name} split of {split!r} holds none of its {len(corpus)} "
                    f"documents, but {counts[k]} {name} samples were asked for; give the {name} split a larger "
                    f"share or ask for no {name} samples",
                    split_name=name,
                    corpus=corpus_name,
                    split=split,
                )
            parts.append(
                GPTSampleDataset(
                    corpus,
                    seq_length=seq_length,
                    num_samples=n,
                    seed=seed,
                    documents=range(start, end),
                    packing=packing,
                    eod_id=eod_id,
                    eod_mask_loss=eod_mask_loss,
                    name=f"{corpus_name}[{name}]",
                )
            )
        result.append(parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, counts[k]))
    return DatasetSplits(*result)


def build_gpt_datasets(
    blend: Blend,
    *,
    seq_length: int,
    num_samples: int | Sequence[int],
    seed: int,
    split: str | Sequence[float] = "969,30,1",
    packing: bool = False,
    eod_id: int | None = None,
    eod_mask_loss: bool = False,
) -> DatasetSplits:
    """The train / valid / test datasets of indexed ``.bin/.idx`` files (``blend``: see ``parse_blend``).

    A missing or malformed file raises ``DataError`` naming it. Other arguments: ``build_gpt_datasets_from_corpora``
    and ``GPTSampleDataset``.
    """
    corpora = [(w, prefix, IndexedDataset(prefix)) for w, prefix in parse_blend(blend)]
    return build_gpt_datasets_from_corpora(
        corpora,
        seq_length=seq_length,
        num_samples=num_samples,
        seed=seed,
        split=split,
        packing=packing,
        eod_id=eod_id,
        eod_mask_loss=eod_mask_loss,
    )


def build_mock_datasets(
    *,
    vocab_size: int,
    seq_length: int,
    num_samples: int | Sequence[int],
    seed: int,
    packing: bool = False,
    mean_document_length: int | None = None,
) -> DatasetSplits:
    """``MockGPTDataset`` splits; each split draws from its own seed, derived from ``seed``."""
    counts = _check_num_samples(num_samples)
    seed = check_int("seed", seed, 0)
    result = []
    for k, n in enumerate(counts):
        if n == 0:
            result.append(None)
            continue
        split_seed = int(np.random.SeedSequence([seed, k]).generate_state(1)[0])
        result.append(
            MockGPTDataset(
                vocab_size=vocab_size,
                seq_length=seq_length,
                num_samples=n,
                seed=split_seed,
                packing=packing,
                mean_document_length=mean_document_length,
            )
        )
    return DatasetSplits(*result)
