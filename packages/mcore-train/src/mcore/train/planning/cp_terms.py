"""Context parallelism's cost terms per ``parallel.cp_comm_type``, as ``mcore.parallel.cp_attention`` runs them.

Per rank, decoder layer and micro-batch, for ``tokens`` = this rank's tokens (``micro_batch x seq_length / cp``;
with dynamic CP a document's ``n / c`` over its group of ``c``). ``KV`` is this rank's K and V in the activation
dtype; ``QKVO`` its Q, K, V and attention output. Bytes are those a rank sends (= receives), counted as the
collective algorithms move them: an all-gather of ``n`` shards sends ``(n - 1)`` shards, a reduce-scatter or an
all-to-all ``(n - 1) / n`` of its input.

- ``p2p``: forward ``(cp - 1) KV`` (each ring step's transfer posted before its block, so it hides behind it);
  backward ``(cp - 1) KV`` again plus ``cp`` hops of the dK/dV accumulators, which travel in fp32.
- ``all_gather``: forward ``(cp - 1) KV`` (K, V gathered), backward ``(cp - 1) KV`` (dK, dV reduce-scattered in the
  activation dtype); not overlapped. The gathered K/V stay for the backward: ``(cp - 1) KV`` more activations.
- ``a2a``: forward and backward ``(cp - 1) / cp QKVO`` each; not overlapped.
- ``a2a+p2p`` (``a2a`` groups of ``A``, rings of ``R = cp / A``): the a2a terms with ``A``, then the p2p terms
  with ``R`` on the same ``KV`` bytes (a ring member holds ``A x tokens`` tokens of ``heads / A``).

The tests count these bytes on the real collectives (``tests/train/test_planning_cp_terms.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.train.planning.shape import ModelShape

__all__ = ["CP_COMM_TYPES", "CPLayerTerms", "cp_layer_terms"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
_ACCUMULATOR_BYTES = 4  # the p2p backward's dK/dV accumulators are fp32


@dataclass(frozen=True)
class CPLayerTerms:
    """What CP adds to one layer's micro-batch on one rank: bytes sent in forward and backward, whether the
    transfers overlap the attention blocks, and activation bytes kept for the backward beyond the local tokens'."""

    forward_bytes: float
    backward_bytes: float
    overlapped: bool
    extra_activation_bytes: float


def cp_layer_terms(
    shape: ModelShape,
    *,
    tokens: float,
    tp: int,
    cp: int,
    comm_type: str = "p2p",
    a2a_size: int | None = None,
    dtype_bytes: int = 2,
) -> CPLayerTerms:
    """The terms above for ``shape`` at ``tp``; ``tokens`` per rank (``b x s / cp``). Full recompute runs the
    forward's transfers once more (add ``forward_bytes`` to the backward)."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_layer_terms: comm_type must be one of {CP_COMM_TYPES}, got {comm_type!r}")
    if cp == 1:
        return CPLayerTerms(0.0, 0.0, True, 0.0)
    v_dim = shape.v_head_dim or shape.head_dim
    hq, hkv = shape.heads / tp, shape.kv_heads / tp
    kv_elements = tokens * hkv * (shape.head_dim + v_dim)
    kv = kv_elements * dtype_bytes
    qkvo = tokens * (hq * shape.head_dim + hkv * shape.head_dim + hkv * v_dim + hq * v_dim) * dtype_bytes

    def ring(n: int) -> tuple[float, float]:
        return (n - 1) * kv, (n - 1) * kv + n * kv_elements * _ACCUMULATOR_BYTES

    if comm_type == "p2p":
        forward, backward = ring(cp)
        return CPLayerTerms(forward, backward, True, 0.0)
    if comm_type == "all_gather":
        return CPLayerTerms((cp - 1) * kv, (cp - 1) * kv, False, (cp - 1) * kv)
    if comm_type == "a2a":
        return CPLayerTerms((cp - 1) / cp * qkvo, (cp - 1) / cp * qkvo, False, 0.0)
    if a2a_size is None or a2a_size < 2 or cp % a2a_size:
        raise ValueError(f"cp_layer_terms: a2a+p2p needs an a2a_size dividing cp={cp}, got {a2a_size}")
    a2a = (a2a_size - 1) / a2a_size * qkvo
    forward, backward = ring(cp // a2a_size)
    return CPLayerTerms(a2a + forward, a2a + backward, False, 0.0)
