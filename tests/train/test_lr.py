"""Learning-rate schedules against torch.optim.lr_scheduler (an implementation that is not ours)."""

from __future__ import annotations

import math

import pytest
import torch

from mcore.train.lr import LRSchedule


def _torch_lrs(sched: torch.optim.lr_scheduler.LRScheduler, steps: int, opt: torch.optim.Optimizer) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


@pytest.mark.parametrize("warmup,decay", [(5, 40), (1, 10), (10, 10)])
def test_warmup_cosine_matches_torch(warmup, decay):
    max_lr, min_lr = 3e-3, 3e-4
    opt = _optimizer(max_lr)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 1.0 / warmup, 1.0, total_iters=max(warmup - 1, 0)),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(decay - warmup, 1), eta_min=min_lr),
        ],
        milestones=[warmup],
    )
    ref = _torch_lrs(sched, decay + 1 if decay > warmup else warmup, opt)
    ours = LRSchedule("cosine", max_lr, min_lr, warmup, decay)
    for step, expected in enumerate(ref):
        assert ours(step) == pytest.approx(expected, rel=1e-9, abs=1e-15), step


def test_warmup_linear_matches_torch():
    max_lr, min_lr, warmup, decay = 1e-3, 1e-4, 4, 24
    opt = _optimizer(max_lr)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 1.0 / warmup, 1.0, total_iters=warmup - 1),
            torch.optim.lr_scheduler.LinearLR(opt, 1.0, min_lr / max_lr, total_iters=decay - warmup),
        ],
        milestones=[warmup],
    )
    ref = _torch_lrs(sched, decay + 5, opt)
    ours = LRSchedule("linear", max_lr, min_lr, warmup, decay)
    for step, expected in enumerate(ref):
        assert ours(step) == pytest.approx(expected, rel=1e-9), step


def test_wsd_phases():
    s = LRSchedule("wsd", 1.0, 0.1, warmup_steps=10, decay_steps=100, wsd_decay_steps=20, wsd_decay_style="linear")
    assert s(0) == pytest.approx(0.1)
    assert s(9) == pytest.approx(1.0)
    assert all(s(i) == 1.0 for i in range(10, 81))
    assert s(90) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(100) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    sqrt = LRSchedule("wsd", 1.0, 0.0, 0, 100, wsd_decay_steps=50, wsd_decay_style="1-sqrt")
    assert sqrt(75) == pytest.approx(1 - math.sqrt(0.5))
    cos = LRSchedule("wsd", 1.0, 0.0, 0, 100, wsd_decay_steps=50, wsd_decay_style="cosine")
    assert cos(75) == pytest.approx(0.5)


def test_constant_and_after_decay():
    assert LRSchedule("constant", 0.5, 0.0, 2, 10)(1000) == 0.5
    assert LRSchedule("cosine", 1.0, 0.2, 0, 10)(10_000) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(schedule="cosine", max_lr=0.0, min_lr=0.0, warmup_steps=0, decay_steps=1), "max_lr"),
        (dict(schedule="cosine", max_lr=1.0, min_lr=2.0, warmup_steps=0, decay_steps=1), "min_lr"),
        (dict(schedule="cosine", max_lr=1.0, min_lr=0.0, warmup_steps=5, decay_steps=2), "decay must end after"),
        (dict(schedule="wsd", max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10, wsd_decay_steps=11), "wsd"),
        (dict(schedule="step", max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10), "lr.schedule"),
    ],
)
def test_bad_schedules_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRSchedule(**kwargs)
