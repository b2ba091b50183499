"""Optimizer CPU offload (``offload_fraction``): the offloaded optimizer equals the on-device one bit for bit.

One process, the toy LM, fp32 (and bf16 parameters), several AdamW steps with clipping: losses, gradient norms,
parameters and the whole state dict equal those of the optimizer without offload, for every share offloaded,
for both kinds of step (torch's foreach AdamW / the fused ``adamw_step_``, each matched by its host path), with
and without DDP buckets; torch's fused CPU AdamW (the default host path) within fp32 rounding. States move between
offloaded and on-device optimizers. The distributed cases (ZeRO-1 at dp=4, sequence parallelism) run with the
FSDP tests' workers (tests/parallel/test_fsdp.py).
"""

from __future__ import annotations

import pytest
import torch

from mcore.parallel import (
    DistributedDataParallel,
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    ProcessGroups,
    default_param_groups,
)
from mcore.parallel.offload import host_adamw_step_
from tests.parallel import _training as T
from tests.parallel._toy_model import ParallelToyLM

STEPS = 4


def _build(fraction: float, *, fused_step: bool, impl: str | None, dtype=torch.float32, ddp: bool = True):
    groups = ProcessGroups.single()
    model = ParallelToyLM(T.CFG, groups, dtype=dtype)
    model.init_weights(T.SEED)
    wrapped = DistributedDataParallel(model, None, bucket_size=1500) if ddp else model
    opt = MixedPrecisionOptimizer(
        wrapped,
        default_param_groups(wrapped, T.WEIGHT_DECAY),
        lr=T.LR,
        clip_grad=T.CLIP,
        fused_step=fused_step,
        offload_fraction=fraction,
        offload_impl=impl,
    )
    return model, wrapped, opt


