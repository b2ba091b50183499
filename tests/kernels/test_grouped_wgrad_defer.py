"""The experts' grouped GEMMs with ``defer=``: backward leaves the weight gradient to the queued closure, which
gives the bits of the immediate one. On the CPU through the reference paths (fp32), on a GPU through the paths a
training step runs (bf16: ``torch._grouped_mm``, ``torch._scaled_grouped_mm`` row-wise, the Triton block-wise
kernels); the GPU cases were written in session 15 for the next device call."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.activations import swiglu
from mcore.kernels.fp8_block_grouped_gemm import fp8_block_grouped_gemm_of_activation
from mcore.kernels.fp8_grouped_gemm import fp8_grouped_gemm
from mcore.kernels.grouped_gemm import grouped_gemm

# experts of 128, 0 and 256 rows, then 128 rows past offsets[-1] (multiples of 128: the block-wise rule)
OFFSETS = [128, 128, 384]
ROWS, K, N = 512, 256, 128
GEMMS = {
    "bf16": lambda x, w, o, defer: grouped_gemm(x, w, o, defer=defer),
    "fp8-rowwise": lambda x, w, o, defer: fp8_grouped_gemm(x, w, o, defer=defer),
    "fp8-blockwise-of-activation": lambda x, w, o, defer: fp8_block_grouped_gemm_of_activation(
        x, w, o, swiglu, defer=defer
    ),
}


def _case(gemm: str, device: str, dtype: torch.dtype, defer: bool):
    gen = torch.Generator().manual_seed(3)
    k_in = 2 * K if gemm.endswith("of-activation") else K
    x = torch.randn(ROWS, k_in, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(len(OFFSETS), N, K, generator=gen) * 0.1).to(device, dtype).requires_grad_()
    offsets = torch.tensor(OFFSETS, dtype=torch.int32, device=device)
    dy = torch.randn(ROWS, N, generator=gen).to(device, dtype)
    queued = []
    y = GEMMS[gemm](x, w, offsets, (lambda p, compute: queued.append((p, compute)) or True) if defer else None)
    y.backward(dy)
    after_backward = w.grad
    for p, compute in queued:
        assert p is w
        grad = compute()
        p.grad = grad if p.grad is None else p.grad + grad
    return x.grad, w.grad, after_backward, len(queued)


def _check(gemm: str, device: str, dtype: torch.dtype) -> None:
    dx0, dw0, _, n0 = _case(gemm, device, dtype, defer=False)
    dx, dw, during, n = _case(gemm, device, dtype, defer=True)
    assert (n0, n, during) == (0, 1, None)  # one closure, nothing written in backward
    assert torch.equal(dx, dx0) and torch.equal(dw, dw0)
    assert torch.any(dw[0] != 0) and torch.all(dw[1] == 0)  # a real expert, the one without rows


@pytest.mark.parametrize("gemm", list(GEMMS))
def test_deferred_equals_immediate_on_the_reference_paths(gemm):
    _check(gemm, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gemm", list(GEMMS))
def test_cuda_deferred_equals_immediate(cuda_triton, gemm):
    _check(gemm, "cuda", torch.bfloat16)
