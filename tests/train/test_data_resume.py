"""Exact resume: after ``consumed_samples``, freshly built datasets and loaders continue the uninterrupted stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore.train.data import IndexedDatasetWriter, MicroBatchSampler, build_data_loader, build_gpt_datasets

SEQ, SEED, TOTAL = 24, 77, 96


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("resume")
    parts = []
    for d, weight in enumerate((0.6, 0.4)):
        rng = np.random.default_rng(d)
        prefix = str(root / f"part{d}")
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            for _ in range(80):
                writer.add_document(rng.integers(0, 60000, size=int(rng.integers(3, 50))))
        parts += [str(weight), prefix]
    return " ".join(parts)


def _train_dataset(blend: str):
    # Built from the files each time, as a restarted job would.
    return build_gpt_datasets(blend, seq_length=SEQ, num_samples=(TOTAL, 8), seed=SEED, split="9,1", packing=True).train


def _batches(loader) -> list[dict]:
    return list(loader)


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], torch.Tensor):
                assert torch.equal(x[key], y[key]), key
            else:
                assert x[key] == y[key], key


def test_resumed_stream_equals_uninterrupted_stream(blend):
    mbs, dp = 2, 2
    step = mbs * dp
    full = {
        r: _batches(build_data_loader(_train_dataset(blend), micro_batch_size=mbs, dp_rank=r, dp_size=dp))
        for r in range(dp)
    }
    assert len(full[0]) == TOTAL // step
    for consumed in (step, 6 * step, TOTAL - step):
        for r in range(dp):
            resumed = build_data_loader(
                _train_dataset(blend), micro_batch_size=mbs, consumed_samples=consumed, dp_rank=r, dp_size=dp
            )
            _assert_same(_batches(resumed), full[r][consumed // step :])
    # The ranks see different samples.
    assert not torch.equal(full[0][0]["tokens"], full[1][0]["tokens"])


def test_resume_with_loader_workers(blend):
    reference = _batches(build_data_loader(_train_dataset(blend), micro_batch_size=4, consumed_samples=0))
    resumed = build_data_loader(_train_dataset(blend), micro_batch_size=4, consumed_samples=40, num_workers=2)
    _assert_same(_batches(resumed), reference[10:])


def test_resume_into_another_data_parallel_size(blend):
    """Same global batch order when dp x micro-batch changes between save and resume (2 x 2 -> 1 x 4)."""
    ds = _train_dataset(blend)
    per_rank = [_batches(build_data_loader(ds, micro_batch_size=2, dp_rank=r, dp_size=2)) for r in range(2)]
    single = _batches(build_data_loader(ds, micro_batch_size=4, consumed_samples=16))
    for k, batch in enumerate(single):
        merged = torch.cat([per_rank[0][4 + k]["tokens"], per_rank[1][4 + k]["tokens"]])
        assert torch.equal(batch["tokens"], merged)


def test_sampler_indices_and_errors():
    sampler = MicroBatchSampler(total_samples=21, consumed_samples=6, micro_batch_size=3, dp_rank=1, dp_size=2)
    assert list(sampler) == [[9, 10, 11], [15, 16, 17]]  # the trailing 3 samples cannot serve both ranks
    assert len(sampler) == 2
    with pytest.raises(ValueError, match="consumed_samples=5 is not a multiple of micro_batch_size \\* dp_size = 6"):
        MicroBatchSampler(total_samples=21, consumed_samples=5, micro_batch_size=3, dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank must be < dp_size"):
        MicroBatchSampler(total_samples=21, consumed_samples=0, micro_batch_size=3, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="exceeds the dataset's 21 samples"):
        MicroBatchSampler(total_samples=21, consumed_samples=24, micro_batch_size=3, dp_rank=0, dp_size=2)
