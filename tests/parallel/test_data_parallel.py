"""DistributedDataParallel: bucket layout, overlap of gradient reduction with backward (counted on gloo),
gradient accumulation under no_sync, reduce-scatter for the distributed optimizer, the overlapped
parameter all-gather, deferred weight gradients, and misuse errors. One spawn of 2 gloo ranks; the
reference gradients come from a plain module run over the whole batch in one process."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mcore.parallel import (
    ColumnParallelLinear,
    DistributedDataParallel,
    RowParallelLinear,
    WeightGradStore,
    attach_weight_grad_store,
)
from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, rel_err, run_cases

TOL = 1e-5
WIDTH, DEPTH, ROWS = 16, 4, 6


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _data(rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 * rank + micro))


def _reference_grads(dp: int, micro_batches: int = 1) -> dict[str, torch.Tensor]:
    """Gradients of the mean (over ranks) of the summed micro-batch losses, in one process."""
    ref = _stack()
    total = sum((ref(_data(r, m)) ** 2).mean() for r in range(dp) for m in range(micro_batches)) / dp
    total.backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _bucket_size_one_layer() -> int:
    return WIDTH * WIDTH + WIDTH  # one nn.Linear per bucket


def check_overlap_counts_collectives(group, overlap: bool) -> dict:
    """Count the collectives issued before backward reaches the model input (the last thing it computes)."""
    model = _stack()
    ddp = DistributedDataParallel(model, group, bucket_size=_bucket_size_one_layer(), overlap_grad_reduce=overlap)
    issued = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        issued.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    seen_at_input = []
    x = _data(dist.get_rank()).requires_grad_()
    x.register_hook(lambda g: seen_at_input.append((len(issued), ddp.launched_buckets())))
    dist.all_reduce = counting_all_reduce
    try:
        (ddp(x) ** 2).mean().backward()
        ddp.finish_grad_sync()
    finally:
        dist.all_reduce = real_all_reduce
    ref = _reference_grads(dist.get_world_size(group))
    errs = {n: rel_err(p.main_grad, ref[n]) for n, p in model.named_parameters()}
    return {
        "buckets": ddp.num_buckets(),
        "before_input_grad": seen_at_input[0],
        "total_issued": len(issued),
        "max_err": max(errs.values()),
    }


def check_no_sync_accumulation(group, use_distributed_optimizer: bool) -> dict:
    model = _stack()
    ddp = DistributedDataParallel(
        model, group, bucket_size=300, use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=True
    )
    rank = dist.get_rank()
    for _ in range(2):  # the second step checks that zero_grad_buffer resets readiness and values
        ddp.zero_grad_buffer()
        for m in range(3):
            ctx = ddp.no_sync() if m < 2 else contextlib.nullcontext()
            with ctx:
                (ddp(_data(rank, m)) ** 2).mean().backward()
            if m < 2:
                assert ddp.launched_buckets() == 0, "no_sync must not issue collectives"
        ddp.finish_grad_sync()
    ref = _reference_grads(dist.get_world_size(group), micro_batches=3)
    errs = {}
    for buf in ddp.grad_buffers:
        for bucket in buf.buckets:
            for p in bucket.params:
                lo, hi = buf.ranges[p]
                name = next(n for n, q in model.named_parameters() if q is p)
                expected = ref[name].reshape(-1)
                if use_distributed_optimizer:  # only this rank's shard of the bucket is reduced
                    a, b = max(lo, bucket.shard_start), min(hi, bucket.shard_end)
                    if a < b:
                        errs[name] = rel_err(buf.grad_data[a:b], expected[a - lo : b - lo])
                else:
                    errs[name] = rel_err(p.main_grad.reshape(-1), expected)
    return {"compared": len(errs), "max_err": max(errs.values())}


def check_param_gather_overlap(group) -> dict:
    model = _stack()
    ddp = DistributedDataParallel(
        model, group, bucket_size=300, use_distributed_optimizer=True, overlap_param_gather=True
    )
    rank, dp = dist.get_rank(), dist.get_world_size(group)
    # what an optimizer step does: each rank writes new values into its own shard of the parameter buffer
    for buf in ddp.grad_buffers:
        for bucket in buf.buckets:
            shard = buf.param_data[bucket.shard_start : bucket.shard_end]
            shard.copy_(torch.arange(shard.numel(), dtype=shard.dtype) + 1000.0 * rank)
    ddp.start_param_sync()
    pending_after_start = any(buf.param_gather_pending for buf in ddp.grad_buffers)
    ddp(_data(rank))  # forward pre-hooks wait for each bucket before its module runs
    pending_after_forward = any(buf.param_gather_pending for buf in ddp.grad_buffers)
    errs = []
    for buf in ddp.grad_buffers:
        for bucket in buf.buckets:
            length = (bucket.end - bucket.start) // dp
            expected = torch.cat([torch.arange(length, dtype=torch.float32) + 1000.0 * r for r in range(dp)])
            errs.append(rel_err(buf.param_data[bucket.start : bucket.end], expected))
    return {
        "pending_after_start": pending_after_start,
        "pending_after_forward": pending_after_forward,
        "err": max(errs),
    }


def _tp_model_and_reference(seed: int, tied: bool = False) -> tuple[nn.Module, nn.Module]:
    """Column -> tanh -> Row (tensor-parallel linears, tp group of one) and the same in plain torch; ``tied``
    adds an embedding whose weight the Column layer also multiplies by (a tied LM head)."""

    class Net(nn.Module):
        def __init__(self, col: nn.Module, row: nn.Module) -> None:
            super().__init__()
            self.embed = nn.Embedding(2 * WIDTH, WIDTH) if tied else None
            self.col, self.row = col, row

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.embed is not None:
                x = x + self.embed(torch.arange(x.shape[0]) % (2 * WIDTH)).sum(0)
            return self.row(torch.tanh(self.col(x)))

    torch.manual_seed(seed)
    model = Net(ColumnParallelLinear(WIDTH, 2 * WIDTH, bias=True), RowParallelLinear(2 * WIDTH, WIDTH))
    ref = Net(nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH, bias=False))
    if tied:
        model.col.weight = model.embed.weight
        ref.col.weight = ref.embed.weight
    ref.load_state_dict(model.state_dict())
    return model, ref


def check_deferred_weight_grads(group) -> dict:
    """Deferred weight gradients reach main_grad through mcore_grad_ready_hook and fire their buckets."""
    model, ref = _tp_model_and_reference(3)
    dp = dist.get_world_size(group)
    (sum((ref(_data(r)) ** 2).mean() for r in range(dp)) / dp).backward()

    ddp = DistributedDataParallel(model, group, bucket_size=1)
    store = WeightGradStore()
    attach_weight_grad_store([ddp], store)
    with store.deferring():
        (ddp(_data(dist.get_rank())) ** 2).mean().backward()
    launched_before_flush = ddp.launched_buckets()
    store.flush()
    launched_after_flush = ddp.launched_buckets()
    ddp.finish_grad_sync()
    errs = [rel_err(p.main_grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
    return {
        "buckets": ddp.num_buckets(),
        "before_flush": launched_before_flush,
        "after_flush": launched_after_flush,
        "err": max(errs),
    }


def check_gradient_accumulation_fusion(group, fusion: bool, tied: bool) -> dict:
    """Weight gradients of the TP linears accumulate straight into main_grad (no .grad, one hook each), over
    micro-batches under no_sync and with overlap; a tied weight also receives the embedding's .grad."""
    import mcore.parallel.tensor_parallel as tp_module

    model, ref = _tp_model_and_reference(5, tied)
    dp, rank, micro = dist.get_world_size(group), dist.get_rank(), 3
    (sum((ref(_data(r, m)) ** 2).mean() for r in range(dp) for m in range(micro)) / dp).backward()

    ddp = DistributedDataParallel(model, group, bucket_size=1, gradient_accumulation_fusion=fusion)
    fused_calls = []
    real = tp_module.accumulate_weight_grad_
    tp_module.accumulate_weight_grad_ = lambda *a: (fused_calls.append(a[0].shape), real(*a))
    try:
        for m in range(micro):
            with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
                (ddp(_data(rank, m)) ** 2).mean().backward()
        launched_before_finish = ddp.launched_buckets()
        ddp.finish_grad_sync()
    finally:
        tp_module.accumulate_weight_grad_ = real
    errs = {n: rel_err(p.main_grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())}
    return {
        "fused_calls": len(fused_calls),
        "launched_before_finish": launched_before_finish,
        "buckets": ddp.num_buckets(),
        "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
        "max_err": max(errs.values()),
    }


