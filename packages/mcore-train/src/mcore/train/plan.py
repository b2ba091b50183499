"""``mcore-train plan``: parameters, FLOPs, memory per rank, predicted step time and MFU of a config.

The models behind it live in :mod:`mcore.train.planning` (memory: ``planning.memory``; time: ``planning.step``);
this module turns a training :class:`~mcore.train.config.Config` into their inputs and prints the result. With a
calibration (``--calibration``, default: the GPU at hand or the shipped H200 one) the plan also predicts the step
time; and it lists the memory of each memory mode (distributed optimizer, recompute, ZeRO-3, optimizer offload)
with the cheapest that fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore.models.accounting import parameter_counts
from mcore.parallel.grid import ParallelConfig
from mcore.train.config import Config
from mcore.train.errors import UserError
from mcore.train.planning.cluster import Network
from mcore.train.planning.ep_traffic import EPTraffic, ep_traffic
from mcore.train.planning.layout import OFFLOAD_PARTS, Layout
from mcore.train.planning.memory import GB, StageMemory, stage_memory
from mcore.train.planning.memory import activation_bytes_per_layer as _layer_activation_bytes
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import StepPrediction, predict_step
from mcore.train.trainer import pipeline_layout, schedule_class

__all__ = ["MemoryMode", "Plan", "StageMemory", "make_plan", "default_world_size", "layout_of"]

# (name, changes to the layout, the overrides that make them) in the order tried when the config does not fit
MEMORY_MODES: tuple[tuple[str, dict, list[str]], ...] = (
    ("ZeRO-1", {"distributed_optimizer": True}, ["parallel.distributed_optimizer=true"]),
    (
        "ZeRO-1 + selective recompute",
        {"distributed_optimizer": True, "recompute": "selective"},
        ["parallel.distributed_optimizer=true", "train.recompute=selective"],
    ),
    (
        "ZeRO-1 + full recompute",
        {"distributed_optimizer": True, "recompute": "full"},
        ["parallel.distributed_optimizer=true", "train.recompute=full"],
    ),
    (
        "ZeRO-3",
        {"dp_shard": True, "distributed_optimizer": False, "overlap_param_gather": False},
        ["parallel.dp_shard=true", "parallel.distributed_optimizer=false", "parallel.overlap_param_gather=false"],
    ),
    (
        "ZeRO-3 + selective recompute",
        {"dp_shard": True, "distributed_optimizer": False, "overlap_param_gather": False, "recompute": "selective"},
        [
            "parallel.dp_shard=true",
            "parallel.distributed_optimizer=false",
            "parallel.overlap_param_gather=false",
            "train.recompute=selective",
        ],  # fmt: skip
    ),
    (
        "ZeRO-3 + full recompute",
        {"dp_shard": True, "distributed_optimizer": False, "overlap_param_gather": False, "recompute": "full"},
        [
            "parallel.dp_shard=true",
            "parallel.distributed_optimizer=false",
            "parallel.overlap_param_gather=false",
            "train.recompute=full",
        ],  # fmt: skip
    ),
    # offloading half the optimizer costs a CPU step per optimizer step, recompute costs a forward per micro-batch:
    # with many micro-batches per step the offload is the cheaper of the two, so both are tried apart
    (
        "ZeRO-1 + half the optimizer offloaded",
        {"distributed_optimizer": True, "optimizer_offload_fraction": 0.5},
        ["parallel.distributed_optimizer=true", "optim.offload_fraction=0.5"],
    ),
    (
        "ZeRO-1 + selective recompute + half the optimizer offloaded",
        {"distributed_optimizer": True, "recompute": "selective", "optimizer_offload_fraction": 0.5},
        ["parallel.distributed_optimizer=true", "train.recompute=selective", "optim.offload_fraction=0.5"],
    ),
    (
        "ZeRO-1 + full recompute + half the optimizer offloaded",
        {"distributed_optimizer": True, "recompute": "full", "optimizer_offload_fraction": 0.5},
        ["parallel.distributed_optimizer=true", "train.recompute=full", "optim.offload_fraction=0.5"],
    ),
    (
        "ZeRO-1 + full recompute + optimizer offloaded",
        {"distributed_optimizer": True, "recompute": "full", "optimizer_offload_fraction": 1.0},
        ["parallel.distributed_optimizer=true", "train.recompute=full", "optim.offload_fraction=1"],
    ),
)


@dataclass(frozen=True)
class MemoryMode:
    """One memory mode of the config: its heaviest rank's GB and whether it fits."""

    name: str
    overrides: list[str]
    worst_gb: float
    fits: bool
    step_s: float | None = None


