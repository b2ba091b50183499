"""End-to-end parity at (tp, dp) in {(2,1), (1,2), (2,2), (2,4), (4,2)} with and without the distributed optimizer
and sequence parallelism: 5 AdamW steps (2 micro-batches each, gradient clipping active) of the toy LM give
the loss curve, grad norms and parameters of the plain single-process run. Also: process groups as built
on real ranks, the grad norm across tp x pp x dp, tied-embedding reduction, resharding the distributed
optimizer's state from dp=4 to dp=2 and dp=1, and an fp16 overflow skipped on every rank.

One spawn of 8 gloo ranks; sub-worlds (``build_process_groups(..., ranks=...)``) host the smaller configs.
(tp, dp) = (1, 1) runs in process in test_optimizer.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mcore.parallel import (
    GROUP_KINDS,
    DynamicLossScaler,
    ParallelConfig,
    build_process_groups,
    finalize_model_grads,
    rank_groups,
    total_grad_norm,
)
from tests.helpers.distributed import run_workers
from tests.parallel import _training as T
from tests.parallel._helpers import rel_err, run_cases

TOL = 1e-5
STEPS = 5
WORLD = 8
RESUME_AT = 3


def _parity(groups, reference, *, distributed_optimizer, sequence_parallel, stash=None):
    _, ddp, opt = T.build(groups, distributed_optimizer=distributed_optimizer, sequence_parallel=sequence_parallel)
    if stash is None:
        return T.compare(T.train(groups, ddp, opt, range(STEPS)), reference, groups)
    first = T.train(groups, ddp, opt, range(RESUME_AT))
    stash["state"] = opt.state_dict()  # collective over dp
    rest = T.train(groups, ddp, opt, range(RESUME_AT, STEPS))
    first.losses += rest.losses
    first.norms += rest.norms
    first.skipped += rest.skipped
    return T.compare(first, reference, groups)


def _resume(groups, reference, state, *, distributed_optimizer):
    """A fresh model at another dp picks up an optimizer state saved at dp=4."""
    _, ddp, opt = T.build(groups, distributed_optimizer=distributed_optimizer, sequence_parallel=True)
    opt.load_state_dict(state)
    run = T.train(groups, ddp, opt, range(RESUME_AT, STEPS))
    return T.compare(run, reference, groups, steps=slice(RESUME_AT, STEPS))


def _fp16_overflow(groups):
    scaler = DynamicLossScaler(initial_scale=2.0**10, hysteresis=1, growth_interval=100)
    model, ddp, opt = T.build(groups, distributed_optimizer=True, dtype=torch.float16, loss_scaler=scaler)
    T.train(groups, ddp, opt, range(1))
    # overlap_param_gather leaves the all-gather of step 0's update in flight: wait for it before reading.
    ddp.finish_param_sync()
    before = [p.detach().clone() for p in model.parameters()]
    skipped = T.train(groups, ddp, opt, range(1, 2), inject_inf_at=1, inject_rank=3)
    ddp.finish_param_sync()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    scale_after_skip = scaler.scale
    rest = T.train(groups, ddp, opt, range(2, 4))
    ddp.finish_param_sync()
    return {
        "skipped": skipped.skipped + rest.skipped,
        "unchanged_during_skip": unchanged,
        "scale_after_skip": scale_after_skip,
        "finite_after": all(torch.isfinite(torch.tensor(rest.losses))),
        "changed_after": any(not torch.equal(a, p) for a, p in zip(before, model.parameters())),
    }


def _groups_match_table(cfg: ParallelConfig) -> dict:
    groups = build_process_groups(cfg)
    table = rank_groups(cfg, WORLD)
    me = dist.get_rank()
    mismatches = []
    for kind in GROUP_KINDS:
        (expected,) = [g for g in table[kind] if me in g] or [[me]]
        pg = getattr(groups, kind)
        actual = [me] if pg is None else dist.get_process_group_ranks(pg)
        if actual != expected:
            mismatches.append((kind, actual, expected))
        if kind != "embedding" and getattr(groups, f"{kind}_rank") != expected.index(me):
            mismatches.append((f"{kind}_rank", getattr(groups, f"{kind}_rank"), expected.index(me)))
    pp = groups.group_ranks["pp"]
    if (groups.pp_prev_rank, groups.pp_next_rank) != (pp[groups.pp_rank - 1], pp[(groups.pp_rank + 1) % len(pp)]):
        mismatches.append(("pp neighbours", groups.pp_prev_rank, groups.pp_next_rank))
    return {"mismatches": mismatches}


def _norm_and_tied_embedding(reference_grads: dict[str, torch.Tensor]) -> dict:
    """tp=2 x pp=2 x dp=2: stage 0 holds the embedding and layer 0, stage 1 the rest plus a tied copy of
    the embedding. Every rank's grads are slices of one reference backward."""
    groups = build_process_groups(ParallelConfig(tp=2, pp=2))
    model = T.ParallelToyLM(T.CFG, groups)
    stage0 = lambda n: n.startswith(("embedding.", "layers.0."))  # noqa: E731
    mine = {n: p for n, p in model.named_parameters() if stage0(n) == groups.is_first_stage}
    tied = nn.Parameter(model.embedding.weight.detach().clone())
    tied.__dict__.update(model.embedding.weight.__dict__)
    for n, p in mine.items():
        p.grad = T.local_slice(p, reference_grads[n], groups).clone()
    if groups.is_last_stage:
        mine["output_copy_of_embedding"] = tied
        tied.grad = T.local_slice(tied, reference_grads["embedding.weight"], groups).clone()
    for p in (model.embedding.weight, tied):
        p.shared_embedding = True  # both copies of a tied embedding (see finalize_model_grads)
    items = [(p, p.grad) for p in mine.values()]
    norm = total_grad_norm(items, tp_group=groups.tp, pp_group=groups.pp)
    # the distributed optimizer's view: each dp rank holds one half of every gradient
    halves = [(p, g.reshape(-1).chunk(2)[groups.dp_rank]) for p, g in items]
    norm_sharded = total_grad_norm(halves, tp_group=groups.tp, pp_group=groups.pp, dp_group=groups.dp)
    expected = torch.nn.utils.get_total_norm(list(reference_grads.values()))

    # tied embedding: the first stage's gradient and the last stage's copy are summed over the embedding group
    holder = nn.Module()
    holder.params = nn.ParameterList(mine.values())
    emb = model.embedding.weight if groups.is_first_stage else tied
    own = emb.grad.clone()
    finalize_model_grads([holder], groups)
    tied_err = rel_err(emb.grad, 2 * own)  # both copies started from the same reference gradient
    return {"norm": rel_err(norm, expected), "norm_dp_sharded": rel_err(norm_sharded, expected), "tied": tied_err}


