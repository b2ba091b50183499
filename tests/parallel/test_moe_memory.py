"""What an MoE layer keeps for backward, against a budget derived from its shapes.

Per layer of ``T`` tokens, top-``k`` (``R = T * k`` routed rows), hidden ``H``, expert FFN ``F``, in the model's
dtype (``b`` bytes), backward needs: the layer input (the router's weight gradient; ``T*H*b``), the permuted rows
(the gate_up weight gradient; ``R*H*b``), the gate_up output ``h`` (SwiGLU's backward, and the down GEMM's weight
gradient through the recomputed SwiGLU; ``R*2F*b``) and the experts' outputs (the routing weights' gradient;
``R*H*b``), plus the routing state (fp32 logits/probabilities ``[T, E]``, int64 plans ``[R]``). The budget allows
that and no more: an fp32 copy of the tokens for the router or a kept SwiGLU output (``R*F*b``) break it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore.parallel.expert_parallel import MoEConfig, MoELayer, router_logits


def _layer(h, f, e, k, dtype, device="cpu"):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=h, num_experts=e, topk=k, moe_intermediate_size=f, norm_topk_prob=True)
    layer = MoELayer(cfg, params_dtype=dtype, device=device)
    layer.router.reset_parameters()
    layer.experts.reset_parameters()
    return layer


def _budget(t, h, f, e, k, itemsize):
    rows = t * k
    activations = (t * h + rows * h + rows * 2 * f + rows * h) * itemsize
    routing = 2 * t * e * 4 + 4 * rows * 8
    return activations + routing


def _saved_bytes(layer, x):
    """Bytes of the distinct storages autograd keeps for the layer's backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    return sum(saved.values()), out


@pytest.mark.parametrize(("t", "h", "f", "e", "k"), [(256, 64, 96, 8, 2), (128, 32, 16, 16, 4)])
def test_saved_tensors_fit_the_budget(t, h, f, e, k):
    layer = _layer(h, f, e, k, torch.bfloat16)
    x = torch.randn(t, 1, h, dtype=torch.bfloat16, requires_grad=True)
    saved, out = _saved_bytes(layer, x)
    assert saved <= _budget(t, h, f, e, k, 2), (saved, _budget(t, h, f, e, k, 2))
    out.float().square().sum().backward()  # and the recomputing backward runs
    assert x.grad is not None and layer.experts.down.grad is not None


def test_router_logits_equal_the_fp32_linear():
    x = torch.randn(40, 24, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(6, 24, dtype=torch.bfloat16, requires_grad=True)
    probe = torch.randn(40, 6)
    ours = router_logits(x, w)
    dx, dw = torch.autograd.grad((ours * probe).sum(), (x, w))
    want = F.linear(x.float(), w.float())
    dx0, dw0 = torch.autograd.grad((want * probe).sum(), (x, w))
    assert ours.dtype == torch.float32
    assert torch.equal(ours, want) and torch.equal(dx, dx0) and torch.equal(dw, dw0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_held_after_forward_fits_the_budget():
    t, h, f, e, k = 8192, 1024, 3584, 8, 2  # Mixtral's ratios (F = 3.5 H), a quarter of its width
    layer = _layer(h, f, e, k, torch.bfloat16, device="cuda")
    x = torch.randn(t, 1, h, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = layer(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    budget = _budget(t, h, f, e, k, 2) - t * h * 2  # the input was allocated before
    assert held <= budget * 1.02, (held, budget)  # 2%: the allocator's 512-byte rounding and small tensors
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out.float().square().sum().backward()
    peak = torch.cuda.max_memory_allocated() - base
    # backward's transients: dh [R, 2F], the recomputed SwiGLU and its gradient [R, F] each, the weight gradients
    # (bf16, [E, 3FH]), dout [T, H] fp32 and the rows' gradients [R, H] fp32 in unpermute
    rows = t * k
    transient = (rows * 2 * f + 2 * rows * f + e * 3 * f * h) * 2 + (t * h + 2 * rows * h) * 4
    print(f"held {held / 2**20:.0f} MiB (budget {budget / 2**20:.0f}), backward peak {peak / 2**20:.0f} MiB")
    assert peak <= (budget + transient) * 1.05, (peak, budget + transient)
