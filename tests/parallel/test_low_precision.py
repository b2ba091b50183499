"""Low-precision TP linears on 2 gloo ranks against the same layers in one process.

With the amax reduced over the TP group, each rank quantizes its shard exactly as the single process
quantizes the whole tensor, so outputs, gradients and weights after three SGD steps agree to fp32 rounding.
With the wrong group (each rank alone) the scales differ and so do the results: a silent divergence that
this test makes loud.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from mcore.kernels.low_precision_linear import Recipe
from mcore.parallel import ColumnParallelLinear, RowParallelLinear
from mcore.parallel.comm import group_rank, group_size
from mcore.parallel.init import partition_slice
from mcore.parallel.low_precision import disable_low_precision, enable_low_precision
from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, rel_err, run_cases

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4", "bitnet")
# recipes whose scales span a shard: a missing reduction changes the numbers
NEEDS_REDUCTION = ("tensorwise", "delayed", "rowwise", "nvfp4", "bitnet")
TOL = 1e-5
M, H, FFN = 64, 256, 512
STEPS = 3


class _MLP(torch.nn.Module):
    def __init__(self, group, sp: bool = False):
        super().__init__()
        self.up = ColumnParallelLinear(H, FFN, tp_group=group, sequence_parallel=sp)
        self.down = RowParallelLinear(FFN, H, tp_group=group, sequence_parallel=sp)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _train(model, xs, lr=0.5, tp_group=None, sp=False):
    """SGD on the mean squared error; with sequence parallelism each rank holds a slice of the rows and the
    loss is its share of the global mean (summed over the ranks for the record)."""
    losses = []
    rank, size = group_rank(tp_group), group_size(tp_group)
    for x, target in xs:
        if sp:
            x, target = partition_slice(x, 0, rank, size), partition_slice(target, 0, rank, size)
        loss = ((model(x) - target) ** 2).sum() / (M * H)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
        loss = loss.detach()
        if sp:
            dist.all_reduce(loss, group=tp_group)
        losses.append(loss)
    return torch.stack(losses)


def _data():
    gen = torch.Generator().manual_seed(7)
    # columns of very different magnitudes, so the two K shards have different amaxes
    scale = torch.logspace(-1, 1, H)
    return [(torch.randn(M, H, generator=gen) * scale, torch.randn(M, H, generator=gen)) for _ in range(STEPS)]


def _compare(recipe_name: str, tp_group, amax_group, sp: bool = False, segments: bool = False) -> dict[str, float]:
    recipe = Recipe(recipe_name)
    torch.manual_seed(0)
    single = _MLP(None)
    if segments:  # a fused weight of two projections interleaved in 64-row chunks, one 10x the other
        ids = (torch.arange(FFN) // 64) % 2
        with torch.no_grad():
            single.up.weight[ids == 1] *= 10
        single.up.register_buffer("weight_row_segments", ids, persistent=False)
    enable_low_precision(single, recipe, keep=())
    sharded = _MLP(tp_group, sp)
    rank, size = group_rank(tp_group), group_size(tp_group)
    with torch.no_grad():
        sharded.up.weight.copy_(partition_slice(single.up.weight, 0, rank, size))
        sharded.down.weight.copy_(partition_slice(single.down.weight, 1, rank, size))
    if segments:
        local_ids = partition_slice(single.up.weight_row_segments, 0, rank, size)
        sharded.up.register_buffer("weight_row_segments", local_ids, persistent=False)
    enable_low_precision(sharded, recipe, tp_group=amax_group, keep=())
    data = _data()
    loss_single, loss_tp = _train(single, data), _train(sharded, data, tp_group=tp_group, sp=sp)
    up = partition_slice(single.up.weight.detach(), 0, rank, size)
    down = partition_slice(single.down.weight.detach(), 1, rank, size)
    return {
        "loss": rel_err(loss_tp, loss_single),
        "up": rel_err(sharded.up.weight, up),
        "down": rel_err(sharded.down.weight, down),
    }


def _cases(rank: int, world_size: int):
    tp = dist.new_group(list(range(world_size)))
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    cases = {}
    for name in RECIPES:
        cases[f"right-{name}"] = lambda name=name: _compare(name, tp, tp)
        cases[f"wrong-{name}"] = lambda name=name: _compare(name, tp, alone)
    for name in ("tensorwise", "rowwise", "blockwise"):
        cases[f"sp-{name}"] = lambda name=name: _compare(name, tp, tp, sp=True)
    cases["right-bitnet-segments"] = lambda: _compare("bitnet", tp, tp, segments=True)
    cases["wrong-bitnet-segments"] = lambda: _compare("bitnet", tp, alone, segments=True)
    return run_cases(cases)


@pytest.fixture(scope="module")
def results():
    return run_workers(2, _cases)


@pytest.mark.parametrize("recipe", RECIPES)
def test_right_group_equals_single_process(results, recipe):
    for errors in case_result(results, f"right-{recipe}"):
        assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_sequence_parallel_equals_single_process(results, recipe):
    for errors in case_result(results, f"sp-{recipe}"):
        assert max(errors.values()) < TOL, errors


def test_bitnet_row_segments_sum_over_the_tp_group(results):
    """One absmean per projection of a fused weight, each summed over the ranks that hold its rows."""
    for errors in case_result(results, "right-bitnet-segments"):
        assert max(errors.values()) < TOL, errors
    for errors in case_result(results, "wrong-bitnet-segments"):
        assert max(errors.values()) > 100 * TOL, errors


@pytest.mark.parametrize("recipe", NEEDS_REDUCTION)
def test_wrong_group_diverges(results, recipe):
    for errors in case_result(results, f"wrong-{recipe}"):
        assert max(errors.values()) > 100 * TOL, errors


def test_keep_patterns_small_layers_and_shape_rules(caplog):
    model = torch.nn.ModuleDict(
        {
            "first": ColumnParallelLinear(256, 256),
            "small": RowParallelLinear(32, 256),
            "odd": ColumnParallelLinear(200, 256),
            "output": ColumnParallelLinear(256, 512),
        }
    )
    with pytest.raises(ValueError, match=r"layer 'odd' \(local weight \[256, 200\]\): K=200 must be a multiple of 128"):
        enable_low_precision(model, Recipe("blockwise"), keep=("output",), min_features=64)
    with caplog.at_level(logging.INFO, logger="mcore.parallel"):
        decisions = enable_low_precision(
            model, Recipe("blockwise"), keep=("output",), min_features=64, on_mismatch="fallback"
        )
    by_name = {d.name: d for d in decisions}
    assert by_name["first"].recipe == "blockwise" and model["first"].low_precision is not None
    assert by_name["small"].recipe is None and "min_features=64" in by_name["small"].reason
    assert by_name["odd"].recipe is None and "fallback" in by_name["odd"].reason
    assert by_name["output"].recipe is None and model["output"].low_precision is None
    assert "odd stays in high precision" in caplog.text
    disable_low_precision(model)
    assert model["first"].low_precision is None
    with pytest.raises(ValueError, match="on_mismatch must be one of"):
        enable_low_precision(model, Recipe(), on_mismatch="ignore")
