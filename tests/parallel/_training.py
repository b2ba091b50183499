"""Training loops for the parity tests: the toy LM under mcore.parallel, and the plain single-process run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcore.parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    ProcessGroups,
    default_param_groups,
    finalize_model_grads,
    partition_slice,
)
from mcore.parallel.comm import group_rank, group_size
from tests.parallel._helpers import rel_err, rel_err_norm
from tests.parallel._toy_model import ParallelToyLM, ToyConfig, batch, reference_from

CFG = ToyConfig()
SEED = 17
GLOBAL_BATCH = 16
MICRO_BATCHES = 2
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.5


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    model: torch.nn.Module | None = None
    optimizer: object | None = None
    ddp: DistributedDataParallel | None = None


def reference_run(steps: int, *, device=None) -> Run:
    """The plain model trained with torch.optim.AdamW on the whole global batch, clipping with torch's utility."""
    ref = reference_from(_full_model(), device)
    groups = [
        {"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, foreach=False)
    run = Run(model=ref, optimizer=opt)
    for step in range(steps):
        ids, labels = batch(CFG, step, GLOBAL_BATCH, device)
        loss = ref(ids, labels).mean()
        loss.backward()
        run.norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        run.losses.append(float(loss.detach()))
    return run


def _full_model() -> ParallelToyLM:
    model = ParallelToyLM(CFG, ProcessGroups.single())
    model.init_weights(SEED)
    return model


def build(
    groups: ProcessGroups,
    *,
    distributed_optimizer: bool,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    loss_scaler: DynamicLossScaler | None = None,
    bucket_size: int = 1500,
    device=None,
):
    model = ParallelToyLM(CFG, groups, sequence_parallel=sequence_parallel, dtype=dtype, device=device)
    model.init_weights(SEED)
    ddp = DistributedDataParallel(
        model,
        groups.dp_cp,
        bucket_size=bucket_size,
        overlap_grad_reduce=True,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=distributed_optimizer,
    )
    cls = DistributedOptimizer if distributed_optimizer else MixedPrecisionOptimizer
    opt = cls(
        ddp,
        default_param_groups(ddp, WEIGHT_DECAY),
        lr=LR,
        clip_grad=CLIP,
        groups=groups,
        loss_scaler=loss_scaler,
    )
    return model, ddp, opt


def train(
    groups: ProcessGroups, ddp, opt, steps: range, *, inject_inf_at: int | None = None, inject_rank: int = 0
) -> Run:
    """Train on this rank's share of each global batch, in MICRO_BATCHES micro-batches."""
    dp, dp_rank = group_size(groups.dp_cp), group_rank(groups.dp_cp)
    rows = GLOBAL_BATCH // dp
    run = Run(model=ddp.module, optimizer=opt, ddp=ddp)
    device = next(ddp.parameters()).device
    for step in steps:
        ids, labels = batch(CFG, step, GLOBAL_BATCH, device)
        ids, labels = ids[dp_rank * rows : (dp_rank + 1) * rows], labels[dp_rank * rows : (dp_rank + 1) * rows]
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for m, (i, lab) in enumerate(zip(ids.chunk(MICRO_BATCHES), labels.chunk(MICRO_BATCHES))):
            sync = m == MICRO_BATCHES - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = ddp(i, lab).mean() / MICRO_BATCHES
                scaled = opt.scale_loss(loss)
                if step == inject_inf_at and sync and (not dist.is_initialized() or dist.get_rank() == inject_rank):
                    scaled = scaled * float("inf")
                scaled.backward()
            total += loss.detach().float()
        finalize_model_grads([ddp], groups)
        result = opt.step()
        if groups.dp_cp is not None:
            dist.all_reduce(total, group=groups.dp_cp)
        run.losses.append(float(total) / dp)
        run.norms.append(float(result.grad_norm))
        run.skipped.append(not result.finite)
    return run


def local_slice(p: torch.Tensor, full: torch.Tensor, groups) -> torch.Tensor:
    if getattr(p, "tensor_parallel", False):
        return partition_slice(full, p.partition_dim, groups.tp_rank, groups.tp_size, p.partition_blocks)
    return full


def compare(run, reference, groups, steps=slice(None)) -> dict[str, float]:
    run.ddp.finish_param_sync()  # the last step's parameter all-gather may still be in flight
    ref_params = dict(reference.model.named_parameters())
    param_err = max(
        rel_err_norm(p.float(), local_slice(p, ref_params[n].detach(), groups)) for n, p in run.model.named_parameters()
    )
    return {
        "loss": rel_err(torch.tensor(run.losses), torch.tensor(reference.losses[steps])),
        "norm": rel_err(torch.tensor(run.norms), torch.tensor(reference.norms[steps])),
        "params": param_err,
        "skipped": float(any(run.skipped)),
    }
