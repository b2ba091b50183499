"""Gradient accumulation without pipelining: one stage runs every micro-batch's forward and backward in turn."""

from __future__ import annotations

from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, Op
from mcore.parallel.pipeline.schedules.base import PipelineSchedule

__all__ = ["NoPipelining"]


class NoPipelining(PipelineSchedule):
    """``F0 B0 F1 B1 ...`` on a single stage (``pp = 1``); activations of one micro-batch live at a time."""

    name = "none"

    @classmethod
    def check_sizes(cls, pp: int, vpp: int, num_microbatches: int) -> None:
        super().check_sizes(pp, vpp, num_microbatches)
        if pp != 1 or vpp != 1:
            raise ValueError(
                f"NoPipelining runs one stage with one model chunk, got pp={pp}, vpp={vpp}; "
                f"use GPipe, OneFOneB, Interleaved1F1B or ZeroBubbleH1 for pp > 1"
            )

    @staticmethod
    def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
        """0: a single stage never waits for another."""
        NoPipelining.check_sizes(pp, vpp, num_microbatches)
        return 0.0

    @classmethod
    def ticks(
        cls, pp: int, pp_rank: int, vpp: int, num_microbatches: int, forward_only: bool = False
    ) -> list[tuple[Op, ...]]:
        cls.check_sizes(pp, vpp, num_microbatches)
        ticks: list[tuple[Op, ...]] = []
        for mb in range(num_microbatches):
            ticks.append((Op(FORWARD, 0, mb),))
            if not forward_only:
                ticks.append((Op(BACKWARD, 0, mb),))
        return ticks
