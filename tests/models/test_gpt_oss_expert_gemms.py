"""A whole GPT-OSS training step (sinks, sliding / full layers, YaRN, router bias, biased experts with the clamped
SwiGLU) with per-expert GEMMs (all three, or the weight gradients alone) against grouped GEMMs: under DDP, two
optimizer steps of two micro-batches each, the losses and every parameter's gradient (``main_grad``: the experts'
written on each step's first micro-batch, added on the second) agree in fp32."""

from __future__ import annotations

import pytest
import torch

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.parallel import DistributedDataParallel

STEPS, MICRO, LR = 2, 2, 0.05


def _model(gemm: str) -> GPTModel:
    # a clamp the tiny model's pre-activations cross, so that the clamped SwiGLU's branches matter
    config = get_config(
        "gpt_oss-tiny", swiglu_limit=0.3, moe_router={"softmax_before_topk": False, "expert_gemm": gemm}
    )
    model = GPTModel(config)
    model.init_weights(1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the biases start at zero (HF's init): make them count
        for name, p in model.named_parameters():
            if name.endswith("_bias") or name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _batches(vocab: int):
    g = torch.Generator().manual_seed(3)
    # sequences of 20 > the tiny preset's window of 8
    return [[torch.randint(0, vocab, (2, 21), generator=g) for _ in range(MICRO)] for _ in range(STEPS)]


def _train(gemm: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = _model(gemm)
    ddp = DistributedDataParallel(model, dp_group=None)
    losses, grads = [], []
    for step_batches in _batches(model.config.vocab_size):
        ddp.zero_grad_buffer()
        total = 0.0
        for micro, ids in enumerate(step_batches):
            with ddp.no_sync() if micro < MICRO - 1 else torch.enable_grad():
                loss = ddp(ids[:, :-1], labels=ids[:, 1:]).mean() / MICRO
                loss.backward()
            total += float(loss.detach())
        ddp.finish_grad_sync()
        losses.append(total)
        grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.main_grad)
    return losses, grads


@pytest.mark.parametrize("gemm", ["per_expert", "grouped_fp32_wgrad"])
def test_per_expert_gemms_train_gpt_oss_like_grouped(gemm):
    grouped_losses, grouped = _train("grouped")
    per_expert_losses, per_expert = _train(gemm)
    assert per_expert_losses == pytest.approx(grouped_losses, rel=1e-6)
    for step, (ours, ref) in enumerate(zip(per_expert, grouped, strict=True)):
        assert set(ours) == set(ref) and any("experts.gate_up_bias" in n for n in ref)
        for name, want in ref.items():
            scale = want.abs().max().item()
            assert scale > 0, name  # every parameter, experts and sinks included, got a gradient
            torch.testing.assert_close(
                ours[name], want, rtol=1e-5, atol=1e-6 * scale, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}"
            )
