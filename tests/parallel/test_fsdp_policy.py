"""When ``FullyShardedDataParallel`` gathers and reduces: the ``"auto"`` policies at one rank and at two.

FSDP2's unit gathers (a group turning unsharded: at one rank the fp32 -> bf16 cast plus a copy) and gradient
reductions (``foreach_reduce``: at one rank a cast plus a copy) are counted over three steps of two micro-batches
of the toy LM (four units and the root: five groups), and the run is compared with the single-process one:

- one rank, ``"auto"``: one gather per group per step (no re-gather in backward, none between micro-batches) and
  one reduction per group per step, of the parameters other than the linear weights, whose weight-gradient GEMMs
  accumulate straight into the fp32 shard gradients (``gradient_accumulation_fusion``); the explicit ZeRO-3
  settings without the fusion gather before each forward and backward and reduce every gradient every
  micro-batch (the counters see the difference);
- two ranks, ``"auto"``: the shards stay sharded, every micro-batch is reduced (the ZeRO-3 memory profile) and
  the last unit is not gathered again for its backward; ``reduce_every_microbatch=False`` reduces once per step;
- an embedding marked ``no_backward_gather`` is not gathered for its backward;
- a forward without grad (evaluation, generation) leaves every unit resharded, so the module shows its shards;
- every run equals the single-process run within 1e-5 (losses, gradient norms, parameters);
- a setting other than True, False or "auto" is refused by name.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor

from mcore.parallel import ParallelConfig, ProcessGroups, build_process_groups, default_param_groups
from mcore.parallel.fsdp import FullyShardedDataParallel, data_parallel_mesh, reshard_policy
from mcore.parallel.sharded_optimizer import FullyShardedOptimizer
from tests.helpers.distributed import run_workers
from tests.parallel import _training as T
from tests.parallel._helpers import case_result, run_cases
from tests.parallel._toy_model import ParallelToyLM, batch
from tests.parallel.test_fsdp import TOL, _against_reference

STEPS = 3
GROUPS = 5  # embedding, two layers, output layer, root
PARAMS = 16  # embedding; per layer norm weight and bias, two linear weights and biases; final norm; output
LINEAR_WEIGHTS = 5  # two per layer, the output layer's


@contextlib.contextmanager
def _counting():
    """Count FSDP2's group gathers (``_to_unsharded``) and gradient reductions (``foreach_reduce``)."""
    group_cls = _fsdp_param_group.FSDPParamGroup
    reduce, to_unsharded = _fsdp_param_group.foreach_reduce, group_cls._to_unsharded
    counts = {"gathers": 0, "reductions": 0, "reduced_params": 0}

    def counted_reduce(fsdp_params, *args, **kwargs):
        counts["reductions"] += 1
        counts["reduced_params"] += len(fsdp_params)
        return reduce(fsdp_params, *args, **kwargs)

    def counted_to_unsharded(self):
        counts["gathers"] += 1
        return to_unsharded(self)

    _fsdp_param_group.foreach_reduce, group_cls._to_unsharded = counted_reduce, counted_to_unsharded
    try:
        yield counts
    finally:
        _fsdp_param_group.foreach_reduce, group_cls._to_unsharded = reduce, to_unsharded


def _build(groups, *, embedding_backward_gather: bool = True, **settings):
    """``test_fsdp._sharded`` with the ``auto`` settings unless given, optionally the embedding not gathered for
    its backward."""
    model = ParallelToyLM(T.CFG, groups)
    model.init_weights(T.SEED)
    units = [model.embedding, *model.layers, model.output]
    no_gather = [] if embedding_backward_gather else [model.embedding]
    wrapper = FullyShardedDataParallel(
        model, data_parallel_mesh(groups.dp_cp, "cpu"), units=units, no_backward_gather=no_gather, **settings
    )
    opt = FullyShardedOptimizer(
        wrapper, default_param_groups(wrapper, T.WEIGHT_DECAY), lr=T.LR, clip_grad=T.CLIP, groups=groups
    )
    return wrapper, opt


def _counted_case(world_size: int, **settings):
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the toy LM returns a transposed view
    groups = build_process_groups(ParallelConfig().resolve(world_size))
    wrapper, opt = _build(groups, **settings)
    with _counting() as counts:
        run = T.train(groups, wrapper, opt, range(STEPS))
    out = _against_reference(run, wrapper, groups, T.reference_run(STEPS))
    out["per_step"] = {k: v / STEPS for k, v in counts.items()}
    out["policy"] = (wrapper.reshard_after_forward, wrapper.reduce_every_microbatch)
    out["sharded"] = all(p.to_local().numel() < p.numel() for p in wrapper.parameters() if p.shape[0] >= 4)
    return out


