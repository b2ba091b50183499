"""The unit of work of a pipeline schedule: one forward, backward or weight-gradient pass of one micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FORWARD", "BACKWARD", "WEIGHT", "Op"]

FORWARD = "F"
"""Forward pass of one model chunk on one micro-batch."""
BACKWARD = "B"
"""Backward pass. In schedules that split the backward (zero bubble) it computes only the input gradient."""
WEIGHT = "W"
"""Weight-gradient pass of a split backward (zero bubble only)."""

_KINDS = (FORWARD, BACKWARD, WEIGHT)


@dataclass(frozen=True)
class Op:
    """One pass of ``kind`` (``"F"``, ``"B"`` or ``"W"``) over ``microbatch`` on local model chunk ``chunk``."""

    kind: str
    chunk: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Op.kind must be one of {_KINDS}, got {self.kind!r}")
        for name in ("chunk", "microbatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Op.{name} must be an int >= 0, got {value!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" if self.chunk == 0 else f"{self.kind}{self.microbatch}.{self.chunk}"
