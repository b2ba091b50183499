"""Learning-rate schedules: linear warmup, then cosine, linear, warmup-stable-decay (WSD) or constant.

The schedule is a pure function of the optimizer step, so resuming a run needs only the step count.
Step ``i`` is the ``i``-th optimizer update counted from 0; warmup reaches ``max_lr`` at step
``warmup_steps - 1`` (the first update does not use a zero learning rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Schedule = Literal["cosine", "linear", "wsd", "constant"]
WSDDecay = Literal["linear", "cosine", "1-sqrt"]


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the step.

    Args:
        schedule: shape after warmup: ``cosine`` and ``linear`` decay from ``max_lr`` to ``min_lr`` between
            the end of warmup and ``decay_steps``; ``wsd`` stays at ``max_lr`` and decays only over the last
            ``wsd_decay_steps`` before ``decay_steps``; ``constant`` stays at ``max_lr``.
        max_lr: peak learning rate.
        min_lr: final learning rate (held after ``decay_steps``).
        warmup_steps: steps of linear warmup from ``max_lr / warmup_steps`` to ``max_lr``.
        decay_steps: the step at which the decay ends (usually the run's total steps).
        wsd_decay_steps: length of the WSD decay phase.
        wsd_decay_style: shape of the WSD decay: ``linear``, ``cosine`` or ``1-sqrt``.
    """

    schedule: Schedule
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    wsd_decay_steps: int = 0
    wsd_decay_style: WSDDecay = "1-sqrt"

    def __post_init__(self) -> None:
        if self.schedule not in ("cosine", "linear", "wsd", "constant"):
            raise ValueError(f"lr.schedule must be cosine, linear, wsd or constant, got {self.schedule!r}")
        if not (self.max_lr > 0 and math.isfinite(self.max_lr)):
            raise ValueError(f"lr.max_lr must be a positive finite number, got {self.max_lr}")
        if not (0 <= self.min_lr <= self.max_lr):
            raise ValueError(f"lr.min_lr must lie in [0, max_lr={self.max_lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"lr.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps < self.warmup_steps:
            raise ValueError(
                f"the decay must end after warmup: decay_steps={self.decay_steps} < warmup_steps="
                f"{self.warmup_steps}; lower lr.warmup_steps or raise lr.decay_steps / train.steps"
            )
        if self.schedule == "wsd":
            if self.wsd_decay_style not in ("linear", "cosine", "1-sqrt"):
                raise ValueError(f"lr.wsd_decay_style must be linear, cosine or 1-sqrt, got {self.wsd_decay_style!r}")
            stable = self.decay_steps - self.warmup_steps
            if not (0 < self.wsd_decay_steps <= stable):
                raise ValueError(
                    f"lr.wsd_decay_steps must lie in (0, decay_steps - warmup_steps = {stable}], "
                    f"got {self.wsd_decay_steps}"
                )

    def __call__(self, step: int) -> float:
        """The learning rate of update number ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.max_lr
        if self.schedule == "wsd":
            decay_start = self.decay_steps - self.wsd_decay_steps
            if step < decay_start:
                return self.max_lr
            progress = min(1.0, (step - decay_start) / self.wsd_decay_steps)
            if self.wsd_decay_style == "linear":
                factor = 1.0 - progress
            elif self.wsd_decay_style == "cosine":
                factor = 0.5 * (1.0 + math.cos(math.pi * progress))
            else:
                factor = 1.0 - math.sqrt(progress)
            return self.min_lr + (self.max_lr - self.min_lr) * factor
        span = self.decay_steps - self.warmup_steps
        progress = 1.0 if span == 0 else min(1.0, (step - self.warmup_steps) / span)
        if self.schedule == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.max_lr - self.min_lr) * factor
