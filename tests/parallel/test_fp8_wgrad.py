"""FP8 linears' weight gradients under DDP: the step's first micro-batch has the fp8 wgrad GEMM write ``main_grad``
(fp32 or bf16, not read: NaN-poisoned here, and DDP then skips its zero-fill), later micro-batches add the
weight-dtype gradient to it. Against the previous path (the GEMM returns the gradient and DDP's hook adds it:
``gradient_accumulation_fusion=False``) over three optimizer steps of 1 and 2 micro-batches, every fp8 recipe:
bit-equal on CPU (fp32 weights: the unfused gradient is already fp32, and ``0 + g`` rounds like ``g``); on CUDA
(bf16 weights) within bf16 rounding, as the fused first micro-batch is never rounded to bf16."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels.low_precision_linear import FP8_RECIPES, Recipe
from mcore.parallel import ColumnParallelLinear, DistributedDataParallel, RowParallelLinear
from mcore.parallel.low_precision import enable_low_precision
from mcore.parallel.param_attrs import wgrad_overwrites_main_grad
from tests.helpers.main_grad import start_step

# M: 128 tokens, as block-wise wgrad on CUDA contracts over them in 128-wide blocks
M, H, FFN, STEPS, LR = 128, 128, 256, 3, 0.5


class _MLP(torch.nn.Module):
    def __init__(self, dtype=torch.float32, device="cpu"):
        super().__init__()
        kw = {"params_dtype": dtype, "device": device}
        self.up = ColumnParallelLinear(H, FFN, bias=True, **kw)
        self.down = RowParallelLinear(FFN, H, **kw)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _model(recipe: str, dtype, device) -> _MLP:
    torch.manual_seed(0)
    model = _MLP(dtype, device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    enable_low_precision(model, Recipe(recipe), keep=())
    return model


def _train(recipe, micro, *, fuse, poison, grad_dtype=torch.float32, dtype=torch.float32, device="cpu", seen=None):
    """STEPS SGD steps on main_grad; returns each step's weight main_grads (after the backward of every micro-batch)."""
    model = _model(recipe, dtype, device)
    ddp = DistributedDataParallel(model, dp_group=None, gradient_accumulation_fusion=fuse, grad_dtype=grad_dtype)
    weights = [model.up.weight, model.down.weight]
    if seen is not None:  # record (layer, accumulate) for every weight gradient that went into main_grad
        for name, layer in (("up", model.up), ("down", model.down)):
            inner = layer.low_precision.wgrad_into
            layer.low_precision.wgrad_into = lambda w, inner=inner, name=name: _record(seen, name, inner(w))
    out = []
    for step in range(STEPS):
        start_step(ddp, weights, poison)
        g = torch.Generator().manual_seed(step)
        for m in range(micro):
            x = torch.randn(M, H, generator=g).to(device, dtype)
            probe = torch.randn(M, H, generator=g).to(device, dtype)
            with ddp.no_sync() if m < micro - 1 else torch.enable_grad():
                (ddp(x).float() * probe.float()).sum().backward()
        ddp.finish_grad_sync()
        out.append([w.main_grad.clone() for w in weights])
        with torch.no_grad():
            for p in model.parameters():
                p.sub_((LR / M) * p.main_grad.to(p.dtype))
    return out, weights


def _record(seen, name, into):
    seen.append((name, None if into is None else into[1]))
    return into


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_first_micro_batch_writes_main_grad_bit_equal_to_the_add(recipe, micro, grad_dtype):
    seen = []
    fused, weights = _train(recipe, micro, fuse=True, poison=True, grad_dtype=grad_dtype, seen=seen)
    unfused, _ = _train(recipe, micro, fuse=False, poison=False, grad_dtype=grad_dtype)
    for step, (a, b) in enumerate(zip(fused, unfused, strict=True)):
        for ga, gb in zip(a, b, strict=True):
            assert ga.dtype == grad_dtype and torch.isfinite(ga).all(), step
            assert torch.equal(ga, gb), (recipe, micro, step, (ga - gb).abs().max())
    # backward order: down then up; the first micro-batch of each step writes, the others add
    expected = [(name, m > 0) for _ in range(STEPS) for m in range(micro) for name in ("down", "up")]
    assert seen == expected
    assert all(wgrad_overwrites_main_grad(w) for w in weights)  # so zero_grad_buffer skips their fill


def test_the_poison_shows_a_read_of_main_grad():
    # the unfused path adds into main_grad: poisoned, it turns NaN (so the test above can fail)
    grads, _ = _train("tensorwise", 1, fuse=False, poison=True)
    assert torch.isnan(grads[0][0]).all()


def test_without_ddp_the_gradient_is_returned_in_the_weight_dtype():
    model = _model("rowwise", torch.float32, "cpu")
    x = torch.randn(M, H)
    model(x).sum().backward()
    assert model.up.weight.grad is not None and model.up.weight.grad.dtype == torch.float32
    assert torch.isfinite(model.down.weight.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_cuda_bf16_weights_write_main_grad(recipe, grad_dtype):
    kw = {"grad_dtype": grad_dtype, "dtype": torch.bfloat16, "device": "cuda"}
    seen = []
    fused, _ = _train(recipe, 2, fuse=True, poison=True, seen=seen, **kw)
    unfused, _ = _train(recipe, 2, fuse=False, poison=False, **kw)
    assert [acc for _, acc in seen[:2]] == [False, False] and all(acc is not None for _, acc in seen)
    for a, b in zip(fused[:1], unfused[:1], strict=True):  # step 1: the same weights; later ones drift apart
        for ga, gb in zip(a, b, strict=True):
            assert torch.isfinite(ga).all()
            # fused: the first micro-batch is never rounded to bf16 (the unfused one is, once). The two micro-batches'
            # terms can cancel, so the rounding is bounded by the gradient's scale, not by each element's value:
            # the atol is 2 bf16 ulps (2^-7) of the largest magnitude (a missed write or a NaN poison fails it).
            torch.testing.assert_close(ga.float(), gb.float(), rtol=1.6e-2, atol=2**-7 * gb.float().abs().max().item())


def _trainer_runs(rank, world_size, base):
    from tests.train.tiny import train, train_records

    fp8 = ["train.precision=fp8", "fp8.recipe=tensorwise", "train.steps=3", "train.global_batch_size=4"]
    runs = {
        "zero1_fused": [],
        "zero1_unfused": ["parallel.gradient_accumulation_fusion=false"],
        "fsdp_one_rank_fused": ["parallel.dp_shard=true"],  # the shard gradients as the GEMMs' targets
        "fsdp_one_rank_unfused": ["parallel.dp_shard=true", "parallel.gradient_accumulation_fusion=false"],
    }
    for name, extra in runs.items():
        train(base / name, *fp8, "train.micro_batch_size=1", *extra)
    return {name: [r["loss"] for r in train_records(base / name).values()] for name in runs}


def test_trainer_zero1_and_one_rank_fsdp_train_alike_with_and_without_the_fusion(tmp_path):
    from tests.helpers.distributed import run_workers

    losses = run_workers(1, _trainer_runs, tmp_path)[0]
    reference = losses.pop("zero1_unfused")
    assert len(reference) == 3
    for name, got in losses.items():  # 4 micro-batches per step: the first writes, three add
        assert got == pytest.approx(reference, rel=1e-6, abs=0), name
