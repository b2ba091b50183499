"""Schedules as pure functions: op orders, their communication plans, bubble fractions, errors (the docs
drawings: tests/test_pipeline_report.py).

No processes here. The plans are replayed under NCCL's matching rules (a send completes only when its receive is
posted, messages between two ranks match in posting order), which would expose a deadlock or a misrouted
tensor for every size tried; the replayed idle time is compared with each schedule's formula and with an
independent, dependency-only simulation.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch import nn

from mcore.parallel.pipeline import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    GPipe,
    Interleaved1F1B,
    NoPipelining,
    OneFOneB,
    Op,
    PipelineP2P,
    ZeroBubbleH1,
    p2p_activation_shape,
    pipeline_idle_fraction,
    render,
    replay_plans,
    simulate,
)
from mcore.parallel.tensor_parallel import ColumnParallelLinear


def _sizes(schedule_cls, pps=(1, 2, 3, 4, 5, 8), max_m=None):
    """Every (pp, vpp, m) the schedule accepts in a small grid, m from 1 to 3*pp+1 (or max_m)."""
    vpps = (2, 3) if schedule_cls is Interleaved1F1B else (1,)
    for pp in pps:
        for vpp in vpps:
            for m in range(1, (max_m or 3 * pp + 1) + 1):
                try:
                    schedule_cls.check_sizes(pp, vpp, m)
                except ValueError:
                    continue
                yield pp, vpp, m


ALL = (NoPipelining, GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1)


@pytest.mark.parametrize("schedule_cls", ALL)
def test_each_rank_runs_every_pass_once_and_in_dependency_order(schedule_cls):
    for pp, vpp, m in _sizes(schedule_cls):
        for rank in range(pp):
            order = schedule_cls.op_order(pp, rank, vpp, m)
            counts = Counter(order)
            kinds = (FORWARD, BACKWARD, WEIGHT) if schedule_cls.splits_backward else (FORWARD, BACKWARD)
            expected = {Op(k, c, mb) for k in kinds for c in range(vpp) for mb in range(m)}
            assert set(counts) == expected and set(counts.values()) == {1}, (pp, vpp, m, rank)
            position = {op: i for i, op in enumerate(order)}
            for c in range(vpp):
                for mb in range(m):
                    assert position[Op(FORWARD, c, mb)] < position[Op(BACKWARD, c, mb)]
                    if schedule_cls.splits_backward:
                        assert position[Op(BACKWARD, c, mb)] < position[Op(WEIGHT, c, mb)]
            forward_only = schedule_cls.op_order(pp, rank, vpp, m, forward_only=True)
            assert sorted(forward_only, key=str) == sorted((op for op in order if op.kind == FORWARD), key=str)


def _op_times(schedule_cls) -> dict[str, float]:
    """A backward costs twice a forward, split evenly into B and W when the schedule splits it."""
    if schedule_cls.splits_backward:
        return {"forward_time": 1.0, "backward_time": 1.0, "weight_time": 1.0}
    return {"forward_time": 1.0, "backward_time": 2.0, "weight_time": 0.0}


@pytest.mark.parametrize("schedule_cls", ALL)
def test_plans_replay_without_deadlock_and_reach_the_theoretical_bubble(schedule_cls):
    """The exact plans that ``run`` executes, replayed with t_B = 2 t_F (ZB-H1: t_F = t_B = t_W): idle share equal
    to ``bubble_fraction`` and to the dependency-only ideal, so the lock-step exchanges cost nothing."""
    times = _op_times(schedule_cls)
    for pp, vpp, m in _sizes(schedule_cls):
        replayed = replay_plans(schedule_cls.plans(pp, vpp, m), pp, **times)
        replay_plans(schedule_cls.plans(pp, vpp, m, forward_only=True), pp, **times)
        ideal = simulate([schedule_cls.op_order(pp, r, vpp, m) for r in range(pp)], vpp, **times)
        formula = schedule_cls.bubble_fraction(pp, vpp, m)
        assert pipeline_idle_fraction(replayed) == pytest.approx(formula, abs=1e-12), (pp, vpp, m)
        assert pipeline_idle_fraction(ideal) == pytest.approx(formula, abs=1e-12), (pp, vpp, m)


def test_bubble_fractions_by_hand():
    assert GPipe.bubble_fraction(4, 1, 8) == pytest.approx(3 / 11)
    assert OneFOneB.bubble_fraction(4, 1, 8) == pytest.approx(3 / 11)
    assert Interleaved1F1B.bubble_fraction(4, 2, 8) == pytest.approx(3 / 19)
    assert ZeroBubbleH1.bubble_fraction(4, 1, 8) == pytest.approx(3 / 27)
    assert ZeroBubbleH1.bubble_fraction(4, 1, 2) == pytest.approx(5 / 11)  # fewer micro-batches than stages
    assert NoPipelining.bubble_fraction(1, 1, 5) == 0.0


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_zero_bubble_idles_a_third_of_1f1b(pp):
    """With t_F = t_B = t_W (1F1B's backward = B + W = 2), each rank idles p - 1 slots instead of 3 (p - 1)."""
    m = 2 * pp
    zb = replay_plans(ZeroBubbleH1.plans(pp, 1, m), pp, forward_time=1, backward_time=1, weight_time=1)
    ofob = replay_plans(OneFOneB.plans(pp, 1, m), pp, forward_time=1, backward_time=2)
    assert [t.idle for t in zb] == [pp - 1] * pp
    assert [t.idle for t in ofob] == [3 * (pp - 1)] * pp


@pytest.mark.parametrize("pp", [2, 4, 5])
def test_zero_bubble_keeps_1f1b_activation_memory(pp):
    """At most p - r micro-batches between F and B on rank r, as 1F1B, and at most p between F and W."""
    for m in (1, pp, 3 * pp + 1):
        for rank in range(pp):
            for cls, limit_fb in ((OneFOneB, pp - rank), (ZeroBubbleH1, pp - rank)):
                started, backward_done, peak_fb, peak_fw = set(), set(), 0, 0
                for op in cls.op_order(pp, rank, 1, m):
                    if op.kind == FORWARD:
                        started.add(op.microbatch)
                    elif op.kind == BACKWARD:
                        backward_done.add(op.microbatch)
                        if not cls.splits_backward:
                            started.discard(op.microbatch)
                    else:
                        started.discard(op.microbatch)
                    peak_fb = max(peak_fb, len(started - backward_done))
                    peak_fw = max(peak_fw, len(started))
                assert peak_fb <= limit_fb and peak_fw <= pp, (cls.__name__, pp, m, rank, peak_fb, peak_fw)


def test_interleaved_visits_chunks_in_groups_of_pp():
    order = Interleaved1F1B.op_order(2, 0, 2, 4, forward_only=True)
    assert [str(op) for op in order] == ["F0", "F1", "F0.1", "F1.1", "F2", "F3", "F2.1", "F3.1"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Interleaved1F1B.check_sizes(4, 2, 13), r"num_microbatches=13, pp=4; use 12 or 16 micro-batches"),
        (lambda: Interleaved1F1B.check_sizes(4, 2, 1), r"num_microbatches=1, pp=4; use 4 micro-batches"),
        (lambda: Interleaved1F1B.check_sizes(2, 1, 4), r"vpp >= 2 .* got vpp=1; use OneFOneB"),
        (lambda: Interleaved1F1B.check_sizes(1, 2, 4), r"pp >= 2, got pp=1"),
        (lambda: OneFOneB.check_sizes(4, 2, 8), r"got vpp=2; use Interleaved1F1B"),
        (lambda: GPipe.bubble_fraction(4, 3, 8), r"got vpp=3"),
        (lambda: ZeroBubbleH1.check_sizes(2, 2, 4), r"got vpp=2"),
        (lambda: NoPipelining.check_sizes(2, 1, 4), r"pp=2, vpp=1"),
        (lambda: OneFOneB.check_sizes(4, 1, 0), r"num_microbatches must be >= 1, got 0"),
    ],
)
def test_invalid_sizes_raise_naming_the_numbers(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_schedule_checks_its_chunks_and_group():
    with pytest.raises(ValueError, match="GPipe runs one model chunk per rank, got vpp=2"):
        GPipe([nn.Linear(2, 2), nn.Linear(2, 2)], num_microbatches=4)
    with pytest.raises(ValueError, match="pp_size=2 needs the pipeline process group"):
        OneFOneB([nn.Linear(2, 2)], num_microbatches=4, pp_rank=0, pp_size=2)
    with pytest.raises(TypeError, match=r"model_chunks\[1\] must be an nn.Module"):
        OneFOneB([nn.Linear(2, 2), "chunk"], num_microbatches=4)


def test_grad_sync_is_off_except_for_each_chunks_last_microbatch():
    """A DDP-like chunk records, whenever a gradient lands, whether sync was on; only the last micro-batch's
    passes (B, and W for the deferred weight) may see it on."""

    class Recording(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = ColumnParallelLinear(4, 4, bias=True)
            self.sync = True
            self.seen: list[tuple[str, bool]] = []
            self.lin.bias.register_post_accumulate_grad_hook(lambda p: self.seen.append(("bias", self.sync)))
            self.lin.weight.mcore_grad_ready_hook = lambda p: self.seen.append(("weight", self.sync))

        @contextlib.contextmanager
        def no_sync(self):
            self.sync = False
            try:
                yield
            finally:
                self.sync = True

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, 4, generator=g) for _ in range(3)]
    for cls in (NoPipelining, ZeroBubbleH1):
        chunk = Recording()
        schedule = cls([chunk], num_microbatches=3)
        schedule.run(lambda c, x, mb, chunk=chunk: chunk.lin(mb).square().mean(), batches)
        bias = [on for what, on in chunk.seen if what == "bias"]
        assert bias == [False, False, True], cls
        if cls is ZeroBubbleH1:  # deferred weight gradients arrive through the ready hook, in W
            assert [on for what, on in chunk.seen if what == "weight"] == [False, False, True]
        assert cls is NoPipelining or schedule.weight_grads.pending() == 0


