"""The ``parallel`` section of the ``mcore-train`` configuration: how the model and the batch are split over ranks.

Kept apart from ``config.py`` because it grows with every parallelism (TP, PP, DP, FSDP, EP, CP) and carries
their cross-checks; ``config.py`` re-exports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mcore.train.config_checks import positive as _positive

if TYPE_CHECKING:
    from mcore.models.config import TransformerConfig

__all__ = ["CP_COMM_TYPES", "CP_MIXERS", "PIPELINE_LAYOUTS", "ParallelSection", "check_context_parallel", "cp_granule"]

PIPELINE_LAYOUTS = ("even", "balanced")
# Megatron-Core's names (--cp-comm-type); the implementations are mcore.parallel.cp_attention's.
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# Token mixers whose attention runs over the CP group (mcore.models.layers.attention); the others see one shard.
CP_MIXERS = ("full_attention", "sliding_attention", "nope_attention", "none")


@dataclass
class ParallelSection:
    """How the model and the batch are split over ranks (sizes multiply to the world size).

    ``dp`` is derived from the world size when ``None``. ``schedule`` picks the pipeline schedule
    (``auto``: 1F1B, interleaved when ``vpp > 1``, none when ``pp == 1``). ``gradient_accumulation_fusion``:
    the linear layers' weight-gradient GEMMs accumulate into the fp32 gradient buffer directly (no bf16 weight
    gradient, no extra add pass; under ``dp_shard`` at dp=1 into the fp32 gradient shards); turn it off only to
    compare. ``overlap_param_gather`` (with the distributed
    optimizer): the all-gather of the updated parameters runs behind the next forward, each layer waiting for
    its own bucket. ``dp_shard`` (ZeRO-3, on torch's FSDP2): parameters, gradients and optimizer states sharded
    over the data-parallel ranks, each layer all-gathered for its forward and backward (in the compute precision;
    the fp32 shards are the master weights), and resharded after its forward when ``dp_shard_reshard_after_forward``
    (false: keep the gathered layers from forward to backward, more memory, one all-gather fewer; auto: true but
    for the last layer, false at dp=1, where a re-gather only repeats the fp32 -> bf16 cast). With gradient
    accumulation each micro-batch's gradients are reduce-scattered into the shards when
    ``dp_shard_reduce_every_microbatch`` (false: accumulated unsharded in fp32 and reduced once on the last
    micro-batch, more memory at dp > 1; auto: true, false at dp=1, where the layers also stay gathered between
    micro-batches).
    ``pipeline_layout``: ``even`` (the same number of layers per virtual stage), ``balanced`` (fewer layers on the
    stage that also runs the output layer and the loss, by their FLOPs: see
    ``mcore.parallel.pipeline.balanced_layout``) or a list of layers per virtual stage.

    ``cp`` (context parallelism): each sequence is cut into ``2 * cp`` chunks and CP rank ``r`` holds chunks ``r``
    and ``2cp-1-r`` (the causal work balanced); attention spans the CP group by ``cp_comm_type``: ``p2p`` (K/V
    around a ring, overlapped with the blocks), ``all_gather`` (K/V gathered), ``a2a`` (Ulysses: heads traded for
    sequence; the KV heads per TP rank must divide by cp) or ``a2a+p2p`` (a2a inside groups of ``cp_a2a_size``
    consecutive CP ranks, a ring across the groups). The world is tp x cp x pp x dp; weights are replicated over
    cp, gradients reduced over the dp x cp group. ``cp_dynamic`` (dynamic CP, see ``mcore.train.dynamic_cp``):
    the training steps give each document of the global batch the CP group its length needs, out of all dp x cp
    ranks (tp = pp = 1, p2p); the losses are static CP's.
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
    dp_shard_reshard_after_forward: bool | Literal["auto"] = "auto"
    dp_shard_reduce_every_microbatch: bool | Literal["auto"] = "auto"
    # Expert parallelism (MoE models): experts split over ep ranks, each expert's FFN over etp (default: tp).
    # Attention keeps tp x cp x dp while experts use etp x ep x edp over the same ranks (parallel folding).
    ep: int = 1
    etp: int | None = None
    # Context parallelism. Ranks are ordered as in Megatron-Core (tp-cp-ep-dp-pp, tp fastest; see
    # mcore.parallel.grid): a CP group is cp ranks tp apart, so with tp x cp <= GPUs per node both stay on NVLink.
    cp: int = 1
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    cp_a2a_size: int | None = None
    cp_dynamic: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "bucket_size", "ep", "cp"):
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
        self._check_context_parallel()
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

    def _check_context_parallel(self) -> None:
        if self.cp_comm_type not in CP_COMM_TYPES:  # typed loading checks it too; direct construction does not
            raise ValueError(f"parallel.cp_comm_type must be one of {list(CP_COMM_TYPES)}, got {self.cp_comm_type!r}")
        if self.cp_dynamic:
            self._check_dynamic_cp()
        size = self.cp_a2a_size
        if self.cp_comm_type != "a2a+p2p":
            if size is not None:
                raise ValueError(
                    f"parallel.cp_a2a_size={size} is the a2a group size of parallel.cp_comm_type=a2a+p2p; drop it or "
                    f"set cp_comm_type=a2a+p2p (now {self.cp_comm_type})"
                )
            return
        divisors = [d for d in range(2, self.cp) if self.cp % d == 0]
        if size is None or size not in divisors:
            valid = f"one of {divisors}" if divisors else "none: cp must have a divisor between 2 and cp-1, e.g. cp=4"
            raise ValueError(
                f"parallel.cp_comm_type=a2a+p2p needs parallel.cp_a2a_size, the a2a group size, a divisor of "
                f"parallel.cp={self.cp} between 2 and cp-1 ({valid}); got {size}"
            )

    def _check_dynamic_cp(self) -> None:
        problems = [
            msg
            for bad, msg in (
                (self.cp == 1, "parallel.cp > 1 (the static CP size: at most seq_length / cp tokens per rank)"),
                (self.tp != 1 or self.pp != 1, f"tp = pp = 1 (got tp={self.tp}, pp={self.pp})"),
                (self.cp_comm_type != "p2p", f"cp_comm_type=p2p (got {self.cp_comm_type})"),
                (self.dp_shard, "no dp_shard (its groups run the DDP buffers' no_sync)"),
            )
            if bad
        ]
        if problems:
            raise ValueError(f"parallel.cp_dynamic=true needs {'; '.join(problems)}")

    def world_size(self) -> int | None:
        """tp * cp * pp * dp, or ``None`` while dp is still to be derived."""
        return None if self.dp is None else self.tp * self.cp * self.pp * self.dp


