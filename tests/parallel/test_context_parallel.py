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
