"""Backward of the flash-attention kernels: preprocess, dK/dV over query blocks, and dQ.

With ``P = exp(S - lse)`` recomputed from the forward's log-sum-exp (``lse`` stays the whole row's, so
the same kernels give the gradients of one key block of a ring step):

- row statistics: ``delta = rowsum(dO * O) - dlse`` per (token, head), fp32 (``dlse`` is the gradient reaching
  a returned log-sum-exp, zero otherwise), and ``lse2 = lse * log2(e)``. By default no separate pass computes
  them: the dQ kernel runs first and computes them from its O/dO tiles (it visits each (query, head) row once)
  and stores them head-major for the dK/dV kernel; when the dK/dV kernel stores dQ itself (short documents) it
  computes them in place. The preprocess pass (one more launch reading O and dO again: measured on the H200 at
  0.450 -> 0.418 ms of the backward at 128 x 128 and 0.973 -> 0.944 at 32 x 512 without it) remains for the
  atomic-dQ mode;
- dK/dV: one program per (key/value head, key block) walks every query block that sees it, for all query
  heads of its GQA group: ``dV += P^T dO``, ``dS = P * (dO V^T - delta)``, ``dK += dS^T Q``. Each key block
  is owned by one program, so dK/dV need no atomics and the sum over the group's heads is in registers;
- dQ = ``dS K``: when every document fits in one key block (short packed documents), the dK/dV program is
  the only one that sees a query's keys and stores dQ itself (exact, deterministic, one kernel fewer);
  otherwise in its own kernel over key blocks (deterministic: fixed summation order), or added by the
  dK/dV programs with fp32 atomics (``deterministic=False``; summation order varies between runs);
- sinks: ``d sink_h = -sum_i exp(sink_h - lse_i) * delta_i`` (the sink column has no value).

Kernel bodies: :mod:`.flash_backward_kernels` (dQ: :mod:`.flash_backward_dq`); tiles: :mod:`.flash_configs`.
"""

from __future__ import annotations

import torch
import triton

from mcore.kernels.attention_layout import AttentionLayout
from mcore.kernels.dispatch import triton_interpreting
from mcore.kernels.triton.flash_attention import LOG2E, _pad_dim, even_dims, precision_for
from mcore.kernels.triton.flash_backward_dq import _bwd_q_kernel
from mcore.kernels.triton.flash_backward_kernels import (
    DQ_ATOMIC,
    DQ_SEPARATE,
    DQ_STORE,
    STATS_FUSED,
    STATS_LOAD,
    _bwd_kv_kernel,
    _preprocess_kernel,
)
from mcore.kernels.triton.flash_configs import (
    FlashConfig,
    KernelConfigs,
    fused_dq_possible,
    gqa_pack,
    kernel_configs,
    longest_key_span,
)
from mcore.kernels.triton.flash_schedule import device_blocks


def backward_configs(head_dim_qk: int, head_dim_v: int, layout: AttentionLayout) -> tuple[FlashConfig, FlashConfig]:
    """(dK/dV, dQ) tiles from :mod:`.flash_configs` (per head dim and longest document)."""
    configs = kernel_configs(head_dim_qk, head_dim_v, longest_key_span(layout), triton_interpreting())
    return configs.kv, configs.dq


def dq_mode(layout: AttentionLayout, kv_config: FlashConfig, deterministic: bool) -> int:
    """How dQ is computed: stored by the dK/dV kernel, by its atomics, or by the separate dQ kernel."""
    if fused_dq_possible(layout, kv_config.block_m):
        return DQ_STORE
    return DQ_SEPARATE if deterministic else DQ_ATOMIC


