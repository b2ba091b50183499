"""Mamba-2 hybrids under context parallelism on 4 gloo ranks: Nemotron-H (Mamba, attention and MLP layers) and
Falcon-H1 (Mamba and attention side by side) at cp2 x dp2 and cp2 x tp2 (sequence parallel), Nemotron-H also at
cp2 x pp2 (1F1B), packed documents in the even steps, give the single-process loss and every gradient (fp32,
relative 1e-5) over two SGD steps; the Mamba mixer trades sequence shards for head shards around its conv and
scan (mcore.parallel.cp_ssm). Also the one clear error when cp does not divide the groups, and the exchange's
channel split."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_workers
from tests.models.test_parallel_parity import _full_slice, _rel_err

REL_TOL = 1e-5
# As in test_hybrid_parallel: the SGD steps amplify the fp32 rounding of the TP / CP reductions into the small,
# cancelling A_log / dt_bias gradients (at tp2 x cp2 one A_log gradient of a third step differs by 1.1e-5; on an
# AVX2 EPYC, whose fp32 sums differ from the first machine's, a first-step dt_bias gradient by 1.4e-5). Those two get
# 3e-5; every other gradient and the loss keep 1e-5 (the kernels take no float64 to make this exact).
CANCELLING_TOL = {"A_log": 3e-5, "dt_bias": 3e-5}
LR = 0.2
B, S, STEPS = 2, 24, 2
DOCS = (0, 8, 24, 28, 48)  # document lengths 8, 16, 4, 20: multiples of 2 x cp
CASES = {  # name -> (preset, tp, sequence parallel, recompute the Mamba core, pp)
    "nemotron_h-cp2xdp2": ("nemotron_h-tiny", 1, False, False, 1),
    "falcon_h1-cp2xdp2": ("falcon_h1-tiny", 1, False, True, 1),
    "nemotron_h-cp2xtp2-sp": ("nemotron_h-tiny", 2, True, True, 1),
    "falcon_h1-cp2xtp2": ("falcon_h1-tiny", 2, False, False, 1),
    "nemotron_h-cp2xpp2": ("nemotron_h-tiny", 1, False, False, 2),  # M- | *M: a Mamba layer on each stage (1F1B)
}


def _config(preset: str, tp: int):
    from mcore.models.families import get_config

    # tp x cp must divide the Mamba groups: 4 groups of 2 heads at tp 2 (the presets have 2 groups)
    return get_config(preset, **({"n_groups": 4} if tp > 1 else {}))


def _global_batch(config, step, dp, device="cpu"):
    g = torch.Generator().manual_seed(70 + step)
    batches = []
    for _ in range(dp):
        ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
        labels = torch.randint(0, config.vocab_size, (B, S), generator=g)
        labels[torch.rand(B, S, generator=g) < 0.2] = -100
        bounds = DOCS if step % 2 == 0 else None
        batches.append({"ids": ids.to(device), "labels": labels.to(device), "bounds": bounds})
    return batches


def _run(case: str, device: str = "cpu", backend: str = "gloo") -> dict[str, float]:
    """Relative errors (max-abs over max-abs) of the losses and every gradient, ``STEPS`` SGD steps; ``device`` /
    ``backend`` ``cuda`` / ``nccl`` for test_cp_hybrid_nccl (the Triton kernels)."""
    import torch.distributed as dist

    from mcore.models.gpt import GPTModel
    from mcore.parallel.context_parallel import CPSharding
    from mcore.parallel.cp_attention import CPContext, CPGroups
    from mcore.parallel.finalize import finalize_model_grads
    from mcore.parallel.grid import ParallelConfig, build_process_groups
    from mcore.parallel.pipeline import NoPipelining, OneFOneB, p2p_activation_shape, stage_layer_ranges

    preset, tp, sp, recompute, pp = CASES[case]
    config = _config(preset, tp)
    groups = build_process_groups(ParallelConfig(tp=tp, pp=pp, cp=2), backend=backend)
    ((start, end),) = stage_layer_ranges(config.num_hidden_layers, pp)[groups.pp_rank]
    extra = {"recompute": "selective", "recompute_modules": ["mamba_core"]} if recompute else {}
    model = GPTModel(
        config, groups=groups, layer_range=(start, end), pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage, sequence_parallel=sp, device=device, **extra,
    )  # fmt: skip
    schedule = (OneFOneB if pp > 1 else NoPipelining)(
        [model], num_microbatches=1, pp_group=groups.pp,
        activation_shape=p2p_activation_shape(S // 2, B, config.hidden_size, tp_size=tp, sequence_parallel=sp),
        finalize_grads=lambda: finalize_model_grads([model], groups),
    )  # fmt: skip
    model.init_weights(11)
    reference = GPTModel(config, device=device)
    reference.init_weights(11)
    ref_params, padded = dict(reference.named_parameters()), config.padded_vocab_size(tp)
    cp_rank, dp = dist.get_rank(groups.cp), groups.dp_size
    dp_rank = dist.get_rank(groups.dp) if groups.dp is not None else 0
    errors = {}
    for step in range(STEPS):
        batches = _global_batch(config, step, dp, device)
        count = sum(int((b["labels"] != -100).sum()) for b in batches)
        mine = batches[dp_rank]
        sharding = CPSharding(B, S, 2, mine["bounds"])
        local = {k: sharding.shard(mine[k], cp_rank) for k in ("ids", "labels")}
        context = CPContext(sharding, CPGroups(groups.cp), "p2p")

        def forward_step(chunk, input_tensor, mb, context=context, local=local, count=count):
            kwargs = {"context_parallel": context, **({"labels": local["labels"]} if model.post_process else {})}
            out = model(local["ids"], **kwargs) if model.pre_process else model(hidden_states=input_tensor, **kwargs)
            return out.sum() / count if model.post_process else out

        losses = schedule.run(forward_step, [None])
        for p in model.parameters():  # what DDP over the dp-cp group does
            dist.all_reduce(p.grad, group=groups.dp_cp)
        ref_loss = sum(
            reference(b["ids"], labels=b["labels"], cu_seqlens=_cu(b["bounds"], device)).sum() for b in batches
        )
        (ref_loss / count).backward()
        if model.post_process:
            total = losses[0].detach().clone()
            dist.all_reduce(total, group=groups.dp_cp)
            errors[f"loss{step}"] = _rel_err(total, ref_loss.detach() / count)
        for n, p in model.named_parameters():
            errors[f"grad{step}:{n}"] = _rel_err(p.grad, _full_slice(ref_params[n].grad, p, groups.tp_rank, tp, padded))
        with torch.no_grad():
            for p in list(model.parameters()) + list(reference.parameters()):
                p -= LR * p.grad
                p.grad = None
    return errors


def _cu(bounds, device):
    return None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=device)


def _refusal() -> str:
    """cp=2 over a model with one Mamba group: the mixer's clear error."""
    import torch.distributed as dist

    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel
    from mcore.parallel.context_parallel import CPSharding
    from mcore.parallel.cp_attention import CPContext, CPGroups

    group = dist.new_group([0, 1])  # collective: every rank creates it
    if dist.get_rank() >= 2:
        return ""
    model = GPTModel(get_config("nemotron_h-tiny", n_groups=1))
    model.init_weights(3)
    sharding = CPSharding(1, 8, 2)
    try:
        model(torch.randint(0, 320, (1, 4)), context_parallel=CPContext(sharding, CPGroups(group)))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _workers(rank: int, world_size: int):
    from tests.parallel._helpers import run_cases

    torch.set_num_threads(1)
    cases = {case: (lambda case=case: _run(case)) for case in CASES}
    return run_cases({**cases, "refusal": _refusal})


@pytest.fixture(scope="module")
def results():
    return run_workers(4, _workers, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_cp_equals_single_process(results, case):
    from tests.parallel._helpers import case_result

    per_rank = case_result(results, case)
    assert any(f"loss{STEPS - 1}" in errors for errors in per_rank)
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if v > CANCELLING_TOL.get(k.rsplit(".", 1)[-1], REL_TOL)}
        assert not bad, (rank, bad)
        assert sum(k.startswith(f"grad{STEPS - 1}:") and ".mamba." in k for k in errors) > 0


def test_cp_not_dividing_the_groups_is_refused(results):
    from tests.parallel._helpers import case_result

    message = case_result(results, "refusal")[0]
    assert "cp=2" in message and "groups" in message, message


def test_block_rank_index_splits_every_block():
    from mcore.parallel.cp_ssm import block_rank_index

    index = block_rank_index((4, 2, 6), 2).tolist()
    assert index == [0, 1, 4, 6, 7, 8, 2, 3, 5, 9, 10, 11]
