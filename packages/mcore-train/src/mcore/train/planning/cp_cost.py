"""Context parallelism's communication and memory per layer and micro-batch, by ``cp_comm_type``, as mcore runs it.

The terms are those of ``docs/context_parallel.md`` ("Cost terms (for mcore-train plan)"), per rank, with ``t``
this rank's tokens (``micro_batch x seq / cp``), ``KV = t x Hkv x (D + Dv) x e`` this rank's K and V and ``QKVO``
its Q, K, V and attention output (``Hq = heads / tp``, ``Hkv = kv_heads / tp``; MLA exchanges its up-projected
K and V: ``Hkv = Hq``, ``D`` the q/k head dim with the rope part):

- ``p2p`` (ring of ``cp``): forward ``cp - 1`` transfers of ``KV``, each under the attention block of the step
  before; backward ``cp - 1`` transfers of ``KV`` and ``cp`` of the fp32 dK/dV accumulators (``2 KV``), also under
  the blocks. Holds one block in flight (transient);
- ``all_gather``: all-gather of K and V in forward, reduce-scatter of dK and dV in backward, blocking; keeps the
  gathered ``(cp - 1) x KV`` for the backward;
- ``a2a`` (Ulysses): all-to-all of Q, K, V (sequence to heads) and of the output (heads to sequence), forward and
  backward, blocking;
- ``a2a+p2p``: the a2a terms inside groups of ``A = cp_a2a_size`` consecutive CP ranks, then the p2p ring over the
  ``cp / A`` groups on the same ``KV`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.train.planning.cluster import Group, Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.shape import ModelShape


@dataclass(frozen=True)
class CPCost:
    """Seconds of one layer's CP communication on one micro-batch: what attention can hide (``ring_*``, the p2p
    transfers) and what blocks (``blocking_*``)."""

    ring_forward: float = 0.0
    ring_backward: float = 0.0
    blocking_forward: float = 0.0
    blocking_backward: float = 0.0


def kv_and_qkvo_bytes(shape: ModelShape, layout: Layout, dtype_bytes: int) -> tuple[float, float]:
    """(``KV``, ``QKVO``) bytes of one layer on one rank (module docstring)."""
    tokens = layout.seq_length * layout.micro_batch / layout.cp
    hq = shape.heads / layout.tp
    if shape.is_mla:
        hkv, d, dv = hq, shape.head_dim + shape.qk_rope_head_dim, shape.v_head_dim
    else:
        hkv, d, dv = shape.kv_heads / layout.tp, shape.head_dim, shape.head_dim
    kv = tokens * hkv * (d + dv) * dtype_bytes
    qkvo = tokens * (hq * d + hkv * d + hkv * dv + hq * dv) * dtype_bytes
    return kv, qkvo


def cp_cost(shape: ModelShape, layout: Layout, network: Network, dtype_bytes: int) -> CPCost:
    """The layer's CP communication (zero at cp = 1)."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return CPCost()
    kv, qkvo = kv_and_qkvo_bytes(shape, layout, dtype_bytes)
    per_node = network.cluster.gpus_per_node
    kind = layout.cp_comm_type
    if kind == "all_gather":
        group = Group(cp, tp)
        return CPCost(
            blocking_forward=network.collective("all_gather", group, cp * kv),
            blocking_backward=network.collective("reduce_scatter", group, cp * kv),
        )
    a2a_size = cp if kind == "a2a" else (layout.cp_a2a_size or 1) if kind == "a2a+p2p" else 1
    blocking = network.collective("all_to_all", Group(a2a_size, tp), qkvo) if a2a_size > 1 else 0.0
    ring = cp // a2a_size
    if ring == 1:
        return CPCost(blocking_forward=blocking, blocking_backward=blocking)
    members = Group(ring, tp * a2a_size)
    crosses = members.size > members.per_node(per_node)
    one, grad = network.p2p(kv, crosses), network.p2p(2 * kv, crosses)
    return CPCost(
        ring_forward=(ring - 1) * one,
        ring_backward=(ring - 1) * one + ring * grad,
        blocking_forward=blocking,
        blocking_backward=blocking,
    )


def cp_held_bytes(shape: ModelShape, layout: Layout, dtype_bytes: int) -> float:
    """Extra bytes a layer keeps for backward per micro-batch: the gathered K/V of ``all_gather``."""
    if layout.cp == 1 or layout.cp_comm_type != "all_gather":
        return 0.0
    return (layout.cp - 1) * kv_and_qkvo_bytes(shape, layout, dtype_bytes)[0]
