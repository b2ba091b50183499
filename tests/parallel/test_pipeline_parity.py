"""Every pipeline schedule trains the small stack exactly like the single-process float64 reference.

One world-size-4 spawn runs pp=4 (each schedule; micro-batches 1, pp, 3*pp+1 where the schedule allows), pp=2 x
dp=2 with DDP, dp=4 without pipelining, and the point-to-point checks; one world-size-8 spawn runs tp=2 x dp=2 x
pp=2 with sequence parallelism. Each case takes 3 SGD steps and compares, at every step, the losses and every
local gradient (TP slices included) with the reference, then the weights; it also checks that the two copies of
the tied embedding stay bit-identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore.parallel.data_parallel import DistributedDataParallel
from mcore.parallel.finalize import finalize_model_grads
from mcore.parallel.grid import ParallelConfig, build_process_groups
from mcore.parallel.pipeline import (
    GPipe,
    Interleaved1F1B,
    NoPipelining,
    OneFOneB,
    PipelineP2P,
    ZeroBubbleH1,
    p2p_activation_shape,
    stage_layer_ranges,
)
from tests.helpers.distributed import run_workers
from tests.parallel.test_pipeline_stack import (
    LR,
    SIZES,
    TOL,
    Microbatch,
    StackChunk,
    full_weights,
    global_name,
    local_grad,
    make_batch,
    reference,
    rel_err,
    sgd_step,
)

STEPS = 3


def _run_case(
    groups,
    schedule_cls,
    m: int,
    *,
    vpp: int = 1,
    ddp: bool = False,
    sequence_parallel: bool = False,
    layout=None,
    variable_shapes: bool = False,
    measure: bool = False,
    seed: int = 11,
    device: torch.device | str = "cpu",
) -> dict:
    """Train ``STEPS`` steps under ``groups``; return this rank's worst errors and what it checked."""
    device = torch.device(device)
    pp, pp_rank, dp, dp_rank = groups.pp_size, groups.pp_rank, groups.dp_size, groups.dp_rank
    weights = full_weights(seed)
    ranges = stage_layer_ranges(SIZES.layers, pp, vpp, layout)[pp_rank]
    chunks = [
        StackChunk(
            weights,
            ranges[c],
            first=pp_rank == 0 and c == 0,
            last=pp_rank == pp - 1 and c == vpp - 1,
            tp_group=groups.tp,
            sequence_parallel=sequence_parallel,
        )
        for c in range(vpp)
    ]
    for chunk in chunks:
        chunk.to(device)
    model = [DistributedDataParallel(c, groups.dp) for c in chunks] if ddp else chunks
    shape = p2p_activation_shape(
        SIZES.seq, SIZES.micro_batch, SIZES.hidden, tp_size=groups.tp_size, sequence_parallel=sequence_parallel
    )
    schedule = schedule_cls(
        model,
        num_microbatches=m,
        pp_group=groups.pp,
        activation_shape=None if variable_shapes else shape,
        variable_shapes=variable_shapes,
        finalize_grads=lambda: finalize_model_grads(model, groups),
        measure=measure,
        device=device,
    )
    # When the backward of chunk 0's last micro-batch starts, have the later chunks' buckets already been issued?
    overlap_seen: list[bool] = []

    def forward_step(chunk_index, x, mb):
        y = model[chunk_index](x, mb)
        if ddp and vpp > 1 and chunk_index == 0 and mb.index == m - 1:
            y.register_hook(
                lambda g: overlap_seen.append(all(c.launched_buckets() == c.num_buckets() for c in model[1:]))
            )
        return y

    result = {"loss_err": None, "grad_err": 0.0, "checked": set(), "tied_equal": None}
    for step in range(STEPS):
        ids, labels = make_batch(seed, step, dp * m)
        ref_losses, ref_grads = reference(weights, ids, labels, SIZES.layers)
        mine = range(dp_rank * m, (dp_rank + 1) * m)
        mbs = [Microbatch(k, ids[i].to(device), labels[i].to(device)) for k, i in enumerate(mine)]
        losses = schedule.run(forward_step, mbs)
        if losses:
            err = rel_err(torch.stack(losses), ref_losses[mine.start : mine.stop])
            result["loss_err"] = max(result["loss_err"] or 0.0, err)
        for chunk in chunks:
            for name, p in chunk.params_by_name.items():
                expected = chunk.local_view[name](ref_grads[global_name(name)])
                result["grad_err"] = max(result["grad_err"], rel_err(local_grad(p), expected))
                result["checked"].add(name)
        sgd_step(model)
        weights = {k: v - LR * ref_grads[k] for k, v in weights.items()}
    result["param_err"] = max(
        rel_err(p, chunk.local_view[name](weights[global_name(name)]))
        for chunk in chunks
        for name, p in chunk.params_by_name.items()
    )
    if groups.embedding is not None:
        tied = chunks[0].embedding.weight if pp_rank == 0 else chunks[-1].output_weight
        copies = [torch.empty_like(tied) for _ in range(2)]
        dist.all_gather(copies, tied.detach(), group=groups.embedding)
        result["tied_equal"] = torch.equal(copies[0], copies[1])
    if ddp and vpp > 1:
        result["overlap"] = overlap_seen
    if measure:
        tl = schedule.last_timeline
        result["timeline_ops"] = [t.op for t in tl.ops]
        result["expected_ops"] = schedule_cls.op_order(pp, pp_rank, vpp, m)
        result["timeline_sane"] = 0 < tl.busy <= tl.span and all(t.start <= t.end for t in tl.ops)
    return result


