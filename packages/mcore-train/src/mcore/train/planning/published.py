"""Megatron-Core's published weak-scaling table, and the planner's prediction of each row.

Source: the README of NVIDIA/Megatron-LM ("Performance Benchmarking", the model table ``images/model_table.png``
and ``images/weak_scaling.png``, labelled Megatron-Core r0.8.0; read at commit d98e8a64ddf3, 2026-08-22): GPT
models with vocabulary 131,072 and sequence length 4,096 on H100 GPUs, trained with the distributed optimizer and
overlapped DP (``--overlap-grad-reduce``, ``--overlap-param-gather``), TP (``--tp-comm-overlap``) and PP
communication. The table gives heads, hidden size, layers, TP, PP, DP, GPUs, global batch, per-GPU TFLOP/s and
MFU. It does not give the micro-batch size, the pipeline schedule or recompute; ``tuned_layout`` takes for those
what the planner predicts fastest among the settings that fit in an H100's memory (the rows are tuned runs).
The models are GPT-3 style: LayerNorm, a plain GELU MLP of width 4 x hidden, multi-head attention, untied
output layer (the table's parameter counts are the untied ones: 1.7B = 24 x 12 x 2048^2 + 2 x 131072 x 2048).
Megatron-Core r0.8.0's own choices the planner models for these rows (read in its source at the table's commit
f2e5db402c, 2024-07-15): the MFU formula (``num_floating_point_operations``: 6 x weights + 12 x layers x hidden x
seq, full attention, the logits included: the planner's ``model_flops_per_token``), the unfused fp32 cross entropy
(``vocab_parallel_cross_entropy`` without ``--cross-entropy-loss-fusion``), fp32 gradient reduction for bf16
(``accumulate_allreduce_grads_in_fp32``), and ``--tp-comm-overlap`` through Transformer Engine's userbuffers
(``tp_overlap``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.train.planning.cluster import Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import GB, stage_memory
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import StepPrediction, predict_step


@dataclass(frozen=True)
class PublishedRow:
    """One row of the table (``batch`` in sequences of 4,096 tokens)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    mfu_percent: float

    def shape(self) -> ModelShape:
        return ModelShape(
            hidden=self.hidden, ffn=4 * self.hidden, layers=self.layers, heads=self.heads, kv_heads=self.heads,
            head_dim=self.hidden // self.heads, vocab=131072, gated=False, layernorm=True, name=self.name,
        )  # fmt: skip


MEGATRON_WEAK_SCALING = (
    PublishedRow("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41),
    PublishedRow("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47),
    PublishedRow("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49),
    PublishedRow("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46),
    PublishedRow("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42),
    PublishedRow("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43),
    PublishedRow("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44),
    PublishedRow("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48),
    PublishedRow("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47),
)


def tuned_layout(
    row: PublishedRow, network: Network, micro_batches: tuple[int, ...] = (1, 2, 4, 8)
) -> tuple[Layout, StepPrediction]:
    """The row's tp / pp / dp and batch, with the fastest fitting micro-batch (of ``micro_batches``), vpp and
    recompute; run as Megatron-Core r0.8.0 runs it (``tp_comm_overlap`` where tp > 1, its fp32 cross entropy)."""
    shape = row.shape()
    per_rank = row.batch // row.dp
    memory = network.gpu.memory_gb
    best: tuple[Layout, StepPrediction] | None = None
    per_stage = row.layers // row.pp
    vpps = [1] + [v for v in range(2, per_stage + 1) if per_stage % v == 0] if row.pp > 1 else [1]
    for mbs in (m for m in micro_batches if per_rank % m == 0):
        for vpp in vpps:
            for recompute in ("none", "selective", "full"):
                layout = Layout(
                    tp=row.tp, pp=row.pp, dp=row.dp, vpp=vpp, micro_batch=mbs, global_batch=row.batch,
                    seq_length=4096, sequence_parallel=row.tp > 1, recompute=recompute,
                    distributed_optimizer=True, overlap_param_gather=True, tp_comm_overlap=row.tp > 1,
                    cross_entropy="fp32", dropout=True, grad_nan_check=True,
                )  # fmt: skip
                if layout.problems(shape):
                    break
                if max(s.total for s in stage_memory(shape, layout)) / GB > memory:
                    continue
                prediction = predict_step(shape, layout, network)
                if best is None or prediction.step_s < best[1].step_s:
                    best = (layout, prediction)
                break  # the lightest recompute that fits is the fastest
    if best is None:
        raise ValueError(f"no micro-batch / vpp / recompute of row {row.name} fits in {memory:g} GB")
    return best
