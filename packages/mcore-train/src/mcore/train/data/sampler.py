"""Resumable micro-batch sampling over data-parallel ranks, and the DataLoader built on it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mcore.train.data.samples import collate_gpt_batch
from mcore.train.data.validation import check_int


class MicroBatchSampler:
    """Yields this data-parallel rank's micro-batches of sample indices, starting after ``consumed_samples``.

    The datasets are already shuffled, so samples are taken in index order: each step of
    ``micro_batch_size * dp_size`` consecutive indices is cut into ``dp_size`` micro-batches, one per rank (as
    Megatron's pretraining sampler does). The order depends only on ``consumed_samples``, which is therefore the
    whole data state to checkpoint; a trailing step too short to serve every rank is dropped.
    """

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        self.total_samples = check_int("total_samples", total_samples, 0)
        self.consumed_samples = check_int("consumed_samples", consumed_samples, 0)
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size, 1)
        self.dp_size = check_int("dp_size", dp_size, 1)
        self.dp_rank = check_int("dp_rank", dp_rank, 0)
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank must be < dp_size, got dp_rank={dp_rank} with dp_size={dp_size}")
        step = self.micro_batch_size * self.dp_size
        if self.consumed_samples % step:
            raise ValueError(
                f"consumed_samples={consumed_samples} is not a multiple of micro_batch_size * dp_size = {step}; "
                "the global batch size must be a multiple of micro_batch_size * dp_size"
            )
        if self.consumed_samples > self.total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} exceeds the dataset's {total_samples} samples; "
                "build the dataset with at least as many samples as the run consumes"
            )

    def __len__(self) -> int:
        step = self.micro_batch_size * self.dp_size
        return (self.total_samples - self.consumed_samples) // step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        first = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(start + first, start + first + self.micro_batch_size))


def build_data_loader(
    dataset: torch.utils.data.Dataset,
    *,
    micro_batch_size: int,
    consumed_samples: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` of collated micro-batches (``collate_gpt_batch``) for this rank, resuming after
    ``consumed_samples``."""
    num_workers = check_int("num_workers", num_workers, 0)
    sampler = MicroBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_gpt_batch,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
