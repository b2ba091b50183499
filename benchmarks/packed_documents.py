"""Packed-document training data for ``train_throughput.py``: a corpus of real-length documents, the rows a run
reads from it, and the model FLOPs of those rows.

Document lengths come from a cited real-corpus distribution, the one ``dynamic_cp.py`` uses: a log-normal with
the mean of FinePDFs-Edu's English documents (4,990 tokens; spread ``sigma`` assumed, see ``dynamic_cp.py``), or
from the user: a text file of lengths (one per line) or the ``PREFIX`` of a Megatron ``.bin/.idx`` token file,
whose documents' lengths are drawn (the tokens are not read: their vocabulary need not be the model's). The
corpus is a real ``.bin/.idx`` pair of uniformly random token ids with those lengths, so the benchmark reads it
through ``mcore-train``'s own data path (``data.path``, ``data.packing=true``: ``GPTSampleDataset`` concatenates
the shuffled documents, cuts ``seq_length + 1`` windows, a document longer than a row continues in the next one,
and each row carries ``cu_seqlens`` and restarting ``position_ids``), exactly what a user's packed run does.

Model FLOPs of a packed row (:func:`row_flops`): each document costs what a sequence of its length costs,

    sum over the row's documents i of  n_i * flops_per_token(n_i)
        = 6 * W * s + 12 * L * q_size * sum_i n_i^2        (Llama: W matmul weights, q_size = heads * head_dim)

so the attention term counts only the work inside documents (the sum of squared document lengths), in the
convention of the standard term (the whole n x n square, as hf_baseline.py and PaLM/Megatron count it: the
causal half of it, the same fraction for both, is not discounted). One document per row gives the standard
``s * flops_per_token(s)`` = ``(6 * W + 12 * L * q_size * s) * s`` exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from dynamic_cp import FINEPDFS_EDU_MEAN_TOKENS, lognormal_lengths

FINEPDFS_EDU_URL = "https://huggingface.co/datasets/tturing/finepdfs-edu-32"
DEFAULT_SIGMA = 1.4  # the middle of the spreads dynamic_cp.py reports (the source gives none)
# A cap on one drawn document (longer ones continue across rows anyway); at sigma 1.4 about 0.1% of draws reach it.
LONGEST_DOCUMENT = 131072
GPU_SEQ = 4096  # the rows of the GPU shapes; dry runs scale the mean by seq / GPU_SEQ


@dataclass(frozen=True)
class LengthSource:
    """Where document lengths come from: ``path`` (a lengths file or an ``.idx`` prefix) or the log-normal."""

    path: Path | None = None
    mean: float = FINEPDFS_EDU_MEAN_TOKENS
    sigma: float = DEFAULT_SIGMA

    def __post_init__(self) -> None:
        if not (self.mean >= 16 and self.sigma > 0):
            raise ValueError(f"document lengths: mean must be >= 16 and sigma > 0, got {self.mean} and {self.sigma}")

    def describe(self) -> str:
        if self.path is not None:
            return f"lengths of {self.path}"
        cited = f"FinePDFs-Edu's mean, {FINEPDFS_EDU_URL}"
        if self.mean != FINEPDFS_EDU_MEAN_TOKENS:
            cited = f"not the cited FinePDFs-Edu {FINEPDFS_EDU_MEAN_TOKENS}"
        return f"log-normal, mean {self.mean:g} tokens ({cited}), sigma {self.sigma:g} (assumed)"

    def draw(self, seed: int, total: int) -> list[int]:
        """Document lengths (seeded) until ``total`` tokens."""
        rng = random.Random(seed)
        if self.path is None:
            return lognormal_lengths(rng, self.mean, self.sigma, LONGEST_DOCUMENT, total)
        values = read_lengths(self.path)
        out, tokens = [], 0
        while tokens < total:
            out.append(rng.choice(values))
            tokens += out[-1]
        return out


def read_lengths(path: Path) -> list[int]:
    """Positive document lengths from a text file (one per line) or the ``.idx`` of a ``.bin/.idx`` prefix."""
    from mcore.train.data.indexed import IndexedDataset, idx_path

    if Path(idx_path(path)).is_file():
        values = [int(n) for n in IndexedDataset(path).sequence_lengths if n > 0]
    elif Path(path).is_file():
        try:
            values = [int(x) for x in Path(path).read_text().split()]
        except ValueError:
            raise ValueError(f"--doc-lengths {path}: expected one integer document length per line") from None
        if any(n < 0 for n in values):
            raise ValueError(f"--doc-lengths {path}: document lengths must be >= 0")
        values = [n for n in values if n > 0]
    else:
        raise ValueError(f"--doc-lengths {path}: neither a lengths file nor the prefix of {idx_path(path)}")
    if not values:
        raise ValueError(f"--doc-lengths {path}: no document of positive length")
    return values


def write_corpus(prefix: Path, lengths: Sequence[int], vocab_size: int, seed: int) -> None:
    """``prefix.bin/.idx`` with one document of uniformly random token ids per entry of ``lengths``."""
    from mcore.train.data.indexed import IndexedDatasetWriter, token_dtype_for_vocab

    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, dtype=token_dtype_for_vocab(vocab_size)) as writer:
        for n in lengths:
            writer.add_document(rng.integers(0, vocab_size, size=int(n), dtype=np.int64))


def data_overrides(prefix: Path) -> list[str]:
    """The ``mcore-train`` overrides that read ``prefix`` packed (after the benchmarks' ``data.mock=true``)."""
    return ["data.mock=false", f"data.path={prefix}", "data.packing=true", "data.split=100,0,0"]


def run_rows(config: Any, num_samples: int) -> dict[str, np.ndarray]:
    """``tokens`` and ``position_ids`` ``[num_samples, s]`` of the first samples ``config``'s run reads, in order
    (dp = 1: step ``k`` reads samples ``(k - 1) * global_batch .. k * global_batch - 1``)."""
    from mcore.train.datasets import build_run_data

    train = build_run_data(config).train
    samples = [train[i] for i in range(num_samples)]
    return {key: np.stack([s[key].numpy() for s in samples]) for key in ("tokens", "position_ids")}


def segment_lengths(position_ids: np.ndarray) -> list[list[int]]:
    """The document segments of each row (a segment starts where its position is 0: ``build_sample``'s layout)."""
    rows = []
    for row in np.asarray(position_ids):
        starts = np.flatnonzero(row == 0)
        if starts.size == 0 or starts[0] != 0:
            raise ValueError("packed position_ids must start every row at 0 (a document start)")
        rows.append(np.diff(np.append(starts, row.size)).tolist())
    return rows


def row_flops(lengths: Sequence[int], flops_per_token: Callable[[int], float]) -> float:
    """Model FLOPs of one packed row (module docstring): ``sum_i n_i * flops_per_token(n_i)``."""
    return float(sum(n * flops_per_token(n) for n in lengths))


def packed_record(
    position_ids: np.ndarray,
    rows_per_step: int,
    timed_steps: range,
    flops_per_token: Callable[[int], float],
    tokens_per_s: float,
    peak_flops: float,
) -> dict[str, Any]:
    """Effective FLOPs per token, TFLOP/s and MFU over ``timed_steps`` (1-based step numbers), and the documents.

    The rate pairs the median step's tokens/s with the mean FLOPs per token of the timed steps (every row is full:
    the tokens per step are fixed; the attention work per step varies with its documents).
    """
    rows = segment_lengths(position_ids)
    s = int(np.asarray(position_ids).shape[1])
    picked = [r for k in timed_steps for r in rows[(k - 1) * rows_per_step : k * rows_per_step]]
    if len(picked) != len(timed_steps) * rows_per_step:
        raise ValueError(f"rows for steps {timed_steps} x {rows_per_step} missing: {len(rows)} rows given")
    flops = sum(row_flops(r, flops_per_token) for r in picked)
    per_token = flops / (len(picked) * s)
    segments = [n for r in picked for n in r]
    return {
        "flops_per_token": per_token,
        "flops_per_token_unpacked": float(flops_per_token(s)),
        "tflops_per_gpu": per_token * tokens_per_s / 1e12,
        "mfu": per_token * tokens_per_s / peak_flops,
        "documents_per_row": len(segments) / len(picked),
        "mean_segment_tokens": sum(segments) / len(segments),
        "attention_work_vs_unpacked": sum(n * n for n in segments) / (len(picked) * s * s),
    }
