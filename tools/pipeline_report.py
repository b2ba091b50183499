"""Timeline drawings and bubble numbers of every schedule, generated from the code for ``docs/parallelism.md``
(a developer tool, not part of the library).

``python tools/pipeline_report.py`` prints the drawings and the theoretical bubble table that the docs
contain; a test regenerates them and compares, so the docs cannot drift from the schedules' real op orders.
The drawings replay each schedule's exact plan (:func:`~mcore.parallel.pipeline.p2p_exchanges.replay_plans`: the
executor's ops and lock-step exchanges under NCCL's matching rules, transfers taking no time) with
``t_F = 1`` and ``t_B = 2`` per model chunk (``t_B = t_W = 1`` for the split backward of ZB-H1).
"""

from __future__ import annotations

from mcore.parallel.pipeline.p2p_exchanges import replay_plans
from mcore.parallel.pipeline.schedules import (
    GPipe,
    Interleaved1F1B,
    NoPipelining,
    OneFOneB,
    PipelineSchedule,
    ZeroBubbleH1,
)
from mcore.parallel.pipeline.timeline import StageTimeline, pipeline_idle_fraction, render

__all__ = ["SCHEDULES", "DRAWN_CASES", "op_times", "planned_timelines", "drawing", "bubble_table", "main"]

SCHEDULES: tuple[type[PipelineSchedule], ...] = (NoPipelining, GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1)

# (schedule, pp, vpp, micro-batches) of each drawing in docs/parallelism.md
DRAWN_CASES: tuple[tuple[type[PipelineSchedule], int, int, int], ...] = (
    (NoPipelining, 1, 1, 4),
    (GPipe, 4, 1, 8),
    (OneFOneB, 4, 1, 8),
    (Interleaved1F1B, 2, 2, 4),
    (ZeroBubbleH1, 4, 1, 8),
)


def op_times(schedule_cls: type[PipelineSchedule]) -> dict[str, float]:
    """Relative op durations: a backward costs twice a forward, split evenly into B and W when split."""
    if schedule_cls.splits_backward:
        return {"forward_time": 1.0, "backward_time": 1.0, "weight_time": 1.0}
    return {"forward_time": 1.0, "backward_time": 2.0, "weight_time": 0.0}


def planned_timelines(schedule_cls: type[PipelineSchedule], pp: int, vpp: int, m: int) -> list[StageTimeline]:
    """Each rank's timeline when the schedule's plan runs with :func:`op_times` and free communication."""
    return replay_plans(schedule_cls.plans(pp, vpp, m), pp, **op_times(schedule_cls))


def drawing(schedule_cls: type[PipelineSchedule], pp: int, vpp: int, m: int) -> str:
    """The text drawing of :func:`planned_timelines` (one row per stage; ``F3`` = forward of micro-batch 3)."""
    return render(planned_timelines(schedule_cls, pp, vpp, m), vpp)


def bubble_table(cases: list[tuple[type[PipelineSchedule], int, int, int]]) -> str:
    """Markdown rows: theoretical bubble fraction and the one of the replayed plan, which must agree."""
    lines = ["| schedule | pp | vpp | m | bubble (formula) | bubble (replayed plan) |", "|---|---|---|---|---|---|"]
    for cls, pp, vpp, m in cases:
        replayed = pipeline_idle_fraction(planned_timelines(cls, pp, vpp, m))
        lines.append(
            f"| {cls.__name__} | {pp} | {vpp} | {m} | {cls.bubble_fraction(pp, vpp, m):.3f} | {replayed:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    for cls, pp, vpp, m in DRAWN_CASES:
        print(f"{cls.__name__}, pp={pp}, vpp={vpp}, m={m}:\n```text\n{drawing(cls, pp, vpp, m)}\n```\n")
    cases = [(c, 4, 2 if c is Interleaved1F1B else 1, m) for c in SCHEDULES[1:] for m in (4, 8, 16)]
    print(bubble_table(cases))


if __name__ == "__main__":
    main()
