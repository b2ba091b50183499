"""A GPT model run context-parallel on 2 gloo ranks (its attention over the CP group, positions from the
sharding) gives the single-process loss and gradients: p2p and a2a, plain rows and packed documents,
a sliding-window family, and selective recomputation of the attention core."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, rel_err_norm, run_cases

B, S = 2, 24
DOCS = (0, 8, 24, 28, 48)  # lengths 8, 16 | 4, 20: multiples of 2 * cp = 4
CASES = {
    "llama-p2p": ("llama-tiny", "p2p", None, None),
    "llama-a2a-documents": ("llama-tiny", "a2a", DOCS, None),
    "mistral-window-p2p-documents": ("mistral-tiny", "p2p", DOCS, None),
    "qwen3-all_gather-selective": ("qwen3-tiny", "all_gather", None, "selective"),
}


def _batch(config, bounds):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, config.vocab_size, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.2] = -100
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    return ids, labels, cu


def _check(name: str, cp_group) -> dict[str, float]:
    import torch.distributed as dist

    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel
    from mcore.parallel.context_parallel import CPSharding
    from mcore.parallel.cp_attention import CPContext

    family, comm_type, bounds, recompute = CASES[name]
    config = get_config(family)
    torch.manual_seed(0)
    reference = GPTModel(config)
    torch.manual_seed(0)
    model = GPTModel(config, recompute=recompute)
    model.load_state_dict(reference.state_dict())
    ids, labels, cu = _batch(config, bounds)
    per_token = reference(ids, labels=labels, cu_seqlens=cu)
    count = (labels != -100).sum()
    ref_loss = per_token.sum() / count
    ref_loss.backward()

    sharding = CPSharding(B, S, dist.get_world_size(cp_group), bounds)
    rank = dist.get_rank(cp_group)
    context = CPContext(sharding, _groups(cp_group), comm_type)
    local = model(sharding.shard(ids, rank), labels=sharding.shard(labels, rank), context_parallel=context)
    loss = local.sum() / count  # the loss over the whole CP group's tokens: summed over ranks below
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    errors = {"loss": abs(total.item() - ref_loss.item()) / abs(ref_loss.item())}
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=cp_group)  # the dp x cp gradient reduction
        errors[pname] = rel_err_norm(grad, ref_params[pname].grad)
    return errors


def _groups(cp_group):
    from mcore.parallel.cp_attention import CPGroups

    return CPGroups(cp_group)


def _workers(rank: int, world_size: int):
    import functools

    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world_size)))
    return run_cases({name: functools.partial(_check, name, group) for name in CASES})


@pytest.fixture(scope="module")
def results():
    return run_workers(2, _workers, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_gpt_context_parallel_equals_single_process(results, name):
    for rank, errors in enumerate(case_result(results, name)):
        assert max(errors.values()) < 1e-5, (rank, {k: v for k, v in errors.items() if v >= 1e-5})


def test_context_parallel_refuses_cu_seqlens():
    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel

    model = GPTModel(get_config("llama-tiny"))
    with pytest.raises(ValueError, match=r"with context_parallel the documents come from its sharding"):
        model(torch.zeros(1, 8, dtype=torch.long), cu_seqlens=torch.tensor([0, 8], dtype=torch.int32),
              context_parallel=object())  # fmt: skip
