"""Interleaved 1F1B (Narayanan et al., 2021, section 2.2): each rank holds ``vpp`` model chunks."""

from __future__ import annotations

from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, Op
from mcore.parallel.pipeline.schedules.base import PipelineSchedule

__all__ = ["Interleaved1F1B"]


class Interleaved1F1B(PipelineSchedule):
    """1F1B over ``pp * vpp`` virtual stages; chunk ``c`` of rank ``r`` is virtual stage ``c * pp + r``.

    Micro-batches go through the chunks in groups of ``pp``: forwards of micro-batches ``0..pp-1`` on chunk 0,
    then the same micro-batches on chunk 1, ..., then the next group. Each op is ``1 / vpp`` of a stage's work, so
    the fill and drain shrink by ``vpp`` at the cost of ``vpp`` times more transfers.

    Requires ``pp >= 2``, ``vpp >= 2`` and ``num_microbatches`` a multiple of ``pp`` (as Megatron-Core's classic
    interleaved schedule), so that every group of ``pp`` micro-batches is complete.
    """

    name = "interleaved-1f1b"

    @classmethod
    def check_sizes(cls, pp: int, vpp: int, num_microbatches: int) -> None:
        super().check_sizes(pp, vpp, num_microbatches)
        if pp < 2:
            raise ValueError(f"Interleaved1F1B needs pp >= 2, got pp={pp}; use NoPipelining for one stage")
        if vpp < 2:
            raise ValueError(
                f"Interleaved1F1B needs vpp >= 2 model chunks per rank, got vpp={vpp}; use OneFOneB for vpp=1"
            )
        if num_microbatches % pp != 0:
            lower = (num_microbatches // pp) * pp
            options = f"{lower} or {lower + pp}" if lower else f"{pp}"
            raise ValueError(
                f"Interleaved1F1B needs num_microbatches divisible by pp: got num_microbatches={num_microbatches}, "
                f"pp={pp}; use {options} micro-batches (a multiple of {pp}), or the OneFOneB schedule"
            )

    @staticmethod
    def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
        """``(p - 1) / (v m + p - 1)``: the fill and drain cost ``p - 1`` chunk-sized slots out of ``v m``."""
        Interleaved1F1B.check_sizes(pp, vpp, num_microbatches)
        return (pp - 1) / (vpp * num_microbatches + pp - 1)

    @staticmethod
    def _chunk_and_microbatch(k: int, pp: int, vpp: int, backward: bool) -> tuple[int, int]:
        """The chunk and micro-batch of a rank's k-th forward (or k-th backward, which visits chunks in reverse)."""
        group, within = divmod(k, pp * vpp)
        chunk = within // pp
        return (vpp - 1 - chunk if backward else chunk), group * pp + within % pp

    @classmethod
    def ticks(
        cls, pp: int, pp_rank: int, vpp: int, num_microbatches: int, forward_only: bool = False
    ) -> list[tuple[Op, ...]]:
        cls.check_sizes(pp, vpp, num_microbatches)
        total = num_microbatches * vpp

        def fwd(k: int) -> Op:
            return Op(FORWARD, *cls._chunk_and_microbatch(k, pp, vpp, backward=False))

        def bwd(k: int) -> Op:
            return Op(BACKWARD, *cls._chunk_and_microbatch(k, pp, vpp, backward=True))

        if forward_only:
            return [(fwd(k),) for k in range(total)]
        # Warmup: the first backward on this rank (of its last chunk) needs the first micro-batch group to pass
        # through all later virtual stages and back: (vpp - 1) * pp forwards, plus 2 per later rank, as in
        # Megatron-Core. With a single group (m == pp) there is no steady state: all forwards first.
        if num_microbatches == pp:
            warmup = total
        else:
            warmup = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)
        ticks = [(fwd(k),) for k in range(warmup)]
        # Steady state: one forward and one backward per exchange. Every rank then works F + B between two
        # exchanges, so the lock-step exchanges never make a rank wait on a neighbour that is still busy.
        ticks += [(fwd(warmup + i), bwd(i)) for i in range(total - warmup)]
        # Cooldown: the remaining backwards.
        ticks += [(bwd(k),) for k in range(total - warmup, total)]
        return ticks
