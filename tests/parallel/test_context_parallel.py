"""Context parallelism on gloo: every cp_comm_type at cp 2 and 4 (a2a+p2p as 2 x 2), with and without packed
documents, a sliding window and sinks, equal to single-process attention (outputs and gradients, fp32)."""

from __future__ import annotations

import functools

import pytest
import torch

from mcore.parallel.context_parallel import CPSharding, pad_documents, pad_packed_row, pieces_layout
from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, rel_err_norm, run_cases

B, S, HQ, HKV, D, DV = 2, 48, 8, 4, 8, 6
DOCS = [0, 16, 40, 48, 56, 96]  # lengths 16, 24, 8 | 8, 40: multiples of 2 * cp for cp 2 and 4
CASES = {
    "causal": dict(),
    "documents": dict(bounds=DOCS),
    "window": dict(window_size=10),
    "documents_window_sinks": dict(bounds=DOCS, window_size=7, sinks=True),
    "documents_bidirectional": dict(bounds=DOCS, causal=False),
}
LAYOUTS = [("p2p", 2), ("p2p", 4), ("all_gather", 2), ("all_gather", 4), ("a2a", 2), ("a2a", 4), ("a2a+p2p", 4)]


def _problem(case: dict, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, S, HQ, D, generator=gen), torch.randn(B, S, HKV, D, generator=gen)
    v, dout = torch.randn(B, S, HKV, DV, generator=gen), torch.randn(B, S, HQ, DV, generator=gen)
    sinks = torch.randn(HQ, generator=gen) if case.get("sinks") else None
    return q, k, v, dout, sinks


