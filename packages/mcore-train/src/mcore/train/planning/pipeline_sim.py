"""Replay a schedule's communication plan with per-stage op times, as ``PipelineSchedule.run`` executes it.

``PipelineSchedule.plans`` groups every rank's ops into lock-step exchanges (``mcore.parallel.pipeline.p2p_exchanges``):
before an op a rank posts one batched exchange with its neighbours and waits until the peer has posted its half.
This replays those plans on a clock where each op of chunk ``c`` on rank ``r`` takes its own time and every
exchange costs its transfer time, so imbalanced stages, the output layer on the last stage and the many exchanges
of interleaving cost what they cost in the real schedule. Long runs are replayed for a few rounds of micro-batches
and extended linearly (the steady state repeats with period ``pp`` micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from mcore.parallel.pipeline import Message, Step

OpTime = Callable[[int, str, int], float]  # (rank, kind, chunk) -> seconds


def _transfer(rank: int, pp: int, msg: Message) -> tuple[str, int, int]:
    """(kind, virtual stage that sends it, micro-batch): the same at both ends of one transfer."""
    stage = msg.chunk * pp + rank
    if msg.send:
        return (msg.kind, stage, msg.microbatch)
    return (msg.kind, stage - 1 if msg.kind == "activation" else stage + 1, msg.microbatch)


@dataclass(frozen=True)
class PipelineRun:
    """End of every rank's last op, busy time per rank, and the span."""

    ends: tuple[float, ...]
    busy: tuple[float, ...]
    span: float

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - sum(self.busy) / (self.span * len(self.busy)) if self.span > 0 else 0.0


def replay(plans: Sequence[Sequence[Step]], pp: int, op_time: OpTime, transfer_time: float) -> PipelineRun:
    """Replay ``plans`` (one per rank): an exchange completes when both ends posted it, plus ``transfer_time``
    when it moves any tensor; ops then take ``op_time``."""
    posted: dict[tuple, float] = {}
    position = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    total = [len(p) for p in plans]
    while any(position[r] < total[r] for r in range(pp)):
        progress = False
        for r in range(pp):
            while position[r] < total[r]:
                step = plans[r][position[r]]
                keys = []
                for msg in step.messages:
                    tid = _transfer(r, pp, msg)
                    keys.append(((tid, msg.send), (tid, not msg.send)))
                for mine, _ in keys:
                    posted.setdefault(mine, clock[r])
                if any(other not in posted for _, other in keys):
                    break
                if keys:
                    clock[r] = max([clock[r]] + [posted[other] for _, other in keys]) + transfer_time
                if step.op is not None:
                    t = op_time(r, step.op.kind, step.op.chunk)
                    clock[r] += t
                    busy[r] += t
                position[r] += 1
                progress = True
        if not progress:
            raise RuntimeError("pipeline plans deadlock in the replay")
    span = max(clock)
    return PipelineRun(tuple(clock), tuple(busy), span)


@lru_cache(maxsize=512)
def _plans(schedule, pp: int, vpp: int, m: int) -> list[list[Step]]:
    return schedule.plans(pp, vpp, m)


def estimate(schedule, pp: int, vpp: int, m: int, op_time: OpTime, transfer_time: float) -> PipelineRun:
    """A closed form for ranking many layouts: the fill and drain pass once through every stage (chunk-sized
    with interleaving), the steady state runs at the pace of the slowest rank; zero bubble fills the drain
    with the deferred W passes. Every rank is taken to end with the span."""
    split = schedule.splits_backward
    per_rank, fill = [], 0.0
    for r in range(pp):
        chunks = [(op_time(r, "F", c), op_time(r, "B", c), op_time(r, "W", c) if split else 0.0) for c in range(vpp)]
        total = sum(f + b + w for f, b, w in chunks) + 2 * vpp * transfer_time
        per_rank.append(total)
        fill += (total - sum(w for _, _, w in chunks)) / vpp
    # every micro-batch passes the slowest rank once, plus the fill and drain of one chunk per other stage
    # (vpp 1: (m + pp - 1) stage times; interleaved: m + (pp - 1) / vpp)
    span = m * max(per_rank) + fill - max(per_rank) / vpp
    return PipelineRun(tuple(span for _ in range(pp)), tuple(m * t for t in per_rank), span)


def run_schedule(schedule, pp: int, vpp: int, m: int, op_time: OpTime, transfer_time: float) -> PipelineRun:
    """Replay ``schedule`` for ``m`` micro-batches; beyond a few rounds, extend the steady state linearly."""
    if pp == 1:
        per = op_time(0, "F", 0) + op_time(0, "B", 0) + (op_time(0, "W", 0) if schedule.splits_backward else 0)
        return PipelineRun((m * per,), (m * per,), m * per)
    rounds = 2 * pp
    if m <= rounds + pp:
        return replay(_plans(schedule, pp, vpp, m), pp, op_time, transfer_time)
    a = replay(_plans(schedule, pp, vpp, rounds), pp, op_time, transfer_time)
    b = replay(_plans(schedule, pp, vpp, rounds + pp), pp, op_time, transfer_time)
    k = (m - rounds) / pp
    grow = lambda x, y: x + k * (y - x)  # noqa: E731
    return PipelineRun(
        tuple(grow(x, y) for x, y in zip(a.ends, b.ends, strict=True)),
        tuple(grow(x, y) for x, y in zip(a.busy, b.busy, strict=True)),
        grow(a.span, b.span),
    )
