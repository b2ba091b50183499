"""GPipe (Huang et al., 2019): every forward, then every backward."""

from __future__ import annotations

from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, Op
from mcore.parallel.pipeline.schedules.base import PipelineSchedule

__all__ = ["GPipe"]


class GPipe(PipelineSchedule):
    """All-forward-all-backward. Simple, but every stage keeps the activations of all ``m`` micro-batches."""

    name = "gpipe"
    one_chunk_per_rank = True

    @staticmethod
    def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
        """``(p - 1) / (m + p - 1)``: the fill and the drain each cost ``p - 1`` op slots of every stage."""
        GPipe.check_sizes(pp, vpp, num_microbatches)
        return (pp - 1) / (num_microbatches + pp - 1)

    @classmethod
    def ticks(
        cls, pp: int, pp_rank: int, vpp: int, num_microbatches: int, forward_only: bool = False
    ) -> list[tuple[Op, ...]]:
        cls.check_sizes(pp, vpp, num_microbatches)
        # Fill: forwards of every micro-batch stream down the pipeline.
        ticks = [(Op(FORWARD, 0, mb),) for mb in range(num_microbatches)]
        if forward_only:
            return ticks
        # Drain: backwards in the same micro-batch order, so that each stage's gradients arrive in order.
        ticks += [(Op(BACKWARD, 0, mb),) for mb in range(num_microbatches)]
        return ticks