def _p2p_cases(groups) -> dict:
    """Ring exchange of tensors whose shapes differ per rank (handshake mode) and fixed-shape transfers."""
    pp, rank = groups.pp_size, groups.pp_rank

    def payload(src: int, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * src + salt)
        return torch.randn(src + 2, 3, generator=g)

    p2p = PipelineP2P(groups.pp, groups.pp_prev_rank, groups.pp_next_rank, shape=None, variable_shapes=True)
    from_prev, from_next = p2p.communicate(
        send_next=payload(rank, 1), send_prev=payload(rank, 2), recv_prev=True, recv_next=True
    )
    variable_ok = torch.equal(from_prev, payload((rank - 1) % pp, 1)) and torch.equal(
        from_next, payload((rank + 1) % pp, 2)
    )
    fixed = PipelineP2P(groups.pp, groups.pp_prev_rank, groups.pp_next_rank, shape=(4, 2), dtype=torch.float64)
    g = torch.Generator().manual_seed(rank)
    sent = torch.randn(4, 2, generator=g, dtype=torch.float64)
    got, _ = fixed.communicate(send_next=sent, recv_prev=True)
    expected = torch.randn(4, 2, generator=torch.Generator().manual_seed((rank - 1) % pp), dtype=torch.float64)
    return {"variable_ok": variable_ok, "fixed_ok": torch.equal(got, expected)}


