"""Mamba-2's ``A_log``, ``D`` and ``dt_bias`` stay fp32 under bf16 training: FSDP2 (``parallel.dp_shard``) and
ZeRO-1 (the distributed optimizer), two gloo ranks, Nemotron-H tiny (Mamba, MLP and attention layers).

What forward sees: the three in fp32, equal to the fp32 master bit for bit, and ``in_proj``'s weight in bf16
(the rest of the layer still computes in bf16). Training: 3 AdamW steps give the losses and the fp32 masters of a
single-process reference that computes each rank's micro-batch with the bf16 model (the three in fp32) and
averages the fp32 gradients, within 1e-6 (at dp=1 1e-4: the embedding's rows summed in fp32); at dp=2 with
FSDP's ``auto`` resharding and at dp=1 (units kept gathered, the weight-gradient GEMMs accumulating into the
shards). Before, FSDP gathered the three in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.models.layers.mamba2 import Mamba2Mixer
from tests.helpers.distributed import run_workers

CONFIG = get_config("nemotron_h-tiny")  # M - * M
SEED, STEPS, LR = 7, 3, 1e-2
FP32_NAMES = ("A_log", "D", "dt_bias")


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))


def _watch(model: torch.nn.Module) -> list[dict]:
    """Forward hooks recording, per Mamba-2 mixer call, the dtypes (and gathered values) it computes with."""
    seen: list[dict] = []
    for mixer in (m for m in model.modules() if isinstance(m, Mamba2Mixer)):

        def mixer_hook(module, args):
            seen.append({n: getattr(module, n).detach().clone() for n in FP32_NAMES})

        def in_proj_hook(module, args):
            seen[-1]["in_proj"] = module.weight.dtype

        mixer.register_forward_pre_hook(mixer_hook)
        mixer.in_proj.register_forward_pre_hook(in_proj_hook)
    return seen


def _reference(batches_per_step: list[list[torch.Tensor]], master: GPTModel) -> dict:
    """Each step: the bf16 model (loaded from the fp32 masters) on every batch, the fp32 mean of the gradients,
    torch AdamW on the masters."""
    compute = GPTModel(CONFIG, params_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    losses = []
    for batches in batches_per_step:
        compute.load_state_dict(master.state_dict())
        names = [n for n, _ in compute.named_parameters()]
        grads = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in master.named_parameters()}
        step_losses = []
        for ids in batches:
            loss = compute(ids, labels=ids).float().mean()
            step_losses.append(float(loss))
            for n, g in zip(names, torch.autograd.grad(loss, list(compute.parameters())), strict=True):
                grads[n] += g.float() / len(batches)
        for n, p in master.named_parameters():
            p.grad = grads[n]
        opt.step()
        losses.append(step_losses)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in master.named_parameters()}}


def _fsdp_run(dp_group) -> dict:
    from mcore.parallel.fsdp import FullyShardedDataParallel, data_parallel_mesh, full_tensor

    rank = dist.get_rank()  # each rank its own batches, at dp=1 too
    model = GPTModel(CONFIG)
    model.init_weights(SEED)
    seen = _watch(model)
    units = [model.embedding, *model.layers.values(), model.output]
    wrapper = FullyShardedDataParallel(
        model, data_parallel_mesh(dp_group, "cpu"), units=units, param_dtype=torch.bfloat16,
        no_backward_gather=[model.embedding],
    )  # fmt: skip
    opt = torch.optim.AdamW(wrapper.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    losses, masters_seen = [], []
    for step in range(STEPS):
        opt.zero_grad()
        ids = _ids(step, rank)
        loss = wrapper(ids, labels=ids).float().mean()
        loss.backward()
        losses.append(float(loss.detach()))
        mixer = next(m for m in model.modules() if isinstance(m, Mamba2Mixer))
        masters_seen.append({n: full_tensor(getattr(mixer, n).detach()).clone() for n in FP32_NAMES})
        opt.step()
    params = {n: full_tensor(p.detach()).clone() for n, p in wrapper.named_parameters()}
    return {"losses": losses, "params": params, "seen": seen, "masters_seen": masters_seen}


def _zero1_run(dp_group) -> dict:
    from mcore.parallel import DistributedDataParallel, DistributedOptimizer, default_param_groups

    rank = dist.get_rank()
    model = GPTModel(CONFIG, params_dtype=torch.bfloat16)
    model.init_weights(SEED)
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}  # the masters' first values
    seen = _watch(model)
    ddp = DistributedDataParallel(model, dp_group, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, default_param_groups(ddp, 0.0), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        ids = _ids(step, rank)
        loss = ddp(ids, labels=ids).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        losses.append(float(loss.detach()))
        opt.step()
    dtypes = {n: p.dtype for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in FP32_NAMES}
    a_log = model.layers["0"].mamba.A_log.detach().clone()
    return {"losses": losses, "seen": seen, "start": start, "dtypes": dtypes, "A_log": a_log}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _seen_summary(run: dict) -> dict:
    """Per Mamba-2 call: the three's dtypes all fp32, in_proj's bf16; the gathered values equal the masters."""
    seen = run["seen"]
    out = {
        "calls": len(seen),
        "fp32": all(call[n].dtype == torch.float32 for call in seen for n in FP32_NAMES),
        "in_proj_bf16": all(call["in_proj"] == torch.bfloat16 for call in seen),
    }
    if "masters_seen" in run:  # the first Mamba layer's values each step against its master
        out["equal_masters"] = all(
            torch.equal(seen[2 * step][n], masters[n])
            for step, masters in enumerate(run["masters_seen"])
            for n in FP32_NAMES
        )
    return out


def _cases(rank: int, world_size: int) -> dict:
    world = dist.new_group(list(range(world_size)))
    runs = {"dp2": _fsdp_run(world), "dp1": _fsdp_run(None), "zero1": _zero1_run(world)}
    refs = {}
    for case in ("dp2", "dp1"):
        master = GPTModel(CONFIG)
        master.init_weights(SEED)
        batches = [[_ids(s, r) for r in range(world_size)] if case == "dp2" else [_ids(s, rank)] for s in range(STEPS)]
        refs[case] = _reference(batches, master)
    master = GPTModel(CONFIG)
    master.load_state_dict(runs["zero1"]["start"])
    refs["zero1"] = _reference([[_ids(s, r) for r in range(world_size)] for s in range(STEPS)], master)
    out = {}
    for case, run in runs.items():
        ref = refs[case]
        out[case] = {
            **_seen_summary(run),
            "losses": run["losses"],
            "ref_losses": [losses[rank if case != "dp1" else 0] for losses in ref["losses"]],
        }
        if "params" in run:
            out[case]["param_err"] = max(_rel(p, ref["params"][n]) for n, p in run["params"].items())
    zero1 = runs["zero1"]
    out["zero1"]["dtypes_fp32"] = set(zero1["dtypes"].values()) == {torch.float32} and len(zero1["dtypes"]) == 6
    out["zero1"]["a_log_err"] = _rel(zero1["A_log"], refs["zero1"]["params"]["layers.0.mamba.A_log"])
    out["zero1"]["a_log_moved"] = _rel(zero1["A_log"], zero1["start"]["layers.0.mamba.A_log"]) > 0
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(2, _cases)


@pytest.mark.parametrize("case", ["dp2", "dp1", "zero1"])
def test_forward_sees_them_in_fp32_and_the_rest_in_bf16(results, case):
    for rank, out in enumerate(results):
        got = out[case]
        assert got["calls"] == 2 * STEPS  # two Mamba layers a step
        assert got["fp32"] and got["in_proj_bf16"], (rank, case)
        if case != "zero1":  # the gathered values are the fp32 masters themselves
            assert got["equal_masters"], (rank, case)


@pytest.mark.parametrize("case", ["dp2", "dp1", "zero1"])
def test_training_equals_the_single_process_reference(results, case):
    for rank, out in enumerate(results):
        got = out[case]
        assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-6, abs=0), (rank, case)
        if case != "zero1":
            # dp=1: the embedding's lookup adds its rows into the fp32 shard (``embedding_lookup``) where the
            # reference sums them into a bf16 table gradient first (rounded per add on CPU): 2.5e-5 after 3 steps
            assert got["param_err"] <= (1e-4 if case == "dp1" else 1e-6), (rank, case, got["param_err"])


def test_zero1_keeps_them_fp32_and_updates_them_like_the_reference(results):
    for out in results:
        got = out["zero1"]
        assert got["dtypes_fp32"] and got["a_log_moved"]
        assert got["a_log_err"] <= 1e-6
