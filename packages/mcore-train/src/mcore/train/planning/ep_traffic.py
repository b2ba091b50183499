"""Expert-parallel all-to-all bytes per GPU and step, per pipeline rank (what ``mcore-train plan`` prints).

An MoE layer exchanges its routed rows twice in forward (dispatch to the experts' ranks, combine back) and twice in
backward (the gradients of both); recomputing the layer (``train.recompute=full`` or ``recompute_modules`` with
``moe``) runs its forward exchanges again. One exchange's buffer is this rank's routed rows, ``tokens x top_k x
hidden`` values in the compute dtype with ``tokens`` the rank's tokens entering the MoE layer (its sequence-parallel
slice gathered over expert-TP, as ``time_model.TimeModel.ep_exchange_bytes`` prices it); ``(ep - 1) / ep`` of it
leaves the GPU. Every pipeline rank runs each micro-batch through its MoE layers (MTP depths on the last rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import rank_chunks
from mcore.train.planning.recompute_terms import layout_recomputes
from mcore.train.planning.shape import ModelShape


@dataclass(frozen=True)
class EPTraffic:
    """One pipeline rank's all-to-all bytes per step (each field: the sum of the exchanges' buffers)."""

    pp_rank: int
    ep: int
    moe_layers: int
    microbatches: int
    exchange_bytes: float  # one exchange of one layer and micro-batch
    dispatch_forward: float
    combine_forward: float
    backward: float  # the gradients of dispatch and combine
    recompute: float  # forward exchanges run again in backward

    @property
    def total(self) -> float:
        return self.dispatch_forward + self.combine_forward + self.backward + self.recompute

    @property
    def off_gpu(self) -> float:
        return self.total * (self.ep - 1) / self.ep


def moe_layers_per_rank(shape: ModelShape, layout: Layout) -> list[int]:
    """MoE layers each pipeline rank runs (its chunks' layers; the MTP depths on the last rank)."""
    out = []
    for rank, chunks in enumerate(rank_chunks(shape, layout)):
        n = sum(1 for start, end in chunks for i in range(start, end) if shape.is_moe_layer(i))
        if rank == layout.pp - 1 and shape.mtp_layers and shape.is_moe_layer(shape.layers - 1):
            n += shape.mtp_layers  # each depth runs a layer like the last
        out.append(n)
    return out


def ep_traffic(shape: ModelShape, layout: Layout, microbatches: int) -> tuple[EPTraffic, ...]:
    """Per pipeline rank, for ``microbatches`` micro-batches per step; empty without all-to-alls (no MoE, ep 1)."""
    if layout.ep == 1 or not shape.num_experts:
        return ()
    dtype = 4 if layout.precision == "fp32" else 2
    tokens = layout.seq_length * layout.micro_batch / layout.cp * layout.expert_tp / layout.tp
    one = tokens * shape.top_k * shape.hidden * dtype
    again = layout.recompute == "full" or layout_recomputes(layout, "moe")
    out = []
    for rank, layers in enumerate(moe_layers_per_rank(shape, layout)):
        per = layers * microbatches * one
        out.append(EPTraffic(rank, layout.ep, layers, microbatches, one, per, per, 2 * per, 2 * per if again else 0.0))
    return tuple(out)