def _world4(rank: int, world_size: int) -> dict:
    pp4 = build_process_groups(ParallelConfig(pp=4))
    pp2 = build_process_groups(ParallelConfig(pp=2))  # dp = 2
    dp4 = build_process_groups(ParallelConfig())  # dp = 4
    out = {"p2p": _p2p_cases(pp4)}
    for cls in (GPipe, OneFOneB, ZeroBubbleH1):
        for m in (1, 4, 13):
            out[f"pp4-{cls.name}-m{m}"] = _run_case(pp4, cls, m)
        for m in (1, 2, 7):
            out[f"pp2dp2-{cls.name}-m{m}"] = _run_case(pp2, cls, m, ddp=True)
    for m in (4, 8):
        out[f"pp4-interleaved-m{m}"] = _run_case(pp4, Interleaved1F1B, m, vpp=2)
    for m in (2, 6):
        out[f"pp2dp2-interleaved-m{m}"] = _run_case(pp2, Interleaved1F1B, m, vpp=2, ddp=True)
    out["dp4-none-m3"] = _run_case(dp4, NoPipelining, 3, ddp=True)
    out["pp4-1f1b-layout"] = _run_case(pp4, OneFOneB, 5, layout=[1, 3, 3, 1])
    # virtual stages without layers, the first wrapped in DDP with no parameter at all (balanced layouts give
    # them when the output layer outweighs the layers): they only pass activations on
    out["pp2dp2-interleaved-empty-stages"] = _run_case(
        pp2, Interleaved1F1B, 4, vpp=2, ddp=True, layout=[SIZES.layers // 2, 0, SIZES.layers - SIZES.layers // 2, 0]
    )
    out["pp4-1f1b-variable-shapes"] = _run_case(pp4, OneFOneB, 4, variable_shapes=True)
    out["pp4-zb-measured"] = _run_case(pp4, ZeroBubbleH1, 8, measure=True)
    out["pp4-interleaved-measured"] = _run_case(pp4, Interleaved1F1B, 4, vpp=2, measure=True)
    return out


def _world8(rank: int, world_size: int) -> dict:
    groups = build_process_groups(ParallelConfig(tp=2, pp=2))  # dp = 2
    out = {}
    for m in (2, 7):
        out[f"tp2dp2pp2-1f1b-sp-m{m}"] = _run_case(groups, OneFOneB, m, ddp=True, sequence_parallel=True)
    out["tp2dp2pp2-1f1b-m3"] = _run_case(groups, OneFOneB, 3, ddp=True)
    for m in (2, 6):
        out[f"tp2dp2pp2-interleaved-sp-m{m}"] = _run_case(
            groups, Interleaved1F1B, m, vpp=2, ddp=True, sequence_parallel=True
        )
    out["tp2dp2pp2-zb-sp-m7"] = _run_case(groups, ZeroBubbleH1, 7, ddp=True, sequence_parallel=True)
    return out


@pytest.fixture(scope="module")
def world4():
    return run_workers(4, _world4)


@pytest.fixture(scope="module")
def world8():
    return run_workers(8, _world8)


def _names() -> set[str]:
    names = {"embedding.weight"}
    for i in range(SIZES.layers):
        names |= {f"layers.{i}.fc1.weight", f"layers.{i}.fc1.bias", f"layers.{i}.fc2.weight"}
    return names


def _check(results: list[dict], case: str, pipelined: bool = True) -> None:
    per_rank = [r[case] for r in results]
    loss_errs = [r["loss_err"] for r in per_rank if r["loss_err"] is not None]
    assert loss_errs, f"{case}: no rank returned losses"
    assert max(loss_errs) <= TOL, f"{case}: loss error {max(loss_errs):.2e}"
    grad_err = max(r["grad_err"] for r in per_rank)
    param_err = max(r["param_err"] for r in per_rank)
    assert grad_err <= TOL, f"{case}: gradient error {grad_err:.2e}"
    assert param_err <= TOL, f"{case}: weight error after {STEPS} steps {param_err:.2e}"
    checked = set().union(*(r["checked"] for r in per_rank))
    assert checked == _names() | ({"embedding.weight@output"} if pipelined else set())
    if pipelined:
        tied = [r["tied_equal"] for r in per_rank if r["tied_equal"] is not None]
        assert tied and all(tied), f"{case}: the two copies of the tied embedding differ"


W4_CASES = (
    [f"pp4-{n}-m{m}" for n in ("gpipe", "1f1b", "zb-h1") for m in (1, 4, 13)]
    + [f"pp2dp2-{n}-m{m}" for n in ("gpipe", "1f1b", "zb-h1") for m in (1, 2, 7)]
    + ["pp4-interleaved-m4", "pp4-interleaved-m8", "pp2dp2-interleaved-m2", "pp2dp2-interleaved-m6"]
    + [
        "pp4-1f1b-layout",
        "pp2dp2-interleaved-empty-stages",
        "pp4-1f1b-variable-shapes",
        "pp4-zb-measured",
        "pp4-interleaved-measured",
    ]
)


@pytest.mark.parametrize("case", W4_CASES)
def test_world4_matches_single_process(world4, case):
    _check(world4, case)


def test_dp4_gradient_accumulation_matches_single_process(world4):
    _check(world4, "dp4-none-m3", pipelined=False)


@pytest.mark.parametrize("case", ["pp2dp2-interleaved-m2", "pp2dp2-interleaved-m6"])
def test_interleaved_reduces_a_chunk_while_earlier_chunks_still_run_backward(world4, case):
    """DDP sync is off for all but a chunk's last micro-batch, so chunk 1's buckets go out during chunk 0's
    last backward instead of after the schedule."""
    for r in world4:
        assert r[case]["overlap"] == [True] * STEPS


@pytest.mark.parametrize("case", ["pp4-zb-measured", "pp4-interleaved-measured"])
def test_measured_timeline_records_every_op_in_order(world4, case):
    for r in world4:
        assert r[case]["timeline_ops"] == r[case]["expected_ops"]
        assert r[case]["timeline_sane"]


def test_p2p_fixed_and_variable_shapes(world4):
    assert all(r["p2p"]["variable_ok"] and r["p2p"]["fixed_ok"] for r in world4)


W8_CASES = [
    "tp2dp2pp2-1f1b-sp-m2",
    "tp2dp2pp2-1f1b-sp-m7",
    "tp2dp2pp2-1f1b-m3",
    "tp2dp2pp2-interleaved-sp-m2",
    "tp2dp2pp2-interleaved-sp-m6",
    "tp2dp2pp2-zb-sp-m7",
]


@pytest.mark.parametrize("case", W8_CASES)
def test_tp2_dp2_pp2_matches_single_process(world8, case):
    _check(world8, case)