def test_p2p_checks_before_communicating():
    p2p = PipelineP2P(None, 0, 1, shape=(4, 2, 8))
    with pytest.raises(ValueError, match=r"shape \(4, 2, 7\) but the pipeline was set up for \(4, 2, 8\)"):
        p2p.communicate(send_next=torch.randn(4, 2, 7))
    with pytest.raises(ValueError, match="dtype torch.float64 but the pipeline transfers torch.float32"):
        p2p.communicate(send_next=torch.randn(4, 2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="no next stage"):
        PipelineP2P(None, 0, None, shape=(1,)).communicate(send_next=torch.randn(1))
    with pytest.raises(ValueError, match="shape is required"):
        PipelineP2P(None, 0, 1, shape=None)


def test_sequence_parallel_activation_shape():
    assert p2p_activation_shape(16, 2, 8, tp_size=4, sequence_parallel=True) == (4, 2, 8)
    assert p2p_activation_shape(16, 2, 8, tp_size=4) == (16, 2, 8)
    with pytest.raises(ValueError, match="seq_length=10 must be divisible by tp_size=4"):
        p2p_activation_shape(10, 2, 8, tp_size=4, sequence_parallel=True)


def test_render_draws_ops_where_they_run():
    tl = replay_plans(OneFOneB.plans(2, 1, 2), 2, forward_time=1, backward_time=2)
    assert render(tl) == "stage 0: F0 F1 .. .. B0 B0 .. B1 B1\nstage 1: .. F0 B0 B0 F1 B1 B1 .. .."
