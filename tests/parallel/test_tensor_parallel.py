"""Tensor-parallel layers, communication primitives, layout-independent init, the RNG tracker and the
WeightGradStore at tp = 1 (in process, no torch.distributed), 2 and 4 (one spawn of 4 gloo ranks),
against plain ``nn.Linear`` / ``nn.Embedding`` / ``F.cross_entropy`` run in one process on the same full
weights and inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mcore.parallel import (
    ColumnParallelLinear,
    ParallelConfig,
    ProcessGroups,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightGradStore,
    attach_weight_grad_store,
    build_process_groups,
    copy_to_tp_region,
    finalize_model_grads,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    get_rng_tracker,
    model_parallel_seed,
    partition_slice,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    seeded_generator,
    vocab_parallel_cross_entropy,
)
from mcore.parallel.comm import group_rank, group_size
from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, rel_err, run_cases

TOL = 1e-5
S, B, H_IN, H_OUT, VOCAB = 8, 3, 12, 16, 24


def _seed(tag: int) -> None:
    # every rank of a TP group draws the same full tensors
    torch.manual_seed(1000 + tag)


def _shard(t: torch.Tensor, dim: int, group, blocks=None) -> torch.Tensor:
    return partition_slice(t, dim % t.dim(), group_rank(group), group_size(group), blocks)


# ---- layers against plain torch ----------------------------------------------------------------------------


def check_column(group, *, sp: bool, bias: bool, blocks=None, gather_output=False) -> dict[str, float]:
    _seed(1)
    ref = nn.Linear(H_IN, H_OUT, bias=bias)
    if bias:
        nn.init.normal_(ref.bias)
    x = torch.randn(S, B, H_IN, requires_grad=True)
    dy = torch.randn(S, B, H_OUT)
    y_ref = ref(x)
    (y_ref * dy).sum().backward()

    layer = ColumnParallelLinear(
        H_IN,
        H_OUT,
        tp_group=group,
        bias=bias,
        sequence_parallel=sp,
        partition_blocks=blocks,
        gather_output=gather_output,
    )
    with torch.no_grad():
        layer.weight.copy_(_shard(ref.weight, 0, group, blocks))
        if bias:
            layer.bias.copy_(_shard(ref.bias, 0, group, blocks))
    x_in = (_shard(x, 0, group) if sp else x).detach().requires_grad_()
    y = layer(x_in)
    dy_local = dy if gather_output else _shard(dy, -1, group, blocks)
    (y * dy_local).sum().backward()
    errs = {
        "out": rel_err(y, y_ref if gather_output else _shard(y_ref, -1, group, blocks)),
        "grad_x": rel_err(x_in.grad, _shard(x.grad, 0, group) if sp else x.grad),
        "grad_w": rel_err(layer.weight.grad, _shard(ref.weight.grad, 0, group, blocks)),
    }
    if bias:
        errs["grad_b"] = rel_err(layer.bias.grad, _shard(ref.bias.grad, 0, group, blocks))
    return errs


def check_row(groups: ProcessGroups, *, sp: bool, bias: bool, input_is_parallel=True) -> dict[str, float]:
    group = groups.tp
    _seed(2)
    ref = nn.Linear(H_IN, H_OUT, bias=bias)
    if bias:
        nn.init.normal_(ref.bias)
    x = torch.randn(S, B, H_IN, requires_grad=True)
    dy = torch.randn(S, B, H_OUT)
    y_ref = ref(x)
    (y_ref * dy).sum().backward()

    layer = RowParallelLinear(
        H_IN, H_OUT, tp_group=group, bias=bias, sequence_parallel=sp, input_is_parallel=input_is_parallel
    )
    with torch.no_grad():
        layer.weight.copy_(_shard(ref.weight, 1, group))
        if bias:
            layer.bias.copy_(ref.bias)
    x_in = (_shard(x, -1, group) if input_is_parallel else x).detach().requires_grad_()
    y = layer(x_in)
    (y * (_shard(dy, 0, group) if sp else dy)).sum().backward()
    # under sequence parallelism the bias saw a sequence shard: its gradient is completed over TP
    finalize_model_grads(layer, groups)
    errs = {
        "out": rel_err(y, _shard(y_ref, 0, group) if sp else y_ref),
        "grad_x": rel_err(x_in.grad, _shard(x.grad, -1, group) if input_is_parallel else x.grad),
        "grad_w": rel_err(layer.weight.grad, _shard(ref.weight.grad, 1, group)),
    }
    if bias:
        errs["grad_b"] = rel_err(layer.bias.grad, ref.bias.grad)
    return errs


def check_embedding(group, *, sp: bool) -> dict[str, float]:
    _seed(3)
    ref = nn.Embedding(VOCAB, H_OUT)
    ids = torch.randint(0, VOCAB, (S, B))
    dy = torch.randn(S, B, H_OUT)
    y_ref = ref(ids)
    (y_ref * dy).sum().backward()

    layer = VocabParallelEmbedding(VOCAB, H_OUT, tp_group=group, sequence_parallel=sp)
    with torch.no_grad():
        layer.weight.copy_(_shard(ref.weight, 0, group))
    y = layer(ids)
    (y * (_shard(dy, 0, group) if sp else dy)).sum().backward()
    return {
        "out": rel_err(y, _shard(y_ref, 0, group) if sp else y_ref),
        "grad_w": rel_err(layer.weight.grad, _shard(ref.weight.grad, 0, group)),
    }


def check_cross_entropy(group) -> dict[str, float]:
    _seed(4)
    valid = VOCAB - 3  # the last 3 columns are vocabulary padding
    logits = (3 * torch.randn(B, S, VOCAB)).requires_grad_()
    target = torch.randint(0, valid, (B, S))
    target[0, :3] = -100
    weights = torch.rand(B, S)
    loss_ref = F.cross_entropy(logits[..., :valid].transpose(1, 2), target, ignore_index=-100, reduction="none")
    (loss_ref * weights).sum().backward()

    shard = _shard(logits, -1, group).detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, group, valid_vocab_size=valid)
    (loss * weights).sum().backward()
    return {"loss": rel_err(loss, loss_ref), "grad_logits": rel_err(shard.grad, _shard(logits.grad, -1, group))}


# ---- communication primitives against hand-built expectations ----------------------------------------------


def check_comm(group) -> dict[str, float]:
    tp, rank = group_size(group), group_rank(group)
    shape = (4 * tp, 2, 3 * tp)

    def per_rank(tag: int, shp) -> list[torch.Tensor]:
        return [torch.randn(shp, generator=torch.Generator().manual_seed(100 * tag + r)) for r in range(tp)]

    errs = {}

    def run(name, fn, x_all, dy_all, expect_y, expect_dx):
        x = x_all[rank].clone().requires_grad_()
        y = fn(x, group)
        y.backward(dy_all[rank])
        errs[f"{name}.fwd"] = rel_err(y, expect_y)
        errs[f"{name}.bwd"] = rel_err(x.grad, expect_dx)

    xs, dys = per_rank(1, shape), per_rank(2, shape)
    run("copy_to_tp", copy_to_tp_region, xs, dys, xs[rank], sum(dys))
    run("reduce_from_tp", reduce_from_tp_region, xs, dys, sum(xs), dys[rank])
    full, dfull = per_rank(3, shape)[0], per_rank(4, shape)[0]
    run(
        "scatter_to_tp",
        scatter_to_tp_region,
        [full] * tp,
        [d.chunk(tp, -1)[rank] for d in per_rank(5, shape)],
        full.chunk(tp, -1)[rank],
        torch.cat([d.chunk(tp, -1)[r] for r, d in enumerate(per_rank(5, shape))], -1),
    )
    run(
        "gather_from_tp",
        gather_from_tp_region,
        [t.chunk(tp, -1)[r] for r, t in enumerate(per_rank(6, shape))],
        [dfull] * tp,
        torch.cat([t.chunk(tp, -1)[r] for r, t in enumerate(per_rank(6, shape))], -1),
        dfull.chunk(tp, -1)[rank],
    )
    run(
        "scatter_to_sp",
        scatter_to_sequence_parallel_region,
        [full] * tp,
        [d.chunk(tp, 0)[rank] for d in per_rank(7, shape)],
        full.chunk(tp, 0)[rank],
        torch.cat([d.chunk(tp, 0)[r] for r, d in enumerate(per_rank(7, shape))], 0),
    )
    seq = [t.chunk(tp, 0)[r] for r, t in enumerate(per_rank(8, shape))]
    run(
        "gather_from_sp", gather_from_sequence_parallel_region, seq, dys, torch.cat(seq, 0), sum(dys).chunk(tp, 0)[rank]
    )
    run(
        "gather_from_sp(split)",
        lambda x, g: gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=False),
        seq,
        [dfull] * tp,
        torch.cat(seq, 0),
        dfull.chunk(tp, 0)[rank],
    )
    run(
        "reduce_scatter_to_sp",
        reduce_scatter_to_sequence_parallel_region,
        xs,
        [d.chunk(tp, 0)[rank] for d in per_rank(9, shape)],
        sum(xs).chunk(tp, 0)[rank],
        torch.cat([d.chunk(tp, 0)[r] for r, d in enumerate(per_rank(9, shape))], 0),
    )
    return errs


# ---- init, RNG, deferred weight gradients ------------------------------------------------------------------


def check_layout_independent_init(group) -> dict[str, float]:
    """A tp-sharded layer initialized from seeded_generator(seed, name) holds the slice of the tp=1 weight."""
    errs = {}
    builders = {
        "column": (lambda g: ColumnParallelLinear(H_IN, H_OUT, tp_group=g, partition_blocks=(8, 8)), 0, (8, 8)),
        "row": (lambda g: RowParallelLinear(H_IN, H_OUT, tp_group=g), 1, None),
        "embedding": (lambda g: VocabParallelEmbedding(VOCAB, H_OUT, tp_group=g), 0, None),
    }
    for name, (build, dim, blocks) in builders.items():
        full_layer, local_layer = build(None), build(group)
        full_layer.reset_parameters(seeded_generator(7, f"{name}.weight"))
        local_layer.reset_parameters(seeded_generator(7, f"{name}.weight"))
        errs[name] = rel_err(local_layer.weight, _shard(full_layer.weight, dim, group, blocks))
    return errs


def check_rng_tracker(group) -> dict[str, bool]:
    model_parallel_seed(99, tp_rank=group_rank(group))
    x = torch.ones(64)
    default_mask = F.dropout(x, 0.5)
    with get_rng_tracker().fork():
        tp_mask = F.dropout(x, 0.5)
    after_fork = F.dropout(x, 0.5)
    model_parallel_seed(99, tp_rank=group_rank(group))
    replay = [F.dropout(x, 0.5), F.dropout(x, 0.5)]
    masks = {"default": default_mask, "tp": tp_mask}
    gathered = {}
    for k, m in masks.items():
        out = [torch.empty_like(m) for _ in range(group_size(group))]
        dist.all_gather(out, m, group=group)
        gathered[k] = out
    return {
        "default_equal_across_tp": all(torch.equal(gathered["default"][0], m) for m in gathered["default"]),
        "tp_distinct_across_tp": all(
            not torch.equal(gathered["tp"][i], gathered["tp"][j]) for i in range(len(gathered["tp"])) for j in range(i)
        ),
        "fork_leaves_default_stream": torch.equal(default_mask, replay[0]) and torch.equal(after_fork, replay[1]),
    }


def check_weight_grad_store(group) -> dict[str, float]:
    _seed(5)
    col = ColumnParallelLinear(H_IN, H_OUT, tp_group=group, bias=True)
    row = RowParallelLinear(H_OUT, H_IN, tp_group=group)
    x = torch.randn(S, B, H_IN)

    def loss(inp):
        return (row(F.gelu(col(inp))) ** 2).sum()

    xa = x.clone().requires_grad_()
    loss(xa).backward()
    expected = {n: p.grad.clone() for n, p in [("col", col.weight), ("row", row.weight)]}
    col.weight.grad = row.weight.grad = col.bias.grad = None

    ready = []
    for p in (col.weight, row.weight):
        p.mcore_grad_ready_hook = ready.append
    xb = x.clone().requires_grad_()
    store = WeightGradStore()
    attach_weight_grad_store([col, row], store)
    with store.deferring():
        loss(xb).backward()
    deferred_none = col.weight.grad is None and row.weight.grad is None and not ready
    assert store.pending() == 1
    store.flush()
    for p in (col.weight, row.weight):
        del p.mcore_grad_ready_hook
    return {
        "deferred_until_flush": 0.0 if deferred_none else 1.0,
        "hooks_called": 0.0 if sorted(map(id, ready)) == sorted(map(id, (col.weight, row.weight))) else 1.0,
        "grad_x": rel_err(xb.grad, xa.grad),
        "col": rel_err(col.weight.grad, expected["col"]),
        "row": rel_err(row.weight.grad, expected["row"]),
    }


# ---- case table, spawned once -------------------------------------------------------------------------------


def _layer_cases(groups: ProcessGroups, tag: str) -> dict:
    g = groups.tp
    cases = {}
    for sp in (False, True):
        for bias in (False, True):
            cases[f"{tag} column sp={sp} bias={bias}"] = lambda sp=sp, bias=bias: check_column(g, sp=sp, bias=bias)
            cases[f"{tag} row sp={sp} bias={bias}"] = lambda sp=sp, bias=bias: check_row(groups, sp=sp, bias=bias)
        cases[f"{tag} embedding sp={sp}"] = lambda sp=sp: check_embedding(g, sp=sp)
        cases[f"{tag} column gather blocks sp={sp}"] = lambda sp=sp: check_column(
            g, sp=sp, bias=True, blocks=(8, 8), gather_output=True
        )
    cases[f"{tag} row scatter input"] = lambda: check_row(groups, sp=False, bias=True, input_is_parallel=False)
    cases[f"{tag} cross_entropy"] = lambda: check_cross_entropy(g)
    cases[f"{tag} comm"] = lambda: check_comm(g)
    cases[f"{tag} init"] = lambda: check_layout_independent_init(g)
    cases[f"{tag} weight_grad_store"] = lambda: check_weight_grad_store(g)
    return cases


def _spawned(rank: int, world_size: int) -> dict:
    out = {}
    for tp in (2, 4):
        groups = build_process_groups(ParallelConfig(tp=tp))
        cases = _layer_cases(groups, f"tp{tp}")
        cases[f"tp{tp} rng"] = lambda g=groups.tp: check_rng_tracker(g)
        out.update(run_cases(cases))
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_workers(4, _spawned)


CASE_NAMES = sorted(_layer_cases(ProcessGroups.single(), "tp1"))


@pytest.fixture(scope="module")
def in_process():
    return [run_cases(_layer_cases(ProcessGroups.single(), "tp1"))]


@pytest.mark.parametrize("case", [c.removeprefix("tp1 ") for c in CASE_NAMES])
def test_tp1_in_process(in_process, case):
    (errs,) = case_result(in_process, f"tp1 {case}")
    assert errs and max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", [c.removeprefix("tp1 ") for c in CASE_NAMES])
def test_tp_spawned(spawned, tp, case):
    for errs in case_result(spawned, f"tp{tp} {case}"):
        assert errs and max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("tp", [2, 4])
def test_rng_tracker_streams(spawned, tp):
    for flags in case_result(spawned, f"tp{tp} rng"):
        assert all(flags.values()), flags


def test_tp1_layers_are_plain_layers_without_distributed():
    assert not dist.is_initialized()
    layer = ColumnParallelLinear(H_IN, H_OUT, bias=True)
    x = torch.randn(5, H_IN)
    assert rel_err(layer(x), F.linear(x, layer.weight, layer.bias)) <= TOL
    assert layer.weight.tensor_parallel and layer.weight.partition_dim == 0
    row = RowParallelLinear(H_IN, H_OUT, bias=True, sequence_parallel=True)
    assert row.weight.partition_dim == 1 and not row.bias.tensor_parallel and row.bias.sequence_parallel
    emb = VocabParallelEmbedding(VOCAB, H_OUT, vocab_size=VOCAB - 2)
    assert (emb.weight.vocab_padded_dim, emb.weight.vocab_size) == (0, VOCAB - 2)


def test_seeded_generator_is_stable_and_name_dependent():
    a = torch.randn(8, generator=seeded_generator(3, "layers.0.mlp.down.weight"))
    b = torch.randn(8, generator=seeded_generator(3, "layers.0.mlp.down.weight"))
    c = torch.randn(8, generator=seeded_generator(3, "layers.1.mlp.down.weight"))
    d = torch.randn(8, generator=seeded_generator(4, "layers.0.mlp.down.weight"))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)


def test_seeded_generator_does_not_depend_on_python_hash_seed():
    import os
    import subprocess
    import sys

    code = (
        "from mcore.parallel.init import seeded_generator; "
        "print(seeded_generator(11, 'embedding.weight').initial_seed())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(seeded_generator(11, "embedding.weight").initial_seed())


@pytest.mark.parametrize(
    ("build", "exc", "pattern"),
    [
        (
            lambda: ColumnParallelLinear(12, 16, partition_blocks=(8, 4)),
            ValueError,
            r"sum to 12, expected out_features 16",
        ),
        (
            lambda: RowParallelLinear(12, 16, sequence_parallel=True, input_is_parallel=False),
            ValueError,
            "input_is_parallel",
        ),
        (lambda: ColumnParallelLinear(0, 16), ValueError, "in_features must be a positive int, got 0"),
        (
            lambda: VocabParallelEmbedding(24, 8, vocab_size=30),
            ValueError,
            r"vocab_size must be in \[1, num_embeddings=24\]",
        ),
        (
            lambda: ColumnParallelLinear(12, 16)(torch.randn(3, 10)),
            ValueError,
            r"expected input \[..., 12\].*got shape \(3, 10\)",
        ),
        (
            lambda: VocabParallelEmbedding(24, 8)(torch.rand(3)),
            TypeError,
            "expected integer token ids, got dtype torch.float32",
        ),
        (
            lambda: partition_slice(torch.randn(10, 2), 0, 0, 4),
            ValueError,
            "block of 10 along dim 0 not divisible by 4 ranks",
        ),
        (
            lambda: vocab_parallel_cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long)),
            ValueError,
            r"logits must be target.shape \+ \(vocab shard,\)",
        ),
    ],
)
def test_bad_input_raises_naming_the_problem(build, exc, pattern):
    with pytest.raises(exc, match=pattern):
        build()
