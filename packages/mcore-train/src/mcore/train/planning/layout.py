"""A parallel layout and the run settings the planner varies, with every reason a layout cannot run.

Names follow Megatron-Core where mcore has no field yet: ``cp`` (``--context-parallel-size``), ``ep``
(``--expert-model-parallel-size``), ``etp`` (``--expert-tensor-parallel-size``), ``dp_shard`` (ZeRO-3, Megatron's
FSDP), ``optimizer_offload_fraction`` (``--optimizer-offload-fraction``). Attention and dense layers use the grid
``tp x cp x dp x pp``; experts the grid ``etp x ep x edp x pp`` over the same ranks (parallel folding), so
``edp = tp * cp * dp / (etp * ep)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from mcore.models.recompute import check_recompute_modules
from mcore.train.planning.shape import ModelShape

Recompute = Literal["none", "selective", "full"]
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved", "zero-bubble")
# the loss: mcore's fused bf16 cross entropy, or Megatron-Core's unfused fp32 one (its default without
# --cross-entropy-loss-fusion: logits cast to fp32, max / subtract / exp / sum / divide each a pass, see time_model)
CROSS_ENTROPY = ("fused", "fp32")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")  # mcore-train's parallel.cp_comm_type
# train.activation_offload: a decoder layer's parts, or the whole layer
OFFLOAD_PARTS = ("input_norm", "attention", "mlp_norm", "mlp", "layer")


@dataclass(frozen=True)
class Layout:
    """Parallel sizes, batch and memory settings of one run (``global_batch`` in sequences)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    cp: int = 1
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    cp_a2a_size: int | None = None
    ep: int = 1
    etp: int | None = None
    micro_batch: int = 1
    global_batch: int = 1
    seq_length: int = 4096
    sequence_parallel: bool = False
    schedule: str = "auto"
    recompute: Recompute = "none"
    recompute_modules: tuple[str, ...] | None = None  # train.recompute_modules (selective only; recompute_terms)
    distributed_optimizer: bool = False
    dp_shard: bool = False
    optimizer_offload_fraction: float = 0.0
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    cross_entropy: Literal["fused", "fp32"] = "fused"
    precision: Literal["bf16", "fp32", "fp8"] = "bf16"
    pipeline_layout: tuple[int, ...] | None = None
    activation_offload: tuple[str, ...] = ()
    dropout: bool = False  # hidden and attention dropout (Megatron's default 0.1 each; mcore-train has none)
    # Megatron-Core r0.8's default check_for_nan_in_loss_and_grad: the norm of each bucket's gradients is checked
    # for NaN before its collective
    grad_nan_check: bool = False
    # the routed experts' GEMMs (``moe_router.expert_gemm``): one grouped GEMM per linear, or one GEMM per expert
    expert_gemm: Literal["grouped", "per_expert"] = "grouped"
    # packed documents (data.packing, cu_seqlens): the lengths of the documents in each sequence, summing to
    # seq_length; empty: one causal document per sequence
    document_lengths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp", "cp", "ep", "micro_batch", "global_batch", "seq_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be an int >= 1, got {value!r}")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"Layout.optimizer_offload_fraction must lie in [0, 1], got {self.optimizer_offload_fraction}"
            )
        lengths = self.document_lengths
        bad = isinstance(lengths, (str, int)) or any(isinstance(n, bool) or not isinstance(n, int) for n in lengths)
        if bad or any(n < 1 for n in lengths):
            raise ValueError(f"Layout.document_lengths must be a tuple of ints >= 1, got {lengths!r}")
        if lengths and sum(lengths) != self.seq_length:
            raise ValueError(
                f"Layout.document_lengths {lengths} sum to {sum(lengths)}, not seq_length {self.seq_length}: "
                "give the lengths of the documents packed into one sequence"
            )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"Layout.cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        if self.expert_gemm not in ("grouped", "per_expert"):
            raise ValueError(f"Layout.expert_gemm must be 'grouped' or 'per_expert', got {self.expert_gemm!r}")
        if self.cross_entropy not in CROSS_ENTROPY:
            raise ValueError(f"Layout.cross_entropy must be one of {CROSS_ENTROPY}, got {self.cross_entropy!r}")
        if self.recompute_modules is not None:
            # only selective recompute takes a list: the memory modes switch a layout to none / full, which drops it
            modules = None
            if self.recompute == "selective":
                modules = check_recompute_modules(self.recompute_modules, self.recompute, "Layout")
            object.__setattr__(self, "recompute_modules", modules)
        unknown = [p for p in self.activation_offload if p not in OFFLOAD_PARTS]
        if isinstance(self.activation_offload, str) or unknown:
            raise ValueError(
                f"Layout.activation_offload must be a tuple of {OFFLOAD_PARTS}, got {self.activation_offload!r}"
            )
        if self.schedule not in ("auto", *SCHEDULES):
            raise ValueError(f"Layout.schedule must be one of {['auto', *SCHEDULES]}, got {self.schedule!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def schedule_name(self) -> str:
        if self.pp == 1:
            return "none"
        if self.schedule == "auto":
            return "interleaved" if self.vpp > 1 else "1f1b"
        return self.schedule

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def problems(self, shape: ModelShape) -> list[str]:
        """Why this layout cannot run ``shape`` (empty when it can): each reason names the numbers."""
        out = []
        if shape.heads % self.tp or shape.kv_heads % self.tp and self.tp % shape.kv_heads:
            out.append(f"tp={self.tp} does not divide the {shape.heads} query / {shape.kv_heads} KV heads")
        if self.sequence_parallel and self.tp == 1:
            out.append("sequence_parallel needs tp > 1")
        if self.tp_comm_overlap and not self.sequence_parallel:
            out.append("tp_comm_overlap needs sequence_parallel (the overlapped collectives are its all-gathers)")
        if self.seq_length % (2 * self.cp) and self.cp > 1:
            out.append(f"seq_length {self.seq_length} is not a multiple of 2*cp = {2 * self.cp} (CP load balancing)")
        if self.seq_length % (self.tp * self.cp) and self.sequence_parallel:
            out.append(f"seq_length {self.seq_length} is not a multiple of tp*cp = {self.tp * self.cp}")
        out += self._cp_problems(shape)
        if shape.mamba is not None and "M" in (shape.hybrid_pattern or ""):
            if shape.mamba.groups % self.tp:  # mcore.models.layers.mamba2.check_mamba2_tensor_parallel
                out.append(
                    f"tp={self.tp} does not divide the {shape.mamba.groups} Mamba-2 groups (whole groups per rank)"
                )
            if self.cp > 1:
                out.append(f"cp={self.cp} with Mamba-2 layers: the Mamba-2 mixer takes no context parallelism")
        per_step = self.micro_batch * self.dp
        if self.global_batch % per_step:
            out.append(f"global batch {self.global_batch} is not a multiple of micro_batch x dp = {per_step}")
        stages = self.pp * self.vpp
        if self.pipeline_layout is None and shape.layers % stages:
            out.append(f"{shape.layers} layers do not split evenly over pp x vpp = {stages} virtual stages")
        if self.pipeline_layout is not None and (
            len(self.pipeline_layout) != stages or sum(self.pipeline_layout) != shape.layers
        ):
            out.append(
                f"pipeline_layout {list(self.pipeline_layout)} is not {stages} entries summing to {shape.layers}"
            )
        if self.vpp > 1 and self.pp == 1:
            out.append(f"vpp={self.vpp} needs pp > 1")
        sched = self.schedule_name
        if sched == "interleaved" and (self.vpp < 2 or self.num_microbatches % self.pp):
            out.append(f"interleaved 1F1B needs vpp >= 2 and micro-batches ({self.num_microbatches}) divisible by pp")
        if sched in ("1f1b", "zero-bubble", "gpipe") and self.vpp > 1:
            out.append(f"schedule {sched} runs one model chunk per rank, got vpp={self.vpp}")
        if self.ep > 1 and not shape.is_moe:
            out.append(f"ep={self.ep} needs a MoE model")
        if shape.is_moe and shape.num_experts % self.ep:
            out.append(f"ep={self.ep} does not divide the {shape.num_experts} experts")
        if (self.tp * self.cp * self.dp) % (self.expert_tp * self.ep):
            out.append(
                f"etp x ep = {self.expert_tp} x {self.ep} does not divide tp x cp x dp = {self.tp * self.cp * self.dp}"
            )
        if self.dp_shard and self.distributed_optimizer:
            out.append("dp_shard (ZeRO-3) already shards the optimizer: leave distributed_optimizer off")
        if self.overlap_param_gather and not (self.distributed_optimizer or self.dp_shard):
            out.append("overlap_param_gather needs the distributed optimizer")
        if self.activation_offload and self.recompute == "full":
            out.append("activation_offload with full recompute: full recompute keeps only each layer's input")
        return out

    def _cp_problems(self, shape: ModelShape) -> list[str]:
        """What mcore-train's parallel config refuses for CP (``parallel_config.check_context_parallel``)."""
        out = []
        if self.cp > 1 and self.ep > 1:
            out.append(f"cp={self.cp} with ep={self.ep}: mcore-train does not run context and expert parallel together")
        divisors = [d for d in range(2, self.cp) if self.cp % d == 0]
        if self.cp_comm_type == "a2a+p2p" and self.cp_a2a_size not in divisors:
            out.append(f"cp_comm_type a2a+p2p needs cp_a2a_size among the divisors {divisors} of cp={self.cp}")
        if self.cp_a2a_size is not None and self.cp_comm_type != "a2a+p2p":
            out.append(f"cp_a2a_size={self.cp_a2a_size} is only for cp_comm_type a2a+p2p (got {self.cp_comm_type})")
        size = self.cp if self.cp_comm_type == "a2a" else self.cp_a2a_size or 1 if self.cp_comm_type == "a2a+p2p" else 1
        heads = {"query": shape.heads, "KV": shape.kv_heads}
        for name, count in heads.items():
            if size > 1 and (count // self.tp) % size:
                out.append(f"cp_comm_type {self.cp_comm_type} splits the {count // self.tp} {name} heads per TP rank "
                           f"over {size} ranks")  # fmt: skip
        return out

    def overrides(self) -> list[str]:
        """The ``mcore-train`` overrides of this layout (Megatron's names where mcore-train has none yet)."""
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}"]
        if self.vpp > 1:
            out.append(f"parallel.vpp={self.vpp}")
        if self.cp > 1:
            out.append(f"parallel.cp={self.cp}")
            if self.cp_comm_type != "p2p":
                out.append(f"parallel.cp_comm_type={self.cp_comm_type}")
            if self.cp_a2a_size is not None:
                out.append(f"parallel.cp_a2a_size={self.cp_a2a_size}")
        if self.ep > 1:
            out.append(f"parallel.ep={self.ep}")
        if self.etp is not None and self.etp != self.tp:
            out.append(f"parallel.etp={self.etp}")
        if self.sequence_parallel:
            out.append("parallel.sequence_parallel=true")
        if self.pp > 1:
            out.append(f"parallel.schedule={self.schedule_name}")
        if self.pipeline_layout is not None:
            out.append(f"parallel.pipeline_layout=[{','.join(map(str, self.pipeline_layout))}]")
        if self.dp_shard:
            out.append("parallel.dp_shard=true")
        # spelled out either way: a config that sets them otherwise would contradict the layout
        out.append(f"parallel.distributed_optimizer={str(self.distributed_optimizer).lower()}")
        out.append(f"parallel.overlap_param_gather={str(self.overlap_param_gather).lower()}")
        if self.optimizer_offload_fraction:
            out.append(f"optim.offload_fraction={self.optimizer_offload_fraction:g}")
        out += [f"train.micro_batch_size={self.micro_batch}", f"train.global_batch_size={self.global_batch}"]
        if self.recompute != "none":
            out.append(f"train.recompute={self.recompute}")
        if self.recompute_modules is not None:
            out.append(f"train.recompute_modules=[{','.join(self.recompute_modules)}]")
        if self.activation_offload:
            out.append(f"train.activation_offload=[{','.join(self.activation_offload)}]")
        return out