@dataclass(frozen=True)
class Plan:
    """Counts, memory and (with a calibration) the predicted step of one configuration on ``world_size`` ranks."""

    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int
    precision: str
    total_parameters: int
    flops_per_step: float
    tokens_per_step: int
    num_microbatches: int
    bubble_fraction: float
    stages: tuple[StageMemory, ...]
    gpu_memory_gb: float
    prediction: StepPrediction | None = None
    calibration: str | None = None
    modes: tuple[MemoryMode, ...] = field(default=())
    cp: int = 1
    ep_traffic: tuple[EPTraffic, ...] = field(default=())  # all-to-all bytes per step per pp rank (MoE, ep > 1)
    states: str = "fp32 gradients and optimizer states"  # optim.main_grads_dtype / exp_avg_dtype / exp_avg_sq_dtype
    notes: tuple[str, ...] = field(default=())  # what the plan does not model about this config, said in the report

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.gpu_memory_gb * GB

    @property
    def suggestion(self) -> MemoryMode | None:
        """The fastest memory mode that fits (by predicted step when there is a calibration, else the first)."""
        fitting = [m for m in self.modes if m.fits]
        if not fitting:
            return None
        return min(fitting, key=lambda m: m.step_s) if all(m.step_s for m in fitting) else fitting[0]


def layout_of(config: Config, world_size: int) -> Layout:
    """The planner's :class:`Layout` of ``config`` on ``world_size`` ranks (fields mcore-train does not have yet,
    such as ``parallel.cp``, are read when present)."""
    parallel = config.parallel
    cp, ep, etp = getattr(parallel, "cp", 1) or 1, getattr(parallel, "ep", 1) or 1, getattr(parallel, "etp", None)
    try:
        resolved = ParallelConfig(tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, dp=parallel.dp, cp=cp).resolve(
            world_size
        )
    except ValueError as exc:
        raise UserError(f"parallel layout does not fit {world_size} rank(s): {exc}") from None
    precision = "bf16" if config.train.precision == "auto" else config.train.precision
    custom = pipeline_layout(config, resolved.pp)
    schedule = schedule_class(config).name if resolved.pp > 1 else "none"
    schedule = {"interleaved-1f1b": "interleaved", "zb-h1": "zero-bubble"}.get(schedule, schedule)
    return Layout(
        tp=resolved.tp,
        pp=resolved.pp,
        dp=resolved.dp,
        vpp=parallel.vpp,
        cp=cp,
        cp_comm_type=getattr(parallel, "cp_comm_type", "p2p"),
        cp_a2a_size=getattr(parallel, "cp_a2a_size", None),
        ep=ep,
        etp=etp,
        micro_batch=config.train.micro_batch_size,
        global_batch=config.train.global_batch_size,
        seq_length=config.data.seq_length,
        sequence_parallel=parallel.sequence_parallel,
        schedule=schedule,
        recompute=config.train.recompute,
        recompute_modules=_modules(config),
        distributed_optimizer=parallel.distributed_optimizer,
        dp_shard=bool(getattr(parallel, "dp_shard", False)),
        optimizer_offload_fraction=float(getattr(config.optim, "offload_fraction", 0.0) or 0.0),
        main_grads_dtype=config.optim.main_grads_dtype,
        exp_avg_dtype=config.optim.exp_avg_dtype,
        exp_avg_sq_dtype=config.optim.exp_avg_sq_dtype,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather,
        precision="fp32" if precision == "fp32" else "bf16",
        pipeline_layout=tuple(custom) if custom is not None else None,
        activation_offload=_offloaded_parts(config),
        expert_gemm=(config.model.moe_router or {}).get("expert_gemm", "grouped"),
        document_lengths=_document_lengths(config),
    )


def _modules(config: Config) -> tuple[str, ...] | None:
    modules = config.train.recompute_modules
    return None if modules is None else tuple(modules)


def _document_lengths(config: Config) -> tuple[int, ...]:
    """The packed documents of a sequence the time model costs: with ``data.packing`` on mock data, the
    documents of the first sample mcore-train draws (``cu_seqlens``); a corpus's lengths are not read, so it is
    planned as one document per sequence."""
    if not (config.data.packing and config.data.mock):
        return ()
    from mcore.train.data.mock import MockGPTDataset

    sample = MockGPTDataset(vocab_size=2, seq_length=config.data.seq_length, num_samples=1, packing=True)[0]
    return tuple(int(n) for n in sample["cu_seqlens"].diff())


