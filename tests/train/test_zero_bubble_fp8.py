"""``train.precision=fp8`` under the zero-bubble schedule at pp=2 (gloo, CPU: the reference fp8 GEMMs) trains
like the single process (losses and gradient norms within the 1e-5 the layout tests use), and the fp8 linears'
weight gradients really are deferred into the schedule's ``WeightGradStore``: every backward of an fp8 linear
queued its weight-gradient closure, none computed it at once (under 1F1B, with no store, none is queued)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.helpers.distributed import run_workers

STEPS, MICROBATCHES = 3, 2  # global batch 4 of micro-batches of 2
FP8_LINEARS_PER_STAGE = 4  # one llama-tiny layer per stage: qkv, o, gate_up, down (the output layer stays bf16)
COMMON = [f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2", "train.precision=fp8"]
RECIPES = ("tensorwise", "delayed")
PIPELINED = {
    "zb": ["parallel.pp=2", "parallel.schedule=zero-bubble"],
    "1f1b": ["parallel.pp=2", "parallel.schedule=1f1b"],
}


def _counting_deferrals(counts: Counter):
    """Wrap the kernels layer's defer-or-run-now step: count, per answer of the store, the fp8 weight gradients."""
    from mcore.kernels import low_precision_linear as lpl

    original = lpl._now_or_deferred

    def counting(defer, param, compute):
        if defer is None:
            counts["no store"] += 1
            return original(defer, param, compute)

        def asking(p, c):
            queued = defer(p, c)
            counts["deferred" if queued else "now"] += 1
            return queued

        return original(asking, param, compute)

    lpl._now_or_deferred = counting
    return lambda: setattr(lpl, "_now_or_deferred", original)


def _curves(run_dir) -> list[tuple[float, float]]:
    from tests.train.tiny import train_records

    return [(r["loss"], r["grad_norm"]) for _, r in sorted(train_records(run_dir).items())]


def _runs(rank: int, world: int, root: str, layouts: dict) -> dict:
    from tests.train.tiny import train

    out = {}
    for recipe in RECIPES:
        for name, overrides in layouts.items():
            counts: Counter = Counter()
            restore = _counting_deferrals(counts)
            try:
                run_dir = f"{root}/{name}-{recipe}"
                train(run_dir, *COMMON, f"fp8.recipe={recipe}", *overrides)
            finally:
                restore()
            out[(name, recipe)] = {"curve": _curves(run_dir), "counts": dict(counts)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("zb_fp8")
    single = run_workers(1, _runs, str(root / "single"), {"single": []})[0]
    pipelined = run_workers(2, _runs, str(root / "pp2"), PIPELINED)
    return single, pipelined


@pytest.mark.parametrize("schedule", list(PIPELINED))
@pytest.mark.parametrize("recipe", RECIPES)
def test_pp2_fp8_trains_like_the_single_process(results, recipe, schedule):
    single, pipelined = results
    reference = single[("single", recipe)]["curve"]
    assert len(reference) == STEPS
    checked = 0
    for rank, per_rank in enumerate(pipelined):
        got = per_rank[(schedule, recipe)]["curve"]
        if not got:  # a rank that found no records (the metrics file is written by the logging rank)
            continue
        checked += 1
        for (loss, norm), (ref_loss, ref_norm) in zip(got, reference, strict=True):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, got, reference)
            assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), (rank, got, reference)
    assert checked, "no rank read the pipelined run's losses"


@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_bubble_defers_every_fp8_weight_gradient(results, recipe):
    _, pipelined = results
    for rank, per_rank in enumerate(pipelined):
        counts = per_rank[("zb", recipe)]["counts"]
        # both stages hold fp8 linears; each of their backwards (micro-batches x steps) queued its weight gradient
        assert counts == {"deferred": FP8_LINEARS_PER_STAGE * MICROBATCHES * STEPS}, (rank, counts)
        # 1F1B has no store: the same linears compute the weight gradient at once
        assert per_rank[("1f1b", recipe)]["counts"] == {"no store": counts["deferred"]}, rank
