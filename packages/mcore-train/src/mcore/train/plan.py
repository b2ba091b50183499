"""``mcore-train plan``: parameters, FLOPs per step and memory per rank of a config, before any GPU is used.

Memory per rank (the heaviest pipeline stage, usually the first) is the sum of:

- weights: this rank's parameters (TP slice of its layers, plus the embedding on the first stage and the
  output layer, or the tied embedding's copy, on the last) in the parameter dtype;
- gradients: fp32 gradient buffers of the same parameters (DDP's ``main_grad``);
- optimizer: fp32 master weights (none when the parameters are fp32 already) and AdamW's two moments,
  divided by dp under the distributed optimizer;
- activations: what backward needs, per layer and micro-batch, times the layers of this rank and the
  micro-batches in flight under the pipeline schedule (Korthikanti et al., 2022, adapted to a gated MLP,
  GQA and flash attention, which stores no score matrix), plus the logits of one micro-batch on the last
  stage;
- a fixed allowance for the CUDA context, communication buffers and allocator slack.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.models.accounting import model_flops_per_token, parameter_counts
from mcore.parallel.grid import ParallelConfig
from mcore.parallel.pipeline import stage_layer_ranges
from mcore.train.config import Config
from mcore.train.errors import UserError
from mcore.train.trainer import pipeline_layout, schedule_class

GB = 1e9
RUNTIME_OVERHEAD_BYTES = 2.0 * GB
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class StageMemory:
    """Estimated bytes of one pipeline rank."""

    pp_rank: int
    layers: int
    parameters: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead


@dataclass(frozen=True)
class Plan:
    """Counts and estimates of one configuration on ``world_size`` ranks."""

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

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.gpu_memory_gb * GB


def layer_params_per_rank(config: Config, tp: int) -> int:
    """Parameters of one transformer layer held by one TP rank (norm weights are replicated)."""
    m = config.model
    h, f = m.hidden_size, m.intermediate_size
    qkv = m.q_size + 2 * m.kv_size
    n = (h * qkv + m.q_size * h + 3 * h * f) // tp
    if m.attention_bias:
        n += qkv // tp
    if m.attention_out_bias:
        n += h
    if m.mlp_bias:
        n += 2 * f // tp + h
    norm = 2 if m.normalization == "layernorm" else 1
    n += 2 * h * norm
    if m.qk_norm:
        n += 2 * m.head_dim * norm
    return n


def activation_bytes_per_layer(config: Config, tp: int, dtype_bytes: int) -> float:
    """Bytes one layer keeps for backward per micro-batch."""
    m = config.model
    tokens = config.data.seq_length * config.train.micro_batch_size
    h, f = m.hidden_size, m.intermediate_size
    replicated = h / tp if config.parallel.sequence_parallel else h
    if config.train.recompute == "full":
        return dtype_bytes * tokens * replicated  # the layer input; the rest is recomputed in backward
    # norm inputs and outputs (4 x h), q/k/v and the attention output, gate/up and the SwiGLU output
    per_token = 4 * replicated + (2 * m.q_size + 2 * m.kv_size) / tp + 3 * f / tp
    if config.train.recompute == "selective":
        per_token -= m.q_size / tp  # the attention output is recomputed
    softmax_stats = 4 * tokens * m.num_attention_heads / tp  # fp32 log-sum-exp of flash attention
    return dtype_bytes * tokens * per_token + softmax_stats


def make_plan(config: Config, world_size: int, gpu_memory_gb: float) -> Plan:
    """Estimate ``config`` on ``world_size`` ranks (see the module docstring)."""
    p = config.parallel
    try:
        layout = ParallelConfig(tp=p.tp, pp=p.pp, vpp=p.vpp, dp=p.dp).resolve(world_size)
    except ValueError as exc:
        raise UserError(f"parallel layout does not fit {world_size} rank(s): {exc}") from None
    tp, pp, dp, vpp = layout.tp, layout.pp, layout.dp, p.vpp
    precision = "bf16" if config.train.precision == "auto" else config.train.precision
    dtype_bytes = _BYTES[precision]
    m = config.model
    counts = parameter_counts(m)
    micro = config.num_microbatches(dp)
    tokens_per_step = config.train.global_batch_size * config.data.seq_length
    flops_per_step = model_flops_per_token(m, config.data.seq_length) * tokens_per_step
    sched = schedule_class(config)
    bubble = sched.bubble_fraction(pp, vpp, micro)

    padded_vocab = m.padded_vocab_size(tp)
    embedding = padded_vocab * m.hidden_size // tp
    ranges = stage_layer_ranges(m.num_hidden_layers, pp, vpp, pipeline_layout(config, pp))
    layers_of_rank = [sum(end - start for start, end in chunks) for chunks in ranges]
    per_layer = layer_params_per_rank(config, tp)
    act_layer = activation_bytes_per_layer(config, tp, dtype_bytes)
    if sched.name == "gpipe":
        in_flight = micro
    elif pp == 1:
        in_flight = 1
    else:
        in_flight = min(micro, pp) * (1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1)
    tokens = config.data.seq_length * config.train.micro_batch_size
    logits = tokens * padded_vocab / tp * (dtype_bytes + 4)  # the logits and their fp32 softmax in the loss

    stages = []
    for rank in range(pp):
        layers_per_rank = layers_of_rank[rank]
        n = layers_per_rank * per_layer
        if rank == 0:
            n += embedding
        if rank == pp - 1:
            n += m.hidden_size * (2 if m.normalization == "layernorm" else 1)
            if not m.tie_word_embeddings or pp > 1:
                n += embedding
        weights = n * dtype_bytes
        gradients = n * 4
        optimizer = n * (4 * 2 + (0 if precision == "fp32" else 4))
        if p.distributed_optimizer:
            optimizer /= dp
        acts = layers_per_rank * act_layer * (in_flight if rank == 0 else max(1.0, in_flight - rank))
        if rank == pp - 1:
            acts += logits
        stages.append(
            StageMemory(rank, layers_per_rank, n, weights, gradients, optimizer, acts, RUNTIME_OVERHEAD_BYTES)
        )
    return Plan(
        world_size=world_size,
        tp=tp,
        pp=pp,
        dp=dp,
        vpp=vpp,
        precision=precision,
        total_parameters=counts.total,
        flops_per_step=flops_per_step,
        tokens_per_step=tokens_per_step,
        num_microbatches=micro,
        bubble_fraction=bubble,
        stages=tuple(stages),
        gpu_memory_gb=gpu_memory_gb,
    )


def format_plan(plan: Plan, peak_flops_per_gpu: float | None = None) -> str:
    """A human-readable report of ``plan``."""
    lines = [
        f"parameters: {plan.total_parameters / 1e9:.3f} B ({plan.total_parameters:,})",
        f"layout: {plan.world_size} rank(s) = tp {plan.tp} x pp {plan.pp} x dp {plan.dp}"
        + (f" (vpp {plan.vpp})" if plan.vpp > 1 else "")
        + f"; {plan.num_microbatches} micro-batch(es) per step; pipeline bubble {100 * plan.bubble_fraction:.1f}%",
        f"tokens per step: {plan.tokens_per_step:,}; model FLOPs per step: {plan.flops_per_step:.3e} "
        f"({plan.flops_per_step / plan.world_size:.3e} per GPU)",
    ]
    if peak_flops_per_gpu:
        at = plan.flops_per_step / plan.world_size / (0.4 * peak_flops_per_gpu)
        lines.append(f"step time at 40% MFU: {at:.2f} s")
    lines.append(f"memory per rank ({plan.precision} parameters, fp32 gradients and optimizer states), GB:")
    lines.append("  pp rank   layers   params(M)   weights   grads   optimizer   activations   overhead   total")
    for s in plan.stages:
        lines.append(
            f"  {s.pp_rank:>7}   {s.layers:>6}   {s.parameters / 1e6:>9.1f}   {s.weights / GB:>7.2f}   "
            f"{s.gradients / GB:>5.2f}   {s.optimizer / GB:>9.2f}   {s.activations / GB:>11.2f}   "
            f"{s.overhead / GB:>8.2f}   {s.total / GB:>5.2f}"
        )
    worst = plan.worst
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"heaviest rank: pp {worst.pp_rank} needs ~{worst.total / GB:.1f} GB: {verdict} in {plan.gpu_memory_gb:g} GB"
    )
    if not plan.fits:
        lines.append(
            "  to reduce it: raise parallel.tp or parallel.pp, set parallel.distributed_optimizer=true, "
            "train.recompute=full, or lower train.micro_batch_size"
        )
    return "\n".join(lines)


def plan_to_dict(plan: Plan) -> dict:
    """``plan`` as JSON-able data."""
    return {
        "world_size": plan.world_size,
        "layout": {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "vpp": plan.vpp},
        "precision": plan.precision,
        "parameters": plan.total_parameters,
        "flops_per_step": plan.flops_per_step,
        "tokens_per_step": plan.tokens_per_step,
        "num_microbatches": plan.num_microbatches,
        "bubble_fraction": plan.bubble_fraction,
        "memory_gb": [
            {
                "pp_rank": s.pp_rank,
                "layers": s.layers,
                "parameters": s.parameters,
                "weights": s.weights / GB,
                "gradients": s.gradients / GB,
                "optimizer": s.optimizer / GB,
                "activations": s.activations / GB,
                "overhead": s.overhead / GB,
                "total": s.total / GB,
            }
            for s in plan.stages
        ],
        "gpu_memory_gb": plan.gpu_memory_gb,
        "fits": plan.fits,
    }


def default_world_size(config: Config) -> int:
    """tp x pp x dp from the config (dp defaults to 1)."""
    p = config.parallel
    return p.tp * p.pp * (p.dp or 1)
