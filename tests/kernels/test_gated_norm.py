"""The Triton gated RMSNorm per group against the norm written out per group in float64 (forward and the
gradients of x, the gate and the weight): gate after / before the norm, no gate, group sizes that are not powers
of two, a gate that is a strided view (as the Mamba-2 mixer splits it from in_proj), fp32 / fp16; and on CUDA."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels import gated_rms_norm


def float64_gated_norm(x, z, w, group_size, eps, before_gate):
    x, w = x.double(), w.double()
    s = None if z is None else z.double() * torch.sigmoid(z.double())
    h = x if (s is None or before_gate) else x * s
    groups = h.view(*h.shape[:-1], -1, group_size)
    u = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    if s is not None and before_gate:
        u = u * s
    return u * w


def _inputs(rows, width, dtype, device, strided_gate, seed=0):
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(rows, 3 * width, generator=gen).to(device, dtype)
    x = torch.randn(rows, width, generator=gen).to(device, dtype)
    z = proj[:, width : 2 * width] if strided_gate else proj[:, :width].contiguous()
    w = (torch.rand(width, generator=gen) + 0.5).to(device)
    return x.requires_grad_(), z.detach().requires_grad_(), w.requires_grad_()


def _check(rows, width, group, dtype, device, before_gate, gated, strided, tol):
    x, z, w = _inputs(rows, width, dtype, device, strided)
    gate = z if gated else None
    out = gated_rms_norm(x, gate, w, group_size=group, eps=1e-5, norm_before_gate=before_gate, backend="triton")
    leaves = [t.detach().cpu().double().requires_grad_() for t in (x, z, w)]
    ref = float64_gated_norm(leaves[0], leaves[1] if gated else None, leaves[2], group, 1e-5, before_gate)
    assert out.shape == x.shape and out.dtype == torch.promote_types(w.dtype, x.dtype)
    scale = ref.abs().max()
    assert (out.detach().cpu().double() - ref).abs().max() <= tol * scale
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out.double() * gy.to(device)).sum().backward()
    (ref * gy).sum().backward()
    for name, mine, theirs in zip("xzw", (x, z, w), leaves):
        if name == "z" and not gated:
            assert mine.grad is None
            continue
        err = (mine.grad.cpu().double() - theirs.grad).abs().max() / theirs.grad.abs().max()
        assert err <= tol, (name, err.item())


@pytest.mark.parametrize("before_gate,gated", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("group", [12, 16])
def test_triton_gated_norm_equals_float64(before_gate, gated, group, interpreter):
    _check(11, 48, group, torch.float32, interpreter, before_gate, gated, strided=True, tol=1e-5)


def test_triton_gated_norm_fp16(interpreter):
    _check(9, 32, 16, torch.float16, interpreter, False, True, strided=False, tol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("before_gate", [False, True])
def test_gpu_triton_gated_norm_nemotron_shape(before_gate, cuda_triton):
    # Nemotron-H-8B: d_inner 8192 in 8 groups of 1024, 4096 tokens, bf16
    _check(4096, 8192, 1024, torch.bfloat16, cuda_triton, before_gate, True, strided=True, tol=2e-2)
