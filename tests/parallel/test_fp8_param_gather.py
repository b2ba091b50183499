"""FP8 parameter all-gather (``DistributedDataParallel(fp8_param_gather=True)``) on 4 gloo ranks.

The reference is the same model, data and layout trained with the ordinary bf16 (here fp32, the CPU's parameter
dtype) parameter all-gather, whose fp8 linears cast their gathered weights themselves: the fp8 gather must give
the same fp8 operands bit for bit, hence the same losses and weights, at dp 4 and at tp 2 x dp 2 (where the
weight amax is also reduced over TP). Without the dp amax reduction the ranks' shards are scaled differently and
training visibly diverges; stale high-precision values outside a rank's shard are never read; a checkpoint
round trip continues identically.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mcore.kernels.low_precision_linear import Recipe
from mcore.parallel import ColumnParallelLinear, RowParallelLinear, fp8_param_gather, grad_buffer
from mcore.parallel.comm import group_rank, group_size
from mcore.parallel.data_parallel import DistributedDataParallel
from mcore.parallel.distributed_optimizer import DistributedOptimizer
from mcore.parallel.fp8_param_gather import Fp8GatherBuffer
from mcore.parallel.init import partition_slice
from mcore.parallel.low_precision import enable_low_precision
from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, run_cases

M, H, FFN = 32, 256, 512
STEPS = 4
RECIPES = ("tensorwise", "delayed", "blockwise")


class _Net(nn.Module):
    """A norm-like scale (a parameter no fp8 linear reads: gathered in high precision) and an fp8 MLP."""

    def __init__(self, tp_group=None):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(H))
        self.up = ColumnParallelLinear(H, FFN, tp_group=tp_group)
        self.down = RowParallelLinear(FFN, H, tp_group=tp_group)

    def forward(self, x):
        return self.down(torch.relu(self.up(x * self.scale)))


def _build(recipe: str, tp, dp, gather: bool, overlap: bool = False):
    torch.manual_seed(0)
    full = _Net()
    with torch.no_grad():  # columns of very different magnitudes, so the shards' amaxes differ
        full.up.weight.mul_(torch.logspace(-1, 1, H))
        full.scale.add_(torch.rand(H))
    net = _Net(tp)
    rank, size = group_rank(tp), group_size(tp)
    with torch.no_grad():
        net.scale.copy_(full.scale)
        net.up.weight.copy_(partition_slice(full.up.weight, 0, rank, size))
        net.down.weight.copy_(partition_slice(full.down.weight, 1, rank, size))
    enable_low_precision(net, Recipe(recipe), tp_group=tp, keep=())
    ddp = DistributedDataParallel(
        net,
        dp,
        bucket_size=FFN * H // 3,  # several buckets, weights split across shard boundaries
        use_distributed_optimizer=True,
        overlap_param_gather=overlap,
        fp8_param_gather=gather,
    )
    return ddp, DistributedOptimizer(ddp, lr=3e-3)


def _batch(dp, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + group_rank(dp))  # one batch per dp rank, shared over tp
    return torch.randn(M, H, generator=gen) * 2, torch.randn(M, H, generator=gen)


def _step(ddp, opt, dp, step: int) -> torch.Tensor:
    x, target = _batch(dp, step)
    loss = ((ddp(x) - target) ** 2).mean()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _train(recipe, tp, dp, gather, overlap=False, steps=STEPS):
    ddp, opt = _build(recipe, tp, dp, gather, overlap)
    losses = torch.stack([_step(ddp, opt, dp, s) for s in range(steps)])
    ddp.finish_param_sync()
    return ddp, opt, losses


def _weights(ddp) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])


def _same_training(recipe, tp, dp, overlap=False) -> dict:
    ref, _, ref_losses = _train(recipe, tp, dp, gather=False)
    got, _, losses = _train(recipe, tp, dp, gather=True, overlap=overlap)
    fp8_buffers = [b for b in got.grad_buffers if isinstance(b, Fp8GatherBuffer)]
    return {
        "loss_diff": (losses - ref_losses).abs().max().item(),
        "weight_diff": (_weights(got) - _weights(ref)).abs().max().item(),
        "loss_change": (ref_losses[-1] - ref_losses[0]).abs().item(),
        "fp8_buffers": len(fp8_buffers),
        "fp8_params": sorted(tuple(p.shape) for b in fp8_buffers for p in b.ranges),
    }


def _operands_equal_own_cast(recipe, tp, dp) -> dict:
    """After a step, the gathered fp8 W and W^T equal the layer's cast of the weight the ordinary gather gives."""
    ref, ref_opt = _build(recipe, tp, dp, gather=False)
    got, opt = _build(recipe, tp, dp, gather=True)
    for s in range(2):
        _step(ref, ref_opt, dp, s), _step(got, opt, dp, s)
    mismatches = []
    for name in ("up", "down"):
        layer, ref_layer = getattr(got.module, name), getattr(ref.module, name)
        w, w_t = layer.low_precision.weight_operands(layer.weight, transposed=True)
        # the reference layer's own cast (delayed: it advances its history as the gathered one's did)
        e, e_t = ref_layer.low_precision.weight_operands(ref_layer.weight, transposed=True)
        for a, b in ((w, e), (w_t, e_t)):
            same = torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
            mismatches += [] if same else [name]
    return {"mismatches": mismatches}


