"""The Mamba-2 token mixer (``"mamba2"``): in_proj, causal conv over [x | B | C], SSD scan, gated norm, out_proj.

Shapes, with ``d_inner = mamba_num_heads * mamba_head_dim``, ``G = n_groups``, ``N = ssm_state_size``,
``H = mamba_num_heads``: ``in_proj`` maps ``hidden -> [z | x | B | C | dt]`` of widths
``(d_inner, d_inner, G*N, G*N, H)``; the depthwise conv runs on ``[x | B | C]`` only; ``A_log``, ``D`` and
``dt_bias`` are ``[H]`` and stay fp32 whatever the parameters' dtype.

Tensor parallelism splits heads, whole groups per rank (``tp`` divides ``n_groups``): each of the five in_proj
blocks, the conv channels of ``x``, ``B`` and ``C``, the per-head parameters and the gated norm's weight are split
block by block, so each rank's SSD and per-group norm need no communication; ``out_proj`` is row-parallel.
Parameter names are HF's (``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, ``norm``, ``out_proj``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcore.kernels import causal_conv1d, gated_rms_norm, ssd_scan
from mcore.kernels.ssd import seq_idx_from_cu_seqlens
from mcore.models.config import TransformerConfig
from mcore.models.parts.registry import PartContext, PartSpec
from mcore.parallel.comm import group_rank
from mcore.parallel.cp_ssm import SequenceHeadExchange, check_ssm_context_parallel
from mcore.parallel.init import normal_init, partition_slice
from mcore.parallel.param_attrs import mark_fp32_compute, set_tensor_parallel_attributes
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

# dt's initial range (HF Mamba2 / NemotronH defaults: time_step_min, time_step_max, time_step_floor).
_DT_MIN, _DT_MAX, _DT_FLOOR = 1e-3, 1e-1, 1e-4


def _shard_param(full_shape, tp_size, blocks, dtype, device) -> nn.Parameter:
    """An uninitialised parameter holding this rank's share of ``full_shape`` along dim 0 (block by block)."""
    local = (full_shape[0] // tp_size, *full_shape[1:])
    p = nn.Parameter(torch.empty(local, dtype=dtype, device=device))
    set_tensor_parallel_attributes(p, tensor_parallel=True, partition_dim=0, partition_blocks=blocks)
    return p


class DepthwiseCausalConv(nn.Module):
    """The conv's ``weight [channels, 1, k]`` and ``bias [channels]`` (HF ``nn.Conv1d`` layout), TP-split by
    channel blocks; initialised as ``nn.Conv1d`` is (uniform in +-1/sqrt(k))."""

    def __init__(self, blocks, k, bias, tp_rank, tp_size, dtype, device) -> None:
        super().__init__()
        self.blocks, self.k, self.tp_rank, self.tp_size = blocks, k, tp_rank, tp_size
        channels = sum(blocks)
        self.weight = _shard_param((channels, 1, k), tp_size, blocks, dtype, device)
        self.bias = _shard_param((channels,), tp_size, blocks, dtype, device) if bias else None

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        bound = 1.0 / math.sqrt(self.k)
        with torch.no_grad():
            for p in (self.weight, self.bias):
                if p is None:
                    continue
                full = torch.empty((sum(self.blocks), *p.shape[1:]), dtype=torch.float32)
                full.uniform_(-bound, bound, generator=generator)
                p.copy_(partition_slice(full, 0, self.tp_rank, self.tp_size, self.blocks))


class GroupedGatedNorm(nn.Module):
    """Gated RMSNorm per group of ``d_inner / n_groups`` features (weight ``[d_inner]``, ones)."""

    def __init__(self, width, group_size, eps, norm_before_gate, tp_size, dtype, device) -> None:
        super().__init__()
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate
        self.weight = _shard_param((width,), tp_size, None, dtype, device)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight``: a share of ``self.weight`` (context parallelism's heads); the whole weight by default."""
        weight = self.weight if weight is None else weight
        return gated_rms_norm(
            x, gate, weight, group_size=self.group_size, eps=self.eps, norm_before_gate=self.norm_before_gate
        )


class _CoreParams(NamedTuple):
    """What the conv + scan + norm core runs on: its head, group and channel counts and those heads' parameters."""

    heads: int
    groups: int
    inner: int
    conv_weight: torch.Tensor  # [inner + 2 * groups * state, k]
    conv_bias: torch.Tensor | None
    A_log: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor | None


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer on ``[s(/tp), b, hidden]``; selective recompute of ``mamba_core`` (the default of
    ``recompute="selective"`` without ``recompute_modules``) recomputes conv + SSD + norm in backward."""

    def __init__(self, config: TransformerConfig, layer_index: int, context: PartContext | None = None) -> None:
        super().__init__()
        ctx = PartContext() if context is None else context
        tp = ctx.tp_size
        check_mamba2_tensor_parallel(config, tp)
        tp_rank = group_rank(ctx.tp_group)
        self.layer_index, self.tp_rank, self.tp_size = layer_index, tp_rank, tp
        c = config
        heads, d_inner, gn = c.mamba_num_heads, c.mamba_d_inner, c.n_groups * c.ssm_state_size
        self.local_heads, self.head_dim = heads // tp, c.mamba_head_dim
        self.local_groups, self.state = c.n_groups // tp, c.ssm_state_size
        self.local_inner, self.chunk_size = d_inner // tp, c.chunk_size
        self.time_step_limit = tuple(float(v) for v in c.time_step_limit)
        self.recompute_core = ctx.recomputes("mamba_core")
        common = dict(tp_group=ctx.tp_group, sequence_parallel=ctx.sequence_parallel)
        common.update(params_dtype=ctx.params_dtype, device=ctx.device)
        init = normal_init(c.initializer_range)
        self.in_blocks = (d_inner, d_inner, gn, gn, heads)
        self.in_proj = ColumnParallelLinear(
            c.hidden_size, sum(self.in_blocks), bias=c.mamba_proj_bias, partition_blocks=self.in_blocks,
            init_method=init, **common,
        )  # fmt: skip
        self.conv1d = DepthwiseCausalConv(
            (d_inner, gn, gn), c.conv_kernel, c.use_conv_bias, tp_rank, tp, ctx.params_dtype, ctx.device
        )
        fp32 = dict(dtype=torch.float32, device=ctx.device)
        self.A_log = _shard_param((heads,), tp, None, **fp32)
        self.D = _shard_param((heads,), tp, None, **fp32)
        self.dt_bias = _shard_param((heads,), tp, None, **fp32)
        for p in (self.A_log, self.D, self.dt_bias):
            mark_fp32_compute(p)  # also when a wrapper casts the rest for compute (FSDP2's mixed precision)
        # Without the gated norm (Falcon-H1's mamba_rms_norm=False) the output is y * silu(z).
        self.norm = None
        if c.mamba_rms_norm:
            self.norm = GroupedGatedNorm(
                d_inner,
                d_inner // c.n_groups,
                c.rms_norm_eps,
                c.mamba_norm_before_gate,
                tp,
                ctx.params_dtype,
                ctx.device,
            )
        # Falcon-H1's muP: the input scaled by ssm_in_multiplier, each in_proj block by its ssm_multipliers entry.
        self.in_multiplier = c.ssm_in_multiplier
        self.block_multipliers = None
        if any(m != 1.0 for m in c.ssm_multipliers):
            local = [b // tp for b in self.in_blocks]
            self.block_multipliers = torch.cat(
                [torch.full((n,), m, dtype=torch.float32) for n, m in zip(local, c.ssm_multipliers, strict=True)]
            )
        self.out_proj = RowParallelLinear(
            d_inner, c.hidden_size, bias=c.projectors_bias, input_is_parallel=True, init_method=init, **common
        )

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The SSM parameters as HF initialises them: ``A = 1..H``, ``D = 1``, ``dt_bias = softplus^-1(dt)`` with
        ``dt`` log-uniform in [1e-3, 1e-1] (full tensors drawn, each rank keeps its heads)."""
        heads = self.local_heads * self.tp_size
        with torch.no_grad():
            a = torch.log(torch.arange(1, heads + 1, dtype=torch.float32))
            u = torch.rand(heads, generator=generator, dtype=torch.float32)
            dt = torch.exp(u * (math.log(_DT_MAX) - math.log(_DT_MIN)) + math.log(_DT_MIN)).clamp(min=_DT_FLOOR)
            inv_dt = dt + torch.log(-torch.expm1(-dt))
            for p, full in ((self.A_log, a), (self.D, torch.ones(heads)), (self.dt_bias, inv_dt)):
                p.copy_(partition_slice(full, 0, self.tp_rank, self.tp_size))

    def forward(
        self, x: torch.Tensor, rope=None, *, cu_seqlens=None, kv_cache=None, context_parallel=None
    ) -> torch.Tensor:
        """``x`` ``[s(/tp), b, hidden]``; ``rope`` is unused (no positions: the scan is ordered). With ``kv_cache``
        (inference) the conv inputs and the SSM state continue from the previous call and are stored for the next.
        ``context_parallel`` (an ``mcore.parallel.cp_attention.CPContext``): ``x`` is this rank's CP shard; the
        conv + scan run on whole sequences of ``heads / cp`` heads (:mod:`mcore.parallel.cp_ssm`)."""
        proj = self.in_proj(x if self.in_multiplier == 1.0 else x * self.in_multiplier)  # [s, b, local widths]
        if self.block_multipliers is not None:
            proj = proj * self.block_multipliers.to(proj.device, proj.dtype)
        if context_parallel is not None:
            return self._forward_context_parallel(proj, cu_seqlens, kv_cache, context_parallel)
        s, b = proj.shape[:2]
        params = self._core_params()
        if kv_cache is not None:
            if cu_seqlens is not None:
                raise ValueError("mamba2 with a cache does not take cu_seqlens (one sequence per batch row)")
            y = self._core(proj.transpose(0, 1), None, params, kv_cache)
        else:
            seq_idx = None if cu_seqlens is None else seq_idx_from_cu_seqlens(cu_seqlens, b, s, check_values=False)
            y = self._run_core(proj.transpose(0, 1), seq_idx, params)
        return self.out_proj(y.transpose(0, 1))

    def _forward_context_parallel(self, proj, cu_seqlens, kv_cache, context_parallel) -> torch.Tensor:
        if cu_seqlens is not None or kv_cache is not None:
            raise ValueError("mamba2 under context parallelism takes no kv_cache or cu_seqlens (the sharding has them)")
        exchange = SequenceHeadExchange(context_parallel.sharding, context_parallel.groups.cp)
        check_ssm_context_parallel(self.local_heads, self.local_groups, exchange.cp)
        blocks = tuple(width // self.tp_size for width in self.in_blocks)
        sequence = exchange.to_heads(proj, blocks)  # [b, seq_len, this CP rank's channels]
        y = self._run_core(sequence, exchange.seq_idx(proj.device), self._core_params(exchange))
        return self.out_proj(exchange.to_sequence(y).transpose(0, 1))

    def _run_core(self, xp: torch.Tensor, seq_idx: torch.Tensor | None, params: _CoreParams) -> torch.Tensor:
        if self.recompute_core and torch.is_grad_enabled():
            return checkpoint(self._core, xp, seq_idx, params, use_reentrant=False)
        return self._core(xp, seq_idx, params)

    def _core_params(self, exchange: SequenceHeadExchange | None = None) -> _CoreParams:
        """The conv, SSM and norm parameters the core runs with: this TP rank's, or this CP rank's share of them."""
        norm_weight = None if self.norm is None else self.norm.weight
        full = _CoreParams(
            self.local_heads, self.local_groups, self.local_inner, self.conv1d.weight.squeeze(1), self.conv1d.bias,
            self.A_log, self.D, self.dt_bias, norm_weight,
        )  # fmt: skip
        if exchange is None:
            return full
        cp, gn = exchange.cp, self.local_groups * self.state
        conv_blocks = (self.local_inner, gn, gn)
        share = exchange.channel_share
        return _CoreParams(
            self.local_heads // cp, self.local_groups // cp, self.local_inner // cp,
            share(full.conv_weight, conv_blocks),
            None if full.conv_bias is None else share(full.conv_bias, conv_blocks),
            share(self.A_log), share(self.D), share(self.dt_bias), None if norm_weight is None else share(norm_weight),
        )  # fmt: skip

    def _core(self, xp: torch.Tensor, seq_idx: torch.Tensor | None, p: _CoreParams, cache=None) -> torch.Tensor:
        """``[b, s, in_proj channels]`` -> gated-norm output ``[b, s, p.inner]``."""
        gn = p.groups * self.state
        z, xbc, dt = xp.split([p.inner, p.inner + 2 * gn, p.heads], dim=-1)
        conv_states = ssm_states = None
        if cache is not None and self.layer_index in cache.states:
            conv_states, ssm_states = cache.states[self.layer_index]
        conv_in = xbc
        xbc = causal_conv1d(
            xbc, p.conv_weight, p.conv_bias, activation="silu", seq_idx=seq_idx, conv_states=conv_states
        )
        xs, B, C = xbc.split([p.inner, gn, gn], dim=-1)
        b, s = xs.shape[:2]
        y, final = ssd_scan(
            xs.reshape(b, s, p.heads, self.head_dim),
            dt,
            -torch.exp(p.A_log.float()),
            B.reshape(b, s, p.groups, self.state),
            C.reshape(b, s, p.groups, self.state),
            chunk_size=self.chunk_size,
            D=p.D,
            dt_bias=p.dt_bias,
            dt_limit=self.time_step_limit,
            seq_idx=seq_idx,
            initial_states=ssm_states,
            return_final_states=True,
        )
        if cache is not None:
            k = self.conv1d.k
            history = conv_in.new_zeros(b, conv_in.shape[-1], k - 1) if conv_states is None else conv_states
            window = torch.cat([history.to(conv_in.dtype), conv_in.transpose(1, 2)], dim=2)
            window = window[:, :, window.shape[2] - (k - 1) :]
            cache.states[self.layer_index] = (window, final)
        y = y.reshape(b, s, p.inner)
        if self.norm is None:
            return y * torch.nn.functional.silu(z)
        return self.norm(y, z, p.norm_weight)


def check_mamba2_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    """TP keeps whole groups (and their heads) per rank: ``tp`` must divide ``n_groups``."""
    if config.n_groups % tp != 0:
        raise ValueError(
            f"tensor parallel size {tp} must divide n_groups ({config.n_groups}) so that each rank holds whole "
            "Mamba-2 groups (the gated norm is per group)"
        )


def mamba2_parameters(config: TransformerConfig, layer_index: int = 0) -> int:
    """in_proj, conv (weight + bias), A_log, D, dt_bias, the gated norm's weight and out_proj."""
    c = config
    d_inner, gn, heads = c.mamba_d_inner, c.n_groups * c.ssm_state_size, c.mamba_num_heads
    in_width, conv_dim = 2 * d_inner + 2 * gn + heads, d_inner + 2 * gn
    n = c.hidden_size * in_width + d_inner * c.hidden_size
    n += conv_dim * c.conv_kernel + (conv_dim if c.use_conv_bias else 0)
    n += 3 * heads + (d_inner if c.mamba_rms_norm else 0)
    n += (in_width if c.mamba_proj_bias else 0) + (c.hidden_size if c.projectors_bias else 0)
    return n


def mamba2_matmul_weights(config: TransformerConfig, layer_index: int = 0) -> int:
    """The two projections (in_proj and out_proj); the depthwise conv is counted with the sequence terms."""
    c = config
    in_width = 2 * c.mamba_d_inner + 2 * c.n_groups * c.ssm_state_size + c.mamba_num_heads
    return c.hidden_size * in_width + c.mamba_d_inner * c.hidden_size


def mamba2_sequence_flops(config: TransformerConfig, layer_index: int, seq_len: int) -> float:
    """Training FLOPs per token of the chunked SSD: ``6 * (2 * Q * d_inner + 4 * d_inner * N)``.

    With ``Q = min(chunk_size, seq_len)`` and ``N`` the state size: the intra-chunk products (``C B^T`` applied to
    ``x``, ``2 Q d_inner`` per token, causal half not discounted, as for attention) and the chunk state and
    state-output products (``2 d_inner N`` each); forward once, backward twice (the factor 6 = 2 x 3). The
    depthwise conv, the gated norm and the elementwise work are not counted. This is the convention of
    ``shared/bench/hf_hybrid_baseline.py``, so that MFU compares like with like.
    """
    c = config
    q = min(c.chunk_size, seq_len)
    return float(6 * (2 * q * c.mamba_d_inner + 4 * c.mamba_d_inner * c.ssm_state_size))


MAMBA2 = PartSpec(
    name="mamba2",
    attribute="mamba",
    build=Mamba2Mixer,
    parameters=mamba2_parameters,
    matmul_weights=mamba2_matmul_weights,
    check_tensor_parallel=check_mamba2_tensor_parallel,
    sequence_flops=mamba2_sequence_flops,
)