@functools.cache
def _single_process(case_name: str):
    """Outputs and gradients of the whole sequence on one process (the reference backend, autograd)."""
    from mcore.kernels import attention

    case = CASES[case_name]
    q, k, v, dout, sinks = _problem(case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_() if sinks is not None else None
    cu = None if "bounds" not in case else torch.tensor(case["bounds"], dtype=torch.int32)
    out = attention(
        *leaves, causal=case.get("causal", True), window_size=case.get("window_size"), cu_seqlens=cu,
        sinks=sink_leaf, backend="reference",
    )  # fmt: skip
    out.backward(dout)
    grads = [t.grad for t in leaves] + ([sink_leaf.grad] if sinks is not None else [])
    return out.detach(), grads


def _check_cp(case_name: str, comm_type: str, groups, cp: int, cp_rank: int) -> dict[str, float]:
    import torch.distributed as dist

    from mcore.parallel.cp_attention import context_parallel_attention

    case = CASES[case_name]
    sharding = CPSharding(B, S, cp, None if "bounds" not in case else tuple(case["bounds"]))
    q, k, v, dout, sinks = _problem(case)
    leaves = [sharding.shard(t, cp_rank).requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_() if sinks is not None else None
    out = context_parallel_attention(
        *leaves, sharding, groups, comm_type=comm_type, causal=case.get("causal", True),
        window_size=case.get("window_size"), sinks=sink_leaf,
    )  # fmt: skip
    out.backward(sharding.shard(dout, cp_rank))
    ref_out, ref_grads = _single_process(case_name)
    errors = {"out": rel_err_norm(out, sharding.shard(ref_out, cp_rank))}
    for name, leaf, ref in zip("qkv", leaves, ref_grads):
        errors["d" + name] = rel_err_norm(leaf.grad, sharding.shard(ref, cp_rank))
    if sinks is not None:  # each rank holds its queries' part of the sinks' gradient: their sum is the whole
        total = sink_leaf.grad.clone()
        dist.all_reduce(total, group=groups.cp)
        errors["dsinks"] = rel_err_norm(total, ref_grads[3])
    return errors


DYNAMIC_LENGTHS = [40, 8, 16, 24, 8, 32, 16]  # CP sizes 4, 1, 1, 2, 1, 2, 1 at 16 tokens per rank


def _dynamic_model():
    from mcore.parallel.dynamic_cp import CostModel

    return CostModel(((128, 50.0), (16384, 400.0)), HQ, D, 1, 6e3, 400.0)


def _check_dynamic(rank: int, world_size: int, comm_type: str) -> dict[str, float]:
    """Each sequence attended by its dynamic group equals the single process: outputs, gradients, total loss."""
    import torch.distributed as dist

    from mcore.kernels import attention
    from mcore.parallel.cp_attention import CPGroups, context_parallel_attention
    from mcore.parallel.dynamic_cp import aligned_groups, local_sequences, plan_dynamic

    groups = aligned_groups(world_size)
    placement = plan_dynamic(DYNAMIC_LENGTHS, world_size, 16, _dynamic_model())
    errors, loss = {}, torch.zeros(())
    for i, first, size, cp_rank in local_sequences(placement, rank):
        length = DYNAMIC_LENGTHS[i]
        q, k, v, dout, _ = _problem({}, seed=100 + i)
        q, k, v, dout = (t[:1, :length] for t in (q, k, v, dout))
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = attention(*ref, backend="reference")
        ref_out.backward(dout)
        sharding = CPSharding(1, length, size)
        leaves = [sharding.shard(t, cp_rank).requires_grad_() for t in (q, k, v)]
        if size == 1:
            out = attention(*leaves, backend="reference")
        else:
            group = CPGroups(groups[(first, size)])
            out = context_parallel_attention(*leaves, sharding, group, comm_type=comm_type)
        local_loss = (out * sharding.shard(dout, cp_rank)).sum()
        local_loss.backward()
        loss = loss + local_loss.detach()
        errors[f"seq{i}-out"] = rel_err_norm(out, sharding.shard(ref_out.detach(), cp_rank))
        for name, leaf, want in zip("qkv", leaves, ref):
            errors[f"seq{i}-d{name}"] = rel_err_norm(leaf.grad, sharding.shard(want.grad, cp_rank))
    dist.all_reduce(loss)
    return {"errors": errors, "loss": loss.item(), "groups": placement.groups}


def _workers(rank: int, world_size: int):
    from mcore.parallel.cp_attention import new_cp_groups

    torch.set_num_threads(1)
    everyone = list(range(world_size))
    groups = {4: new_cp_groups(everyone), "2x2": new_cp_groups(everyone, a2a_size=2)}
    pairs = [new_cp_groups([0, 1]), new_cp_groups([2, 3])]  # two independent cp=2 groups
    groups[2] = pairs[rank // 2]
    cases = {}
    for comm_type, cp in LAYOUTS:
        group = groups["2x2" if comm_type == "a2a+p2p" else cp]
        cp_rank = rank % cp
        for name in CASES:
            cases[f"{comm_type}-cp{cp}-{name}"] = functools.partial(_check_cp, name, comm_type, group, cp, cp_rank)
    for comm_type in ("p2p", "all_gather"):
        cases[f"dynamic-{comm_type}"] = functools.partial(_check_dynamic, rank, world_size, comm_type)
    return run_cases(cases)


@pytest.fixture(scope="module")
def results():
    return run_workers(4, _workers, timeout=300)  # a rank failing mid-exchange leaves its peers waiting


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("comm_type,cp", LAYOUTS)
def test_cp_attention_equals_single_process(results, comm_type, cp, case_name):
    for rank, errors in enumerate(case_result(results, f"{comm_type}-cp{cp}-{case_name}")):
        assert max(errors.values()) < 1e-5, (rank, errors)


def test_sharding_positions_and_round_trip():
    sharding = CPSharding(2, 48, 4, tuple(DOCS))
    x = torch.arange(2 * 48).view(2, 48)
    shards = [sharding.shard(x, r) for r in range(4)]
    assert torch.equal(sharding.unshard(shards), x)
    # Rank 1 of cp 4 keeps pieces 1 and 6 of 8 of each document; positions restart per document.
    assert shards[1][0, :4].tolist() == [2, 3, 12, 13]  # document 0 (16 tokens): pieces of 2
    assert sharding.positions(1)[0, :4].tolist() == [2, 3, 12, 13]
    assert sharding.positions(1)[0, 4:10].tolist() == [3, 4, 5, 18, 19, 20]  # document 1 (24 tokens, at 16)
    assert shards[1][0, 4:10].tolist() == [19, 20, 21, 34, 35, 36]


def test_load_balance_of_the_chunk_split():
    """Every rank gets the same causal work from the 2cp split, and a rank's own step sees its own diagonal."""
    sharding = CPSharding(1, 64, 4)
    work = []
    for r in range(4):
        mine = sharding.pieces(r)
        everything = sharding.gathered_pieces(range(4))
        work.append(pieces_layout(mine, everything, 1, 16, 64, True, None).work())
    assert len(set(work)) == 1 and sum(work) == 64 * 65 // 2


def test_odd_documents_are_refused_and_padded_not_truncated():
    with pytest.raises(
        ValueError, match=r"document 1 \(row 0, tokens 16..21\) has 5 tokens, not a multiple of 2 \* cp = 4"
    ):
        CPSharding(1, 24, 2, (0, 16, 21, 24))
    with pytest.raises(ValueError, match=r"documents cannot cross rows"):
        CPSharding(2, 8, 1, (0, 4, 12, 16))
    assert pad_documents([5, 8, 0, 1], 4) == [8, 8, 0, 4]
    tokens, labels = torch.arange(1, 10), torch.arange(101, 110)
    padded_tokens, padded_labels, lengths = pad_packed_row(tokens, labels, [5, 4], 4, pad_id=0, ignore_index=-100)
    assert lengths == [8, 4]
    assert padded_tokens.tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 9]
    assert padded_labels.tolist() == [101, 102, 103, 104, 105, -100, -100, -100, 106, 107, 108, 109]
    with pytest.raises(ValueError, match=r"lengths sum to 8, but the row has 9 tokens"):
        pad_packed_row(tokens, labels, [4, 4], 4, pad_id=0, ignore_index=-100)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_dynamic_cp_equals_single_process(results, comm_type):
    from mcore.kernels import attention

    per_rank = case_result(results, f"dynamic-{comm_type}")
    assert [size for _, size in per_rank[0]["groups"]] == [4, 1, 1, 2, 1, 2, 1]
    seen = set()
    for errors in (r["errors"] for r in per_rank):
        assert max(errors.values()) < 1e-5, errors
        seen |= {key.split("-")[0] for key in errors}
    assert seen == {f"seq{i}" for i in range(len(DYNAMIC_LENGTHS))}  # every sequence computed somewhere
    expected = 0.0
    for i, n in enumerate(DYNAMIC_LENGTHS):  # the single-process loss of the whole batch
        q, k, v, dout, _ = _problem({}, seed=100 + i)
        expected += (attention(q[:1, :n], k[:1, :n], v[:1, :n], backend="reference") * dout[:1, :n]).sum().item()
    assert all(abs(r["loss"] - expected) <= 1e-5 * abs(expected) for r in per_rank)


def test_dynamic_plan_balances_a_long_tail():
    from mcore.parallel.dynamic_cp import CostModel, plan_dynamic, plan_static

    # Llama-3-8B-like: 32 layers of 32 heads x 128, 6 x 8e9 linear FLOPs per token.
    model = CostModel(((128, 46.0), (512, 140.0), (4096, 334.0), (16384, 381.0)), 32, 128, 32, 4.8e10, 400.0)
    lengths = [32768, 16384] + [1024] * 24 + [512] * 40 + [2048] * 12  # two long documents, many short ones
    static = plan_static(lengths, 8, 4, 16384, model)
    dynamic = plan_dynamic(lengths, 8, 16384, model)
    assert sum(static.tokens) == sum(dynamic.tokens) == sum(lengths)
    assert max(dynamic.tokens) <= 16384
    assert dynamic.imbalance() < static.imbalance() and dynamic.step_seconds() < static.step_seconds()
    assert dynamic.groups[0][1] >= 2 and dynamic.groups[-1][1] == 1  # the long one spread, short ones whole
    with pytest.raises(ValueError, match=r"a 70000-token sequence needs 32 ranks of 4096 tokens"):
        plan_dynamic([70000], 8, 4096, model)