def _spawned(rank: int, world_size: int) -> dict:
    reference = T.reference_run(STEPS)
    ref_model = T.reference_from(T._full_model())
    ids, labels = T.batch(T.CFG, 0, T.GLOBAL_BATCH)
    ref_model(ids, labels).mean().backward()
    reference_grads = {n: p.grad for n, p in ref_model.named_parameters()}

    out = run_cases(
        {
            "groups tp2 pp2": lambda: _groups_match_table(ParallelConfig(tp=2, pp=2)),
            "groups tp2 cp2 pp2": lambda: _groups_match_table(ParallelConfig(tp=2, cp=2, pp=2)),
            "groups ep4 etp1": lambda: _groups_match_table(ParallelConfig(tp=2, ep=4, etp=1)),
            "norm tp2 pp2 dp2": lambda: _norm_and_tied_embedding(reference_grads),
        }
    )
    stash: dict = {}
    plan = [
        # (tp, ranks of the sub-world, [(distributed optimizer, sequence parallel), ...])
        (2, range(8), [(False, False), (True, True)]),
        (4, range(8), [(False, True), (True, False)]),
        (2, range(4), [(False, False), (True, True), (False, True), (True, False)]),
        (2, range(2), [(False, False), (True, True)]),
        (1, range(2), [(False, False), (True, False)]),
    ]
    for tp, ranks, variants in plan:
        groups = build_process_groups(ParallelConfig(tp=tp), ranks=list(ranks))  # collective over the world
        if groups is None:
            continue
        tag = f"tp{tp} dp{groups.dp_size}"
        cases = {}
        for dist_opt, sp in variants:
            keep = stash if (tp, groups.dp_size, dist_opt, sp) == (2, 4, True, True) else None
            cases[f"{tag} distopt={dist_opt} sp={sp}"] = lambda g=groups, d=dist_opt, s=sp, k=keep: _parity(
                g, reference, distributed_optimizer=d, sequence_parallel=s, stash=k
            )
        if (tp, groups.dp_size) == (2, 2):
            cases["resume dp4->dp2 distopt"] = lambda g=groups: _resume(
                g, reference, stash["state"], distributed_optimizer=True
            )
            cases["fp16 overflow"] = lambda g=groups: _fp16_overflow(g)
        if (tp, groups.dp_size) == (2, 1):
            cases["resume dp4->dp1"] = lambda g=groups: _resume(
                g, reference, stash["state"], distributed_optimizer=False
            )
        out.update(run_cases(cases))
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_workers(WORLD, _spawned)


