"""The experts' weight gradients under DDP: the step's first micro-batch writes ``main_grad`` (not read, not
zero-filled-then-added), later ones add, for grouped GEMMs (the loop reference and torch's grouped GEMM) and
per-expert GEMMs (all three, or the weight gradients alone: ``grouped_fp32_wgrad``), with plain and GPT-OSS
(biased, clamped) experts; over three micro-batches (one with 3 tokens,
so most experts get no rows) and two optimizer steps the gradients equal those of the previous path (the GEMM
returns the gradient and DDP's hook adds it: ``gradient_accumulation_fusion=False``), bit for bit for the grouped
GEMMs and within 1e-6 for the per-expert ones (addmm rounds unlike mm then add), also under activation recompute
(where the per-expert GEMMs used to miss the fusion). The early host copy of the per-expert offsets changes no
result."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mcore.parallel.expert_gemm as expert_gemm
from mcore.parallel import DistributedDataParallel, MoELayer
from mcore.parallel.expert_biases import use_gpt_oss_options
from mcore.parallel.expert_gemm import HostOffsets
from tests.helpers.main_grad import record_wgrad_targets, start_step
from tests.parallel._moe import BASE
from tests.parallel._moe import full_weights as _full_weights

# the module (mcore.kernels exports a function of the same name)
grouped_gemm_module = importlib.import_module("mcore.kernels.grouped_gemm")
TOKENS = (3, 12, 7)  # per micro-batch; 3 tokens x top-2 leave at least 2 of the 8 experts without rows
STEPS, LR = 2, 0.1


def _layer(gemm: str, gpt_oss: bool) -> MoELayer:
    layer = MoELayer(replace(BASE, expert_gemm=gemm))
    if gpt_oss:
        use_gpt_oss_options(layer, router_bias=True, expert_biases=True, activation=(1.702, 0.6))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _batch(step: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + micro)
    n = TOKENS[micro]
    return torch.randn(n, BASE.hidden_size, generator=g), torch.randn(n, BASE.hidden_size, generator=g)


def _train(
    layer: MoELayer, *, fuse: bool, poison: bool = False, recompute: bool = False, grad_dtype=torch.float32
) -> list[dict]:
    """STEPS steps of len(TOKENS) micro-batches, SGD on main_grad; each step's main_grads after its backward."""
    ddp = DistributedDataParallel(layer, dp_group=None, gradient_accumulation_fusion=fuse, grad_dtype=grad_dtype)
    experts = [layer.experts.input_weight, layer.experts.down]  # the GEMMs' weights (GPT-OSS's biases: DDP's hook)
    out = []
    for step in range(STEPS):
        start_step(ddp, experts, poison)
        for micro in range(len(TOKENS)):
            x, probe = _batch(step, micro)
            last = micro == len(TOKENS) - 1
            with ddp.no_sync() if not last else torch.enable_grad():
                y = checkpoint(ddp.module, x, use_reentrant=False) if recompute else ddp(x)
                (y * probe).sum().backward()
        ddp.finish_grad_sync()
        out.append({name: p.main_grad.clone() for name, p in layer.named_parameters()})
        with torch.no_grad():
            for p in layer.parameters():
                p.sub_(LR * p.main_grad.float())
    return out


def _force_torch_grouped_mm(monkeypatch):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    monkeypatch.setattr(grouped_gemm_module, "_choose", lambda x, w, backend: grouped_gemm_module.GROUPED_MM)


GEMMS = ["grouped_reference", "grouped_mm", "per_expert", "grouped_fp32_wgrad", "grouped_mm_fp32_wgrad"]
MODES = {
    "per_expert": "per_expert",
    "grouped_fp32_wgrad": "grouped_fp32_wgrad",
    "grouped_mm_fp32_wgrad": "grouped_fp32_wgrad",
}


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("gemm", GEMMS)
def test_first_micro_batch_writes_main_grad_and_the_rest_add(gemm, gpt_oss, recompute, monkeypatch):
    if gemm.startswith("grouped_mm"):
        _force_torch_grouped_mm(monkeypatch)
    mode = MODES.get(gemm, "grouped")
    taken = record_wgrad_targets(monkeypatch)  # for every expert wgrad GEMM that took main_grad: overwrote it?
    previous = _train(_layer(mode, gpt_oss), fuse=False, recompute=recompute)
    assert taken == []  # without the fusion the GEMMs return their gradients (the previous path)
    ours = _train(_layer(mode, gpt_oss), fuse=True, poison=True, recompute=recompute)
    # per step: the first micro-batch overwrites both weights, the two others add
    assert taken == ([True, True] + [False] * 4) * STEPS
    for step, (got, want) in enumerate(zip(ours, previous, strict=True)):
        for name, ref in want.items():
            assert torch.isfinite(got[name]).all(), (step, name)
            if mode == "grouped":  # the same GEMM's gradient copied (then added) instead of added: bit-equal
                assert torch.equal(got[name], ref), (step, name)
            else:  # per-expert weight-gradient GEMMs: addmm into main_grad rounds differently from mm then add
                where, scale = f"step {step} {name}", ref.abs().max().item()
                torch.testing.assert_close(
                    got[name], ref, rtol=1e-6, atol=1e-6 * scale, msg=lambda m, w=where: f"{w}: {m}"
                )


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_bf16_main_grad_is_written_in_its_own_dtype(gemm, monkeypatch):
    """DDP's bf16 gradient buffers (``grad_dtype``): the same write-then-add, the target's dtype read from it."""
    if gemm.startswith("grouped_mm"):
        _force_torch_grouped_mm(monkeypatch)
    mode = MODES.get(gemm, "grouped")
    previous = _train(_layer(mode, False), fuse=False, grad_dtype=torch.bfloat16)
    ours = _train(_layer(mode, False), fuse=True, poison=True, grad_dtype=torch.bfloat16)
    for got, want in zip(ours, previous, strict=True):
        for name, ref in want.items():
            assert got[name].dtype == torch.bfloat16 and torch.isfinite(got[name]).all(), name
            scale = ref.float().abs().max().item()
            torch.testing.assert_close(got[name].float(), ref.float(), rtol=1.6e-2, atol=1.6e-2 * scale)


