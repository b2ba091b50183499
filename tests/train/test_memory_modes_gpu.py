"""The memory modes on one GPU through mcore-train (llama-tiny, bf16 with fp32 masters, 6 steps).

``parallel.dp_shard`` (FSDP2 at world size 1 on NCCL, in its own process), ``optim.offload_fraction`` (the CUDA
streams path) and ``train.activation_offload`` train like ZeRO-1 without offload: activation offload bit for bit
(the same kernels on the same values), the others within bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_workers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = ["train.device=cuda", "train.precision=bf16", "train.steps=6", "parallel.distributed_optimizer=true"]
MODES = {
    "zero1": [],
    "dp_shard": ["parallel.distributed_optimizer=false", "parallel.dp_shard=true"],
    "optim_offload": ["optim.offload_fraction=0.6"],
    "act_offload": ["train.activation_offload=[attention,mlp]"],
}


def _train_all(rank: int, world_size: int, base):
    import torch.distributed as dist

    from tests.train.tiny import train, train_records

    dist.destroy_process_group()  # the helper's gloo group: dp_shard makes its own one-rank NCCL group
    out = {}
    for name, extra in MODES.items():
        train(base / name, *GPU, *extra)
        out[name] = train_records(base / name)
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return run_workers(1, _train_all, tmp_path_factory.mktemp("memory_gpu"))[0]


@pytest.mark.parametrize("mode", ["dp_shard", "optim_offload", "act_offload"])
def test_mode_trains_like_zero1(records, mode):
    ref, got = records["zero1"], records[mode]
    for step in range(1, 7):
        if mode == "act_offload":
            assert got[step]["loss"] == ref[step]["loss"], step
        else:
            assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=2e-2), step
    assert got[6]["loss"] < got[1]["loss"]
