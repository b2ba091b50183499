"""Dynamic context parallelism: per global batch, each sequence gets the CP size its length needs.

Static CP splits every sequence over the same ``cp`` ranks, sized for the longest one; with real data
(mostly short documents, a long tail) the rows dealt to the data-parallel groups then carry very different
attention work (it grows with the square of each document's length), and short documents pay ring
communication for nothing. Here each sequence of length ``L`` gets the smallest power-of-two CP size ``c``
with ``L / c <= tokens_per_rank`` (short ones whole on one rank, long ones over just enough ranks), and the
sequences are placed, heaviest first, on the aligned group of ``c`` ranks whose busiest member would finish
first (longest-processing-time greedy, token capacity respected while possible). The attention of every
sequence is computed exactly (the CP attention of its group), so the losses are those of static CP.

Work is predicted per rank as attention time (the issue's FLOP count over a measured rate that depends on
the document length) plus the linear layers' time (proportional to tokens).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one training step's work on one rank.

    ``attention_rates``: ``(document length, fwd+bwd TFLOP/s)`` points, interpolated in log(length);
    ``linear_tflops``: rate of the token-proportional work; ``linear_flops_per_token``: its FLOPs per token
    (6 x parameters for a dense model); ``heads``, ``head_dim``, ``layers`` size the attention FLOPs;
    ``ring_step_seconds``: what one ring step costs beyond its block (P2P latency, launches, the merge) per
    layer and pass (forward, backward counted twice); assumed 30 us, the order of an NVLink P2P round trip
    plus a kernel launch, not measured here.
    """

    attention_rates: tuple[tuple[int, float], ...]
    heads: int
    head_dim: int
    layers: int
    linear_flops_per_token: float
    linear_tflops: float
    ring_step_seconds: float = 30e-6

    def attention_flops(self, length: int) -> float:
        """fwd+bwd FLOPs of one causal document: 3.5 x 4 * L^2 / 2 * H * D per layer (issue #18's count)."""
        return 3.5 * 4.0 * length * length / 2 * self.heads * self.head_dim * self.layers

    def attention_rate(self, length: int) -> float:
        """TFLOP/s at a document length, log-linear between the measured points, flat outside them."""
        points = sorted(self.attention_rates)
        xs = [math.log(p[0]) for p in points]
        x = math.log(max(length, 1))
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return points[i - 1][1] + t * (points[i][1] - points[i - 1][1])

    def seconds(self, length: int, cp: int) -> tuple[float, float]:
        """(attention seconds, linear seconds) each of ``cp`` ranks spends on a document of ``length`` tokens;
        the kernel runs at the rate of the per-rank piece (``length / cp`` queries)."""
        attention = self.attention_flops(length) / cp / (self.attention_rate(length // cp) * 1e12)
        linear = self.linear_flops_per_token * length / cp / (self.linear_tflops * 1e12)
        ring = (cp - 1) * 3 * self.layers * self.ring_step_seconds
        return attention + ring, linear


@dataclasses.dataclass
class Placement:
    """Where a plan puts each sequence: ``groups[i] = (first rank, CP size)``; per-rank predicted loads."""

    groups: list[tuple[int, int]]
    attention_flops: list[float]
    seconds: list[float]
    tokens: list[int]

    def imbalance(self) -> float:
        """max / mean of the per-rank attention FLOPs."""
        mean = sum(self.attention_flops) / len(self.attention_flops)
        return max(self.attention_flops) / mean if mean else 1.0

    def step_seconds(self) -> float:
        return max(self.seconds)


def _cp_size(length: int, tokens_per_rank: int, world: int) -> int:
    size = 1
    while size * tokens_per_rank < length:
        size *= 2
    if size > world:
        raise ValueError(
            f"dynamic CP: a {length}-token sequence needs {size} ranks of {tokens_per_rank} tokens, but the world "
            f"has {world}; raise tokens_per_rank or the number of ranks"
        )
    return size


def _empty(world: int) -> Placement:
    return Placement([], [0.0] * world, [0.0] * world, [0] * world)


def _add(placement: Placement, first: int, size: int, length: int, model: CostModel) -> None:
    attention, linear = model.seconds(length, size)
    for rank in range(first, first + size):
        placement.attention_flops[rank] += model.attention_flops(length) / size
        placement.seconds[rank] += attention + linear
        placement.tokens[rank] += length // size


def plan_dynamic(lengths: list[int], world: int, tokens_per_rank: int, model: CostModel) -> Placement:
    """CP sizes by length, then heaviest first onto the aligned group that finishes first.

    A sequence gets the smallest power-of-two size that fits its tokens, doubled while its per-rank share
    still exceeds the mean per-rank load (a quadratic-cost document alone must not outweigh a rank's
    fair share; spreading further only adds ring steps and smaller, slower kernels). Placement is the
    longest-processing-time greedy over aligned groups of that size, token capacity first.
    """
    sizes = [_cp_size(n, tokens_per_rank, world) for n in lengths]
    mean_load = sum(sum(model.seconds(n, c)) * c for n, c in zip(lengths, sizes)) / world
    for i, n in enumerate(lengths):
        while sizes[i] < world and n % (4 * sizes[i]) == 0 and sum(model.seconds(n, sizes[i])) > mean_load:
            sizes[i] *= 2
        if sizes[i] > 1 and n % (2 * sizes[i]):
            raise ValueError(f"dynamic CP: a {n}-token sequence is not a multiple of 2 * cp = {2 * sizes[i]}; pad it")
    placement = _empty(world)
    placement.groups = [(0, 0)] * len(lengths)
    shares = [sum(model.seconds(n, c)) for n, c in zip(lengths, sizes)]
    for i in sorted(range(len(lengths)), key=lambda i: -shares[i]):
        n, size = lengths[i], sizes[i]
        best = None
        for first in range(0, world, size):
            members = range(first, first + size)
            fits = all(placement.tokens[r] + n // size <= tokens_per_rank for r in members)
            key = (not fits, max(placement.seconds[r] for r in members) + shares[i], first)
            best = key if best is None or key < best else best
        placement.groups[i] = (best[2], size)
        _add(placement, best[2], size, n, model)
    return placement


def plan_static(lengths: list[int], world: int, cp: int, tokens_per_rank: int, model: CostModel) -> Placement:
    """Static CP ``cp``: documents packed in order into rows of ``cp * tokens_per_rank`` tokens (a document that
    does not fit starts the next row), rows dealt round-robin to the ``world / cp`` data-parallel groups."""
    if world % cp:
        raise ValueError(f"static CP: cp={cp} must divide the world ({world})")
    placement = _empty(world)
    row_capacity = cp * tokens_per_rank
    row, used = 0, 0
    for length in lengths:
        if length > row_capacity:
            raise ValueError(f"static CP: a {length}-token document exceeds a row of {row_capacity} tokens")
        if used + length > row_capacity:
            row, used = row + 1, 0
        used += length
        first = (row % (world // cp)) * cp
        placement.groups.append((first, cp))
        _add(placement, first, cp, length, model)
    return placement


def aligned_groups(world: int) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A process group for every aligned power-of-two block of ranks (``(first, size)`` with size >= 2);
    every rank must call this (``new_group`` is collective)."""
    groups = {}
    size = 2
    while size <= world:
        for first in range(0, world, size):
            groups[(first, size)] = dist.new_group(list(range(first, first + size)))
        size *= 2
    return groups


def local_sequences(placement: Placement, rank: int) -> list[tuple[int, int, int, int]]:
    """``(sequence index, first rank, CP size, CP rank)`` of every sequence ``rank`` works on, in the global
    order every rank follows (so the collectives of overlapping groups are issued in the same order)."""
    return [
        (i, first, size, rank - first)
        for i, (first, size) in enumerate(placement.groups)
        if first <= rank < first + size
    ]