def _offloaded_parts(config: Config) -> tuple[str, ...]:
    parts = tuple(getattr(config.train, "activation_offload", ()) or ())
    unknown = [p for p in parts if p not in OFFLOAD_PARTS]
    if unknown:
        raise UserError(f"mcore-train plan models train.activation_offload of {list(OFFLOAD_PARTS)}, got {unknown}")
    return parts


def activation_bytes_per_layer(config: Config, tp: int, dtype_bytes: int) -> float:
    """Bytes one (first) layer of ``config`` keeps for backward per micro-batch at tensor parallelism ``tp``."""
    layout = Layout(
        tp=tp,
        micro_batch=config.train.micro_batch_size,
        global_batch=config.train.micro_batch_size,
        seq_length=config.data.seq_length,
        sequence_parallel=config.parallel.sequence_parallel,
        recompute=config.train.recompute,
        recompute_modules=_modules(config),
    )
    return _layer_activation_bytes(ModelShape.from_config(config.model), layout, 0, dtype_bytes)


def _modes(shape: ModelShape, layout: Layout, memory_gb: float, network: Network | None) -> tuple[MemoryMode, ...]:
    out, seen = [], set()
    for name, changes, overrides in (("as configured", {}, []), *MEMORY_MODES):
        if changes.get("dp_shard") and layout.dp == 1:
            continue
        trial = layout.replace(**changes)
        if trial in seen or trial.problems(shape):
            continue  # a mode the config already is, or one its layout cannot take
        seen.add(trial)
        worst = max(s.total for s in stage_memory(shape, trial)) / GB
        step = predict_step(shape, trial, network).step_s if network is not None else None
        out.append(MemoryMode(name, overrides, worst, worst <= memory_gb, step))
    return tuple(out)


def _states(layout: Layout) -> str:
    dtypes = (layout.main_grads_dtype, layout.exp_avg_dtype, layout.exp_avg_sq_dtype)
    if dtypes == ("fp32", "fp32", "fp32"):
        return Plan.states
    return f"{dtypes[0]} gradients, fp32 masters, {dtypes[1]} exp_avg, {dtypes[2]} exp_avg_sq"


def make_plan(config: Config, world_size: int, gpu_memory_gb: float, network: Network | None = None) -> Plan:
    """Memory (and, with ``network``, time) of ``config`` on ``world_size`` ranks."""
    layout = layout_of(config, world_size)
    shape = ModelShape.from_config(config.model)
    problems = layout.problems(shape)
    if problems:
        raise UserError(f"parallel layout cannot run this model: {'; '.join(problems)}")
    micro = config.num_microbatches(layout.dp)
    stages = tuple(stage_memory(shape, layout))
    sched = schedule_class(config)
    prediction = predict_step(shape, layout, network) if network is not None else None
    return Plan(
        world_size=world_size,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        vpp=layout.vpp,
        cp=layout.cp,
        precision=layout.precision,
        total_parameters=parameter_counts(config.model).total,
        flops_per_step=shape.model_flops_per_token(layout.seq_length) * layout.global_batch * layout.seq_length,
        tokens_per_step=layout.global_batch * layout.seq_length,
        num_microbatches=micro,
        bubble_fraction=sched.bubble_fraction(layout.pp, layout.vpp, micro),
        stages=stages,
        gpu_memory_gb=gpu_memory_gb,
        prediction=prediction,
        calibration=network.gpu.name if network is not None else None,
        modes=_modes(shape, layout, gpu_memory_gb, network),
        states=_states(layout),
        ep_traffic=ep_traffic(shape, layout, micro),
        notes=_unmodelled(config),
    )


def _unmodelled(config: Config) -> tuple[str, ...]:
    """What the plan leaves out of this config: said, so that a prediction is not read as covering it."""
    precision = config.train.precision
    if precision in ("fp8", "fp4") or config.train.quant == "bitnet":
        what = "train.quant=bitnet" if config.train.quant == "bitnet" else f"train.precision={precision}"
        extra = ", nor fp8.param_gather's 1-byte gather" if precision == "fp8" and config.fp8.param_gather else ""
        return (
            f"{what} is planned as bf16: bf16 GEMM rates and bf16 parameters; neither the quantized GEMMs' speed, "
            f"their casts nor the weight casts' memory are modelled{extra}",
        )
    return ()


def default_world_size(config: Config) -> int:
    """tp x cp x pp x dp from the config (dp defaults to 1)."""
    p = config.parallel
    return p.tp * (getattr(p, "cp", 1) or 1) * p.pp * (p.dp or 1)
