"""The planner's Mamba-2 mixer (``mcore.models.layers.mamba2``): its matmuls, parameters, saved bytes and kernels.

A hybrid model (Nemotron-H) is a :class:`~mcore.train.planning.shape.ModelShape` with a ``hybrid_pattern``, one
Megatron symbol per layer: ``M`` a Mamba-2 mixer, ``*`` attention, ``-`` a dense MLP; each layer is its pre-norm
and that one block. A Mamba-2 mixer of ``H`` heads of ``P`` channels (``d_inner = H P``), ``G`` groups of state
size ``N`` and a depthwise conv of ``K`` taps runs, per token:

- ``in_proj`` (hidden -> ``2 d_inner + 2 G N + H``: z, [x | B | C], dt; column-parallel) and ``out_proj``
  (``d_inner`` -> hidden, row-parallel): GEMMs from the calibration's table;
- the causal conv over ``conv_dim = d_inner + 2 G N`` channels with its SiLU: forward reads and writes each
  channel (``2 conv_dim`` elements per token), backward reads the input and the output gradient and writes the input
  gradient (``3 conv_dim``), each at the calibration's measured conv rate (``conv_gbps``: [forward, backward]);
- the chunked SSD scan (chunk ``Q``): ``2 (2 Q d_inner + 4 d_inner N)`` FLOPs per token forward (the intra-chunk
  ``C B^T x`` and the two state products, the ``mcore.models`` convention of ``mamba2_sequence_flops``), twice that
  backward, each at the calibration's measured SSD rate (``ssd_tflops``: [forward, backward]);
- the gated RMSNorm (reads y and z, writes its output; backward reads the three, writes two gradients) and the
  split of ``in_proj``'s output: memory-bound at the calibrated copy bandwidth.

``rates_from_ssm_benchmark`` derives the two calibration entries from ``benchmarks/ssm_throughput.py``'s
``kernels`` record (the per-kernel CUDA profile of one layer's conv and SSD at the benchmark's shape).
``train.recompute=selective`` (``mamba_core``, its default; with ``train.recompute_modules`` only when listed)
recomputes the conv, the scan and the gated norm in backward (``Mamba2Mixer.recompute_core``) and keeps only
``in_proj``'s output and the core's output.
"""

from __future__ import annotations

from dataclasses import dataclass

SSD_FORWARD_PARTS = ("intra_fwd", "state_fwd", "chunk_state_fwd", "inter_fwd")
SSD_BACKWARD_PARTS = ("intra_bwd", "state_bwd", "chunk_state_bwd", "inter_bwd")
CONV_FORWARD_KERNELS = ("_conv_fwd_kernel",)
# the split backward (dpre, dx) or the fused one, whichever the kernels ran, and the partial sums
CONV_BACKWARD_KERNELS = ("_conv_dpre_kernel", "_conv_dx_kernel", "_conv_bwd_fused_kernel", "_conv_dw_kernel")


@dataclass(frozen=True)
class MambaShape:
    """One Mamba-2 mixer's sizes (unsharded)."""

    heads: int
    head_dim: int
    groups: int
    state: int
    conv: int = 4
    chunk: int = 128

    def __post_init__(self) -> None:
        for name in ("heads", "head_dim", "groups", "state", "conv", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MambaShape.{name} must be an int >= 1, got {value!r}")
        if self.heads % self.groups:
            raise ValueError(f"MambaShape.heads ({self.heads}) must be a multiple of groups ({self.groups})")

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.groups * self.state

    @property
    def in_width(self) -> int:
        return 2 * self.d_inner + 2 * self.groups * self.state + self.heads

    def own_parameters(self, tp: int = 1) -> float:
        """Non-matmul parameters on one TP rank: the conv's weight and bias, A_log, D, dt_bias, the norm weight."""
        return (self.conv_dim * (self.conv + 1) + 3 * self.heads + self.d_inner) / tp

    def ssd_forward_flops(self, seq_length: int) -> float:
        """Forward FLOPs per token of the chunked scan (backward: twice this)."""
        q = min(self.chunk, seq_length)
        return 2.0 * (2 * q * self.d_inner + 4 * self.d_inner * self.state)

    def saved_bytes_per_token(self, tp: int, core_recomputed: bool) -> float:
        """What the mixer keeps for backward per token on one rank (its input apart: the layer counts the norm
        output ``in_proj`` saves): ``in_proj``'s output (z and the conv input are views of it) and ``out_proj``'s
        input; then, unless the core is recomputed (``mamba_core``), what the Triton conv, SSD and gated norm save
        (``mcore.kernels.ssd_triton``; ``tests/train/test_planning_mamba.py`` counts it under the interpreter)."""
        out = 2 * (self.in_width + self.d_inner) / tp
        if core_recomputed:
            return out
        h, g = self.heads, self.groups
        scan_inputs = 2 * self.conv_dim  # bf16 contiguous copies of the conv output's x, B and C (not the output)
        states = 4 * h * self.head_dim * self.state / self.chunk  # fp32 incoming state of each chunk
        scores = 4 * g * self.chunk  # fp32 C B^T of each chunk and group, Q per token and group
        # fp32 per head: softplus's input, dt, the cumulative decay, the decays to the chunk end and from its start,
        # each token's weight in its chunk state (six per token), and the chunk's carried decay (one per chunk)
        per_head = 6 * 4 * h + 4 * h / self.chunk
        norm = 2 * self.d_inner + 4 * g  # the gated norm's bf16 input y and fp32 rstd per group (z: in_proj's view)
        return out + (scan_inputs + states + scores + per_head + norm) / tp


def rates_from_ssm_benchmark(kernels: dict) -> dict[str, list[float]]:
    """``ssd_tflops`` and ``conv_gbps`` ([forward, backward]) from ``ssm_throughput.json``'s ``kernels``: the
    measured kernel milliseconds of one layer at its (batch, seq, heads, head_dim, groups, state, chunk), divided
    into the FLOPs and bytes of the formulas above (bf16 conv)."""
    shape = MambaShape(kernels["heads"], kernels["head_dim"], kernels["groups"], kernels["state"], kernels["conv"],
                       kernels["chunk"])  # fmt: skip
    tokens = kernels["batch"] * kernels["seq"]
    parts, conv = kernels["ssd_parts_ms"], kernels["conv_ours_kernels"]["kernels_ms"]
    fwd_ms, bwd_ms = (sum(parts[p] for p in names) for names in (SSD_FORWARD_PARTS, SSD_BACKWARD_PARTS))
    flops = tokens * shape.ssd_forward_flops(kernels["seq"])
    # .get: a backward path's kernels that did not run are absent from the profile
    conv_fwd, conv_bwd = (sum(conv.get(k, 0.0) for k in ks) for ks in (CONV_FORWARD_KERNELS, CONV_BACKWARD_KERNELS))
    elements = 2.0 * tokens * shape.conv_dim  # bf16 bytes of one pass over the channels
    return {
        "ssd_tflops": [flops / (fwd_ms * 1e9), 2 * flops / (bwd_ms * 1e9)],
        "conv_gbps": [2 * elements / (conv_fwd * 1e6), 3 * elements / (conv_bwd * 1e6)],
    }
