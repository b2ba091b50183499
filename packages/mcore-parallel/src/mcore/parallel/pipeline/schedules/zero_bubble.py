"""ZB-H1 zero-bubble schedule (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from torch import nn

from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, WEIGHT, Op
from mcore.parallel.pipeline.schedules.base import PipelineSchedule
from mcore.parallel.tensor_parallel import attach_weight_grad_store
from mcore.parallel.weight_grad_store import WeightGradStore

__all__ = ["ZeroBubbleH1"]


class ZeroBubbleH1(PipelineSchedule):
    """1F1B with the backward split into B (input gradient, on the critical path) and W (weight gradient).

    Forwards and B passes follow 1F1B exactly, so activation memory and communication are those of 1F1B. W passes
    have no consumer downstream, so rank ``r`` lets up to ``r`` of them wait: the later stages, which idle longest
    at the end of 1F1B while the backward travels back to rank 0, run their saved-up W passes there instead. With
    ``t_F = t_B = t_W`` this leaves ``p - 1`` op slots idle per rank, a third of 1F1B's ``3 (p - 1)``.

    Weight gradients are deferred through the schedule's own :class:`~mcore.parallel.weight_grad_store.
    WeightGradStore` (``weight_grads``, handed to the tensor-parallel linears of the chunks): each B pass runs
    inside ``weight_grads.deferring()`` (one queued batch per micro-batch) and each W pass runs the oldest batch
    with ``weight_grads.flush(1)``; W passes come in micro-batch order, so that is the right one. Only the
    tensor-parallel linears split their backward; every other parameter gets its gradient in B, which is correct,
    only less bubble-filling. Under data parallelism the B and the W pass of the last micro-batch both run with
    gradient sync on: each completes a different set of gradients.
    """

    name = "zb-h1"
    one_chunk_per_rank = True
    splits_backward = True

    @staticmethod
    def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
        """Idle share for ``t_F = t_B = t_W``: ``(p - 1) / (3 m + p - 1)`` when ``m >= p``.

        That is the paper's ``(p - 1)(t_F + t_B - t_W)`` bubble over a span of ``3 m`` op slots plus the bubble.
        With fewer micro-batches than stages there are not enough W passes to fill the cooldown and the span
        grows by ``p - m`` slots: ``(2 p - m - 1) / (2 p + 2 m - 1)``. For other timings use :func:`simulate`.
        """
        ZeroBubbleH1.check_sizes(pp, vpp, num_microbatches)
        m = num_microbatches
        idle = pp - 1 + max(0, pp - m)
        return idle / (3 * m + idle)

    @classmethod
    def ticks(
        cls, pp: int, pp_rank: int, vpp: int, num_microbatches: int, forward_only: bool = False
    ) -> list[tuple[Op, ...]]:
        cls.check_sizes(pp, vpp, num_microbatches)
        m = num_microbatches
        if forward_only:
            return [(Op(FORWARD, 0, mb),) for mb in range(m)]
        max_waiting_w = pp_rank
        waiting_w: list[int] = []
        ticks: list[tuple[Op, ...]] = []

        def backward_then_weight(mb: int) -> None:
            ticks.append((Op(BACKWARD, 0, mb),))
            waiting_w.append(mb)
            if len(waiting_w) > max_waiting_w:
                ticks.append((Op(WEIGHT, 0, waiting_w.pop(0)),))

        # Warmup: as 1F1B.
        warmup = min(pp - pp_rank - 1, m)
        ticks += [(Op(FORWARD, 0, mb),) for mb in range(warmup)]
        # Steady state: F, B, and the W of the oldest micro-batch once more than pp_rank are waiting.
        for i in range(m - warmup):
            ticks.append((Op(FORWARD, 0, warmup + i),))
            backward_then_weight(i)
        # Cooldown: the remaining B passes, still releasing W passes beyond the allowance.
        for mb in range(m - warmup, m):
            backward_then_weight(mb)
        # Drain: the waiting W passes fill what would be 1F1B's cooldown bubble on the later stages.
        ticks += [(Op(WEIGHT, 0, mb),) for mb in waiting_w]
        return ticks

    def __init__(self, model_chunks: Sequence[nn.Module], **kwargs: Any) -> None:
        super().__init__(model_chunks, **kwargs)
        self.weight_grads = WeightGradStore()
        attach_weight_grad_store(self.model_chunks, self.weight_grads)

    def _check_store_empty(self, when: str) -> None:
        if self.weight_grads.pending():
            raise RuntimeError(
                f"WeightGradStore holds {self.weight_grads.pending()} queued weight-gradient batches {when}; "
                f"ZeroBubbleH1 owns the queue while it runs: flush() or clear() it before calling run()"
            )

    def _before_backward_passes(self) -> None:
        self._check_store_empty("before the schedule started")

    def _backward_context(self) -> contextlib.AbstractContextManager:
        return self.weight_grads.deferring()

    def _weight_pass(self, chunk: int, microbatch: int) -> None:
        if self.weight_grads.flush(1) != 1:
            raise RuntimeError(
                f"W pass of micro-batch {microbatch} found no deferred weight gradients: the WeightGradStore queue "
                f"was emptied by someone else during the schedule"
            )

    def _after_backward_passes(self) -> None:
        self._check_store_empty("after every W pass ran")