class _NoSync:
    """The plain module as the training helper expects a DDP wrapper (gradients in .grad, no buckets)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        return self.module(*args)

    def no_sync(self):
        import contextlib

        return contextlib.nullcontext()

    def parameters(self):
        return self.module.parameters()

    def modules(self):  # finalize_model_grads looks for MoE layers in the chunks
        return self.module.modules()


def _train(fraction, *, fused_step, impl, dtype=torch.float32, ddp=True):
    model, wrapped, opt = _build(fraction, fused_step=fused_step, impl=impl, dtype=dtype, ddp=ddp)
    run = T.train(ProcessGroups.single(), wrapped if ddp else _NoSync(wrapped), opt, range(STEPS))
    run.ddp = wrapped
    return model, opt, run


def _assert_identical(a, b, exact: bool = True):
    (model_a, opt_a, run_a), (model_b, opt_b, run_b) = a, b
    same = torch.equal if exact else (lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-7))
    assert (run_a.losses == run_b.losses) if exact else run_a.losses == pytest.approx(run_b.losses, rel=1e-6)
    assert (run_a.norms == run_b.norms) if exact else run_a.norms == pytest.approx(run_b.norms, rel=1e-6)
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert same(p.detach(), q.detach()), name
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["step"] == sb["step"] == STEPS and sorted(sa["tensors"]) == sorted(sb["tensors"])
    for key, t in sa["tensors"].items():
        assert same(t, sb["tensors"][key]), key


@pytest.mark.parametrize("fraction", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("fused_step,impl", [(False, "foreach"), (True, "mcore")])
def test_offloaded_equals_on_device_bitwise(fraction, fused_step, impl):
    on_device = _train(0.0, fused_step=fused_step, impl=None)
    offloaded = _train(fraction, fused_step=fused_step, impl=impl)
    assert 0 < offloaded[1]._offload.numel <= sum(p.numel() for p in offloaded[0].parameters())
    _assert_identical(offloaded, on_device)


def test_loss_scaled_offload_skips_an_inf_step_like_on_device():
    """fp16-style loss scaling (the fused step keeps gradients scaled; the host unscales): an inf gradient at step
    1 is skipped by both, the pending host copies are dropped, and the runs stay bit for bit equal."""
    runs = []
    for fraction in (0.0, 0.6):
        model, ddp, _ = _build(0.0, fused_step=True, impl=None)
        opt = MixedPrecisionOptimizer(
            ddp, default_param_groups(ddp, T.WEIGHT_DECAY), lr=T.LR, clip_grad=T.CLIP, fused_step=True,
            loss_scaler=DynamicLossScaler(initial_scale=2.0**8, hysteresis=1), offload_fraction=fraction,
            offload_impl="mcore",
        )  # fmt: skip
        runs.append((T.train(ProcessGroups.single(), ddp, opt, range(STEPS), inject_inf_at=1), model, opt))
    (base, base_model, base_opt), (off, off_model, off_opt) = runs
    assert off.skipped == base.skipped == [False, True, False, False]
    assert off.losses == base.losses and off_opt.loss_scale == base_opt.loss_scale == 2.0**7
    assert all(torch.equal(p, q) for p, q in zip(off_model.parameters(), base_model.parameters()))


def test_offload_share_follows_the_fraction():
    _, _, opt = _build(0.5, fused_step=False, impl="foreach")
    total = sum(pc.hi - pc.lo for pc in opt._pieces)
    largest = max(pc.hi - pc.lo for pc in opt._pieces)
    assert abs(opt._offload.numel - total / 2) <= largest / 2
    assert all(opt._pieces[i].master.device.type == "cpu" for i in opt._offload.indices)


def test_offload_without_buckets_and_with_bf16_parameters_bitwise():
    # both without DDP: under DDP the embedding's rows go into main_grad one token at a time (embedding_lookup), a
    # different fp32 summation order than the dense table gradient that .grad accumulates
    _assert_identical(
        _train(1.0, fused_step=False, impl="foreach", ddp=False), _train(0.0, fused_step=False, impl=None, ddp=False)
    )
    bf16 = dict(fused_step=True, dtype=torch.bfloat16)
    _assert_identical(_train(0.6, impl="mcore", **bf16), _train(0.0, impl=None, **bf16))


def test_torch_fused_cpu_adamw_matches_within_rounding():
    _assert_identical(
        _train(1.0, fused_step=False, impl="fused"), _train(0.0, fused_step=False, impl=None), exact=False
    )


def test_state_moves_between_offloaded_and_on_device():
    model_a, opt_a, run_a = _train(0.5, fused_step=False, impl="foreach")
    model_b, wrapped_b, opt_b = _build(0.0, fused_step=False, impl=None)
    opt_b.load_state_dict(opt_a.state_dict())
    model_c, wrapped_c, opt_c = _build(1.0, fused_step=False, impl="foreach")
    opt_c.load_state_dict(opt_b.state_dict())
    runs = [
        T.train(ProcessGroups.single(), w, o, range(STEPS, STEPS + 2))
        for w, o in ((run_a.ddp, opt_a), (wrapped_b, opt_b), (wrapped_c, opt_c))
    ]
    assert runs[0].losses == runs[1].losses == runs[2].losses
    for p, q, r in zip(model_a.parameters(), model_b.parameters(), model_c.parameters()):
        assert torch.equal(p, q) and torch.equal(q, r)


def test_host_adamw_paths_agree():
    outs = {}
    for impl in ("foreach", "fused", "mcore"):
        g = torch.Generator().manual_seed(3)
        masters, grads = [torch.randn(100, generator=g)], [torch.randn(100, generator=g)]
        m, v, steps = [torch.zeros(100)], [torch.zeros(100)], [torch.zeros(())]
        for k in (1, 2):
            host_adamw_step_(
                impl, masters, [x.clone() for x in grads], m, v, steps, steps=k, lr=1e-2, beta1=0.9, beta2=0.95,
                eps=1e-8, weight_decay=0.1, multiplier=0.5,
            )  # fmt: skip
        outs[impl] = masters[0]
        assert float(steps[0]) == 2.0
    assert torch.allclose(outs["mcore"], outs["foreach"], rtol=1e-6, atol=1e-8)
    assert torch.allclose(outs["fused"], outs["foreach"], rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="impl must be one of"):
        host_adamw_step_("numpy", [], [], [], [], [], steps=1, lr=1, beta1=0, beta2=0, eps=0, weight_decay=0)


def test_bad_offload_arguments():
    with pytest.raises(ValueError, match="offload_fraction must lie in"):
        _build(1.5, fused_step=False, impl=None)
    with pytest.raises(TypeError, match="offload_fraction must be a number"):
        _build("half", fused_step=False, impl=None)
    with pytest.raises(ValueError, match="offload_impl must be one of"):
        _build(0.5, fused_step=False, impl="numpy")
    model = ParallelToyLM(T.CFG, ProcessGroups.single())
    with pytest.raises(ValueError, match="needs the fused step"):
        MixedPrecisionOptimizer(model, offload_fraction=0.5, fused_step=False, loss_scaler=DynamicLossScaler())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused_step,impl,dtype", [(False, "foreach", torch.float32), (True, "fused", torch.bfloat16)])
def test_cuda_offload_streams_match_on_device(fused_step, impl, dtype):
    """The CUDA path (pinned buffers, side-stream copies behind the buckets, host-to-device into the gradient
    buffer): the on-device optimizer's losses and parameters to fp32 rounding (the CPU and GPU AdamW differ)."""
    runs = []
    for fraction in (0.0, 0.6):
        model = ParallelToyLM(T.CFG, ProcessGroups.single(), dtype=dtype, device="cuda")
        model.init_weights(T.SEED)
        ddp = DistributedDataParallel(model, None, bucket_size=1500)
        opt = MixedPrecisionOptimizer(
            ddp, default_param_groups(ddp, T.WEIGHT_DECAY), lr=T.LR, clip_grad=T.CLIP, fused_step=fused_step,
            offload_fraction=fraction, offload_impl=impl,
        )  # fmt: skip
        runs.append((T.train(ProcessGroups.single(), ddp, opt, range(STEPS)), model, opt))
    (base, base_model, _), (off, off_model, opt) = runs
    assert opt._offload.numel > 0 and opt._offload.host_grads[opt._offload.indices[0]].is_pinned()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert off.losses == pytest.approx(base.losses, rel=tol)
    for p, q in zip(off_model.parameters(), base_model.parameters()):
        assert torch.allclose(p.float(), q.float(), rtol=tol, atol=tol * 1e-2)