def _wrong_group(recipe, tp, dp) -> dict:
    """The dp MAX all-reduce of the shard amaxes skipped: each rank scales its shard by its own amaxes."""

    class _NoReduce:
        ReduceOp = dist.ReduceOp

        @staticmethod
        def all_reduce(*args, **kwargs):
            return None

    _, _, ref_losses = _train(recipe, tp, dp, gather=False)
    real, fp8_param_gather.dist = fp8_param_gather.dist, _NoReduce
    try:
        _, _, losses = _train(recipe, tp, dp, gather=True)
    finally:
        fp8_param_gather.dist = real
    return {"rel_diff": ((losses - ref_losses).abs() / ref_losses.abs()).max().item()}


def _stale_high_precision_unread(tp, dp) -> dict:
    """NaN written over every element outside this rank's shards after a step: the next forward does not see it
    (it reads the gathered fp8 copy), and finish_param_sync brings back the right values."""
    ref, ref_opt = _build("tensorwise", tp, dp, gather=False)
    got, opt = _build("tensorwise", tp, dp, gather=True)
    _step(ref, ref_opt, dp, 0), _step(got, opt, dp, 0)
    for buf in got.grad_buffers:
        if isinstance(buf, Fp8GatherBuffer):
            keep = torch.zeros(buf.numel, dtype=torch.bool)
            for bucket in buf.buckets:
                keep[bucket.shard_start : bucket.shard_end] = True
            buf.param_data[~keep] = float("nan")
    ref_loss, loss = _step(ref, ref_opt, dp, 1), _step(got, opt, dp, 1)
    got.finish_param_sync()
    ref.finish_param_sync()
    weight_diff = (_weights(got) - _weights(ref)).abs().max().item()
    raised = ""
    buf = next(b for b in got.grad_buffers if isinstance(b, Fp8GatherBuffer))
    _step(got, opt, dp, 2)
    buf._operands.clear()  # a lost fp8 copy while the bf16 values are partial: one clear error, no stale read
    try:
        got(_batch(dp, 3)[0])
    except RuntimeError as exc:
        raised = str(exc)
    return {
        "loss_diff": (loss - ref_loss).abs().item(),
        "finite": bool(torch.isfinite(loss)),
        "weight_diff": weight_diff,
        "raised": raised,
    }


def _checkpoint_round_trip(tp, dp) -> dict:
    """state dicts after 2 steps loaded into another fp8-gathering model, one that trained on other data first (its
    fp8 copies and partial bf16 weights stale): the next 2 steps as uninterrupted. Tensor-wise: delayed scaling's
    amax history is not checkpointed."""
    ddp, opt = _build("tensorwise", tp, dp, gather=True)
    for s in range(2):
        _step(ddp, opt, dp, s)
    model_state = {k: v.clone() for k, v in ddp.state_dict().items()}
    opt_state = opt.state_dict()
    ahead = torch.stack([_step(ddp, opt, dp, s) for s in (2, 3)])
    fresh, fresh_opt = _build("tensorwise", tp, dp, gather=True)
    for s in (7, 8):
        _step(fresh, fresh_opt, dp, s)
    fresh.load_state_dict(model_state)
    fresh_opt.load_state_dict(opt_state)
    resumed = torch.stack([_step(fresh, fresh_opt, dp, s) for s in (2, 3)])
    return {"loss_diff": (resumed - ahead).abs().max().item()}


def _gathered_bytes(tp, dp) -> dict:
    """Bytes each parameter all-gather moves: the fp8 weights 1 per element, the rest in their dtype."""
    moved: dict[str, list[tuple[str, int]]] = {"fp8": [], "other": []}
    real = fp8_param_gather.all_gather_into

    def counting(kind):
        def gather(output, shard, group, async_op=False):
            moved[kind].append((str(output.dtype), output.numel()))
            return real(output, shard, group, async_op=async_op)

        return gather

    ddp, opt = _build("tensorwise", tp, dp, gather=True)
    fp8_param_gather.all_gather_into, grad_buffer.all_gather_into = counting("fp8"), counting("other")
    try:
        _step(ddp, opt, dp, 0)
    finally:
        fp8_param_gather.all_gather_into = grad_buffer.all_gather_into = real
    fp8 = [b for b in ddp.grad_buffers if isinstance(b, Fp8GatherBuffer)]
    return {
        "moved": {k: (sorted({d for d, _ in v}), sum(n for _, n in v)) for k, v in moved.items()},
        "fp8_numel": sum(b.numel for b in fp8),
        "other_numel": sum(b.numel for b in ddp.grad_buffers if b not in fp8),
    }


