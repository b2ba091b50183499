"""Tensor-parallel communication overlapped with GEMMs the way Transformer Engine's userbuffers do it.

Megatron-Core's ``--tp-comm-overlap`` hands each sequence-parallel collective to Transformer Engine, which hides it
behind the GEMM next to it by splitting that GEMM (read in TE ``transformer_engine/pytorch/module/base.py``,
``initialize_ub``, at the release paired with Megatron-Core r0.8.0, July 2024, with no ``--tp-comm-overlap-cfg``):

- **ring exchange** (``qkv_fprop``, ``fc1_fprop``, ``proj_dgrad``, ``fc2_dgrad``): the all-gather of the input
  (forward) or of the output gradient (backward) becomes ``tp - 1`` point-to-point copies on the copy engines;
  the GEMM runs as ``tp`` chunks of ``tokens / tp`` rows, chunk ``i`` on the shard that arrived during chunk
  ``i - 1``. Cost: ``tp`` small GEMMs instead of one, and any copy slower than its chunk;
- **pipeline** (``proj_fprop``, ``fc2_fprop``): the GEMM runs as ``num_splits = 4`` chunks of rows and the
  reduce-scatter of chunk ``i`` (a kernel on ``num_sm = 16`` SMs, no SM margin reserved for the GEMM) runs beside
  chunk ``i + 1``. Cost: 4 smaller GEMMs slowed by the SMs the reduce-scatter takes, and the last chunk's
  reduce-scatter after the GEMM;
- **bulk** (``qkv_dgrad``, ``fc1_dgrad`` with the all-gather of the saved input; ``qkv_wgrad``, ``fc1_wgrad`` with
  the reduce-scatter of the input gradient): one collective on 16 SMs beside one whole GEMM. Cost: the GEMM slowed
  by those SMs, and the collective's excess over it.

The block's entry linear (its first ``column`` linear, which consumes the gathered input) takes the ring exchange
in forward and the bulk overlaps in backward; its exit (the ``row`` linear) the pipelined reduce-scatter in forward
and the ring exchange in backward. Other column linears of a block (MLA's second projections) run plainly.
"""

from __future__ import annotations

from dataclasses import dataclass

TE_COMM_SMS = 16  # TE's default num_sm of the pipeline and bulk overlaps (initialize_ub)
TE_PIPELINE_SPLITS = 4  # TE's default num_splits of the pipeline overlap


@dataclass(frozen=True)
class OverlapPlan:
    """How one linear's three GEMMs run: row chunks and SM-sharing slowdown per GEMM, and which collective each
    hides (``"ring"``, ``"pipeline"``, ``"bulk"`` or ``""``)."""

    fwd_chunks: int = 1
    fwd_slowdown: float = 1.0
    fwd_comm: str = ""
    dgrad_chunks: int = 1
    dgrad_slowdown: float = 1.0
    dgrad_comm: str = ""
    wgrad_slowdown: float = 1.0
    wgrad_comm: str = ""


PLAIN = OverlapPlan()


def overlap_plans(roles: list[str], tp: int, sm_count: int) -> list[OverlapPlan]:
    """One :class:`OverlapPlan` per linear of a layer (``roles``: each linear's TP role, in layer order)."""
    slow = sm_count / (sm_count - TE_COMM_SMS)
    plans, entered = [], False
    for role in roles:
        if role == "column" and not entered:
            entered = True
            plans.append(OverlapPlan(tp, 1.0, "ring", 1, slow, "bulk", slow, "bulk"))
        elif role == "row":
            entered = False
            plans.append(OverlapPlan(TE_PIPELINE_SPLITS, slow, "pipeline", tp, 1.0, "ring"))
        else:
            plans.append(PLAIN)
    return plans


def exposed_seconds(kind: str, gemm_s: float, chunks: int, collective_s: float, shard_copy_s: float) -> float:
    """Seconds of a collective left exposed beside a GEMM of ``gemm_s`` (all its chunks) under ``kind``:
    ring: each of the ``tp - 1`` copies beyond its chunk's GEMM; pipeline: the last chunk's share of the
    reduce-scatter; bulk: the collective beyond the GEMM."""
    if kind == "ring":
        return (chunks - 1) * max(0.0, shard_copy_s - gemm_s / chunks)
    if kind == "pipeline":
        return collective_s / chunks
    if kind == "bulk":
        return max(0.0, collective_s - gemm_s)
    return 0.0
