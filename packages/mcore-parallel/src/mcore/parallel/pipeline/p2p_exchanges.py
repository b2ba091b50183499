"""The point-to-point traffic of a pipeline, derived from the ranks' op orders, and an independent check of it.

A forward of virtual stage ``s`` receives its input activation from stage ``s - 1`` and sends its output to
``s + 1``; a backward receives the output gradient from ``s + 1`` and sends the input gradient to ``s - 1``;
weight-gradient passes communicate nothing. NCCL matches the sends and receives between two ranks in posting
order and a send only completes once the receive is posted (gloo may buffer, which is never less safe), so a
careless ordering deadlocks: rank A blocks sending to B while B blocks sending to A. :func:`pipeline_plans`
therefore groups transfers into lock-step exchanges that both ends post at the same point of their plan, and
:func:`replay_plans` replays all ranks' plans under those strict rules, failing on a deadlock or on a message
landing in the wrong receive, and timing every op as the ranks would run it. Every schedule runs through the
same plan builder, so one argument (and one test over many sizes) covers them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, WEIGHT, Op
from mcore.parallel.pipeline.timeline import StageTimeline, TimedOp

__all__ = ["ACTIVATION", "GRADIENT", "Message", "Step", "pipeline_plans", "replay_plans"]

ACTIVATION = "activation"
GRADIENT = "gradient"


@dataclass(frozen=True)
class Message:
    """One half of a point-to-point transfer, seen from the rank that posts it.

    ``chunk`` is this rank's model chunk that produces (send) or consumes (receive) the tensor.
    """

    send: bool
    peer: str  # "prev" or "next"
    kind: str  # ACTIVATION or GRADIENT
    chunk: int
    microbatch: int


@dataclass(frozen=True)
class Step:
    """One batched exchange (waited for; may be empty), then ``op`` (``None`` for an exchange alone)."""

    messages: tuple[Message, ...]
    op: Op | None


def _produced(op: Op, stage: int, last_stage: int) -> list[Message]:
    if op.kind == FORWARD and stage < last_stage:
        return [Message(True, "next", ACTIVATION, op.chunk, op.microbatch)]
    if op.kind == BACKWARD and stage > 0:
        return [Message(True, "prev", GRADIENT, op.chunk, op.microbatch)]
    return []


def _needed(op: Op, stage: int, last_stage: int) -> list[Message]:
    if op.kind == FORWARD and stage > 0:
        return [Message(False, "prev", ACTIVATION, op.chunk, op.microbatch)]
    if op.kind == BACKWARD and stage < last_stage:
        return [Message(False, "next", GRADIENT, op.chunk, op.microbatch)]
    return []


def _posting_order(msg: Message) -> tuple[int, int]:
    """Sends to next, sends to prev, receives from prev, receives from next: the order ``PipelineP2P`` posts them.
    A send to ``next`` meets its peer's receive from ``prev``, so with two stages (prev == next) both ends of a
    pair agree on the order of two messages in one exchange."""
    if msg.send:
        return (0, 0 if msg.peer == "next" else 1)
    return (1, 0 if msg.peer == "prev" else 1)


def pipeline_plans(ticks: Sequence[Sequence[Sequence[Op]]], pp: int, vpp: int = 1) -> list[list[Step]]:
    """Every rank's steps, given ``ticks[rank]``: the rank's ops in order, in groups that share one exchange.

    Ticks are a lock-step clock: at each tick every rank runs its next group of ops if all their inputs arrived
    in an earlier tick, and after the tick every rank does one exchange holding the tensors produced in that tick
    and the ones its neighbours produced for it. Both halves of every transfer are thus in the same-numbered
    exchange of the two ranks, so no rank can wait on a neighbour that waits on something later: the plan cannot
    deadlock however long each op really takes. Ticks where a rank neither runs ops nor exchanges anything are
    dropped from its plan. Raises ``RuntimeError`` if the groups can never all run (an invalid op order).
    """
    if len(ticks) != pp:
        raise ValueError(f"need the op groups of every pipeline rank: got {len(ticks)} for pp={pp}")
    last_stage = pp * vpp - 1
    position = [0] * pp
    arrived: set[tuple] = set()
    plans: list[list[Step]] = [[] for _ in range(pp)]
    before: list[list[Message]] = [[] for _ in range(pp)]  # exchange of the previous tick, done before the ops
    while any(position[r] < len(ticks[r]) for r in range(pp)):
        ran: list[Sequence[Op] | None] = [None] * pp
        sent: list[tuple[int, Message]] = []
        for r in range(pp):
            if position[r] >= len(ticks[r]):
                continue
            group = ticks[r][position[r]]
            needed = [_transfer_id(r, pp, m) for op in group for m in _needed(op, op.chunk * pp + r, last_stage)]
            if all(tid in arrived for tid in needed):
                ran[r] = group
                position[r] += 1
                sent += [(r, m) for op in group for m in _produced(op, op.chunk * pp + r, last_stage)]
        if all(group is None for group in ran):
            stuck = {r: ticks[r][position[r]] for r in range(pp) if position[r] < len(ticks[r])}
            raise RuntimeError(f"op orders deadlock: every remaining op waits for an input that is never sent: {stuck}")
        for r in range(pp):
            exchange = tuple(sorted(before[r], key=_posting_order))
            if ran[r]:
                plans[r].append(Step(exchange, ran[r][0]))
                plans[r] += [Step((), op) for op in ran[r][1:]]
            elif exchange:
                plans[r].append(Step(exchange, None))
        before = [[] for _ in range(pp)]
        for r, msg in sent:
            tid = _transfer_id(r, pp, msg)
            arrived.add(tid)
            dst_stage = tid[3] + 1 if msg.kind == ACTIVATION else tid[3] - 1
            side = "prev" if msg.kind == ACTIVATION else "next"
            before[r].append(msg)
            before[tid[1]].append(Message(False, side, msg.kind, dst_stage // pp, msg.microbatch))
    for r in range(pp):
        if before[r]:
            plans[r].append(Step(tuple(sorted(before[r], key=_posting_order)), None))
    return plans


def _transfer_id(rank: int, pp: int, msg: Message) -> tuple[int, int, str, int, int]:
    """(src rank, dst rank, kind, src virtual stage, microbatch): the same value at both ends of a transfer."""
    stage = msg.chunk * pp + rank
    if msg.send:
        other = stage + 1 if msg.kind == ACTIVATION else stage - 1
        return (rank, other % pp, msg.kind, stage, msg.microbatch)
    other = stage - 1 if msg.kind == ACTIVATION else stage + 1
    return (other % pp, rank, msg.kind, other, msg.microbatch)


def replay_plans(
    plans: Sequence[Sequence[Step]],
    pp: int,
    *,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    weight_time: float = 1.0,
) -> list[StageTimeline]:
    """Run all ranks' plans on a clock with NCCL's rules; return each rank's timeline.

    Between two ranks, messages are matched first-posted to first-posted in each direction, and an exchange
    completes when every message in it is matched, at the latest time any of the two ends posted it (free,
    instant transfers). Each op then takes its given time. Raises ``RuntimeError`` on a deadlock or on a message
    matched with a different one. All timelines share the span ``[0, end of the last op]``.
    """
    if len(plans) != pp:
        raise ValueError(f"need one plan per pipeline rank: got {len(plans)} plans for pp={pp}")
    cost = {FORWARD: forward_time, BACKWARD: backward_time, WEIGHT: weight_time}
    # Per directed pair: the (transfer id, time posted) of every send / receive, in posting order.
    sends: dict[tuple[int, int], list[tuple[tuple, float]]] = {}
    recvs: dict[tuple[int, int], list[tuple[tuple, float]]] = {}
    position = [0] * pp
    clock = [0.0] * pp
    timelines = [StageTimeline(pp_rank=r) for r in range(pp)]
    posted: list[list[tuple[list, int, tuple]] | None] = [None] * pp  # per rank: the counterparts it waits for
    while True:
        progress = False
        for rank in range(pp):
            if position[rank] >= len(plans[rank]):
                continue
            step = plans[rank][position[rank]]
            if posted[rank] is None:
                entries = []
                for msg in step.messages:
                    tid = _transfer_id(rank, pp, msg)
                    own, other = (sends, recvs) if msg.send else (recvs, sends)
                    mine = own.setdefault(tid[:2], [])
                    mine.append((tid, clock[rank]))
                    entries.append((other.setdefault(tid[:2], []), len(mine) - 1, tid))
                posted[rank] = entries
                progress = True
            entries = posted[rank]
            if not all(len(counterpart) > index for counterpart, index, _ in entries):
                continue
            for counterpart, index, tid in entries:
                if counterpart[index][0] != tid:
                    raise RuntimeError(
                        f"pipeline traffic mismatch on rank {rank} at step {position[rank]}: message {tid} is "
                        f"matched with {counterpart[index][0]}"
                    )
                clock[rank] = max(clock[rank], counterpart[index][1])
            if step.op is not None:
                start = clock[rank]
                clock[rank] += cost[step.op.kind]
                timelines[rank].ops.append(TimedOp(step.op, start, clock[rank]))
            position[rank] += 1
            posted[rank] = None
            progress = True
        if all(position[r] >= len(plans[r]) for r in range(pp)):
            break
        if not progress:
            stuck = {r: plans[r][position[r]] for r in range(pp) if position[r] < len(plans[r])}
            raise RuntimeError(f"pipeline deadlock: ranks wait forever at steps {stuck}")
    for key, lst in sends.items():
        if len(recvs.get(key, [])) != len(lst):
            received = len(recvs.get(key, []))
            raise RuntimeError(f"{len(lst)} sends but {received} receives from rank {key[0]} to {key[1]}")
    for key, lst in recvs.items():
        if key not in sends:
            raise RuntimeError(f"{len(lst)} receives from rank {key[0]} to {key[1]} are never sent")
    end = max(t.ops[-1].end if t.ops else 0.0 for t in timelines)
    for t in timelines:
        t.end = end
    return timelines
