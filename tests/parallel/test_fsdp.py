"""Fully sharded data parallelism (FSDP2 units, ``FullyShardedOptimizer``) against the single-process run.

Four gloo ranks, the toy LM, fp32, several AdamW steps with clipping: dp=4 and tp=2 x dp=2 (with and without
sequence parallelism) give the losses, gradient norms and parameters of the plain model trained in one process
within 1e-5, and the losses of ZeRO-1 at the same layout; micro-batch gradients accumulated unreduced
(``reduce_every_microbatch=False``) and layers kept gathered from forward to backward without prefetch too; a
loss-scaled step with an inf gradient is skipped on every shard; the optimizer state moves between ZeRO-3 and
ZeRO-1 bit for bit; ZeRO-1 with its optimizer offloaded equals ZeRO-1 on the device bit for bit. Pipeline
parallelism with dp_shard is tested through the trainer (tests/train/test_dp_shard.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mcore.parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicLossScaler,
    ParallelConfig,
    ProcessGroups,
    build_process_groups,
    default_param_groups,
)
from mcore.parallel.fsdp import FullyShardedDataParallel, data_parallel_mesh, full_tensor
from mcore.parallel.sharded_optimizer import FullyShardedOptimizer
from tests.helpers.distributed import run_workers
from tests.parallel import _training as T
from tests.parallel._helpers import case_result, rel_err, rel_err_norm, run_cases
from tests.parallel._toy_model import ParallelToyLM

STEPS = 4
TOL = 1e-5


def _sharded(groups, *, sequence_parallel=False, loss_scaler=None, reduce_every_microbatch=True, **fsdp):
    model = ParallelToyLM(T.CFG, groups, sequence_parallel=sequence_parallel)
    model.init_weights(T.SEED)
    mesh = data_parallel_mesh(groups.dp_cp, "cpu")
    units = [model.embedding, *model.layers, model.output]
    wrapper = FullyShardedDataParallel(
        model, mesh, units=units, reduce_every_microbatch=reduce_every_microbatch, **fsdp
    )
    opt = FullyShardedOptimizer(
        wrapper,
        default_param_groups(wrapper, T.WEIGHT_DECAY),
        lr=T.LR,
        clip_grad=T.CLIP,
        groups=groups,
        loss_scaler=loss_scaler,
    )
    return wrapper, opt


def _against_reference(run, wrapper, groups, reference) -> dict[str, float]:
    ref_params = dict(reference.model.named_parameters())
    params = max(
        rel_err_norm(full_tensor(p.detach()), T.local_slice(p, ref_params[n].detach(), groups))
        for n, p in wrapper.named_parameters()
    )
    return {
        "loss": rel_err(torch.tensor(run.losses), torch.tensor(reference.losses)),
        "norm": rel_err(torch.tensor(run.norms), torch.tensor(reference.norms)),
        "params": params,
    }


def _train_case(tp: int, *, sequence_parallel=False, accumulate=True, **fsdp):
    groups = build_process_groups(ParallelConfig(tp=tp).resolve(4))
    wrapper, opt = _sharded(groups, sequence_parallel=sequence_parallel, reduce_every_microbatch=accumulate, **fsdp)
    run = T.train(groups, wrapper, opt, range(STEPS))
    out = _against_reference(run, wrapper, groups, T.reference_run(STEPS))
    _, ddp, zero1 = T.build(groups, distributed_optimizer=True, sequence_parallel=sequence_parallel)
    zero1_run = T.train(groups, ddp, zero1, range(STEPS))
    out["zero1_loss"] = rel_err(torch.tensor(run.losses), torch.tensor(zero1_run.losses))
    out["sharded"] = all(p.to_local().numel() < p.numel() for p in wrapper.parameters() if p.shape[0] >= 4)
    return out


def _loss_scaler_case():
    """An inf gradient on one rank's last micro-batch: every shard skips the step and the scale backs off, as ZeRO-1."""
    groups = build_process_groups(ParallelConfig().resolve(4))
    wrapper, opt = _sharded(groups, loss_scaler=DynamicLossScaler(initial_scale=2.0**8, hysteresis=1))
    run = T.train(groups, wrapper, opt, range(3), inject_inf_at=1, inject_rank=2)
    _, ddp, zero1 = T.build(
        groups, distributed_optimizer=True, loss_scaler=DynamicLossScaler(initial_scale=2.0**8, hysteresis=1)
    )
    ref = T.train(groups, ddp, zero1, range(3), inject_inf_at=1, inject_rank=2)
    return {
        "skipped": run.skipped,
        "scale": opt.loss_scale,
        "zero1_scale": zero1.loss_scale,
        "loss": rel_err(torch.tensor(run.losses[2:]), torch.tensor(ref.losses[2:])),
    }


def _states_equal(a: dict, b: dict) -> bool:
    return (
        a["step"] == b["step"]
        and sorted(a["tensors"]) == sorted(b["tensors"])
        and all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
    )


