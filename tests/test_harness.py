import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import WorkerError, run_workers


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def test_workers_share_a_gloo_group():
    assert run_workers(3, _allreduce) == [6.0, 6.0, 6.0]


def test_worker_failure_carries_its_traceback():
    with pytest.raises(WorkerError, match="boom on rank one"):
        run_workers(2, _fail_on_rank_one)
