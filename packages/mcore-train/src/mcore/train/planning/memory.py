"""Peak GPU memory of each pipeline rank: states by precision and sharding, activations by schedule.

Per rank (a pipeline stage, the same on every tp / cp / dp rank of it):

- weights: this rank's parameters (its TP / expert slice of its layers, the embedding on the first stage, the
  output layer on the last) in bf16 (fp32 when training in fp32); under ``dp_shard`` (ZeRO-3, FSDP2 as
  ``mcore.train.dp_shard`` builds it) a 1/dp shard of fp32 masters plus the two layers gathered at a time in the
  compute dtype (the one running and the one prefetched);
- gradients: fp32 or bf16 (DDP's ``main_grad`` buffers, ``main_grads_dtype``); under ``dp_shard`` fp32 1/dp
  shards (FSDP2 casts its reduced gradients back to the parameters' dtype, whatever its reduce_dtype) that it
  creates as each layer's backward ends and drops at the step (``zero_grad_buffer`` sets them to None): with one
  micro-batch per step they grow while the activations are freed, so the peak holds the larger of the two, else
  all of them;
- optimizer: fp32 master weights (none for fp32 parameters, none under ``dp_shard``, whose shards are the
  masters) and AdamW's two moments (fp32 or bf16 each: ``exp_avg_dtype``, ``exp_avg_sq_dtype``), divided by
  dp x cp (expert parameters: by the expert-data-parallel size) under the distributed optimizer or ``dp_shard``,
  and the part ``optimizer_offload_fraction`` moved to the host taken out;
- activations: what backward keeps per layer and micro-batch (Korthikanti et al., 2022, adapted to gated MLPs,
  GQA, MoE dispatch buffers and flash attention, which stores no score matrix) times the micro-batches in flight,
  counted by replaying the rank's op order of the schedule (``op_order``: 1F1B holds ``pp - rank``, interleaved
  more, zero bubble keeps the weight-gradient inputs until the deferred W pass), plus one layer's worth of
  backward workspace; with activation offload (``train.activation_offload``) the offloaded parts' bytes leave the
  GPU (``max_memory_allocated`` stops counting a tensor when it is freed, even while its copy is in flight);
- logits on the last stage: the bf16 logits of one micro-batch and their gradient (the fused cross entropy
  writes a logits-sized gradient and keeps no fp32 copy), once more per MTP depth, whose layers, ``eh_proj`` and
  norms also live on the last stage;
- then a fragmentation margin on the sum and a fixed runtime allowance (CUDA context, NCCL buffers), which
  ``torch.cuda.max_memory_allocated`` does not see.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mcore.parallel.pipeline import GPipe, Interleaved1F1B, NoPipelining, OneFOneB, ZeroBubbleH1, stage_layer_ranges
from mcore.train.planning.cp_cost import cp_held_bytes
from mcore.train.planning.layout import Layout
from mcore.train.planning.recompute_terms import dropped_per_token, layout_recomputes, uses_module_terms
from mcore.train.planning.shape import ModelShape

GB = 1e9
FRAGMENTATION_MARGIN = 0.05
RUNTIME_OVERHEAD_BYTES = 2.0 * GB
SCHEDULE_CLASSES = {
    "none": NoPipelining,
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved": Interleaved1F1B,
    "zero-bubble": ZeroBubbleH1,
}
# Share of a micro-batch's activations a zero-bubble B pass leaves for its deferred W pass (the linears' inputs
# and output gradients, which are most of a layer's saved tensors).
ZERO_BUBBLE_W_SHARE = 0.75


@dataclass(frozen=True)
class StageMemory:
    """Estimated bytes of one pipeline rank (``allocated``: what ``max_memory_allocated`` would report)."""

    pp_rank: int
    layers: int
    parameters: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    margin: float
    overhead: float
    never_together: float = 0.0  # bytes of gradients and activations that are never allocated at the same time

    @property
    def allocated(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits - self.never_together

    @property
    def total(self) -> float:
        return self.allocated + self.margin + self.overhead


def rank_chunks(shape: ModelShape, layout: Layout) -> list[list[tuple[int, int]]]:
    """Per pipeline rank, the (start, end) layer range of each of its model chunks."""
    custom = list(layout.pipeline_layout) if layout.pipeline_layout is not None else None
    return stage_layer_ranges(shape.layers, layout.pp, layout.vpp, custom)


def _sharded(lin_weights: int, role: str, tp: int) -> float:
    return lin_weights if role == "replicated" else lin_weights / tp


def layer_parameters_per_rank(shape: ModelShape, index: int, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters of layer ``index`` on one rank."""
    dense = sum(_sharded(lin.weights, lin.role, layout.tp) for lin in shape.layer_linears(index))
    dense += shape.layer_norm_and_bias_params(index, layout.tp)
    expert = 0.0
    if shape.is_moe_layer(index):
        per_expert = sum(lin.weights for lin in shape.expert_linears()) / layout.expert_tp
        if shape.expert_bias:
            per_expert += sum(lin.out_features for lin in shape.expert_linears()) / layout.expert_tp
            dense += shape.num_experts  # the router's bias
        expert = per_expert * shape.num_experts / layout.ep
    return dense, expert