def check_unused_parameter(group) -> dict:
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(WIDTH, WIDTH)
            self.unused = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(4)
    model = WithUnused()
    ddp = DistributedDataParallel(model, group, bucket_size=1)
    (ddp(_data(dist.get_rank())) ** 2).sum().backward()
    ddp.finish_grad_sync()  # must issue the never-ready bucket instead of hanging
    return {"unused_zero": bool(model.unused.weight.main_grad.abs().sum() == 0)}


def _spawned(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    return run_cases(
        {
            "overlap on": lambda: check_overlap_counts_collectives(group, True),
            "overlap off": lambda: check_overlap_counts_collectives(group, False),
            "no_sync all-reduce": lambda: check_no_sync_accumulation(group, False),
            "no_sync reduce-scatter": lambda: check_no_sync_accumulation(group, True),
            "param gather overlap": lambda: check_param_gather_overlap(group),
            "deferred weight grads": lambda: check_deferred_weight_grads(group),
            "unused parameter": lambda: check_unused_parameter(group),
            **{
                f"fusion {fusion} tied {tied}": lambda fusion=fusion, tied=tied: check_gradient_accumulation_fusion(
                    group, fusion, tied
                )
                for fusion in (True, False)
                for tied in (False, True)
            },
        }
    )


@pytest.fixture(scope="module")
def spawned():
    return run_workers(2, _spawned)


def test_bucket_reduction_overlaps_backward(spawned):
    for res in case_result(spawned, "overlap on"):
        issued, launched = res["before_input_grad"]
        assert res["buckets"] == DEPTH
        # when autograd reaches the input, the buckets of layers DEPTH..2 are already in flight
        assert issued >= DEPTH - 1 and launched >= DEPTH - 1, res
        assert res["total_issued"] == DEPTH and res["max_err"] <= TOL, res


def test_without_overlap_nothing_is_issued_during_backward(spawned):
    for res in case_result(spawned, "overlap off"):
        assert res["before_input_grad"] == (0, 0), res
        assert res["total_issued"] == DEPTH and res["max_err"] <= TOL, res


@pytest.mark.parametrize("kind", ["all-reduce", "reduce-scatter"])
def test_gradient_accumulation_reduces_once_and_averages(spawned, kind):
    results = case_result(spawned, f"no_sync {kind}")
    for res in results:
        assert res["max_err"] <= TOL, res
    assert sum(r["compared"] for r in results) >= 2 * DEPTH


def test_overlapped_param_gather_is_waited_for_by_forward(spawned):
    for res in case_result(spawned, "param gather overlap"):
        assert res["pending_after_start"] and not res["pending_after_forward"], res
        assert res["err"] == 0.0, res


def test_deferred_weight_gradients_fire_buckets_on_flush(spawned):
    for res in case_result(spawned, "deferred weight grads"):
        assert res["before_flush"] < res["buckets"] and res["after_flush"] == res["buckets"], res
        assert res["err"] <= TOL, res


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("fusion", [True, False])
def test_gradient_accumulation_fusion(spawned, fusion, tied):
    for res in case_result(spawned, f"fusion {fusion} tied {tied}"):
        # two linears x three micro-batches; the tied weight is fused too (the embedding part comes via .grad)
        assert res["fused_calls"] == (6 if fusion else 0), res
        assert res["grads_left"] == [], res
        # overlap: every bucket (one per parameter) was issued during the last backward, each exactly once
        assert res["launched_before_finish"] == res["buckets"], res
        assert res["max_err"] <= TOL, res


def test_unused_parameter_does_not_hang(spawned):
    for res in case_result(spawned, "unused parameter"):
        assert res["unused_zero"]


# ---- in process (dp_group=None) -------------------------------------------------------------------------------


def test_buffer_layout_reverse_order_padding_and_views():
    model = _stack()
    ddp = DistributedDataParallel(model, None, bucket_size=300, use_distributed_optimizer=True)
    (buf,) = ddp.grad_buffers
    params = list(model.parameters())
    assert list(buf.ranges) == params[::-1]
    for bucket in buf.buckets:
        assert (bucket.end - bucket.start) % 64 == 0 and bucket.end - bucket.start >= 300
    offsets = [buf.ranges[p][0] for p in params[::-1]]
    assert offsets == sorted(offsets)
    for p in params:
        lo, hi = buf.ranges[p]
        assert p.main_grad.data_ptr() == buf.grad_data[lo:hi].data_ptr()
        assert p.data_ptr() == buf.param_data[lo:hi].data_ptr()


def test_single_rank_ddp_gives_plain_gradients():
    model, ref = _stack(), _stack()
    ddp = DistributedDataParallel(model, None, bucket_size=100)
    (ddp(_data(0)) ** 2).mean().backward()
    (ref(_data(0)) ** 2).mean().backward()
    ddp.finish_grad_sync()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is None and rel_err(p.main_grad, q.grad) <= TOL
    assert [n for n, _ in ddp.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(ddp.state_dict()) == list(ref.state_dict())


def test_module_trained_after_its_wrapper_is_gone_gets_grads_again():
    """Fusion follows the wrapper's lifetime: with the DDP object dropped (hooks not removed), the TP linears'
    weight gradients land in .grad again, not in the orphaned main_grad."""
    import gc

    model, ref = _tp_model_and_reference(6)
    ddp = DistributedDataParallel(model, None, bucket_size=100)
    (ddp(_data(0)) ** 2).mean().backward()
    assert all(p.grad is None for p in model.parameters())
    del ddp
    gc.collect()
    (model(_data(0)) ** 2).mean().backward()
    (ref(_data(0)) ** 2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and rel_err(p.grad, q.grad) <= TOL


def test_backward_twice_without_no_sync_raises():
    ddp = DistributedDataParallel(_stack(), None, bucket_size=100)
    (ddp(_data(0)) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match="inside no_sync"):
        (ddp(_data(0)) ** 2).mean().backward()


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"bucket_size": 0}, ValueError, "bucket_size must be a positive int"),
        ({"grad_dtype": torch.int32}, TypeError, "grad_dtype must be a floating torch.dtype"),
        ({"overlap_param_gather": True}, ValueError, "needs use_distributed_optimizer=True"),
    ],
)
def test_bad_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        DistributedDataParallel(_stack(), None, **kwargs)


def test_wrapped_model_and_buffers_are_freed_when_dropped():
    """The gradient hooks live in C++ (invisible to Python's gc): they must not keep the model, the wrapper or
    the buffers alive once the caller drops them (one process running several models, e.g. benchmarks)."""
    import gc
    import weakref

    model = _stack()
    ddp = DistributedDataParallel(model, None, bucket_size=100, use_distributed_optimizer=True)
    (ddp(_data(0)) ** 2).mean().backward()
    ddp.finish_grad_sync()
    refs = [weakref.ref(model), weakref.ref(ddp), *(weakref.ref(b.grad_data) for b in ddp.grad_buffers)]
    refs += [weakref.ref(p) for p in model.parameters()]
    del model, ddp
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
