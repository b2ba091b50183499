"""Context-parallel attention on 2 CUDA GPUs over NCCL with our Triton kernel as the block (skipped without
two GPUs): p2p, all_gather and a2a with packed documents, a window and sinks, fp32 (exact products) and bf16,
against single-process attention on one GPU."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, rel_err_norm, run_cases
from tests.parallel.test_context_parallel import CASES, _problem

pytestmark = pytest.mark.multigpu

COMM_TYPES = ("p2p", "all_gather", "a2a")
DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 2e-2)}


def _check(case_name, comm_type, dtype, groups, device, deterministic=False):
    import torch.distributed as dist

    from mcore.kernels import attention
    from mcore.parallel.context_parallel import CPSharding
    from mcore.parallel.cp_attention import context_parallel_attention

    case = CASES[case_name]
    rank, cp = dist.get_rank(groups.cp), dist.get_world_size(groups.cp)
    tensors = [t if t is None else t.to(device, dtype) for t in _problem(case)]
    q, k, v, dout, sinks = tensors
    sinks = None if sinks is None else sinks.float()
    cu = None if "bounds" not in case else torch.tensor(case["bounds"], dtype=torch.int32)
    rule = dict(causal=case.get("causal", True), window_size=case.get("window_size"))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
    ref = attention(*ref_leaves, sinks=ref_sinks, cu_seqlens=cu, backend="triton", deterministic=True, **rule)
    ref.backward(dout)
    sharding = CPSharding(q.shape[0], q.shape[1], cp, None if cu is None else tuple(case["bounds"]))
    leaves = [sharding.shard(t, rank).requires_grad_() for t in (q, k, v)]
    cp_sinks = None if sinks is None else sinks.clone().requires_grad_()
    out = context_parallel_attention(
        *leaves, sharding, groups, comm_type=comm_type, sinks=cp_sinks, deterministic=deterministic, **rule
    )
    out.backward(sharding.shard(dout, rank))
    errors = {"out": rel_err_norm(out.float(), sharding.shard(ref.detach(), rank).float())}
    for name, leaf, want in zip("qkv", leaves, ref_leaves):
        errors["d" + name] = rel_err_norm(leaf.grad.float(), sharding.shard(want.grad, rank).float())
    if sinks is not None:
        total = cp_sinks.grad.clone()
        dist.all_reduce(total, group=groups.cp)
        errors["dsinks"] = rel_err_norm(total, ref_sinks.grad)
    return errors


def _cases(rank: int, world_size: int) -> dict:
    from mcore.parallel.cp_attention import new_cp_groups

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    groups = new_cp_groups(list(range(world_size)), backend="nccl")
    cases = {}
    for comm_type in COMM_TYPES:
        for dtype_name, (dtype, _) in DTYPES.items():
            for name in ("documents", "documents_window_sinks", "window"):
                key = f"{comm_type}-{dtype_name}-{name}"
                cases[key] = functools.partial(_check, name, comm_type, dtype, groups, device)
    cases["p2p-deterministic"] = functools.partial(
        _check, "documents_window_sinks", "p2p", torch.float32, groups, device, True
    )
    return run_cases(cases)


@pytest.fixture(scope="module")
def spawned():
    return run_workers(2, _cases, timeout=600)


@pytest.mark.parametrize("case_name", ["documents", "documents_window_sinks", "window"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_cp_attention_nccl_triton(spawned, comm_type, dtype_name, case_name):
    tolerance = DTYPES[dtype_name][1]
    for rank, errors in enumerate(case_result(spawned, f"{comm_type}-{dtype_name}-{case_name}")):
        assert max(errors.values()) < tolerance, (rank, errors)


def test_cp_attention_nccl_triton_deterministic(spawned):
    for rank, errors in enumerate(case_result(spawned, "p2p-deterministic")):
        assert max(errors.values()) < 1e-5, (rank, errors)
