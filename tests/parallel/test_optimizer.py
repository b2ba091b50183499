"""Optimizers, loss scaler and gradient clipping in one process (tp = dp = 1), against torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ on the plain model; the multi-rank parity runs are in test_training_parity."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mcore.parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    ProcessGroups,
    clip_grad_norm,
)
from tests.parallel import _training as T
from tests.parallel._helpers import rel_err, rel_err_norm

TOL = 1e-5
STEPS = 5


@pytest.fixture(scope="module")
def reference():
    return T.reference_run(STEPS)


def _assert_matches_reference(run, reference, tol=TOL):
    run.ddp.finish_param_sync()
    for name, (ours, ref) in {"loss": (run.losses, reference.losses), "norm": (run.norms, reference.norms)}.items():
        err = rel_err(torch.tensor(ours), torch.tensor(ref))
        assert err <= tol, (name, ours, ref)
    ref_params = dict(reference.model.named_parameters())
    for name, p in run.model.named_parameters():
        assert rel_err_norm(p.float(), ref_params[name]) <= tol, name


@pytest.mark.parametrize("distributed", [False, True])
def test_single_rank_training_matches_torch_adamw(reference, distributed):
    groups = ProcessGroups.single()
    _, ddp, opt = T.build(groups, distributed_optimizer=distributed)
    run = T.train(groups, ddp, opt, range(STEPS))
    assert not any(run.skipped)
    assert max(run.norms) > T.CLIP  # clipping was active
    _assert_matches_reference(run, reference)


def test_optimizer_on_a_plain_module_without_ddp(reference):
    model = T._full_model()
    opt = MixedPrecisionOptimizer(
        model,
        [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": T.WEIGHT_DECAY},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=T.LR,
        clip_grad=T.CLIP,
    )
    losses = []
    for step in range(STEPS):
        ids, labels = T.batch(T.CFG, step, T.GLOBAL_BATCH)
        loss = model(ids, labels).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert rel_err(torch.tensor(losses), torch.tensor(reference.losses)) <= TOL


@pytest.mark.parametrize("distributed", [False, True])
def test_state_dict_roundtrip_resumes_exactly(reference, distributed):
    groups = ProcessGroups.single()
    _, ddp, opt = T.build(groups, distributed_optimizer=distributed)
    T.train(groups, ddp, opt, range(2))
    state = opt.state_dict()
    names = [n for n, _ in ddp.named_parameters()]
    assert set(state["tensors"]) == {f"{n}/{k}" for n in names for k in ("master", "exp_avg", "exp_avg_sq")}
    params = dict(ddp.named_parameters())
    for key, t in state["tensors"].items():
        assert t.dtype == torch.float32 and t.shape == params[key.rpartition("/")[0]].shape
    assert state["step"] == 2 and state["tensors"]["output.weight/exp_avg_sq"].abs().sum() > 0

    # a fresh model (different weights) of the other optimizer kind picks the run up
    _, ddp2, opt2 = T.build(groups, distributed_optimizer=not distributed)
    opt2.load_state_dict(state)
    run = T.train(groups, ddp2, opt2, range(2, STEPS))
    assert rel_err(torch.tensor(run.losses), torch.tensor(reference.losses[2:])) <= TOL
    ref_params = dict(reference.model.named_parameters())
    for name, p in ddp2.named_parameters():
        assert rel_err_norm(p, ref_params[name]) <= TOL, name


def test_bf16_params_keep_fp32_masters_and_main_grads(reference):
    groups = ProcessGroups.single()
    model, ddp, opt = T.build(groups, distributed_optimizer=True, dtype=torch.bfloat16)
    run = T.train(groups, ddp, opt, range(STEPS))
    for p in model.parameters():
        assert p.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32
    masters = opt.state_dict()["tensors"]
    for name, p in model.named_parameters():
        assert torch.equal(p, masters[f"{name}/master"].to(torch.bfloat16)), name
    # bf16 forward/backward: the curve follows the fp32 reference to bf16 accuracy
    assert rel_err(torch.tensor(run.losses), torch.tensor(reference.losses)) <= 2e-2


def test_fp16_loss_scaler_skips_an_inf_step_and_recovers(reference):
    groups = ProcessGroups.single()
    scaler = DynamicLossScaler(initial_scale=2.0**12, hysteresis=1, growth_interval=2)
    model, ddp, opt = T.build(groups, distributed_optimizer=False, dtype=torch.float16, loss_scaler=scaler)
    T.train(groups, ddp, opt, range(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = opt.state_dict()
    run = T.train(groups, ddp, opt, range(1, 2), inject_inf_at=1)
    assert run.skipped == [True] and not torch.isfinite(torch.tensor(run.norms[0]))
    assert scaler.scale == 2.0**11 and scaler.skipped_steps == 1 and opt.step_count == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    state_after = opt.state_dict()
    for key, t in state_before["tensors"].items():
        assert torch.equal(t, state_after["tensors"][key]), key
    run = T.train(groups, ddp, opt, range(2, 5))
    assert run.skipped == [False, False, False] and opt.step_count == 4
    assert scaler.scale == 2.0**12  # grew back after growth_interval=2 good steps
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    # after the skipped step, the fp16 run keeps training on the same data as the reference's steps 1..3
    assert all(abs(a - b) / b < 3e-2 for a, b in zip(run.losses, reference.losses[2:5]))


def test_set_lr_applies_group_multipliers():
    model = nn.Linear(4, 4)
    opt = MixedPrecisionOptimizer(model, [{"params": [model.weight]}, {"params": [model.bias], "lr_mult": 0.5}], lr=1.0)
    opt.set_lr(0.2)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.1] and opt.lr == 0.2


def test_clip_grad_norm_matches_torch_in_one_process():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    ref = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    (model(x) ** 3).sum().backward()
    (ref(x) ** 3).sum().backward()
    ours = clip_grad_norm(model.parameters(), 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert rel_err(ours, theirs) <= TOL
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= TOL


def test_loss_scaler_growth_backoff_hysteresis_and_state():
    s = DynamicLossScaler(initial_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 8.0  # the first overflow only uses up hysteresis
    s.update(found_inf=True)
    assert s.scale == 4.0
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 8.0 and s.skipped_steps == 2
    copy = DynamicLossScaler(initial_scale=8.0, growth_interval=3, hysteresis=2)
    copy.load_state_dict(s.state_dict())
    assert copy.state_dict() == s.state_dict()
    tiny = DynamicLossScaler(initial_scale=1.0, min_scale=1.0, hysteresis=1)
    tiny.update(found_inf=True)
    assert tiny.scale == 1.0
    assert float(DynamicLossScaler(initial_scale=4.0).scale_loss(torch.tensor(1.5))) == 6.0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be > 1"),
        ({"backoff_factor": 1.5}, "backoff_factor must be < 1"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1, got 0"),
        ({"initial_scale": float("inf")}, "initial_scale must be a finite number > 0"),
        ({"initial_scale": 0.5, "min_scale": 1.0}, "min_scale <= initial_scale <= max_scale"),
    ],
)
def test_loss_scaler_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DynamicLossScaler(**kwargs)


def test_optimizer_argument_errors():
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(ValueError, match="not in model_chunks"):
        MixedPrecisionOptimizer(model, [{"params": [other.weight]}])
    with pytest.raises(ValueError, match="appears in more than one param group"):
        MixedPrecisionOptimizer(model, [{"params": [model.weight]}, {"params": [model.weight]}])
    with pytest.raises(ValueError, match=r"unknown keys \['momentum'\]"):
        MixedPrecisionOptimizer(model, [{"params": [model.weight], "momentum": 0.9}])
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got -1"):
        MixedPrecisionOptimizer(model, lr=-1)
    with pytest.raises(TypeError, match="must be a DistributedDataParallel built with use_distributed_optimizer=True"):
        DistributedOptimizer(DistributedDataParallel(model, None))
    with pytest.raises(ValueError, match="use DistributedOptimizer with it"):
        MixedPrecisionOptimizer(DistributedDataParallel(nn.Linear(4, 4), None, use_distributed_optimizer=True))
    opt = MixedPrecisionOptimizer(model)
    state = opt.state_dict()
    state["tensors"]["weight/master"] = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"weight/master has shape \(4, 2\), the TP-local parameter has \(4, 4\)"):
        opt.load_state_dict(state)
    del state["tensors"]["bias/exp_avg"]
    with pytest.raises(ValueError, match="missing"):
        opt.load_state_dict(state)
