"""``planning.cp_terms`` against the real CP attention: on 4 gloo ranks, the bytes each rank sends through
``mcore.parallel.cp_attention`` in forward and in backward (counted on the collectives it calls) equal the planner's
terms, for every comm type at cp 2 and 4 (a2a+p2p as 2 x 2), in bf16."""

from __future__ import annotations

import pytest
import torch

from mcore.train.planning.cp_terms import cp_layer_terms
from mcore.train.planning.shape import ModelShape
from tests.helpers.distributed import run_workers

SHAPE = ModelShape(hidden=32, ffn=64, layers=1, heads=4, kv_heads=2, head_dim=8, vocab=100)
BATCH, SEQ = 2, 32
LAYOUTS = {  # name: (cp, comm type, a2a size)
    "cp2-p2p": (2, "p2p", None),
    "cp4-p2p": (4, "p2p", None),
    "cp2-all_gather": (2, "all_gather", None),
    "cp4-all_gather": (4, "all_gather", None),
    "cp2-a2a": (2, "a2a", None),
    "cp4-a2a+p2p": (4, "a2a+p2p", 2),
}


class _Counter:
    """Bytes this rank sends through the collectives CP attention uses (patched in for the worker's life)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        import mcore.parallel.comm as comm

        self.sent = 0.0
        batch, a2a = dist.batch_isend_irecv, dist.all_to_all_single
        gather, scatter = comm.all_gather_into, comm.reduce_scatter_into

        def batch_isend_irecv(ops):
            self.sent += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
            return batch(ops)

        def all_to_all_single(out, x, *args, group=None, **kwargs):
            n = dist.get_world_size(group)
            self.sent += x.nbytes * (n - 1) / n
            return a2a(out, x, *args, group=group, **kwargs)

        def all_gather_into(output, shard, group, async_op=False):
            self.sent += shard.nbytes * (dist.get_world_size(group) - 1)
            return gather(output, shard, group, async_op)

        def reduce_scatter_into(output, full, group, async_op=False):
            n = dist.get_world_size(group)
            self.sent += full.nbytes * (n - 1) / n
            return scatter(output, full, group, async_op)

        dist.batch_isend_irecv, dist.all_to_all_single = batch_isend_irecv, all_to_all_single
        comm.all_gather_into, comm.reduce_scatter_into = all_gather_into, reduce_scatter_into

    def take(self) -> float:
        value, self.sent = self.sent, 0.0
        return value


def _measure(counter, cp, comm_type, a2a_size):
    from mcore.parallel.context_parallel import CPSharding
    from mcore.parallel.cp_attention import context_parallel_attention
    from mcore.parallel.cp_groups import build_cp_groups
    from mcore.parallel.grid import ParallelConfig, build_process_groups

    groups = build_process_groups(ParallelConfig(cp=cp), backend="gloo")
    cp_groups = build_cp_groups(groups, a2a_size or 1)
    sharding = CPSharding(BATCH, SEQ, cp, (0, 8, SEQ, SEQ + 16, 2 * SEQ))
    t = SEQ // cp
    g = torch.Generator().manual_seed(groups.cp_rank)
    q, k, v = (
        torch.randn(BATCH, t, h, SHAPE.head_dim, generator=g, dtype=torch.bfloat16).requires_grad_()
        for h in (SHAPE.heads, SHAPE.kv_heads, SHAPE.kv_heads)
    )
    counter.take()
    out = context_parallel_attention(q, k, v, sharding, cp_groups, comm_type=comm_type, window_size=12)
    forward = counter.take()
    out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))
    backward = counter.take()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v))
    return forward, backward


def _workers(rank: int, world_size: int):
    torch.set_num_threads(1)
    counter = _Counter()
    return {name: _measure(counter, *layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def measured():
    return run_workers(4, _workers, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_terms_are_the_bytes_cp_attention_sends(measured, name):
    cp, comm_type, a2a_size = LAYOUTS[name]
    terms = cp_layer_terms(SHAPE, tokens=BATCH * SEQ / cp, tp=1, cp=cp, comm_type=comm_type, a2a_size=a2a_size)
    for rank, results in enumerate(measured):
        forward, backward = results[name]
        assert forward == pytest.approx(terms.forward_bytes, rel=1e-9), (rank, "forward")
        assert backward == pytest.approx(terms.backward_bytes, rel=1e-9), (rank, "backward")
        assert forward > 0


def test_cp_terms_other_properties():
    kv = BATCH * SEQ / 4 * SHAPE.kv_heads * 2 * SHAPE.head_dim * 2
    gather = cp_layer_terms(SHAPE, tokens=BATCH * SEQ / 4, tp=1, cp=4, comm_type="all_gather")
    assert gather.extra_activation_bytes == 3 * kv and not gather.overlapped
    assert cp_layer_terms(SHAPE, tokens=64, tp=1, cp=4).overlapped
    assert cp_layer_terms(SHAPE, tokens=64, tp=1, cp=1).forward_bytes == 0
    with pytest.raises(ValueError, match="a2a_size dividing cp=4"):
        cp_layer_terms(SHAPE, tokens=64, tp=1, cp=4, comm_type="a2a+p2p", a2a_size=3)
    with pytest.raises(ValueError, match="comm_type must be one of"):
        cp_layer_terms(SHAPE, tokens=64, tp=1, cp=4, comm_type="ring")