def test_the_poison_shows_a_read_of_main_grad():
    # the previous path adds into main_grad: poisoned, it turns NaN (so the test above can fail)
    poisoned = _train(_layer("grouped", False), fuse=False, poison=True)
    assert not torch.isfinite(poisoned[0]["experts.gate_up"]).all()


def test_a_parameter_written_twice_in_a_step_adds_the_second_time():
    # the zeroed mark is taken by the first writer only; DDP's hook clears it after every backward
    from mcore.parallel.param_attrs import mark_main_grad_zeroed, take_wgrad_in_main_grad, take_wgrad_target

    layer = _layer("grouped", False)
    ddp = DistributedDataParallel(layer, dp_group=None)
    w = layer.experts.down
    assert take_wgrad_target(w) == (w.main_grad, False)  # not marked: add
    ddp.zero_grad_buffer()
    assert take_wgrad_target(w)[1] is True and take_wgrad_target(w)[1] is False
    mark_main_grad_zeroed(w)
    take_wgrad_in_main_grad(w)  # a backward's hook ran: main_grad may hold a .grad added there
    assert take_wgrad_target(w)[1] is False


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt_oss"])
def test_early_host_offsets_change_no_result(gpt_oss):
    """The dispatcher's early copy of the offsets against the experts' own copy (``host_offsets`` dropped)."""
    x, probe = _batch(0, 1)
    results, passed = [], []

    def experts_forward(forward, keep: bool):
        def call(rows, offsets, tail_rows=None, host_offsets=None):
            passed.append(isinstance(host_offsets, HostOffsets))
            return forward(rows, offsets, tail_rows, host_offsets if keep else None)

        return call

    for early in (True, False):
        layer = _layer("per_expert", gpt_oss)
        layer.experts.forward = experts_forward(layer.experts.forward, keep=early)
        xr = x.clone().requires_grad_(True)
        y = layer(xr)
        (y * probe).sum().backward()
        results.append([y.detach(), xr.grad, *(p.grad for p in layer.parameters())])
    assert passed == [True, True]  # the dispatcher started the copy for the per-expert experts
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_host_offsets_from_the_host_and_from_a_tensor_agree():
    offsets = torch.tensor([2, 2, 5, 9], dtype=torch.int32)
    want = [(0, 2), (2, 2), (2, 5), (5, 9)]
    assert HostOffsets.start(offsets).bounds() == want == HostOffsets.from_ends([2, 2, 5, 9]).bounds()
    assert expert_gemm.expert_bounds(offsets) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_offsets_copy_without_a_sync_and_bf16_main_grad_is_written():
    offsets = torch.tensor([3, 3, 8, 12], dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # a blocking device-to-host copy raises
    try:
        early = HostOffsets.start(offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert early._host.is_pinned() and early.bounds() == [(0, 3), (3, 3), (3, 8), (8, 12)]
    # bf16 weights, fp32 main_grad, every GEMM mode on CUDA: written (NaN-poisoned) on the first micro-batch, added on
    # the second, the modes' gradients equal within bf16 rounding
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(64, BASE.hidden_size, generator=g).cuda().bfloat16() for _ in range(2)]
    grads = {}
    for gemm in ("grouped", "per_expert", "grouped_fp32_wgrad"):
        torch.manual_seed(0)
        layer = MoELayer(replace(BASE, expert_gemm=gemm, align=8), params_dtype=torch.bfloat16, device="cuda")
        layer.load_full_weights(*(t.cuda() for t in _full_weights()))
        ddp = DistributedDataParallel(layer, dp_group=None)
        ddp.zero_grad_buffer()
        weights = (layer.experts.gate_up, layer.experts.down)
        for p in weights:
            p.main_grad.fill_(float("nan"))
        for i, x in enumerate(xs):
            with ddp.no_sync() if i == 0 else torch.enable_grad():
                ddp(x).float().square().sum().backward()
        assert all(torch.isfinite(p.main_grad).all() for p in weights), gemm
        grads[gemm] = [p.main_grad.clone() for p in weights]
    # the per-expert weight gradients were written by a bf16 GEMM with an fp32 output, not a GEMM then a copy
    assert expert_gemm._MIXED_DTYPE_WRITE in ("mm", "addmm"), expert_gemm._MIXED_DTYPE_WRITE
    for gemm, got in grads.items():
        for ours, ref in zip(got, grads["grouped"], strict=True):
            torch.testing.assert_close(ours, ref, rtol=0, atol=2e-2 * ref.abs().max().item(), msg=gemm)
