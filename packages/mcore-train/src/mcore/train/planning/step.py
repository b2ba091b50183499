"""One training step of a layout: the pipeline replayed, then data-parallel communication and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from mcore.train.planning.cluster import Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import (
    SCHEDULE_CLASSES,
    offloaded_bytes_per_layer,
    rank_chunks,
    stage_overwritten_weights,
    stage_parameters,
)
from mcore.train.planning.offload_cost import activation_offload_seconds, offloaded_pieces, optimizer_offload_seconds
from mcore.train.planning.pipeline_sim import estimate, run_schedule
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.time_model import BUCKET_ELEMENTS, OpCost, TimeModel, adamw_bytes_per_param

# Before each bucket's collective the fp32 gradients are divided by dp in place (mcore's GradBuffer._issue_reduction;
# Megatron-Core r0.8's Bucket.start_grad_sync, megatron/core/distributed/param_and_grad_buffer.py at f2e5db402c,
# with its default average_in_collective=False): read and write 4 bytes per element. Layout.grad_nan_check adds
# Megatron's grad_data.norm(p=2) of each bucket (read 4; the host sync on its isnan() is not charged).
BUCKET_SCALE_BYTES = 8
BUCKET_NAN_CHECK_BYTES = 4


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds of one optimizer step and where they go (``breakdown``: seconds on the slowest rank)."""

    step_s: float
    tokens_per_step: int
    world_size: int
    model_flops_per_token: float
    peak_flops: float
    bubble_fraction: float
    breakdown: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.tokens_per_s * self.model_flops_per_token / (self.world_size * self.peak_flops)


def chunk_costs(model: TimeModel, chunks_of_ranks) -> list[list[OpCost]]:
    """Per rank and chunk: the summed cost of its layers, plus the embedding / output layer where they live."""
    pp, vpp = model.layout.pp, model.layout.vpp
    cache: dict[int, OpCost] = {}
    out = []
    for rank, chunks in enumerate(chunks_of_ranks):
        row = []
        for c, (start, end) in enumerate(chunks):
            total = OpCost()
            for i, count in model.shape.layer_kinds(start, end).items():
                if i not in cache:
                    cache[i] = model.layer_cost(i)
                total += cache[i].scaled(count)
            first, last = rank == 0 and c == 0, rank == pp - 1 and c == vpp - 1
            layers_only = (total.f, total.b)
            if first or last:
                total += model.head_cost(first, last)
            if last and model.shape.mtp_layers:
                total += model.mtp_cost().scaled(model.shape.mtp_layers)
            if model.layout.activation_offload:
                gap = total.f + total.b - sum(layers_only) if last else sum(layers_only)
                total.add("B", "activation_offload", _activation_offload(model, cache, start, end, gap))
            row.append(total)
        out.append(row)
    return out


def _activation_offload(model: TimeModel, cache: dict[int, OpCost], start: int, end: int, gap: float) -> float:
    """Exposed seconds of one micro-batch's activation copies in layers ``start..end-1`` (``offload_cost``): the
    replayed copy stream, and at least what the copies take beyond the chunk's compute (several micro-batches
    share the one copy stream)."""
    s = model.shape
    kinds = [s.layer_kinds(i, i + 1).popitem()[0] for i in range(start, end)]
    nbytes = [offloaded_bytes_per_layer(s, model.layout, i) for i in kinds]
    fwd, bwd = [cache[i].f for i in kinds], [cache[i].b for i in kinds]
    replay = activation_offload_seconds(fwd, bwd, nbytes, gap, model.gpu.pcie_gbps)
    return max(replay, 2 * sum(nbytes) / (model.gpu.pcie_gbps * 1e9) - sum(fwd) - sum(bwd))


def _data_parallel(
    model: TimeModel, dense: float, expert: float, last_backward: float, first_forward: float, first_stage: bool
) -> dict[str, float]:
    """Exposed seconds of the gradient reduction and parameter all-gather of one rank (module docstring of
    ``time_model``)."""
    lay, net, s = model.layout, model.net, model.shape
    out = {"dp_grad_comm": 0.0, "dp_param_comm": 0.0, "dp_overlap_slowdown": 0.0}
    if lay.dp_shard:
        return out
    sharded = lay.distributed_optimizer
    kind = "reduce_scatter" if sharded else "all_reduce"
    g = lay.grad_bytes  # the buffers are reduced in their dtype (optim.main_grads_dtype)
    comm = net.collective(kind, model.dp_group, g * dense) + net.collective(kind, model.edp_group, g * expert)
    if lay.overlap_grad_reduce:
        last_elems = max(BUCKET_ELEMENTS, s.padded_vocab(lay.tp) * s.hidden / lay.tp if first_stage else 0)
        last = net.collective(kind, model.dp_group, g * min(last_elems, dense))
        out["dp_grad_comm"] = max(last, comm - last_backward)
        # the backward beside the overlapped part runs slower (NCCL's reduction kernels share SMs and HBM)
        out["dp_overlap_slowdown"] = model.gpu.reduce_overlap_slowdown * (comm - out["dp_grad_comm"])
    else:
        out["dp_grad_comm"] = comm
    if sharded:
        gather = net.collective("all_gather", model.dp_group, model.dtype * dense)
        gather += net.collective("all_gather", model.edp_group, model.dtype * expert)
        if lay.overlap_param_gather:
            one = net.collective("all_gather", model.dp_group, model.dtype * min(BUCKET_ELEMENTS, dense))
            out["dp_param_comm"] = max(one, gather - first_forward)
        else:
            out["dp_param_comm"] = gather
    return out


