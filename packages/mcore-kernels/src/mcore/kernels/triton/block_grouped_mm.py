"""Grouped block-scaled FP8 GEMMs of MoE experts in Triton: ``block_scaled_mm``'s kernel with an expert per tile.

Every expert's row count is a multiple of 128 (the caller pads), so each 128-row tile of the tokens lies in one
expert (or past ``offsets[-1]``, in none) and each 128-token scale block too:

* :func:`block_grouped_mm`: ``out[rows of e] = (A * sa)[rows of e] @ (B[e] * sb[e])^T`` with ``A [T, K]`` and
  1 x 128 ``sa [T, K/128]``, ``B [E, N, K]`` and 128 x 128 ``sb [E, N/128, K/128]`` (forward and input gradient).
  Each M tile reads its expert from ``tile_expert`` (computed on the device, no host sync); tiles of no expert
  write zeros.
* :func:`block_grouped_wgrad`: ``out[e] = sum over e's token blocks of (A * sa)[:, blk] @ (B * sb)[:, blk]^T``
  with ``A [N, T]``, ``B [K, T]`` (``dy^T`` and ``x^T``) and 1 x 128 scales along the tokens; a grid over
  (expert, N tile, K tile), each looping over its expert's token blocks; an expert without rows writes zeros.

K and N are multiples of 128 (checked by the caller), so only the rows of ``A`` need masks. Under the interpreter
the caller passes fp16 stand-ins for the fp8 values (its dot does not take fp8; fp16 holds every e4m3 exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _block_grouped_mm_kernel(
    A, B, SA, SB, TILE_EXPERT, C, M, N, K, experts, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_k_blocks = K // BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < M
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    expert = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert < experts:  # else a tile of no expert: zeros
        b_expert = B + expert * N * K
        sb_expert = SB + expert * (N // BLOCK_N) * n_k_blocks + pid_n * n_k_blocks
        for kb in range(0, n_k_blocks):
            k = kb * BLOCK_K + ks
            a = tl.load(A + r64[:, None] * K + k[None, :], mask=rmask[:, None], other=0.0)
            b = tl.load(b_expert + c64[:, None] * K + k[None, :])
            partial = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
            sa = tl.load(SA + r64 * n_k_blocks + kb, mask=rmask, other=0.0)
            sb = tl.load(sb_expert + kb)  # one 128 x 128 block per (N tile, K step): BLOCK_N == 128
            acc += partial * sa[:, None] * sb
    tl.store(C + r64[:, None] * N + c64[None, :], acc.to(C.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _block_grouped_wgrad_kernel(
    A, B, SA, SB, OFFSETS, C, N, K, T, t_blocks, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr
):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(OFFSETS + pid_e - 1, mask=pid_e > 0, other=0)
    end = tl.load(OFFSETS + pid_e)
    rows_a = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows_b = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    ts = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for tb in range(start // BLOCK_T, end // BLOCK_T):  # the expert's token blocks, whole (128-aligned offsets)
        t = tb * BLOCK_T + ts
        a = tl.load(A + rows_a[:, None] * T + t[None, :])
        b = tl.load(B + rows_b[:, None] * T + t[None, :])
        partial = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        sa = tl.load(SA + rows_a * t_blocks + tb)
        sb = tl.load(SB + rows_b * t_blocks + tb)
        acc += partial * sa[:, None] * sb[None, :]
    out = C + pid_e.to(tl.int64) * N * K + rows_a[:, None] * K + rows_b[None, :]
    tl.store(out, acc.to(C.dtype.element_ty))


def block_grouped_mm(a, b, scale_a, scale_b, tile_expert, out_dtype) -> torch.Tensor:
    """``[T, N]`` in ``out_dtype`` (see the module docstring); ``tile_expert`` [ceil(T/128)] int, ``E`` for none."""
    rows, k = a.shape
    experts, n = b.shape[0], b.shape[1]
    out = torch.empty((rows, n), dtype=out_dtype, device=a.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, BLOCK), n // BLOCK)
    _block_grouped_mm_kernel[grid](
        a.contiguous(), b.contiguous(), scale_a.float().contiguous(), scale_b.float().contiguous(),
        tile_expert.contiguous(), out, rows, n, k, experts,
        BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK, num_warps=8, num_stages=3,
    )  # fmt: skip
    return out


def block_grouped_wgrad(a, b, scale_a, scale_b, offsets) -> torch.Tensor:
    """``[E, N, K]`` fp32 from ``a`` [N, T], ``b`` [K, T] and their ``[*, ceil(T/128)]`` scales (module docstring)."""
    n, tokens = a.shape
    k, experts = b.shape[0], offsets.shape[0]
    out = torch.empty((experts, n, k), dtype=torch.float32, device=a.device)
    if experts == 0:
        return out
    grid = (experts, n // BLOCK, k // BLOCK)
    _block_grouped_wgrad_kernel[grid](
        a.contiguous(), b.contiguous(), scale_a.float().contiguous(), scale_b.float().contiguous(),
        offsets.contiguous(), out, n, k, tokens, scale_a.shape[1],
        BLOCK_N=BLOCK, BLOCK_K=BLOCK, BLOCK_T=BLOCK, num_warps=8, num_stages=3,
    )  # fmt: skip
    return out