def _cases(rank: int, world_size: int):
    whole = dist.new_group(list(range(world_size)))
    singles = [dist.new_group([r]) for r in range(world_size)]
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    layouts = {"dp4": (singles[rank], whole), "tp2dp2": (tp_groups[rank // 2], dp_groups[rank % 2])}
    cases = {}
    for layout, (tp, dp) in layouts.items():
        for recipe in RECIPES:
            cases[f"same-{recipe}-{layout}"] = lambda r=recipe, tp=tp, dp=dp: _same_training(r, tp, dp)
            cases[f"operands-{recipe}-{layout}"] = lambda r=recipe, tp=tp, dp=dp: _operands_equal_own_cast(r, tp, dp)
    tp, dp = layouts["tp2dp2"]
    cases["same-overlap-tp2dp2"] = lambda: _same_training("tensorwise", tp, dp, overlap=True)
    for recipe in ("tensorwise", "blockwise"):
        cases[f"wrong-group-{recipe}-dp4"] = lambda r=recipe: _wrong_group(r, *layouts["dp4"])
    cases["stale-dp4"] = lambda: _stale_high_precision_unread(*layouts["dp4"])
    cases["checkpoint-tp2dp2"] = lambda: _checkpoint_round_trip(tp, dp)
    cases["bytes-dp4"] = lambda: _gathered_bytes(*layouts["dp4"])
    return run_cases(cases)


@pytest.fixture(scope="module")
def results():
    return run_workers(4, _cases)


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_gather_trains_exactly_as_the_bf16_gather(results, recipe, layout):
    for r in case_result(results, f"same-{recipe}-{layout}"):
        assert r["fp8_buffers"] == 1 and r["fp8_params"] == sorted(
            [(FFN // 2, H), (H, FFN // 2)] if "tp" in layout else [(FFN, H), (H, FFN)]
        ), r
        assert r["loss_change"] > 1e-3, r  # it trained
        assert r["loss_diff"] == 0.0 and r["weight_diff"] == 0.0, r


@pytest.mark.parametrize("layout", ["dp4", "tp2dp2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gathered_operands_are_the_layers_own_cast_bit_for_bit(results, recipe, layout):
    for r in case_result(results, f"operands-{recipe}-{layout}"):
        assert r["mismatches"] == [], r


def test_overlapped_fp8_gather_trains_exactly_as_the_bf16_gather(results):
    for r in case_result(results, "same-overlap-tp2dp2"):
        assert r["loss_diff"] == 0.0 and r["weight_diff"] == 0.0, r


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_without_the_dp_amax_reduction_training_diverges(results, recipe):
    assert max(r["rel_diff"] for r in case_result(results, f"wrong-group-{recipe}-dp4")) > 1e-3


def test_stale_high_precision_values_are_never_read(results):
    for r in case_result(results, "stale-dp4"):
        assert r["finite"] and r["loss_diff"] == 0.0 and r["weight_diff"] == 0.0, r
        assert "no fp8 copy" in r["raised"] and "start_param_sync" in r["raised"], r


def test_checkpoint_round_trip_continues_identically(results):
    for r in case_result(results, "checkpoint-tp2dp2"):
        assert r["loss_diff"] == 0.0, r


def test_fp8_weights_are_gathered_as_bytes(results):
    for r in case_result(results, "bytes-dp4"):
        assert r["moved"]["fp8"] == (["torch.uint8"], r["fp8_numel"]), r  # every fp8 weight once, 1 byte each
        assert r["moved"]["other"] == (["torch.float32"], r["other_numel"]), r  # the scale, in its dtype


def test_bad_configurations_raise_one_clear_error():
    net = _Net()
    with pytest.raises(ValueError, match="needs use_distributed_optimizer=True"):
        DistributedDataParallel(net, None, fp8_param_gather=True)
    # no fp8 linear (a pipeline stage of kept layers): everything in the ordinary buffers
    plain = DistributedDataParallel(_Net(), None, use_distributed_optimizer=True, fp8_param_gather=True)
    assert not any(isinstance(b, Fp8GatherBuffer) for b in plain.grad_buffers)
    enable_low_precision(net, Recipe("rowwise"), keep=())
    with pytest.raises(ValueError, match=r"layer 'up' runs the fp8 recipe 'rowwise'; the recipes"):
        DistributedDataParallel(net, None, use_distributed_optimizer=True, fp8_param_gather=True)


def test_one_rank_casts_locally_and_trains_as_without():
    """dp = 1: nothing to gather; the layers cast their complete weights at each step's first use."""
    losses = {}
    for gather in (False, True):
        ddp, opt = _build("delayed", None, None, gather)
        losses[gather] = torch.stack([_step(ddp, opt, None, s) for s in range(3)])
    assert torch.equal(losses[True], losses[False])