def _filled_gradients(shape: ModelShape, layout: Layout, rank: int, chunks, dense: float, expert: float) -> float:
    """Gradient-buffer elements DDP's ``zero_grad_buffer`` zero-fills each step (a write-only fill: copy speed).
    With ``skip_overwritten_fill`` (its default) the regions whose step's first weight gradient a GEMM writes
    without reading (``param_attrs.take_wgrad_target``) are left stale: the tensor-parallel linears' weights and
    the output layer (``memory.stage_overwritten_weights``) and the expert weights (every expert GEMM mode:
    grouped, per_expert, grouped_fp32_wgrad). Still filled: the embedding, norms, biases, replicated linears, the
    expert biases (GPT-OSS: added by autograd) and the bucket padding (under a bucket's alignment, not counted)."""
    filled = dense - stage_overwritten_weights(shape, layout, rank, chunks)
    if not expert:
        return filled
    weights = sum(lin.weights for lin in shape.expert_linears())
    biases = sum(lin.out_features for lin in shape.expert_linears()) if shape.expert_bias else 0
    return filled + expert * biases / (weights + biases)


def _optimizer(model: TimeModel, dense: float, expert: float, rank: int, chunks, last_backward: float):
    """The device part of the AdamW step and what the host part (``offload_cost``) adds beyond it."""
    lay, gpu = model.layout, model.gpu
    sharded = lay.distributed_optimizer or lay.dp_shard
    local = dense / (lay.dp * lay.cp) + expert / lay.expert_dp if sharded else dense + expert
    pieces = []
    if lay.optimizer_offload_fraction:
        pieces = offloaded_pieces(model.shape, lay, rank, chunks, lay.dp * lay.cp if sharded else 1)
    on_gpu = local - sum(pieces)
    adamw = adamw_bytes_per_param(lay) * on_gpu / (gpu.copy_gbps * 1e9 * gpu.optimizer_efficiency)
    grad = 4 if lay.dp_shard else lay.grad_bytes  # the norm reads each gradient once
    device = adamw + gpu.memory_seconds(grad * on_gpu)
    out = {"optimizer": device}
    if not lay.dp_shard:  # FSDP2 has no buffer to fill: its shard gradients are set to None and made afresh
        out["grad_zero"] = (
            lay.grad_bytes * _filled_gradients(model.shape, lay, rank, chunks, dense, expert) / (gpu.copy_gbps * 1e9)
        )
    passes = (BUCKET_SCALE_BYTES if lay.dp * lay.cp > 1 and not lay.dp_shard else 0) + (
        BUCKET_NAN_CHECK_BYTES if lay.grad_nan_check else 0
    )
    passes *= lay.grad_bytes / 4  # the constants are for fp32 buffers
    if passes:  # on the compute stream, in the last micro-batch's backward
        out["grad_bucket_passes"] = gpu.memory_seconds(passes * (dense + expert))
    if pieces:  # the host step runs beside the device part
        out["optimizer_offload"] = optimizer_offload_seconds(
            pieces, last_backward, device, gpu.cpu_adam_gparams_per_s, gpu.pcie_gbps
        )
    return out


def predict_step(shape: ModelShape, layout: Layout, network: Network, exact: bool = True) -> StepPrediction:
    """Predicted step of ``shape`` under ``layout`` (which must be valid: see ``Layout.problems``); ``exact=False``
    uses the pipeline's closed form instead of replaying the schedule (``pipeline_sim.estimate``)."""
    model = TimeModel(shape, layout, network)
    chunks_of_ranks = rank_chunks(shape, layout)
    costs = chunk_costs(model, chunks_of_ranks)
    schedule = SCHEDULE_CLASSES[layout.schedule_name]
    split = schedule.splits_backward

    def op_time(rank: int, kind: str, chunk: int) -> float:
        c = costs[rank][chunk]
        if kind == "F":
            return c.f
        if kind == "B":
            return c.b - c.wgrad if split else c.b
        return c.wgrad

    act = model.tokens * shape.hidden * model.dtype / (layout.tp if layout.sequence_parallel else 1)
    transfer = network.p2p(act, model.pp_crosses_node) if layout.pp > 1 else 0.0
    m = layout.num_microbatches
    run = (run_schedule if exact or layout.pp == 1 else estimate)(schedule, layout.pp, layout.vpp, m, op_time, transfer)
    finish, worst = 0.0, None
    for rank, chunks in enumerate(chunks_of_ranks):
        dense, expert = stage_parameters(shape, layout, rank, chunks)
        last_b = sum(c.b for c in costs[rank])
        first_f = sum(c.f for c in costs[rank])
        tail = _data_parallel(model, dense, expert, last_b, first_f, rank == 0)
        tail.update(_optimizer(model, dense, expert, rank, chunks, last_b))
        end = run.ends[rank] + sum(tail.values())
        if end >= finish:
            finish, worst = end, (rank, tail)
    rank, tail = worst
    breakdown: dict[str, float] = {}
    for c in costs[rank]:
        for phase in (c.forward, c.backward):
            for k, v in phase.items():
                breakdown[k] = breakdown.get(k, 0.0) + v * m
    breakdown["pipeline_wait"] = max(0.0, run.ends[rank] - run.busy[rank])
    breakdown.update(tail)
    breakdown["host_step"] = network.gpu.host_ms_per_step * 1e-3
    step = finish + breakdown["host_step"]
    return StepPrediction(
        step_s=step,
        tokens_per_step=layout.global_batch * layout.seq_length,
        world_size=layout.world_size,
        model_flops_per_token=shape.model_flops_per_token(layout.seq_length),
        peak_flops=network.gpu.peak_tflops["bf16"] * 1e12,  # MFU is against the dense bf16 peak, as in the docs
        bubble_fraction=run.bubble_fraction,
        breakdown=breakdown,
    )