def stage_parameters(shape: ModelShape, layout: Layout, rank: int, chunks) -> tuple[float, float]:
    """(dense, expert) parameters held by pipeline rank ``rank``."""
    key = (layout.tp, layout.pp, layout.ep, layout.expert_tp)
    return _stage_parameters(shape, key, rank, tuple(tuple(c) for c in chunks))


@lru_cache(maxsize=65536)
def _stage_parameters(shape: ModelShape, key: tuple[int, int, int, int], rank: int, chunks) -> tuple[float, float]:
    tp, pp, ep, etp = key
    layout = Layout(tp=tp, pp=pp, ep=ep, etp=etp)
    dense = expert = 0.0
    for start, end in chunks:
        for i, count in shape.layer_kinds(start, end).items():
            d, e = layer_parameters_per_rank(shape, i, layout)
            dense, expert = dense + count * d, expert + count * e
    embedding = shape.padded_vocab(layout.tp) * shape.hidden / layout.tp
    if rank == 0:
        dense += embedding
    if rank == layout.pp - 1:
        dense += shape.norm_params()
        if not shape.tied or layout.pp > 1:
            dense += embedding
        if shape.mtp_layers:  # per depth: a layer like the last, eh_proj (column-parallel), three norms
            d, e = layer_parameters_per_rank(shape, shape.layers - 1, layout)
            own = shape.mtp_eh_proj().weights / layout.tp + 3 * shape.norm_params()
            dense, expert = dense + shape.mtp_layers * (d + own), expert + shape.mtp_layers * e
    return dense, expert


def stage_overwritten_weights(shape: ModelShape, layout: Layout, rank: int, chunks) -> float:
    """Dense gradient elements on pipeline rank ``rank`` whose step's first weight-gradient GEMM writes ``main_grad``
    without reading it (``tensor_parallel._weight_grad``, gradient-accumulation fusion on: the default), so DDP's
    ``zero_grad_buffer`` leaves them unfilled: the column- and row-parallel linears' weights, the output layer (also
    when tied to the embedding at pp = 1: its GEMM runs first in backward, the embedding's gradient is added after)
    and MTP's ``eh_proj``. Not the replicated linears (MLA's down projections, the router: autograd's ``.grad``)."""
    tp = layout.tp

    def tp_linears(index: int) -> float:
        return sum(lin.weights / tp for lin in shape.layer_linears(index) if lin.role != "replicated")

    n = sum(count * tp_linears(i) for start, end in chunks for i, count in shape.layer_kinds(start, end).items())
    if rank == layout.pp - 1:
        n += shape.padded_vocab(tp) * shape.hidden / tp
        if shape.mtp_layers:  # per depth: a layer like the last and eh_proj
            n += shape.mtp_layers * (tp_linears(shape.layers - 1) + shape.mtp_eh_proj().weights / tp)
    return n


