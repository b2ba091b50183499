"""Mamba-2 hybrids under context parallelism on 2 CUDA GPUs over NCCL (skipped without two GPUs): Nemotron-H and
Falcon-H1 tiny at cp2, packed documents in the first step, with the Triton conv and scan on whole sequences of
heads / cp heads (mcore.parallel.cp_ssm's all-to-all on NCCL), against the same model on one GPU: the losses and
every gradient over two SGD steps, fp32 (relative 1e-3 of each tensor's largest entry, the bound of
test_gpu's Mamba-2 gradients against HF: the Triton kernels' fp32 dots need not round as the one-GPU run does)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_workers
from tests.models.test_cp_hybrid import _run

pytestmark = pytest.mark.multigpu

CASES = ("nemotron_h-cp2xdp2", "falcon_h1-cp2xdp2")  # tp 1: at world 2, cp2 (x dp1)
REL_TOL = 1e-3


def _cases(rank: int, world_size: int) -> dict:
    from tests.parallel._helpers import run_cases

    torch.cuda.set_device(rank)
    return run_cases({case: (lambda case=case: _run(case, f"cuda:{rank}", "nccl")) for case in CASES})


@pytest.fixture(scope="module")
def spawned():
    return run_workers(2, _cases, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_hybrid_cp_nccl_triton_equals_one_gpu(spawned, case):
    from tests.parallel._helpers import case_result

    for rank, errors in enumerate(case_result(spawned, case)):
        bad = {k: v for k, v in errors.items() if v > REL_TOL}
        assert not bad, (rank, bad)
        assert any(".mamba." in k for k in errors)
