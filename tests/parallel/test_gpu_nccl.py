"""The same parity runs on 2 CUDA GPUs over NCCL groups (skipped without two GPUs): fused AdamW on the
masters, in-place NCCL reduce-scatter / all-gather of the buckets, the vocab-parallel cross entropy on its
CUDA kernel, bf16 parameters, and a fused-AdamW optimizer state resumed by the other optimizer class.

The harness starts a gloo world; ``build_process_groups(..., backend="nccl")`` lays NCCL groups over it.
"""

from __future__ import annotations

import pytest
import torch

from mcore.parallel import ParallelConfig, build_process_groups
from tests.helpers.distributed import run_workers
from tests.parallel import _training as T
from tests.parallel._helpers import case_result, rel_err, run_cases

pytestmark = pytest.mark.multigpu

TOL = 1e-5
STEPS = 5


def _parity(groups, reference, device, *, distributed_optimizer: bool, sequence_parallel: bool) -> dict:
    _, ddp, opt = T.build(
        groups, distributed_optimizer=distributed_optimizer, sequence_parallel=sequence_parallel, device=device
    )
    return T.compare(T.train(groups, ddp, opt, range(STEPS)), reference, groups)


def _resume(groups, reference, device) -> dict:
    _, ddp, opt = T.build(groups, distributed_optimizer=True, device=device)
    T.train(groups, ddp, opt, range(3))
    state = opt.state_dict()
    _, ddp2, opt2 = T.build(groups, distributed_optimizer=False, device=device)
    opt2.load_state_dict(state)
    return T.compare(T.train(groups, ddp2, opt2, range(3, STEPS)), reference, groups, steps=slice(3, STEPS))


def _bf16(groups, reference, device) -> dict:
    model, ddp, opt = T.build(
        groups, distributed_optimizer=True, sequence_parallel=True, dtype=torch.bfloat16, device=device
    )
    run = T.train(groups, ddp, opt, range(STEPS))
    ddp.finish_param_sync()
    return {
        "loss": rel_err(torch.tensor(run.losses), torch.tensor(reference.losses)),
        "fp32_main_grads": all(p.main_grad.dtype == torch.float32 for p in model.parameters()),
        "fused": opt._fused,
    }


def _cases(rank: int, world_size: int) -> dict:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs fp32 GEMMs
    reference = T.reference_run(STEPS, device=device)
    out = {}
    for tp in (2, 1):
        groups = build_process_groups(ParallelConfig(tp=tp), backend="nccl")
        tag = f"tp{tp} dp{groups.dp_size}"
        out.update(
            run_cases(
                {
                    f"{tag} distopt": lambda g=groups: _parity(
                        g, reference, device, distributed_optimizer=True, sequence_parallel=True
                    ),
                    f"{tag} replicated": lambda g=groups: _parity(
                        g, reference, device, distributed_optimizer=False, sequence_parallel=False
                    ),
                    f"{tag} resume": lambda g=groups: _resume(g, reference, device),
                    f"{tag} bf16": lambda g=groups: _bf16(g, reference, device),
                }
            )
        )
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_workers(2, _cases)


@pytest.mark.parametrize("layout", ["tp2 dp1", "tp1 dp2"])
@pytest.mark.parametrize("kind", ["distopt", "replicated", "resume"])
def test_nccl_training_equals_single_process(spawned, layout, kind):
    for errs in case_result(spawned, f"{layout} {kind}"):
        assert errs["skipped"] == 0.0 and max(errs["loss"], errs["norm"], errs["params"]) <= TOL, errs


@pytest.mark.parametrize("layout", ["tp2 dp1", "tp1 dp2"])
def test_nccl_bf16_trains_with_fp32_main_grads(spawned, layout):
    for res in case_result(spawned, f"{layout} bf16"):
        assert res["fp32_main_grads"] and res["fused"] and res["loss"] <= 2e-2, res
