"""Block-scaled FP8 GEMM ``C = (A * sa) @ (B * sb)^T`` in Triton, DeepGEMM's structure: one K step per 128-wide scale
block, the block's partial product from ``tl.dot`` (fp32 accumulate) scaled by its A-row and B-row (or B-block)
scales and added into an fp32 accumulator.

``A [M, K]`` and ``B [N, K]`` row-major in fp8 (e4m3 or e5m2; mixed formats are upcast to fp16 for the dot, which
holds every fp8 value exactly); ``scale_a [M, ceil(K/128)]`` (1 x 128 tiles); ``scale_b`` either
``[ceil(N/128), ceil(K/128)]`` (128 x 128 blocks) or ``[N, ceil(K/128)]`` (1 x 128 tiles). It runs the pairs
cuBLAS refuses (an e5m2 gradient) and under the interpreter, where fp16/fp32 operands stand for the fp8 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _block_scaled_mm_kernel(
    A,
    B,
    SA,
    SB,
    C,
    M,
    N,
    K,
    n_k_blocks,
    B_SQUARE: tl.constexpr,  # scale_b per 128 x 128 block (else per row and 128 columns)
    UPCAST: tl.constexpr,  # operands of different fp8 formats: dot in fp16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask, cmask = rows < M, cols < N
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, n_k_blocks):
        k = kb * BLOCK_K + ks
        kmask = k < K
        a = tl.load(A + r64[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(B + c64[:, None] * K + k[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float16), b.to(tl.float16)
        partial = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        sa = tl.load(SA + r64 * n_k_blocks + kb, mask=rmask, other=0.0)
        if B_SQUARE:
            sb = tl.load(SB + (c64 // BLOCK_K) * n_k_blocks + kb, mask=cmask, other=0.0)
        else:
            sb = tl.load(SB + c64 * n_k_blocks + kb, mask=cmask, other=0.0)
        acc += partial * sa[:, None] * sb[None, :]
    tl.store(C + r64[:, None] * N + c64[None, :], acc.to(C.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def block_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, b_square: bool, out_dtype
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` (see the module docstring for the operands' layouts)."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    n_k_blocks = triton.cdiv(k, BLOCK)
    grid = (triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK))
    _block_scaled_mm_kernel[grid](
        a.contiguous(),
        b.contiguous(),
        scale_a.float().contiguous(),
        scale_b.float().contiguous(),
        out,
        m,
        n,
        k,
        n_k_blocks,
        B_SQUARE=b_square,
        UPCAST=a.dtype != b.dtype,
        BLOCK_M=BLOCK,
        BLOCK_N=BLOCK,
        BLOCK_K=BLOCK,
        num_warps=8,
        num_stages=3,
    )
    return out
