"""Expert parallelism on gloo: ep 2 and 4, etp 2 and ep2 x etp2, both dispatchers, DDP and the distributed
optimizer over the expert grid, equal to the single-process MoE layer (outputs, gradients, AdamW steps); also with
per-expert GEMMs, whose host offsets come from the all-to-all's split exchange (ep/etp > 1) or from the allgather
dispatcher's early copy, and whose weight gradients are written into main_grad on each step's first backward."""

from __future__ import annotations

import pytest
import torch

from mcore.parallel import MoELayer
from tests.helpers.distributed import run_workers
from tests.parallel import _moe

AUX = dict(aux_loss_coef=0.01, z_loss_coef=1e-3)
DROP = dict(capacity_factor=0.75, drop_policy="probability")
PER_EXPERT = dict(expert_gemm="per_expert")
WORLD2 = {
    "ep2": (dict(ep=2), {}, "fwd_bwd"),
    "ep2_allgather": (dict(ep=2), dict(dispatcher="allgather"), "fwd_bwd"),
    "etp2": (dict(etp=2), {}, "fwd_bwd"),
    "etp2_allgather": (dict(etp=2), dict(dispatcher="allgather"), "fwd_bwd"),
    "ep2_capacity": (dict(ep=2), DROP, "fwd_bwd"),
    "ep2_aligned": (dict(ep=2), dict(align=4), "fwd_bwd"),
    "ep2_train_aux": (dict(ep=2), AUX, "train"),
    "ep2_train_bias": (dict(ep=2), dict(expert_bias=True, bias_update_rate=0.05), "train"),
    "ep2_per_expert": (dict(ep=2), PER_EXPERT, "fwd_bwd"),
    "etp2_per_expert": (dict(etp=2), PER_EXPERT, "fwd_bwd"),
    "ep2_allgather_per_expert": (dict(ep=2), dict(dispatcher="allgather", **PER_EXPERT), "fwd_bwd"),
    "ep2_train_per_expert": (dict(ep=2), dict(**AUX, **PER_EXPERT), "train"),
    "ep2_train_fp32_wgrad": (dict(ep=2), dict(**AUX, expert_gemm="grouped_fp32_wgrad"), "train"),
}
WORLD4 = {
    "ep4": (dict(ep=4), {}, "fwd_bwd"),
    "ep2_etp2": (dict(ep=2, etp=2), {}, "fwd_bwd"),
    "ep2_etp2_allgather": (dict(ep=2, etp=2), dict(dispatcher="allgather"), "fwd_bwd"),
    "ep2_edp2_distopt": (dict(ep=2), AUX, "train_distopt"),
    "ep4_train": (dict(ep=4), dict(score_function="sigmoid", expert_bias=True, bias_update_rate=0.05), "train"),
    "ep2_etp2_distopt": (dict(ep=2, etp=2), {}, "train_distopt"),
    "ep2_etp2_per_expert": (dict(ep=2, etp=2), PER_EXPERT, "fwd_bwd"),
    "ep2_edp2_distopt_per_expert": (dict(ep=2), dict(**AUX, **PER_EXPERT), "train_distopt"),
}


@pytest.fixture(scope="module")
def world2():
    return run_workers(2, _moe.cases, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, _moe.cases, WORLD4)


def _check(results, name):
    for rank, res in enumerate(results):
        errs = res[name]
        for key, value in errs.items():
            if key == "clipped":
                assert value, f"{name}: clipping never engaged, the norm is not tested"
            else:
                assert value <= 1e-5, f"{name} rank {rank}: {key} differs by {value:.2e}"


@pytest.mark.parametrize("name", sorted(WORLD2))
def test_world2(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", sorted(WORLD4))
def test_world4(world4, name):
    _check(world4, name)


def test_single_process_layer_matches_hf_mixtral_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(
        hidden_size=_moe.H, intermediate_size=_moe.F, num_local_experts=_moe.E, num_experts_per_tok=_moe.K
    )
    hf = MixtralSparseMoeBlock(cfg)
    router, gate_up, down = _moe.full_weights()
    with torch.no_grad():
        hf.gate.weight.copy_(router)
        hf.experts.gate_up_proj.copy_(gate_up)
        hf.experts.down_proj.copy_(down)
    ours = _moe._layer(_moe.BASE)
    x, probe = _moe.tokens(0)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    y_hf = hf(xs[0].transpose(0, 1).contiguous()).transpose(0, 1)  # HF is [b, s, h]
    y = ours(xs[1])
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-6)
    (y_hf * probe).sum().backward()
    (y * probe).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.experts.gate_up.grad, hf.experts.gate_up_proj.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.router.weight.grad, hf.gate.weight.grad, rtol=1e-5, atol=1e-6)


def test_layout_errors_name_valid_values():
    with pytest.raises(ValueError, match=r"num_experts=8 not divisible by ep=3; valid ep: \[1, 2, 4, 8\]"):
        _moe.BASE.check_layout(3, 1)
    with pytest.raises(
        ValueError, match=r"moe_intermediate_size=24 not divisible by etp=16; valid etp: \[1, 2, 4, 8\]"
    ):
        _moe.BASE.check_layout(1, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("align", [1, 8])
def test_cuda_bf16_layer_matches_fp32_and_never_syncs(align):
    # 64 x 64 experts: the bf16 grouped GEMM's fast path (16-byte rows); align 1 leaves the experts' row counts odd
    from dataclasses import replace

    config = replace(_moe.BASE, hidden_size=64, moe_intermediate_size=64, align=align)
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(8, 64, generator=g), torch.randn(8, 128, 64, generator=g) * 0.1)
    full = (*full, torch.randn(8, 64, 64, generator=g) * 0.1)
    x = torch.randn(256, 2, 64, generator=g)
    ref = MoELayer(config)
    ref.load_full_weights(*full)
    want = ref(x).detach()
    layer = MoELayer(config, params_dtype=torch.bfloat16, device="cuda")
    layer.load_full_weights(*(t.cuda() for t in full))
    xc = x.cuda().bfloat16().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host copy in forward or backward raises
    try:
        y = layer(xc)
        y.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    scale = want.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), want, rtol=0, atol=3e-2 * scale)
    assert xc.grad is not None and torch.isfinite(xc.grad).all()
