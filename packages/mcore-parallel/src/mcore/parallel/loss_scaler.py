"""Dynamic loss scaling for fp16 training.

The loss is multiplied by ``scale`` before backward so that small fp16 gradients do not flush to zero; the
optimizer divides the gradients by it again. When a step meets an inf/nan gradient the step is skipped
and, once ``hysteresis`` such steps have accumulated, the scale is multiplied by ``backoff_factor``;
after ``growth_interval`` consecutive good steps it is multiplied by ``growth_factor`` (and the
hysteresis budget refills), as in Megatron-Core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["DynamicLossScaler"]


@dataclass
class DynamicLossScaler:
    """Loss scale that backs off on overflow and grows after a run of finite steps."""

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    scale: float = field(init=False)
    skipped_steps: int = field(init=False, default=0)
    _growth_tracker: int = field(init=False, default=0, repr=False)
    _hysteresis_tracker: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        def positive_float(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"DynamicLossScaler.{name} must be a finite number > 0, got {value!r}")

        for name in ("initial_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            positive_float(name)
        if self.growth_factor <= 1:
            raise ValueError(f"DynamicLossScaler.growth_factor must be > 1, got {self.growth_factor}")
        if self.backoff_factor >= 1:
            raise ValueError(f"DynamicLossScaler.backoff_factor must be < 1, got {self.backoff_factor}")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicLossScaler.{name} must be an int >= 1, got {value!r}")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"DynamicLossScaler: need min_scale <= initial_scale <= max_scale, got "
                f"{self.min_scale} <= {self.initial_scale} <= {self.max_scale}"
            )
        self.scale = float(self.initial_scale)
        self._hysteresis_tracker = self.hysteresis

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: call backward on this."""
        return loss * self.scale

    def update(self, found_inf: bool) -> None:
        """Account for one optimizer step (``found_inf``: it was skipped for an inf/nan gradient)."""
        if found_inf:
            self.skipped_steps += 1
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state)
        if missing:
            raise ValueError(f"DynamicLossScaler.load_state_dict: missing keys {sorted(missing)}")
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