def _no_grad_forward_case():
    """A forward without grad (evaluation) leaves no unit gathered: the module shows its shards."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    groups = build_process_groups(ParallelConfig().resolve(1))
    wrapper, _ = _build(groups)
    ids, labels = batch(T.CFG, 0, 4)
    gathered = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            wrapper(ids, labels).mean()
        gathered.append(sorted(n for n, p in wrapper.module.named_parameters() if not isinstance(p, DTensor)))
    return {"after_training_forward": gathered[0], "after_no_grad_forward": gathered[1]}


def _one_rank_cases(rank: int, world_size: int):
    return run_cases(
        {
            "auto": lambda: _counted_case(1),
            "zero3_settings": lambda: _counted_case(
                1, reshard_after_forward=True, reduce_every_microbatch=True, gradient_accumulation_fusion=False
            ),
            "no_grad_forward": _no_grad_forward_case,
        }
    )


def _two_rank_cases(rank: int, world_size: int):
    return run_cases(
        {
            "auto": lambda: _counted_case(2),
            "reduce_once": lambda: _counted_case(2, reduce_every_microbatch=False),
            "embedding_not_gathered": lambda: _counted_case(2, embedding_backward_gather=False),
        }
    )


@pytest.fixture(scope="module")
def one_rank():
    return run_workers(1, _one_rank_cases)


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(2, _two_rank_cases)


def _assert_equal_to_single_process(out):
    for key in ("loss", "norm", "params"):
        assert out[key] < TOL, (key, out)


def test_one_rank_gathers_and_reduces_once_per_step(one_rank):
    (out,) = case_result(one_rank, "auto")
    _assert_equal_to_single_process(out)
    assert out["policy"] == ([False] * 4, False)
    # the linear weights' gradients went into the fp32 shards inside the GEMMs and the embedding's rows were added
    # there by its lookup: FSDP reduces the others, and has nothing left to reduce in the output layer's group and
    # the embedding's
    assert out["per_step"] == {
        "gathers": GROUPS,
        "reductions": GROUPS - 2,
        "reduced_params": PARAMS - LINEAR_WEIGHTS - 1,
    }


def test_one_rank_with_zero3_settings_gathers_and_reduces_per_micro_batch(one_rank):
    (out,) = case_result(one_rank, "zero3_settings")
    _assert_equal_to_single_process(out)
    # per micro-batch: every group before its forward, the four units again before their backward; every gradient
    assert out["per_step"] == {
        "gathers": T.MICRO_BATCHES * (GROUPS + 4),
        "reductions": T.MICRO_BATCHES * GROUPS,
        "reduced_params": T.MICRO_BATCHES * PARAMS,
    }


def test_two_ranks_reduce_every_micro_batch_and_keep_the_last_unit_gathered(two_ranks):
    for out in case_result(two_ranks, "auto"):
        _assert_equal_to_single_process(out)
        assert out["sharded"] and out["policy"] == ([True, True, True, False], True)
        assert out["per_step"] == {
            "gathers": T.MICRO_BATCHES * (GROUPS + 3),
            "reductions": T.MICRO_BATCHES * GROUPS,
            "reduced_params": T.MICRO_BATCHES * PARAMS,  # no GEMM fusion: FSDP must reduce every gradient
        }


def test_two_ranks_can_reduce_once_per_step(two_ranks):
    for out in case_result(two_ranks, "reduce_once"):
        _assert_equal_to_single_process(out)
        assert out["per_step"]["reductions"] == GROUPS


def test_two_ranks_skip_the_embedding_gather_in_backward(two_ranks):
    for out in case_result(two_ranks, "embedding_not_gathered"):
        _assert_equal_to_single_process(out)
        # the embedding's weight gradient needs only the token ids: two layer units gathered in backward
        assert out["per_step"]["gathers"] == T.MICRO_BATCHES * (GROUPS + 2)


def test_a_forward_without_grad_leaves_the_shards_in_the_module(one_rank):
    (out,) = case_result(one_rank, "no_grad_forward")
    assert out["after_training_forward"]  # the auto settings keep the units gathered until the backward
    assert out["after_no_grad_forward"] == []


def test_reshard_policy_by_mesh_size():
    assert reshard_policy("auto", 3, 1) == [False, False, False]
    assert reshard_policy("auto", 3, 8) == [True, True, False]
    assert reshard_policy("auto", 0, 8) == []
    assert reshard_policy(True, 2, 1) == [True, True]


@pytest.mark.parametrize("key", ["reshard_after_forward", "reduce_every_microbatch"])
def test_a_bad_setting_is_refused_by_name(key):
    model = ParallelToyLM(T.CFG, ProcessGroups.single())
    with pytest.raises(ValueError, match=f"{key} must be True, False or 'auto', got 'sometimes'"):
        FullyShardedDataParallel(model, None, **{key: "sometimes"})
    assert torch.is_tensor(next(model.parameters()))
