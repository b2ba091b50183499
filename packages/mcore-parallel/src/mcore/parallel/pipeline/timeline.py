"""Bubble accounting: when each stage was busy, idle, and what its timeline looks like.

Two sources feed the same :class:`StageTimeline`:

- :func:`simulate` places every rank's op order on an ideal clock (fixed time per F, B and W, free
  communication), which gives the timeline drawings in ``docs/parallelism.md`` and checks each schedule's
  bubble formula;
- a schedule run with ``measure=True`` records the wall time (``time.perf_counter``) of each op it executes.

A stage's *idle time* is the part of its span (from the start of the run to the end of its last op, or a
common end for the whole pipeline) in which it executed no op: waiting for a neighbour or for communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, WEIGHT, Op

__all__ = ["TimedOp", "StageTimeline", "simulate", "render", "pipeline_idle_fraction"]


@dataclass(frozen=True)
class TimedOp:
    """An op with its start and end time (seconds when measured, abstract units when simulated)."""

    op: Op
    start: float
    end: float


@dataclass
class StageTimeline:
    """The ops one pipeline stage ran, with the span they are measured against."""

    pp_rank: int
    ops: list[TimedOp] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def busy(self) -> float:
        """Total time spent inside ops."""
        return sum(t.end - t.start for t in self.ops)

    @property
    def span(self) -> float:
        return self.end - self.start

    @property
    def idle(self) -> float:
        """Time within the span in which no op ran (waiting for neighbours or transfers)."""
        return self.span - self.busy

    @property
    def idle_fraction(self) -> float:
        return self.idle / self.span if self.span > 0 else 0.0


def pipeline_idle_fraction(timelines: Sequence[StageTimeline]) -> float:
    """Idle share of the whole pipeline: every stage measured over the common span (first start, last end)."""
    if not timelines:
        raise ValueError("need at least one stage timeline")
    start = min(t.start for t in timelines)
    end = max(t.end for t in timelines)
    total = (end - start) * len(timelines)
    return 1.0 - sum(t.busy for t in timelines) / total if total > 0 else 0.0


def simulate(
    orders: Sequence[Sequence[Op]],
    vpp: int = 1,
    *,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    weight_time: float = 0.0,
) -> list[StageTimeline]:
    """Run every rank's op order on an ideal clock and return one timeline per rank.

    ``orders[r]`` is rank ``r``'s op order. An op starts when its rank is free and its inputs exist: a forward
    after the forward of the previous virtual stage, a backward after its own forward and the backward of the next
    virtual stage, a weight pass after its backward. For schedules that do not split the backward, pass the whole
    backward cost as ``backward_time`` and leave ``weight_time`` at 0. Times are per model chunk. All stages share
    the common span ``[0, end of the last op]``. Raises ``RuntimeError`` if the orders deadlock.
    """
    pp = len(orders)
    if pp < 1:
        raise ValueError("need the op order of at least one rank")
    last_stage = pp * vpp - 1
    cost = {FORWARD: forward_time, BACKWARD: backward_time, WEIGHT: weight_time}
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * pp
    free = [0.0] * pp
    timelines = [StageTimeline(pp_rank=r) for r in range(pp)]
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                op = orders[r][position[r]]
                stage = op.chunk * pp + r
                if op.kind == FORWARD:
                    deps = [(FORWARD, stage - 1, op.microbatch)] if stage > 0 else []
                elif op.kind == BACKWARD:
                    deps = [(FORWARD, stage, op.microbatch)]
                    if stage < last_stage:
                        deps.append((BACKWARD, stage + 1, op.microbatch))
                else:
                    deps = [(BACKWARD, stage, op.microbatch)]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + cost[op.kind]
                done[(op.kind, stage, op.microbatch)] = end
                free[r] = end
                timelines[r].ops.append(TimedOp(op, start, end))
                position[r] += 1
                progress = True
    stuck = {r: orders[r][position[r]] for r in range(pp) if position[r] < len(orders[r])}
    if stuck:
        raise RuntimeError(f"op orders deadlock: ranks wait forever at {stuck}")
    end = max(free)
    for t in timelines:
        t.end = end
    return timelines


def _label(op: Op, vpp: int, width: int) -> str:
    text = f"{op.kind}{op.microbatch}"
    if vpp > 1:
        text += "abcdefghijklmnopqrstuvwxyz"[op.chunk]
    return text.ljust(width)


def render(timelines: Sequence[StageTimeline], vpp: int = 1, *, unit: float | None = None) -> str:
    """Draw timelines as text: one row per stage, one cell per ``unit`` of time.

    A cell shows the op running at that time as kind + micro-batch (``F3`` = forward of micro-batch 3; with
    ``vpp > 1`` a chunk letter follows: ``F3b`` = chunk 1), ``.`` when the stage is idle. ``unit`` defaults to
    the shortest op, which is exact for simulated timelines; measured timelines are drawn at that resolution.
    """
    ops = [t for tl in timelines for t in tl.ops]
    if not ops:
        return ""
    if unit is None:
        unit = min(t.end - t.start for t in ops if t.end > t.start)
    start = min(tl.start for tl in timelines)
    end = max(tl.end for tl in timelines)
    width = max(len(_label(t.op, vpp, 0)) for t in ops) + 1
    cells = max(1, round((end - start) / unit))
    lines = []
    for tl in timelines:
        row = ["." * (width - 1) + " "] * cells
        for t in tl.ops:
            first = round((t.start - start) / unit)
            last = max(first + 1, round((t.end - start) / unit))
            for i in range(first, min(last, cells)):
                row[i] = _label(t.op, vpp, width)
        lines.append(f"stage {tl.pp_rank}: " + "".join(row).rstrip())
    return "\n".join(lines)
