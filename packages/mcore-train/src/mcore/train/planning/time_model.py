"""Step time of one layout: compute per op from calibrated rates, communication per link, overlap as coded.

Per layer and micro-batch on one rank (tokens = seq x micro-batch / cp):

- GEMMs: every matmul's forward, input-gradient and weight-gradient GEMM at the calibration's rate for its size
  (the weight-gradient one writing fp32 into the gradient buffer, ``wgrad_fp32_slowdown``); routed experts as
  ``top_k x tokens`` rows spread over this rank's experts; recompute adds the forward (full) or attention
  (selective) again to the backward; the experts' GEMMs as one grouped GEMM per linear at the calibrated
  grouped efficiency for their rows per expert;
- attention: the causal FLOPs at the calibration's rate for the document length (a sliding window: its pairs at
  the rate for the window's length), backward 2.5x the forward;
- memory-bound ops (norms, residual adds, RoPE, the GLU, casts and layout copies): their bytes at the calibrated
  share of copy bandwidth; the MoE permute / unpermute (gathers and scatters of the routed rows) at the
  calibration's measured ``moe_dispatch_gbps``;
- TP / SP collectives: two per layer in forward and two in backward, on the critical path (mcore does not
  overlap them); ``tp_comm_overlap`` (Megatron's ``--tp-comm-overlap``) runs them as Transformer Engine's
  userbuffers do, split GEMMs beside the communication (``tp_overlap``);
- CP by ``cp_comm_type`` (``cp_cost``): the p2p ring of K/V (and backward's fp32 dK/dV) overlapped with the
  attention it feeds, all-gather / all-to-all blocking; EP all-to-all (dispatch, combine) exposed;
- ZeRO-3 (``dp_shard``): per layer parameter all-gather (forward and backward) and gradient reduce-scatter,
  prefetched under the layer's compute (exposed: what exceeds it), and FSDP2's copies into and out of the
  collectives' flat buffers (memory-bound, on the compute stream, at any dp);
- host: ``host_ms_per_layer`` the GPU waits for launches.

Per step: the schedule's plans replayed with these per-stage op times and p2p transfer times
(``pipeline_sim``), then per rank the data-parallel gradient reduction as ``DistributedDataParallel`` runs it:
bucketed, launched during the last micro-batch's backward when ``overlap_grad_reduce`` (exposed: what exceeds
that backward, and at least the last bucket, which on the first stage is the embedding's gradient), all of it
after the backward otherwise; the optimizer; the distributed optimizer's parameter all-gather, after the step
or, with ``overlap_param_gather``, under the next forward (exposed: what exceeds the first micro-batch's
forward, at least one bucket).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore.train.planning.calibration import BACKWARD_ATTENTION_RATIO, Calibration
from mcore.train.planning.cluster import Group, Network
from mcore.train.planning.cp_cost import cp_cost
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import layer_parameters_per_rank
from mcore.train.planning.recompute_terms import recomputed_forward, uses_module_terms
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.tp_overlap import PLAIN, OverlapPlan, exposed_seconds, overlap_plans

# the fused AdamW pass (fp32 master, gradient, two moments read, three written, the bf16 parameter written) at the
# calibration's optimizer_efficiency, and the gradient-norm read at the memory-bound share
ADAMW_BYTES_PER_PARAM, GRAD_NORM_BYTES_PER_PARAM = 30, 4
BUCKET_ELEMENTS = 40_000_000
# Bytes moved per logit element by the loss (forward, backward). fused: mcore's bf16 cross entropy reads the
# logits once and writes a bf16 gradient (plus a copy). fp32: Megatron-Core r0.8.0's vocab_parallel_cross_entropy
# (megatron/core/tensor_parallel/cross_entropy.py): .float() (read 2, write 4), max (4), in-place subtract (8),
# in-place exp (8), sum (4), in-place divide (8); backward: in-place multiply (8), the cast back to bf16 (6).
CROSS_ENTROPY_BYTES = {"fused": (2, 8), "fp32": (38, 14)}
# Dropout (Layout.dropout: Megatron-Core's defaults, attention and hidden dropout 0.1). Hidden: each of a layer's
# two bias-dropout-adds (megatron/core/fusions/fused_bias_dropout.py, one fused kernel) also writes a 1-byte mask
# per element in forward, and backward, which without dropout passes the gradient through, reads the gradient and
# the mask and writes the input gradient (2 + 1 + 2 bytes). Attention: cuDNN's fused attention draws the mask in
# the kernel; on an H200 it cost 3.4% of forward + backward (0.594 -> 0.614 ms, TransformerEngine issue #3312:
# TE 2.15, sbhd, 4 x 4096 tokens, 16 heads of 128, p=0.1).
DROPOUT_BYTES = (1, 5)
ATTENTION_DROPOUT_COST = 0.614 / 0.594 - 1


@dataclass
class OpCost:
    """Seconds of one layer's (or the head's) forward and backward on one micro-batch, by category."""

    forward: dict[str, float] = field(default_factory=dict)
    backward: dict[str, float] = field(default_factory=dict)
    wgrad: float = 0.0  # the weight-gradient GEMMs inside backward (what zero bubble defers)

    def add(self, phase: str, key: str, seconds: float) -> None:
        d = self.forward if phase == "F" else self.backward
        d[key] = d.get(key, 0.0) + seconds

    def __iadd__(self, other: OpCost) -> OpCost:
        for phase, d in (("F", other.forward), ("B", other.backward)):
            for k, v in d.items():
                self.add(phase, k, v)
        self.wgrad += other.wgrad
        return self

    def scaled(self, factor: float) -> OpCost:
        """This cost ``factor`` times (``factor`` layers of one kind)."""
        return OpCost(
            {k: v * factor for k, v in self.forward.items()},
            {k: v * factor for k, v in self.backward.items()},
            self.wgrad * factor,
        )

    @property
    def f(self) -> float:
        return sum(self.forward.values())

    @property
    def b(self) -> float:
        return sum(self.backward.values())


class TimeModel:
    """Per-op and per-step times of ``shape`` under ``layout`` on ``network`` (see the module docstring)."""

    def __init__(self, shape: ModelShape, layout: Layout, network: Network) -> None:
        self.shape, self.layout, self.net = shape, layout, network
        self.gpu: Calibration = network.gpu
        self.tokens = layout.seq_length * layout.micro_batch / layout.cp
        # GEMM curve: fp8 or fp32 when the calibration has one, else bf16's
        self.precision = layout.precision if layout.precision in self.gpu.gemm else "bf16"
        self.dtype = 4 if layout.precision == "fp32" else 2
        # tokens one rank sends into its MoE layers: its sequence-parallel slice, gathered over the expert-TP group
        self.moe_tokens = self.tokens * layout.expert_tp / layout.tp
        tp, cp, dp = layout.tp, layout.cp, layout.dp
        self.tp_group, self.cp_group = Group(tp, 1), Group(cp, tp)
        self.dp_group = Group(dp * cp, tp)  # gradients and optimizer states over dp x cp (CP ranks hold replicas)
        self.ep_group = Group(layout.ep, layout.expert_tp)
        self.edp_group = Group(layout.expert_dp, layout.expert_tp * layout.ep)
        per_node = network.cluster.gpus_per_node
        self.pp_crosses_node = tp * cp * dp >= per_node and layout.pp > 1
        self.tp_overlap = layout.tp_comm_overlap and layout.sequence_parallel and tp > 1
        if self.tp_overlap:  # one sequence-parallel collective of the layer input, and one shard's copy
            nbytes = self.tokens * shape.hidden * self.dtype
            self.tp_times = {
                "all_gather": network.collective("all_gather", self.tp_group, nbytes),
                "reduce_scatter": network.collective("reduce_scatter", self.tp_group, nbytes),
                "shard": network.p2p(nbytes / tp, False),
            }

    # ----------------------------------------------------------------------------------------- pieces
    def _gemms(self, cost: OpCost, m: float, k: int, n: float, count: float = 1.0, plan: OverlapPlan = PLAIN) -> None:
        g = self.gpu
        m, k, n = max(1, round(m)), max(1, round(k)), max(1, round(n))

        def split(rows: int, cols: int, inner: int, chunks: int) -> float:  # one GEMM run as row chunks
            return chunks * g.gemm_seconds(max(1, rows // chunks), cols, inner, self.precision) * count

        fwd = split(m, n, k, plan.fwd_chunks) * plan.fwd_slowdown
        dgrad = split(m, k, n, plan.dgrad_chunks) * plan.dgrad_slowdown
        wgrad = g.gemm_seconds(n, k, m, self.precision) * count * g.wgrad_fp32_slowdown * plan.wgrad_slowdown
        cost.add("F", "gemm", fwd)
        cost.add("B", "gemm", dgrad + wgrad)
        cost.wgrad += wgrad
        if plan is not PLAIN:
            t = self.tp_times
            fwd_comm = t["all_gather"] if plan.fwd_comm == "ring" else t["reduce_scatter"]
            dgrad_comm = t["all_gather"]  # ring: the output gradient's; bulk: the saved input's (for wgrad)
            cost.add("F", "tp_comm", exposed_seconds(plan.fwd_comm, fwd, plan.fwd_chunks, fwd_comm, t["shard"]))
            cost.add("B", "tp_comm", exposed_seconds(plan.dgrad_comm, dgrad, plan.dgrad_chunks, dgrad_comm, t["shard"]))
            cost.add("B", "tp_comm", exposed_seconds(plan.wgrad_comm, wgrad, 1, t["reduce_scatter"], t["shard"]))

    def _linears(self, cost: OpCost, linears, rows: float) -> None:
        tp = self.layout.tp
        plans = overlap_plans([lin.role for lin in linears], tp, self.gpu.sm_count) if self.tp_overlap else None
        for i, lin in enumerate(linears):
            k = lin.in_features // tp if lin.role == "row" else lin.in_features
            n = lin.out_features // tp if lin.role == "column" else lin.out_features
            self._gemms(cost, rows, k, n, plan=plans[i] if plans else PLAIN)

    def _experts(self, cost: OpCost) -> None:
        """The routed experts: per linear one grouped GEMM over this rank's experts (``mcore.kernels.grouped_gemm``;
        forward, input gradient and weight gradient each a grouped GEMM of the same kind), or under
        ``expert_gemm="per_expert"`` one dense GEMM per expert of its (balanced) rows."""
        s, lay, g = self.shape, self.layout, self.gpu
        local = s.num_experts // lay.ep
        rows = self.moe_tokens * s.top_k * lay.ep / s.num_experts  # per expert, on average (balanced routing)
        for lin in s.expert_linears():
            k = lin.in_features // lay.expert_tp if lin.role == "row" else lin.in_features
            n = lin.out_features // lay.expert_tp if lin.role == "column" else lin.out_features
            if lay.expert_gemm == "per_expert":  # one cuBLAS GEMM per expert, its wgrad into fp32 main_grad
                fwd = local * g.gemm_seconds(rows, n, k, self.precision)
                dgrad = local * g.gemm_seconds(rows, k, n, self.precision)
                wgrad = local * g.gemm_seconds(n, k, rows, self.precision) * g.wgrad_fp32_slowdown
            else:
                fwd = g.grouped_gemm_seconds(local, rows, n, k, self.precision)
                dgrad = g.grouped_gemm_seconds(local, rows, k, n, self.precision)
                wgrad = fwd * g.wgrad_fp32_slowdown  # the same FLOPs, writing fp32 into the gradient buffer
            cost.add("F", "gemm", fwd)
            cost.add("B", "gemm", dgrad + wgrad)
            cost.wgrad += wgrad

    def _attention(self, cost: OpCost, index: int) -> None:
        s, lay = self.shape, self.layout
        width = (s.score_width() + s.attention_width) / lay.tp
        seq, span = lay.seq_length, lay.seq_length
        pairs = seq**2 / 2  # query-key pairs a causal document computes
        if s.is_window_layer(index) and s.window < seq:  # each query sees the last `window` keys
            span = s.window
            pairs = seq * span - span**2 / 2
        causal_fwd = 2.0 * lay.micro_batch * pairs * width / lay.cp
        if lay.document_lengths:  # packed documents: each its own causal block at the rate for its length
            fwd, bwd = self._packed_attention(index, width)
            total = fwd + bwd
        else:
            # a window's work runs in tiles like a document of its length: the calibrated rate at that length
            total = self.gpu.attention_seconds(causal_fwd * (1 + BACKWARD_ATTENTION_RATIO), span)
            fwd = total / (1 + BACKWARD_ATTENTION_RATIO)
        if lay.dropout:
            fwd, total = fwd * (1 + ATTENTION_DROPOUT_COST), total * (1 + ATTENTION_DROPOUT_COST)
        cost.add("F", "attention", fwd)
        cost.add("B", "attention", total - fwd)
        if lay.cp > 1:  # cp_cost: ring transfers under the attention blocks, the rest blocking
            cp = cp_cost(s, lay, self.net, self.dtype)
            cost.add("F", "cp_comm", max(0.0, cp.ring_forward - fwd) + cp.blocking_forward)
            cost.add("B", "cp_comm", max(0.0, cp.ring_backward - (total - fwd)) + cp.blocking_backward)
        if lay.recompute == "selective" and not uses_module_terms(s, lay):  # else recompute_terms prices it
            cost.add("B", "attention", fwd)

    def _packed_attention(self, index: int, width: float) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch's packed documents (``Layout.document_lengths``): the
        work is the sum over documents of their query-key pairs (a window caps each document's span), each at
        the calibrated packed-kernel rate for its length."""
        s, lay = self.shape, self.layout
        fwd = bwd = 0.0
        for length in lay.document_lengths:
            span = s.window if s.is_window_layer(index) and s.window < length else length
            pairs = length * span - span**2 / 2
            f, b = self.gpu.packed_attention_seconds(2.0 * lay.micro_batch * pairs * width / lay.cp, span)
            fwd, bwd = fwd + f, bwd + b
        return fwd, bwd

    def _mamba(self, cost: OpCost) -> None:
        """A Mamba-2 mixer's conv and scan at the calibrated rates, and its memory-bound work: the gated norm
        (forward reads y, z and writes the output; backward reads three, writes two) and the conv input's copy out
        of ``in_proj``'s output (backward: the three gradients written back into one); selective recompute runs the
        conv, the scan and the norm again in backward (``planning/mamba_terms.py``)."""
        m, g, tp = self.shape.mamba, self.gpu, self.layout.tp
        (ssd_f, ssd_b), (conv_f, conv_b) = g.mamba_rates()
        flops = self.tokens * m.ssd_forward_flops(self.layout.seq_length) / tp
        conv = self.tokens * m.conv_dim * self.dtype / tp
        fwd = flops / (ssd_f * 1e12) + 2 * conv / (conv_f * 1e9)
        cost.add("F", "ssm", fwd)
        cost.add("B", "ssm", 2 * flops / (ssd_b * 1e12) + 3 * conv / (conv_b * 1e9))
        copies_f = (3 * m.d_inner + 2 * m.conv_dim) / tp * self.tokens * self.dtype
        copies_b = (5 * m.d_inner + 2 * m.in_width) / tp * self.tokens * self.dtype
        cost.add("F", "memory", g.memory_seconds(copies_f))
        cost.add("B", "memory", g.memory_seconds(copies_b))
        if self.layout.recompute == "selective":
            cost.add("B", "ssm", fwd)
            cost.add("B", "memory", g.memory_seconds(copies_f))

    def _memory_bound(self, cost: OpCost, moe: bool, block: str = "T") -> None:
        s, lay = self.shape, self.layout
        tp = lay.tp
        if block != "T":  # a hybrid layer: one norm and residual add, then its block's own
            self._hybrid_memory_bound(cost, block)
            return
        rep = s.hidden / tp if lay.sequence_parallel else s.hidden
        qkv = (s.q_size + s.kv_size) / tp
        routed = s.moe_ffn * s.top_k / lay.expert_tp * self.moe_tokens / self.tokens
        width = routed + s.shared_ffn / tp if moe else s.ffn / tp
        glu_f, glu_b = (3, 5) if s.gated else (2, 3)
        fwd = 4 * rep + 6 * rep + 2 * qkv + glu_f * width + 16 * s.hidden / tp
        bwd = 6 * rep + 6 * rep + 2 * qkv + glu_b * width + 16 * s.hidden / tp
        cost.add("F", "memory", self.gpu.memory_seconds(fwd * self.tokens * self.dtype))
        cost.add("B", "memory", self.gpu.memory_seconds(bwd * self.tokens * self.dtype))
        if lay.dropout:  # the two bias-dropout-adds: a mask written in forward; read with the gradient in backward
            fwd_bytes, bwd_bytes = DROPOUT_BYTES
            cost.add("F", "memory", self.gpu.memory_seconds(2 * fwd_bytes * rep * self.tokens))
            cost.add("B", "memory", self.gpu.memory_seconds(2 * bwd_bytes * rep * self.tokens))
        if moe:  # permute and unpermute each read and write every routed row, in forward and in backward
            permute = 4 * s.top_k * s.hidden * self.moe_tokens * self.dtype
            cost.add("F", "moe_dispatch", self.gpu.dispatch_seconds(permute))
            cost.add("B", "moe_dispatch", self.gpu.dispatch_seconds(permute))

    def _hybrid_memory_bound(self, cost: OpCost, block: str) -> None:
        s, tp = self.shape, self.layout.tp
        rep = s.hidden / tp if self.layout.sequence_parallel else s.hidden
        fwd, bwd = 5 * rep + 8 * s.hidden / tp, 6 * rep + 8 * s.hidden / tp  # half a transformer layer's
        if block == "*":
            fwd, bwd = fwd + 2 * (s.q_size + s.kv_size) / tp, bwd + 2 * (s.q_size + s.kv_size) / tp
        elif block == "-":
            glu_f, glu_b = (3, 5) if s.gated else (2, 3)
            fwd, bwd = fwd + glu_f * s.ffn / tp, bwd + glu_b * s.ffn / tp
        cost.add("F", "memory", self.gpu.memory_seconds(fwd * self.tokens * self.dtype))
        cost.add("B", "memory", self.gpu.memory_seconds(bwd * self.tokens * self.dtype))

    def _tp_comm(self, cost: OpCost, collectives: int) -> None:
        lay = self.layout
        if lay.tp == 1:
            return
        nbytes = self.tokens * self.shape.hidden * self.dtype
        if lay.sequence_parallel:
            one = self.net.collective("all_gather", self.tp_group, nbytes)
            one = (one + self.net.collective("reduce_scatter", self.tp_group, nbytes)) / 2
        else:
            one = self.net.collective("all_reduce", self.tp_group, nbytes)
        cost.add("F", "tp_comm", collectives * one)
        cost.add("B", "tp_comm", collectives * one)

    def ep_exchange_bytes(self) -> float:
        """Bytes of one EP all-to-all of one MoE layer and micro-batch (NCCL's buffer size: this rank's routed
        rows, ``tokens x top_k x hidden``); a layer runs four (dispatch and combine, forward and backward), each
        sending ``(ep - 1) / ep`` of it off the rank."""
        s = self.shape
        return self.moe_tokens * s.top_k * s.hidden * self.dtype

    def _ep_comm(self, cost: OpCost) -> None:
        if self.layout.ep == 1:
            return
        one = self.net.collective("all_to_all", self.ep_group, self.ep_exchange_bytes())
        cost.add("F", "ep_comm", 2 * one)
        cost.add("B", "ep_comm", 2 * one)

    def _zero3(self, cost: OpCost, dense: float, expert: float) -> None:
        """ZeRO-3: gather this layer's parameters before its forward and again before its backward, reduce-scatter
        its fp32 gradients after; dense parameters over dp, expert ones over the expert-data-parallel group."""
        if not self.layout.dp_shard:
            return
        gather = sum(
            self.net.collective("all_gather", group, n * self.dtype)
            for group, n in ((self.dp_group, dense), (self.edp_group, expert))
        )
        scatter = sum(
            self.net.collective("reduce_scatter", group, n * 4.0)
            for group, n in ((self.dp_group, dense), (self.edp_group, expert))
        )
        cost.add("F", "dp_shard_comm", max(0.0, gather - cost.f))
        hidden_scatter = min(scatter, max(0.0, cost.b - gather))
        cost.add("B", "dp_shard_comm", max(0.0, gather + scatter - cost.b))
        cost.add("B", "dp_overlap_slowdown", self.gpu.reduce_overlap_slowdown * hidden_scatter)
        self._zero3_copies(cost, dense + expert)

    def _zero3_copies(self, cost: OpCost, params: float) -> None:
        """FSDP2's copies around its collectives, at any dp (also 1): an all-gather reads the fp32 shard and writes
        it in the compute dtype into the flat buffer, then splits the gathered buffer into the parameters; a
        reduce-scatter casts the gradients into an fp32 buffer and writes the fp32 shard. Forward gathers, backward
        gathers again (``reshard_after_forward``) and reduce-scatters."""
        shards, dt = self.layout.dp * self.layout.cp, self.dtype
        gather = params * ((4 + dt) / shards + 2 * dt)
        scatter = params * (dt + 4 + 4 / shards)
        cost.add("F", "dp_shard_copy", self.gpu.memory_seconds(gather))
        cost.add("B", "dp_shard_copy", self.gpu.memory_seconds(gather + scatter))

    # ------------------------------------------------------------------------------------------- layer
    def layer_cost(self, index: int) -> OpCost:
        """One layer, one micro-batch, one rank."""
        s, lay = self.shape, self.layout
        cost = OpCost()
        self._linears(cost, s.layer_linears(index), self.tokens)
        moe = s.is_moe_layer(index)
        if moe:
            self._experts(cost)
            self._ep_comm(cost)
        block = s.block(index)
        if s.has_attention(index):
            self._attention(cost, index)
        if block == "M":
            self._mamba(cost)
        self._memory_bound(cost, moe, block)
        if not self.tp_overlap:  # else charged with the linears
            self._tp_comm(cost, 2 if block == "T" else 1)
        if lay.recompute == "full":
            for k, v in list(cost.forward.items()):
                cost.add("B", k, v)
        if uses_module_terms(s, lay):  # train.recompute_modules: each recomputed module's forward again
            recomputed_forward(self, index, cost)
        host = self.gpu.host_ms_per_layer * 1e-3
        cost.add("F", "host", host / 3)
        cost.add("B", "host", 2 * host / 3)
        self._zero3(cost, *layer_parameters_per_rank(s, index, lay))
        return cost

    def mtp_cost(self) -> OpCost:
        """One MTP depth on the last stage, one micro-batch: ``eh_proj``, a layer like the last, the output layer
        and its loss again."""
        s = self.shape
        cost = OpCost()
        self._linears(cost, [s.mtp_eh_proj()], self.tokens)
        cost += self.layer_cost(s.layers - 1)
        cost += self.head_cost(False, True)
        return cost

    def head_cost(self, first: bool, last: bool) -> OpCost:
        """The embedding (first stage) and the output layer with the loss (last stage), one micro-batch."""
        s, lay = self.shape, self.layout
        cost = OpCost()
        vocab = s.padded_vocab(lay.tp) // lay.tp
        if first:
            cost.add("F", "memory", self.gpu.memory_seconds(self.tokens * s.hidden * self.dtype * 2))
            cost.add("B", "memory", self.gpu.memory_seconds(self.tokens * s.hidden * 10))
            self._tp_comm(cost, 1)
        if lay.dp_shard:  # the embedding and the output layer are FSDP units of their own
            self._zero3_copies(cost, (int(first) + int(last and (not s.tied or lay.pp > 1))) * vocab * s.hidden)
        if last:
            self._gemms(cost, self.tokens, s.hidden, vocab)
            elements = self.tokens * vocab
            fwd, bwd = CROSS_ENTROPY_BYTES[lay.cross_entropy]
            cost.add("F", "memory", self.gpu.memory_seconds(elements * fwd + self.tokens * s.hidden * 4))
            cost.add("B", "memory", self.gpu.memory_seconds(elements * bwd))
            self._tp_comm(cost, 1)
        return cost