@lru_cache(maxsize=65536)
def activation_parts_per_layer(shape: ModelShape, layout: Layout, index: int, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes layer ``index`` keeps for backward per micro-batch on one rank, by the decoder layer's part that saves
    them (``input_norm``, ``attention``, ``mlp_norm``, ``mlp``: the names ``train.activation_offload`` takes); full
    recompute keeps only the layer input (counted under ``input_norm``). Cached: do not modify the result."""
    tokens = layout.seq_length * layout.micro_batch / layout.cp
    tp = layout.tp
    rep = shape.hidden / tp if layout.sequence_parallel else shape.hidden
    if layout.recompute == "full":
        return {"input_norm": dtype_bytes * tokens * rep, "attention": 0.0, "mlp_norm": 0.0, "mlp": 0.0}
    if shape.block(index) in ("M", "-"):
        return _hybrid_parts(shape, layout, index, tokens, rep, dtype_bytes)
    if shape.is_mla:
        attn = (2 * shape.score_width() + 2 * shape.attention_width) / tp + shape.kv_lora_rank + shape.q_lora_rank
    else:
        attn = (2 * shape.q_size + 2 * shape.kv_size) / tp  # q, k, v and the attention output
    by_module = uses_module_terms(shape, layout)  # train.recompute_modules (or MLA's selective): recompute_terms
    if layout.recompute == "selective" and not by_module:
        attn -= shape.attention_width / tp  # the attention output is recomputed
    pieces = {"norm_output": rep}
    if shape.is_moe_layer(index):
        rows = shape.top_k * layout.expert_tp / tp  # routed rows per token of this rank (see time_model)
        pieces["routed"] = rows * (2 * shape.hidden + (3 if shape.gated else 2) * shape.moe_ffn / layout.expert_tp)
        pieces["shared"] = (3 if shape.gated else 2) * shape.shared_ffn / tp
        pieces["dispatch"] = 4 * shape.num_experts / dtype_bytes  # dispatch buffers, fp32 router probs
        mlp = pieces["routed"] + pieces["shared"] + pieces["dispatch"]
    else:
        mlp = pieces["dense"] = (3 if shape.gated else 2) * shape.ffn / tp
    softmax_stats = 4 * tokens * shape.heads / tp  # fp32 log-sum-exp of flash attention
    if by_module:
        attn_dropped, mlp_dropped, stats_dropped = dropped_per_token(shape, layout, pieces)
        attn, mlp = attn - attn_dropped, mlp - mlp_dropped
        softmax_stats = 0.0 if stats_dropped else softmax_stats
    # each norm keeps its input; its output is the input the next part's first linear keeps
    alone = shape.block(index) == "*"  # a hybrid attention layer: no MLP part
    return {
        "input_norm": dtype_bytes * tokens * rep,
        "attention": dtype_bytes * tokens * (rep + attn)
        + softmax_stats
        + cp_held_bytes(shape, layout, dtype_bytes)
        + (tokens * rep if layout.dropout else 0.0),
        "mlp_norm": 0.0 if alone else dtype_bytes * tokens * rep,
        "mlp": 0.0 if alone else dtype_bytes * tokens * (rep + mlp) + (tokens * rep if layout.dropout else 0.0),
    }  # dropout: 1-byte masks


def _hybrid_parts(shape: ModelShape, layout: Layout, index: int, tokens: float, rep: float, dtype_bytes: int) -> dict:
    """A hybrid layer of one Mamba-2 mixer (under ``attention``: the mixer part) or one dense MLP (``mlp``)."""
    mixer = mlp = 0.0
    kept_norm = 0.0 if layout_recomputes(layout, "layernorm") else rep  # the norm output the block's linear keeps
    if shape.block(index) == "M":
        core = shape.mamba.saved_bytes_per_token(layout.tp, layout_recomputes(layout, "mamba_core"))
        mixer = tokens * (dtype_bytes * kept_norm + core)
    else:
        hidden = 0.0 if layout_recomputes(layout, "mlp") else (3 if shape.gated else 2) * shape.ffn / layout.tp
        mlp = dtype_bytes * tokens * (kept_norm + hidden)
    return {"input_norm": dtype_bytes * tokens * rep, "attention": mixer, "mlp_norm": 0.0, "mlp": mlp}


def activation_bytes_per_layer(shape: ModelShape, layout: Layout, index: int, dtype_bytes: int = 2) -> float:
    """Bytes layer ``index`` keeps for backward per micro-batch on one rank."""
    return sum(activation_parts_per_layer(shape, layout, index, dtype_bytes).values())


def offloaded_bytes_per_layer(shape: ModelShape, layout: Layout, index: int) -> float:
    """Bytes of layer ``index`` that ``layout.activation_offload`` moves to the host per micro-batch."""
    parts = activation_parts_per_layer(shape, layout, index)
    names = set(layout.activation_offload)
    return sum(parts.values()) if "layer" in names else sum(v for k, v in parts.items() if k in names)


@lru_cache(maxsize=4096)
def _live_states(schedule_name: str, pp: int, vpp: int, m: int, rank: int) -> tuple[tuple[float, ...], ...]:
    """The distinct per-chunk counts of live micro-batch activations right after each forward of ``rank`` (peaks
    only follow a forward), replaying its op order; zero bubble's B keeps ``ZERO_BUBBLE_W_SHARE`` until the W."""
    schedule = SCHEDULE_CLASSES[schedule_name]
    live = [0.0] * vpp
    states = set()
    for op in schedule.op_order(pp, rank, vpp, m):
        if op.kind == "F":
            live[op.chunk] += 1
            states.add(tuple(live))
        elif op.kind == "B":
            live[op.chunk] -= (1 - ZERO_BUBBLE_W_SHARE) if schedule.splits_backward else 1
        else:
            live[op.chunk] -= ZERO_BUBBLE_W_SHARE
    # a state no larger than another in every chunk can never be the peak
    ordered = sorted(states, key=sum, reverse=True)
    kept: list[tuple[float, ...]] = []
    for state in ordered:
        if not any(all(a <= b for a, b in zip(state, k, strict=True)) for k in kept):
            kept.append(state)
    return tuple(kept)


def live_activation_peak(layout: Layout, chunk_bytes: list[float], rank: int) -> float:
    """Peak bytes of activations held by ``rank`` while its schedule's op order runs (enough micro-batches to
    reach the steady state; GPipe: all of them)."""
    m, step = layout.num_microbatches, layout.pp * layout.vpp
    name = layout.schedule_name
    cap = m if name == "gpipe" or m <= 2 * step else 2 * step
    if name == "interleaved":
        cap = -(-cap // layout.pp) * layout.pp
    states = _live_states(name, layout.pp, layout.vpp, cap, rank)
    return max(sum(n * b for n, b in zip(state, chunk_bytes, strict=True)) for state in states)


def stage_memory(shape: ModelShape, layout: Layout) -> list[StageMemory]:
    """Memory of every pipeline rank (see the module docstring)."""
    param_bytes = 4 if layout.precision == "fp32" else 2
    master = 0 if layout.precision == "fp32" else 4
    sharded = layout.distributed_optimizer or layout.dp_shard
    keep = 1.0 - layout.optimizer_offload_fraction
    out = []
    for rank, chunks in enumerate(rank_chunks(shape, layout)):
        dense, expert = stage_parameters(shape, layout, rank, chunks)
        n = dense + expert
        shards = (layout.dp * layout.cp, layout.expert_dp) if sharded else (1, 1)
        optimizer = (master + layout.moment_bytes) * (dense / shards[0] + expert / shards[1]) * keep
        weights, grads = param_bytes * n, layout.grad_bytes * n
        if layout.dp_shard:
            layers = sum(e - s for s, e in chunks) or 1
            working = 2 * n / layers  # two layers unsharded at a time, in the compute dtype
            local = dense / shards[0] + expert / shards[1]  # FSDP2 shards over dp x cp (experts: edp)
            optimizer = layout.moment_bytes * local * keep  # the fp32 shards are the masters: only the moments
            weights, grads = 4 * local + param_bytes * working, 4 * local
        per_chunk = [
            sum(n * activation_bytes_per_layer(shape, layout, i) for i, n in shape.layer_kinds(s, e).items())
            for s, e in chunks
        ]
        if rank == layout.pp - 1 and shape.mtp_layers:  # the MTP layers run after the last chunk's layers
            per_chunk[-1] += shape.mtp_layers * activation_bytes_per_layer(shape, layout, shape.layers - 1)
        kept = per_chunk
        if layout.activation_offload:  # what goes to the host leaves the GPU; backward's workspace is a whole layer
            kept = [
                c - sum(n * offloaded_bytes_per_layer(shape, layout, i) for i, n in shape.layer_kinds(s, e).items())
                for c, (s, e) in zip(per_chunk, chunks, strict=True)
            ]
        acts = live_activation_peak(layout, kept, rank)
        layer_counts = [e - s for s, e in chunks]
        if any(layer_counts):
            acts += max(c / n_ for c, n_ in zip(per_chunk, layer_counts, strict=True) if n_)  # backward workspace
        logits = 0.0
        if rank == layout.pp - 1:
            tokens = layout.seq_length * layout.micro_batch / layout.cp
            # fused: bf16 logits and their gradient; fp32 (Megatron's): the bf16 logits and the fp32 softmax it
            # saves for backward (its gradient is computed in place)
            second = 2 if layout.cross_entropy == "fused" else 4
            logits = tokens * shape.padded_vocab(layout.tp) / layout.tp * (2 + second) * (1 + shape.mtp_layers)
        never_together = 0.0
        if layout.dp_shard and layout.num_microbatches == 1 and layout.pp == 1:
            never_together = min(grads, acts + logits)  # the gradients appear as the activations are freed
        allocated = weights + grads + optimizer + acts + logits - never_together
        out.append(
            StageMemory(
                pp_rank=rank,
                layers=sum(layer_counts),
                parameters=round(n),
                weights=weights,
                gradients=grads,
                optimizer=optimizer,
                activations=acts,
                logits=logits,
                never_together=never_together,
                margin=FRAGMENTATION_MARGIN * allocated,
                overhead=RUNTIME_OVERHEAD_BYTES,
            )
        )
    return out