def preprocess(
    out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(delta, lse2)``, both ``[b, Hq, s]`` fp32: ``rowsum(dO * O) - dlse`` and ``lse * log2(e)``."""
    b, s, n_heads, d_v = out.shape
    delta = torch.empty(b, n_heads, s, device=out.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    block_t = 16 if triton_interpreting() else 64
    grid = (n_heads, triton.cdiv(s, block_t), b)
    _preprocess_kernel[grid](
        out, dout, lse, dlse if dlse is not None else lse, delta, lse2, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), s, n_heads, d_v,
        HAS_DLSE=dlse is not None, BLOCK_T=block_t, BLOCK_DV=_pad_dim(d_v),
    )  # fmt: skip
    return delta, lse2


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [stride for t in tensors for stride in t.stride()[:3]]


class RowStats:
    """What a kernel needs to compute the row statistics itself instead of reading the preprocess pass's:
    the forward's output and lse, the lse's incoming gradient (or None), and whether to store ``delta``."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, store_delta: bool):
        self.out, self.lse, self.dlse, self.store_delta = out, lse, dlse, store_delta

    @staticmethod
    def args(stats: RowStats | None, fallback: torch.Tensor) -> tuple[list, dict]:
        """Kernel arguments (OUT, LSE, DLSE, out strides) and constexprs; ``fallback`` stands in when unused."""
        if stats is None:
            return [fallback, fallback, fallback, 0, 0, 0], dict(STATS=STATS_LOAD, HAS_DLSE=False)
        dlse = stats.dlse if stats.dlse is not None else stats.lse
        tensors = [stats.out, stats.lse, dlse, *stats.out.stride()[:3]]
        return tensors, dict(STATS=STATS_FUSED, HAS_DLSE=stats.dlse is not None)


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, softmax_scale: float):
    d_qk, d_v = q.shape[-1], v.shape[-1]
    constants = dict(
        CAUSAL=layout.causal, HAS_WINDOW=layout.window_size is not None, PRECISION=precision_for(q.dtype),
        EVEN_D=even_dims(d_qk, d_v), BLOCK_DQK=_pad_dim(d_qk), BLOCK_DV=_pad_dim(d_v),
    )  # fmt: skip
    n_heads, n_kv = q.shape[2], k.shape[2]
    scalars = (q.shape[1], n_heads, n_heads // n_kv, softmax_scale, softmax_scale * LOG2E)
    return constants, (*scalars, layout.window_size or 0, d_qk, d_v)


def launch_kv(
    q, k, v, dout, lse2, delta, dq, dk, dv, layout, softmax_scale, config: FlashConfig, mode: int, *, stats=None
) -> None:
    """The dK/dV kernel (and dQ by ``mode``); ``config.block_m`` key rows per program, ``config.block_n`` query
    rows (of one head, or of the GQA group's heads packed) per step. ``stats`` (a :class:`RowStats`, only with
    ``mode == DQ_STORE``, where each query row is seen once) makes it compute lse2/delta itself."""
    if stats is not None and mode != DQ_STORE:
        raise ValueError("launch_kv: in-kernel row statistics need dQ stored by this kernel (one visit per row)")
    blocks, segments = device_blocks(layout, "k", config.block_m, q.device)
    if not blocks.shape[0]:
        return
    constants, scalars = _common(q, k, v, layout, softmax_scale)
    pack = gqa_pack(config, q.shape[2] // k.shape[2], config.block_n)
    stat_args, stat_constants = RowStats.args(stats, lse2)
    _bwd_kv_kernel[(k.shape[2], blocks.shape[0])](
        q, k, v, dout, lse2, delta, dq, dk, dv, blocks, segments, *stat_args, *_strides(q, k, v, dout, dq, dk, dv),
        *scalars, DQ_MODE=mode, ONE_LOOP=config.one_loop, PACK=pack, BLOCK_M=config.block_n, BLOCK_N=config.block_m,
        STORE_DELTA=stats is not None and stats.store_delta, num_warps=config.num_warps,
        num_stages=config.num_stages, **stat_constants, **constants,
    )  # fmt: skip


def launch_dq(q, k, v, dout, lse2, delta, dq, layout, softmax_scale, config: FlashConfig, *, stats=None) -> None:
    """The separate, deterministic dQ kernel; ``config.block_m`` query rows (of one head, or of the GQA group's
    heads packed) per program. With ``stats`` (a :class:`RowStats`) it computes lse2/delta itself and stores
    them into ``lse2``/``delta`` for the dK/dV kernel launched after it (each row has one dQ program)."""
    pack = gqa_pack(config, q.shape[2] // k.shape[2], config.block_m)
    blocks, segments = device_blocks(layout, "q", config.block_m // pack, q.device)
    if not blocks.shape[0]:
        return
    constants, scalars = _common(q, k, v, layout, softmax_scale)
    stat_args, stat_constants = RowStats.args(stats, lse2)
    _bwd_q_kernel[(q.shape[2] // pack, blocks.shape[0])](
        q, k, v, dout, lse2, delta, dq, blocks, segments, *stat_args, *_strides(q, k, v, dout, dq), *scalars,
        ONE_LOOP=config.one_loop, PACK=pack, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages, **stat_constants, **constants,
    )  # fmt: skip


def flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    layout: AttentionLayout,
    softmax_scale: float,
    sinks: torch.Tensor | None,
    *,
    dlse: torch.Tensor | None = None,
    deterministic: bool = False,
    configs: KernelConfigs | None = None,
    fuse_stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dsinks)`` of :func:`~.flash_attention.flash_forward`; ``lse`` is the row's full one.
    ``configs`` overrides the tiles of :mod:`.flash_configs` (the benchmark's sweep; ``forward`` unused);
    ``fuse_stats=False`` runs the preprocess pass even where a kernel could compute the row statistics."""
    kv_config, q_config = (configs.kv, configs.dq) if configs else backward_configs(q.shape[-1], v.shape[-1], layout)
    dlse = None if dlse is None else dlse.contiguous()
    mode = dq_mode(layout, kv_config, deterministic)
    # Rows in no pair: the preprocess gives them delta = -dlse (out is 0) and the sinks' gradient reads it; the
    # fused kernels never visit them, so keep the preprocess where that matters.
    fused = fuse_stats and mode != DQ_ATOMIC and (dlse is None or sinks is None or layout.covers_all("q"))
    if fused:
        stats = RowStats(out, lse, dlse, store_delta=sinks is not None)
        b, s, n_heads = lse.shape
        delta = (torch.empty if layout.covers_all("q") else torch.zeros)(b, n_heads, s, device=q.device)
        lse2 = torch.empty_like(delta) if mode == DQ_SEPARATE else delta  # DQ_STORE reads no lse2 buffer
    else:
        stats = None
        delta, lse2 = preprocess(out, dout, lse, dlse)
    alloc_k = torch.empty if layout.covers_all("k") else torch.zeros
    dk, dv = alloc_k(k.shape, device=q.device, dtype=k.dtype), alloc_k(v.shape, device=q.device, dtype=v.dtype)
    if mode == DQ_ATOMIC:
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    else:  # each query row written once (rows in no pair stay zero)
        dq = (torch.empty if layout.covers_all("q") else torch.zeros)(q.shape, device=q.device, dtype=q.dtype)
    if mode == DQ_SEPARATE:  # first: with fused stats it writes lse2/delta for the dK/dV kernel
        launch_dq(q, k, v, dout, lse2, delta, dq, layout, softmax_scale, q_config, stats=stats)
    kv_stats = stats if mode == DQ_STORE else None
    launch_kv(q, k, v, dout, lse2, delta, dq, dk, dv, layout, softmax_scale, kv_config, mode, stats=kv_stats)
    dsinks = None
    if sinks is not None:
        # Rows in no pair kept lse = -inf (and delta = 0): their sink probability is taken as 0.
        p_sink = torch.exp(sinks.float()[None, :, None] - lse.transpose(1, 2).clamp_min(torch.finfo(torch.float32).min))
        dsinks = (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
    return dq.to(q.dtype), dk, dv, dsinks
