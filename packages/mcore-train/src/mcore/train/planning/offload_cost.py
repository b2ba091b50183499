"""What host offload costs a step: activation offload (``train.activation_offload``) and optimizer offload
(``optim.offload_fraction``), each as mcore's code runs it.

Activation offload (``mcore.parallel.activation_offload``): while an offloaded part of a layer runs forward, what
it saves for backward is copied device-to-host on one side stream (the compute stream never waits for it); in
backward the first layer asked for is brought back, and each layer's fetch starts the previous layer's, on the same
side stream, so that it runs under this layer's backward. ``activation_offload_seconds`` replays that one copy
stream (first in, first out, PCIe at ``pcie_gbps`` each way) against the layers' forward and backward times.

Optimizer offload (``mcore.parallel.offload``): the optimizer's pieces (parameters in bucket order, the last layers
first) are taken while that brings the offloaded share closer to the fraction (``offloaded_pieces`` replays that
choice); their fp32 gradients go to the host behind each bucket's collective, under the rest of the last
micro-batch's backward; at the step the device part is updated on the GPU while the CPU updates the host part in
chunks of 32 Mi elements, each chunk's masters going back (fp32) under the next chunk's update, so only the last
chunk's copy is exposed.
"""

from __future__ import annotations

from collections.abc import Sequence

from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import layer_parameters_per_rank
from mcore.train.planning.shape import ModelShape

HOST_CHUNK_ELEMENTS = 32 * 2**20  # mcore.parallel.offload._CHUNK_ELEMENTS


def activation_offload_seconds(
    forward: Sequence[float], backward: Sequence[float], nbytes: Sequence[float], gap: float, pcie_gbps: float
) -> float:
    """Seconds one micro-batch's backward of a chunk ends later with activation offload: its layers' forward and
    backward seconds and offloaded bytes in forward order, ``gap`` the seconds between the last layer's forward and
    its backward (the output layer and loss, or the rest of the pipeline)."""
    rate = pcie_gbps * 1e9
    copy_free = clock = 0.0
    for f, b in zip(forward, nbytes, strict=True):  # device-to-host behind each layer's forward
        start = max(copy_free, clock)
        clock += f
        copy_free = max(start + b / rate, clock)  # a copy cannot finish before its tensors are written
    begin = clock + gap
    plain_end = begin + sum(backward)
    layers = list(range(len(forward)))[::-1]
    ready: dict[int, float] = {}

    def fetch(i: int, asked: float) -> None:
        nonlocal copy_free
        if i >= 0 and i not in ready:
            copy_free = max(copy_free, asked) + nbytes[i] / rate
            ready[i] = copy_free

    clock = begin
    for i in layers:  # each layer's first saved tensor brings it back (if not prefetched) and starts the previous
        fetch(i, clock)
        fetch(i - 1, clock)
        clock = max(clock, ready[i]) + backward[i]
    return max(0.0, clock - plain_end)


def offloaded_pieces(shape: ModelShape, layout: Layout, rank: int, chunks, shards: float) -> list[float]:
    """The optimizer pieces (elements) ``HostOffload`` puts on the host for pipeline rank ``rank``: its parameters
    in bucket order (reverse forward order), each divided by ``shards`` (the distributed optimizer's dp x cp), taken
    while the share of elements moves closer to ``layout.optimizer_offload_fraction``."""
    pieces: list[float] = []
    vocab = shape.padded_vocab(layout.tp) * shape.hidden / layout.tp
    last, first = rank == layout.pp - 1, rank == 0
    if last and (not shape.tied or layout.pp > 1):
        pieces.append(vocab)
    if last:
        pieces.append(shape.norm_params())
    for start, end in reversed(chunks):
        for i in range(end - 1, start - 1, -1):
            dense, expert = layer_parameters_per_rank(shape, i, layout)
            linears = shape.layer_linears(i)
            per_linear = [lin.weights / (1 if lin.role == "replicated" else layout.tp) for lin in linears]
            pieces += [expert] if expert else []
            pieces += per_linear[::-1] + [dense - sum(per_linear)]
    if first:
        pieces.append(vocab)
    pieces = [p / shards for p in pieces if p > 0]
    budget, taken, chosen = layout.optimizer_offload_fraction * sum(pieces), 0.0, []
    for size in pieces:
        if taken + size / 2 > budget:
            break
        chosen.append(size)
        taken += size
    return chosen


def last_host_chunk(pieces: Sequence[float]) -> float:
    """Elements of the last chunk the host updates (pieces grouped until a group reaches 32 Mi elements): the one
    whose copy back to the GPU nothing hides."""
    last, size = 0.0, 0.0
    for p in pieces:
        size += p
        if size >= HOST_CHUNK_ELEMENTS:
            last, size = size, 0.0
    return size or last


def optimizer_offload_seconds(
    pieces: Sequence[float], last_backward: float, device_step: float, cpu_gparams_per_s: float, pcie_gbps: float
) -> float:
    """Seconds the step ends later than the device part of the update (``device_step``) with ``pieces`` offloaded:
    the gradient copies that ``last_backward`` does not hide, the CPU update, the last chunk's copy back."""
    elements = sum(pieces)
    if not elements:
        return 0.0
    rate = pcie_gbps * 1e9
    down = max(0.0, 4 * elements / rate - last_backward)
    host = elements / (cpu_gparams_per_s * 1e9) + 4 * last_host_chunk(pieces) / rate
    return max(0.0, down + host - device_step)
