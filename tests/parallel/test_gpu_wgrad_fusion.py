"""Gradient-accumulation fusion on a CUDA GPU (skipped without one): the weight-gradient GEMM of bf16 operands
accumulates into the fp32 ``main_grad`` in place (torch's ``addmm(out_dtype=)``), against float64."""

from __future__ import annotations

import pytest
import torch

import mcore.parallel.tensor_parallel as tp_module
from mcore.parallel import ColumnParallelLinear, DistributedDataParallel, RowParallelLinear

pytestmark = pytest.mark.gpu


def test_bf16_weight_gradient_accumulates_into_fp32_main_grad():
    g = torch.Generator(device="cuda").manual_seed(0)
    n, out_f, in_f = 4096, 1536, 1024
    grad_out = torch.randn(n, out_f, device="cuda", generator=g).bfloat16()
    x = torch.randn(n, in_f, device="cuda", generator=g).bfloat16()
    main = torch.randn(out_f, in_f, device="cuda", generator=g)
    expected = main.double() + grad_out.double().t() @ x.double()
    ptr = main.data_ptr()
    tp_module.accumulate_weight_grad_(main, grad_out, x)
    assert tp_module._MIXED_DTYPE_ADDMM is True, "this torch has no CUDA addmm(out_dtype=float32): fusion is off"
    assert main.data_ptr() == ptr
    # fp32 accumulation of n=4096 products: error ~ sqrt(n) * 2^-24 relative to the magnitudes involved
    err = (main.double() - expected).abs().max() / expected.abs().max()
    assert err < 1e-5, err


def test_ddp_bf16_linears_fused_equal_unfused():
    """Two bf16 TP linears under DDP on one GPU, three micro-batches: main_grad with fusion equals main_grad
    without (which adds bf16 weight gradients) up to that bf16 rounding; .grad stays empty either way."""
    torch.manual_seed(1)
    results = {}
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    for fusion in (True, False):
        torch.manual_seed(2)
        model = torch.nn.Sequential(
            ColumnParallelLinear(256, 1024, params_dtype=torch.bfloat16, device="cuda"),
            torch.nn.GELU(),
            RowParallelLinear(1024, 256, params_dtype=torch.bfloat16, device="cuda"),
        )
        ddp = DistributedDataParallel(model, None, gradient_accumulation_fusion=fusion)
        for _ in range(2):
            with ddp.no_sync():
                ddp(x).float().square().mean().backward()
        ddp(x).float().square().mean().backward()
        ddp.finish_grad_sync()
        results[fusion] = [p.main_grad.clone() for p in model.parameters()]
        assert all(p.grad is None for p in model.parameters())
    for fused, unfused in zip(results[True], results[False]):
        assert (fused - unfused).abs().max() <= 1e-2 * unfused.abs().max()
