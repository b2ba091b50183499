"""Cases of the expert-parallel tests: one MoE layer under ep / etp equal to the single-process layer.

Every rank draws the same full weights and every rank's tokens (seeded), runs the single-process reference on
all of them, then the parallel layer on its own tokens, and returns the differences.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from mcore.parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    MixedPrecisionOptimizer,
    MoEConfig,
    MoELayer,
    ParallelConfig,
    build_process_groups,
    finalize_model_grads,
)

H, F, E, K, TOKENS = 16, 24, 8, 2, 12
BASE = MoEConfig(hidden_size=H, num_experts=E, topk=K, moe_intermediate_size=F, norm_topk_prob=True)
LR, CLIP, STEPS = 1e-2, 0.05, 3


def full_weights(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(E, H, generator=g) * 0.5,
        torch.randn(E, 2 * F, H, generator=g) * 0.2,
        torch.randn(E, H, F, generator=g) * 0.2,
    )


def tokens(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    # [s, b, h] hidden states and a probe that turns the output into a loss
    return torch.randn(TOKENS // 2, 2, H, generator=g), torch.randn(TOKENS // 2, 2, H, generator=g)


def _layer(config, groups=None):
    layer = MoELayer(config, groups=groups)
    layer.load_full_weights(*full_weights())
    return layer


def _local_slices(layer: MoELayer, router, gate_up, down):
    """The full tensors cut like ``layer``'s parameters (to compare gradients or weights)."""
    experts = layer.experts
    f, fl = experts.ffn_size, experts.ffn_size // experts.etp
    cols = slice(experts.etp_rank * fl, (experts.etp_rank + 1) * fl)
    mine = slice(experts.first_expert, experts.first_expert + layer.num_local_experts)
    gate_up, down = gate_up[mine], down[mine]
    return router, torch.cat((gate_up[:, :f][:, cols], gate_up[:, f:][:, cols]), dim=1), down[:, :, cols]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def forward_backward_case(config: MoEConfig, groups, world: int) -> dict:
    """One forward/backward: outputs, input grads and DDP-reduced weight grads against the reference."""
    rank = dist.get_rank()
    ref = _layer(config)
    loss = 0.0
    for r in range(world):
        x, probe = tokens(r)
        x = x.requires_grad_(True)
        y = ref(x)
        loss = loss + (y * probe).sum() / world
        if r == rank:
            ref_y, ref_x = y.detach(), x
    loss.backward()
    layer = _layer(config, groups)
    ddp = DistributedDataParallel(layer, groups.dp_cp, expert_dp_group=groups.expert_dp, bucket_size=10_000)
    x, probe = tokens(rank)
    x = x.requires_grad_(True)
    y = ddp(x)
    (y * probe).sum().backward()
    finalize_model_grads([ddp], groups)
    want = _local_slices(layer, ref.router.weight.grad, ref.experts.gate_up.grad, ref.experts.down.grad)
    got = (layer.router.weight.main_grad, layer.experts.gate_up.main_grad, layer.experts.down.main_grad)
    return {
        "out": _rel(y.detach(), ref_y),
        "dx": _rel(x.grad, ref_x.grad * world),
        "grads": max(_rel(g, w) for g, w in zip(got, want)),
    }


def training_case(config: MoEConfig, groups, world: int, distributed: bool) -> dict:
    """STEPS AdamW steps with clipping (active): losses, grad norms and final weights against torch."""
    rank = dist.get_rank()
    ref = _layer(config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    layer = _layer(config, groups)
    ddp = DistributedDataParallel(
        layer, groups.dp_cp, expert_dp_group=groups.expert_dp, bucket_size=200, use_distributed_optimizer=distributed
    )
    cls = DistributedOptimizer if distributed else MixedPrecisionOptimizer
    opt = cls(ddp, lr=LR, weight_decay=0.0, clip_grad=CLIP, groups=groups, fused_step=False)
    errs = {"loss": 0.0, "norm": 0.0, "bias": 0.0}
    for step in range(STEPS):
        ref.aux_loss_scale = 1.0 / world
        ref_loss = 0.0
        for r in range(world):
            x, probe = tokens(r, step)
            ref_loss = ref_loss + (ref(x) * probe).sum() / world
        ref_loss.backward()
        if ref.expert_bias is not None:  # the reference's bias step: counts of every rank's tokens
            finalize_model_grads(ref)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()

        opt.zero_grad()
        x, probe = tokens(rank, step)
        loss = (ddp(x) * probe).sum()
        loss.backward()
        finalize_model_grads([ddp], groups)
        result = opt.step()
        total = loss.detach() / world
        dist.all_reduce(total, group=groups.dp_cp)
        errs["loss"] = max(errs["loss"], abs(float(total - ref_loss)) / abs(float(ref_loss)))
        errs["norm"] = max(errs["norm"], abs(float(result.grad_norm - ref_norm)) / float(ref_norm))
        if ref.expert_bias is not None:
            errs["bias"] = max(errs["bias"], float((layer.expert_bias - ref.expert_bias).abs().max()))
    ddp.finish_param_sync()
    want = _local_slices(layer, ref.router.weight.detach(), ref.experts.gate_up.detach(), ref.experts.down.detach())
    got = (layer.router.weight, layer.experts.gate_up, layer.experts.down)
    errs["weights"] = max(_rel(g.detach(), w) for g, w in zip(got, want))
    errs["clipped"] = float(ref_norm) > CLIP
    return errs


def cases(rank: int, world: int, layouts: dict) -> dict:
    out, built = {}, {}
    for name, (parallel, overrides, kind) in layouts.items():
        key = tuple(sorted(parallel.items()))
        if key not in built:  # creating groups is the slow part of a case on gloo
            built[key] = build_process_groups(ParallelConfig(**parallel))
        groups = built[key]
        config = replace(BASE, **overrides)
        torch.manual_seed(0)
        if kind == "fwd_bwd":
            out[name] = forward_backward_case(config, groups, world)
        else:
            out[name] = training_case(config, groups, world, distributed=kind == "train_distopt")
    return out