def _per_rank(spawned, name):
    values = []
    for rank, res in enumerate(spawned):
        if name not in res:
            continue  # this rank is outside the sub-world of the case
        value = res[name]
        if isinstance(value, dict) and "error" in value:
            raise AssertionError(f"case {name!r} failed on rank {rank}:\n{value['error']}")
        values.append(value)
    assert values, f"no rank ran {name!r}"
    return values


PARITY = [
    "tp2 dp4 distopt=False sp=False",
    "tp2 dp4 distopt=True sp=True",
    "tp4 dp2 distopt=False sp=True",
    "tp4 dp2 distopt=True sp=False",
    "tp2 dp2 distopt=False sp=False",
    "tp2 dp2 distopt=True sp=True",
    "tp2 dp2 distopt=False sp=True",
    "tp2 dp2 distopt=True sp=False",
    "tp2 dp1 distopt=False sp=False",
    "tp2 dp1 distopt=True sp=True",
    "tp1 dp2 distopt=False sp=False",
    "tp1 dp2 distopt=True sp=False",
    "resume dp4->dp2 distopt",
    "resume dp4->dp1",
]


@pytest.mark.parametrize("case", PARITY)
def test_parallel_training_equals_single_process(spawned, case):
    for errs in _per_rank(spawned, case):
        assert errs["skipped"] == 0.0, errs
        assert max(errs["loss"], errs["norm"], errs["params"]) <= TOL, errs


@pytest.mark.parametrize("case", ["groups tp2 pp2", "groups tp2 cp2 pp2", "groups ep4 etp1"])
def test_built_groups_match_rank_table(spawned, case):
    values = _per_rank(spawned, case)
    assert len(values) == WORLD
    for res in values:
        assert res["mismatches"] == [], res


def test_grad_norm_across_tp_pp_dp_and_tied_embedding(spawned):
    values = _per_rank(spawned, "norm tp2 pp2 dp2")
    assert len(values) == WORLD
    for errs in values:
        assert max(errs.values()) <= TOL, errs


def test_fp16_overflow_is_skipped_on_every_rank_and_training_recovers(spawned):
    values = _per_rank(spawned, "fp16 overflow")
    assert len(values) == 4
    for res in values:
        assert res["skipped"] == [True, False, False], res
        assert res["unchanged_during_skip"] and res["finite_after"] and res["changed_after"], res
        assert res["scale_after_skip"] == 2.0**9, res