def cp_granule(parallel: ParallelSection) -> int:
    """Row lengths under CP are multiples of this: ``2 * cp`` chunks, each rank's ``s / cp`` split over tp with
    sequence parallelism."""
    granule = 2 * parallel.cp
    return math.lcm(granule, parallel.cp * parallel.tp) if parallel.sequence_parallel else granule


def check_context_parallel(parallel: ParallelSection, model: TransformerConfig, seq_length: int) -> None:
    """Refuse, naming the key and the valid values, a CP layout this model and sequence length cannot run."""
    cp = parallel.cp
    if cp == 1:
        return
    granule = cp_granule(parallel)
    if seq_length % granule:
        why = f"lcm(2 x cp, cp x tp) = {granule} with sequence parallelism" if parallel.sequence_parallel else (
            f"2 x parallel.cp = {granule}"
        )  # fmt: skip
        raise ValueError(
            f"data.seq_length ({seq_length}) must be a multiple of {why}: each sequence is cut into 2 x cp chunks; "
            f"use e.g. {-(-seq_length // granule) * granule}"
        )
    mixers = sorted({model.mixer_type(i) for i in range(model.num_hidden_layers)} - set(CP_MIXERS))
    if mixers:
        raise ValueError(
            f"parallel.cp={cp}: layers with token mixer(s) {mixers} cannot run context-parallel (only "
            f"{list(CP_MIXERS)} can); use parallel.cp=1"
        )
    if parallel.ep > 1:
        raise ValueError(f"parallel.cp={cp} with parallel.ep={parallel.ep} is not supported yet; use ep=1 or cp=1")
    if getattr(model, "attention_sinks", False):  # GPT-OSS (the gptoss branch): the CP path does not pass them yet
        raise ValueError(f"parallel.cp={cp} with model.attention_sinks=true is not supported yet; use cp=1")
    router = model.moe_router or {}
    if model.num_experts is not None and (model.router_aux_loss_coef or router.get("z_loss_coef")):
        # the MoE layers' aux losses are those of the tokens of their tp ranks; under CP they would need the
        # statistics of the whole tp x cp group and a cp-scaled gradient
        raise ValueError(
            f"parallel.cp={cp} with MoE aux losses (model.router_aux_loss_coef={model.router_aux_loss_coef}, "
            f"model.moe_router.z_loss_coef={router.get('z_loss_coef')}) is not supported yet; set them to 0 (the "
            "aux-loss-free expert_bias works) or use cp=1"
        )
    if parallel.cp_dynamic and model.num_experts is not None:
        raise ValueError("parallel.cp_dynamic=true does not run MoE models yet (their aux losses); use static CP")
    if parallel.cp_comm_type in ("a2a", "a2a+p2p"):
        size = cp if parallel.cp_comm_type == "a2a" else parallel.cp_a2a_size
        heads = {"num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_key_value_heads}
        for key, count in heads.items():
            if (count // parallel.tp) % size:
                raise ValueError(
                    f"parallel.cp_comm_type={parallel.cp_comm_type} splits each TP rank's heads over {size} ranks, but "
                    f"model.{key}={count} / parallel.tp={parallel.tp} = {count // parallel.tp} is not divisible by "
                    f"{size}; use cp_comm_type p2p or all_gather, or a size dividing it"
                )
