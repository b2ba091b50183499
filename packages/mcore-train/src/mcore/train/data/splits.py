"""Train / valid / test splits of a corpus by contiguous document ranges (Megatron's ``--split 969,30,1``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str | Sequence[float]) -> tuple[float, float, float]:
    """Normalize a split such as ``"98,2,0"`` or ``(0.9, 0.1)`` to three fractions summing to 1.

    Missing trailing parts are 0, so ``"1"`` puts everything in train.
    """
    if isinstance(split, str):
        parts = [p.strip() for p in split.replace("/", ",").split(",")]
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ValueError(
                f"split must be up to three comma-separated numbers such as '98,2,0', got {split!r}"
            ) from None
    elif isinstance(split, Sequence):
        weights = list(split)
        if not all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights):
            raise TypeError(f"split must hold numbers, got {split!r}")
        weights = [float(w) for w in weights]
    else:
        raise TypeError(f"split must be a string such as '98,2,0' or a sequence of numbers, got {type(split).__name__}")
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"split needs 1 to 3 parts (train, valid, test), got {len(weights)} in {split!r}")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"split parts must be finite and non-negative, got {split!r}")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"split parts must not all be zero, got {split!r}")
    weights += [0.0] * (3 - len(weights))
    return (weights[0] / total, weights[1] / total, weights[2] / total)


def split_document_ranges(num_documents: int, split: str | Sequence[float]) -> list[tuple[int, int]]:
    """Cut ``range(num_documents)`` into three contiguous, disjoint ``(start, end)`` ranges, one per split.

    Boundaries are the rounded cumulative fractions, so the ranges cover every document exactly once.
    """
    if not isinstance(num_documents, int) or isinstance(num_documents, bool) or num_documents < 0:
        raise ValueError(f"num_documents must be a non-negative int, got {num_documents!r}")
    fractions = parse_split(split)
    bounds = [0]
    cumulative = 0.0
    for fraction in fractions:
        cumulative += fraction
        bounds.append(min(num_documents, round(cumulative * num_documents)))
    bounds[-1] = num_documents
    return [(bounds[k], bounds[k + 1]) for k in range(3)]
