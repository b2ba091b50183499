"""Context parallelism composed with the other parallelisms on 4 gloo ranks: cp2 x tp2 (sequence parallel),
cp2 x pp2 (1F1B) and cp2 x dp2 give the single-process loss and gradients over two SGD steps. The loss is
the mean over every valid token of the dp x cp group; gradients are summed over the dp-cp group."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_workers
from tests.models.test_parallel_parity import _full_slice, _rel_err

REL_TOL = 1e-5
B, S = 2, 24
DOCS = (0, 8, 24, 28, 48)
LAYOUTS = {"cp2xtp2-sp": (2, 1, True), "cp2xpp2": (1, 2, False), "cp2xdp2": (1, 1, False)}  # tp, pp, sp


def _global_batch(config, step, dp):
    """One micro-batch per data-parallel rank; documents in the even steps."""
    g = torch.Generator().manual_seed(50 + step)
    batches = []
    for _ in range(dp):
        ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
        labels = torch.randint(0, config.vocab_size, (B, S), generator=g)
        labels[torch.rand(B, S, generator=g) < 0.2] = -100
        batches.append({"ids": ids, "labels": labels, "bounds": DOCS if step % 2 == 0 else None})
    return batches


def _run(layout: str) -> dict[str, float]:
    import torch.distributed as dist

    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel
    from mcore.parallel.context_parallel import CPSharding
    from mcore.parallel.cp_attention import CPContext, CPGroups
    from mcore.parallel.finalize import finalize_model_grads
    from mcore.parallel.grid import ParallelConfig, build_process_groups
    from mcore.parallel.pipeline import NoPipelining, OneFOneB, p2p_activation_shape, stage_layer_ranges

    tp, pp, sp = LAYOUTS[layout]
    config = get_config("llama-tiny")  # 2 layers: one per stage at pp 2
    groups = build_process_groups(ParallelConfig(tp=tp, pp=pp, cp=2), backend="gloo")
    ((start, end),) = stage_layer_ranges(config.num_hidden_layers, pp)[groups.pp_rank]
    stage = GPTModel(
        config, groups=groups, layer_range=(start, end), pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage, sequence_parallel=sp,
    )  # fmt: skip
    stage.init_weights(42)
    reference = GPTModel(config)
    reference.init_weights(42)
    ref_params = dict(reference.named_parameters())
    padded = config.padded_vocab_size(tp)
    cp_rank, dp = dist.get_rank(groups.cp), groups.dp_size
    dp_rank = dist.get_rank(groups.dp) if groups.dp is not None else 0
    errors = {}
    for step in range(2):
        batches = _global_batch(config, step, dp)
        count = sum(int((b["labels"] != -100).sum()) for b in batches)  # valid tokens of the global batch
        mine = batches[dp_rank]
        sharding = CPSharding(B, S, 2, mine["bounds"])
        context = CPContext(sharding, CPGroups(groups.cp), "p2p")
        local = {k: sharding.shard(mine[k], cp_rank) for k in ("ids", "labels")}

        def forward_step(chunk, input_tensor, mb, context=context, local=local, count=count):
            kwargs = {"context_parallel": context}
            if stage.post_process:
                kwargs["labels"] = local["labels"]
            out = stage(local["ids"], **kwargs) if stage.pre_process else stage(hidden_states=input_tensor, **kwargs)
            return out.sum() / count if stage.post_process else out

        schedule = (OneFOneB if pp > 1 else NoPipelining)(
            [stage], num_microbatches=1, pp_group=groups.pp,
            activation_shape=p2p_activation_shape(S // 2, B, config.hidden_size, tp_size=tp, sequence_parallel=sp),
            finalize_grads=lambda: finalize_model_grads([stage], groups),
        )  # fmt: skip
        losses = schedule.run(forward_step, [None])
        for p in stage.parameters():  # what DDP over the dp-cp group does
            dist.all_reduce(p.grad, group=groups.dp_cp)
        ref_loss = sum(reference(b["ids"], labels=b["labels"], cu_seqlens=_cu(b["bounds"])).sum() for b in batches)
        (ref_loss / count).backward()
        if stage.post_process:
            total = losses[0].clone()
            dist.all_reduce(total, group=groups.dp_cp)
            errors[f"loss{step}"] = _rel_err(total, ref_loss.detach() / count)
        for n, p in stage.named_parameters():
            errors[f"grad{step}:{n}"] = _rel_err(p.grad, _full_slice(ref_params[n].grad, p, groups.tp_rank, tp, padded))
        with torch.no_grad():
            for p in list(stage.parameters()) + list(reference.parameters()):
                p -= 0.5 * p.grad
                p.grad = None
    return errors


def _cu(bounds):
    return None if bounds is None else torch.tensor(bounds, dtype=torch.int32)


def _workers(rank: int, world_size: int):
    from tests.parallel._helpers import run_cases

    torch.set_num_threads(1)
    return run_cases({layout: (lambda layout=layout: _run(layout)) for layout in LAYOUTS})


@pytest.fixture(scope="module")
def results():
    return run_workers(4, _workers, timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_composes_with_tp_pp_dp(results, layout):
    from tests.parallel._helpers import case_result

    per_rank = case_result(results, layout)
    assert any("loss1" in errors for errors in per_rank)
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if v > REL_TOL}
        assert not bad, (rank, bad)
        assert sum(k.startswith("grad1:") for k in errors) > 0