def _state_roundtrip_case():
    """ZeRO-3 state -> ZeRO-1 optimizer -> its state: bitwise the same; and back into a fresh ZeRO-3 one."""
    groups = build_process_groups(ParallelConfig(tp=2).resolve(4))
    wrapper, opt = _sharded(groups)
    T.train(groups, wrapper, opt, range(2))
    saved = opt.state_dict()
    _, ddp, zero1 = T.build(groups, distributed_optimizer=True)
    zero1.load_state_dict(saved)
    as_zero1 = zero1.state_dict()
    params_from_masters = all(
        torch.equal(p.detach(), saved["tensors"][f"{n}/master"]) for n, p in ddp.module.named_parameters()
    )
    wrapper2, opt2 = _sharded(groups)
    opt2.load_state_dict(as_zero1)
    back = opt2.state_dict()
    shards_from_masters = all(
        torch.equal(full_tensor(p.detach()), saved["tensors"][f"{n}/master"]) for n, p in wrapper2.named_parameters()
    )
    # both continue identically from the same state
    a = T.train(groups, wrapper, opt, range(2, 4)).losses
    b = T.train(groups, wrapper2, opt2, range(2, 4)).losses
    return {
        "zero1": _states_equal(saved, as_zero1),
        "zero3": _states_equal(saved, back),
        "params": params_from_masters and shards_from_masters,
        "continued": a == b,
    }


def _zero1_offload_case(tp: int, sequence_parallel: bool):
    """ZeRO-1 with 60% of its shards offloaded (gradient copies started at each bucket's reduce-scatter; the
    sequence-parallel ones after finalize_model_grads) equals ZeRO-1 on the device bit for bit."""
    groups = build_process_groups(ParallelConfig(tp=tp).resolve(4))
    runs = []
    for fraction in (0.0, 0.6):
        model = ParallelToyLM(T.CFG, groups, sequence_parallel=sequence_parallel)
        model.init_weights(T.SEED)
        ddp = DistributedDataParallel(model, groups.dp_cp, bucket_size=1500, use_distributed_optimizer=True)
        opt = DistributedOptimizer(
            ddp, default_param_groups(ddp, T.WEIGHT_DECAY), lr=T.LR, clip_grad=T.CLIP, groups=groups,
            fused_step=False, offload_fraction=fraction, offload_impl="foreach",
        )  # fmt: skip
        run = T.train(groups, ddp, opt, range(STEPS))
        runs.append((run, [p.detach().clone() for p in model.parameters()], opt))
    (base, base_params, _), (off, off_params, opt) = runs
    return {
        "offloaded": opt._offload.numel > 0,
        "equal": base.losses == off.losses
        and base.norms == off.norms
        and all(torch.equal(a, b) for a, b in zip(base_params, off_params)),
    }


def _cases(rank: int, world_size: int):
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the toy LM returns a transposed view
    return run_cases(
        {
            "dp4": lambda: _train_case(1),
            "dp4_accumulate": lambda: _train_case(1, accumulate=False),
            "dp4_keep_gathered": lambda: _train_case(1, reshard_after_forward=False, prefetch=False),
            "tp2_dp2": lambda: _train_case(2),
            "tp2_dp2_sp": lambda: _train_case(2, sequence_parallel=True),
            "loss_scaler": _loss_scaler_case,
            "state_roundtrip": _state_roundtrip_case,
            "zero1_offload_dp4": lambda: _zero1_offload_case(1, False),
            "zero1_offload_tp2_sp": lambda: _zero1_offload_case(2, True),
        }
    )


@pytest.fixture(scope="module")
def results():
    return run_workers(4, _cases)


@pytest.mark.parametrize("case", ["dp4", "dp4_accumulate", "dp4_keep_gathered", "tp2_dp2", "tp2_dp2_sp"])
def test_fully_sharded_training_equals_single_process(results, case):
    for rank, err in enumerate(case_result(results, case)):
        assert err["sharded"], rank
        for key in ("loss", "norm", "params", "zero1_loss"):
            assert err[key] < TOL, (rank, key, err)


def test_loss_scaler_skips_an_inf_step_on_every_shard(results):
    for out in case_result(results, "loss_scaler"):
        assert out["skipped"] == [False, True, False]
        assert out["scale"] == out["zero1_scale"] == 2.0**7
        assert out["loss"] < TOL


def test_optimizer_state_moves_between_zero3_and_zero1_bitwise(results):
    for out in case_result(results, "state_roundtrip"):
        assert out == {"zero1": True, "zero3": True, "params": True, "continued": True}


@pytest.mark.parametrize("case", ["zero1_offload_dp4", "zero1_offload_tp2_sp"])
def test_zero1_with_optimizer_offload_equals_on_device_bitwise(results, case):
    for out in case_result(results, case):
        assert out == {"offloaded": True, "equal": True}


def test_bad_arguments_name_the_problem():
    model = ParallelToyLM(T.CFG, ProcessGroups.single())
    with pytest.raises(TypeError, match="1-D DeviceMesh"):
        FullyShardedDataParallel(model, None)
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        FullyShardedDataParallel("model", None)
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        data_parallel_mesh(None, "cpu")
    ddp = DistributedDataParallel(model, None, use_distributed_optimizer=True)
    with pytest.raises(TypeError, match="must be a FullyShardedDataParallel"):
        FullyShardedOptimizer(ddp)
