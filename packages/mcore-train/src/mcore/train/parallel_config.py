"""The ``parallel`` section of the ``mcore-train`` configuration: how the model and the batch are split over ranks.

Kept apart from ``config.py`` because it grows with every parallelism (TP, PP, DP, FSDP, EP, CP) and carries
their cross-checks; ``config.py`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore.train.config_checks import positive as _positive

__all__ = ["PIPELINE_LAYOUTS", "ParallelSection"]

PIPELINE_LAYOUTS = ("even", "balanced")


@dataclass
class ParallelSection:
    """How the model and the batch are split over ranks (sizes multiply to the world size).

    ``dp`` is derived from the world size when ``None``. ``schedule`` picks the pipeline schedule
    (``auto``: 1F1B, interleaved when ``vpp > 1``, none when ``pp == 1``). ``gradient_accumulation_fusion``:
    the linear layers' weight-gradient GEMMs accumulate into the fp32 gradient buffer directly (no bf16 weight
    gradient, no extra add pass); turn it off only to compare. ``overlap_param_gather`` (with the distributed
    optimizer): the all-gather of the updated parameters runs behind the next forward, each layer waiting for
    its own bucket. ``dp_shard`` (ZeRO-3, on torch's FSDP2): parameters, gradients and optimizer states sharded
    over the data-parallel ranks, each layer all-gathered for its forward and backward (in the compute precision;
    the fp32 shards are the master weights), and resharded after its forward when ``dp_shard_reshard_after_forward``
    (off: keep the gathered layers from forward to backward, more memory, one all-gather fewer).
    ``pipeline_layout``: ``even`` (the same number of layers per virtual stage), ``balanced`` (fewer layers on the
    stage that also runs the output layer and the loss, by their FLOPs: see
    ``mcore.parallel.pipeline.balanced_layout``) or a list of layers per virtual stage.
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int | None = None
    sequence_parallel: bool = False
    schedule: Literal["auto", "gpipe", "1f1b", "interleaved", "zero-bubble"] = "auto"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    bucket_size: int = 40_000_000
    gradient_accumulation_fusion: bool = True
    pipeline_layout: str | list[int] = "even"
    dp_shard: bool = False
    dp_shard_reshard_after_forward: bool = True
    # Expert parallelism (MoE models): experts split over ep ranks, each expert's FFN over etp (default: tp).
    # Attention keeps tp x cp x dp while experts use etp x ep x edp over the same ranks (parallel folding).
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "bucket_size", "ep"):
            _positive("parallel", name, getattr(self, name))
        if self.etp is not None:
            _positive("parallel", "etp", self.etp)
        if self.dp is not None:
            _positive("parallel", "dp", self.dp)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs tp > 1 (it splits the sequence over TP ranks)")
        if self.schedule == "interleaved" and self.vpp == 1:
            raise ValueError("parallel.schedule=interleaved needs parallel.vpp > 1 (virtual stages per rank)")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"parallel.vpp={self.vpp} needs pp > 1")
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError(
                "parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true (only the distributed "
                "optimizer all-gathers the updated parameters)"
            )
        if self.dp_shard:
            self._check_dp_shard()
        layout = self.pipeline_layout
        if isinstance(layout, str):
            if layout not in PIPELINE_LAYOUTS:
                raise ValueError(
                    f"parallel.pipeline_layout must be one of {list(PIPELINE_LAYOUTS)} or a list of layers per "
                    f"virtual stage, got {layout!r}"
                )
        elif any(n < 0 for n in layout):
            raise ValueError(f"parallel.pipeline_layout {layout}: layer counts must be >= 0")
        elif len(layout) != self.pp * self.vpp:
            raise ValueError(
                f"parallel.pipeline_layout {layout} has {len(layout)} entries; pp*vpp = {self.pp}*{self.vpp} = "
                f"{self.pp * self.vpp} virtual stages need one each (entry c*pp+r: layers of chunk c of rank r)"
            )

    def _check_dp_shard(self) -> None:
        if self.distributed_optimizer:
            raise ValueError(
                "parallel.dp_shard=true shards the optimizer states itself (ZeRO-3); drop "
                "parallel.distributed_optimizer=true (ZeRO-1), they are alternatives"
            )
        if self.schedule == "zero-bubble":
            raise ValueError(
                "parallel.dp_shard=true cannot run parallel.schedule=zero-bubble: its deferred weight gradients arrive "
                "after FSDP has reduce-scattered the layer's gradients; use 1f1b or interleaved"
            )

    def world_size(self) -> int | None:
        """tp * pp * dp, or ``None`` while dp is still to be derived."""
        return None if self.dp is None else self.tp * self.pp * self.dp
