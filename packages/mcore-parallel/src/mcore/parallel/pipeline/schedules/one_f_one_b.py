"""1F1B (PipeDream-Flush, Narayanan et al., 2021): alternate one forward and one backward in the steady state."""

from __future__ import annotations

from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, Op
from mcore.parallel.pipeline.schedules.base import PipelineSchedule

__all__ = ["OneFOneB"]


class OneFOneB(PipelineSchedule):
    """Same bubble as GPipe, but rank ``r`` holds at most ``p - r`` micro-batches of activations instead of ``m``."""

    name = "1f1b"
    one_chunk_per_rank = True

    @staticmethod
    def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
        """``(p - 1) / (m + p - 1)``, as GPipe (Narayanan et al., 2021, section 2.2)."""
        OneFOneB.check_sizes(pp, vpp, num_microbatches)
        return (pp - 1) / (num_microbatches + pp - 1)

    @classmethod
    def ticks(
        cls, pp: int, pp_rank: int, vpp: int, num_microbatches: int, forward_only: bool = False
    ) -> list[tuple[Op, ...]]:
        cls.check_sizes(pp, vpp, num_microbatches)
        m = num_microbatches
        if forward_only:
            return [(Op(FORWARD, 0, mb),) for mb in range(m)]
        # Warmup: enough forwards in flight that the first backward reaches this stage just as they finish.
        warmup = min(pp - pp_rank - 1, m)
        ticks = [(Op(FORWARD, 0, mb),) for mb in range(warmup)]
        # Steady state: each new forward is followed by the backward of the oldest micro-batch in flight.
        for i in range(m - warmup):
            ticks.append((Op(FORWARD, 0, warmup + i),))
            ticks.append((Op(BACKWARD, 0, i),))
        # Cooldown: the backwards of the micro-batches still in flight.
        ticks += [(Op(BACKWARD, 0, mb),) for mb in range(m - warmup, m)]
        return ticks
