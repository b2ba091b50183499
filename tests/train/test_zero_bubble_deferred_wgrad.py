"""``train.precision=fp8`` under the zero-bubble schedule at pp=2 (gloo, CPU: the reference fp8 GEMMs) trains
like the single process (losses and gradient norms within the 1e-5 the layout tests use), and the fp8 linears'
weight gradients really are deferred into the schedule's ``WeightGradStore``: every backward of an fp8 linear
queued its weight-gradient closure, none computed it at once (under 1F1B, with no store, none is queued).
Likewise under zero bubble (same spawned processes): a tiny Mixtral with high-precision experts (CPU: fp32, the
bf16 experts' grouped GEMMs) and with fp8 row-wise experts, whose every expert weight gradient is deferred, and
llama-tiny with BitNet linears, whose every BitNet weight gradient is."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.helpers.distributed import run_workers

STEPS, MICROBATCHES = 3, 2  # global batch 4 of micro-batches of 2
FP8_LINEARS_PER_STAGE = 4  # one llama-tiny layer per stage: qkv, o, gate_up, down (the output layer stays bf16)
BATCHES = [f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2"]
RECIPES = ("tensorwise", "delayed")
# run under zero bubble only (and single-process): name -> overrides
DEFERRING = {
    "moe": ["model=mixtral-tiny"],
    "moe-fp8": ["model=mixtral-tiny", "train.precision=fp8", "fp8.recipe=rowwise"],
    "bitnet": ["train.quant=bitnet"],
}
EXPERT_WEIGHTS_PER_STAGE = 2  # one mixtral-tiny MoE layer per stage: gate_up and down
MOE_FP8_LINEARS_PER_STAGE = 2  # its attention's qkv and o (the output layer stays bf16)
PIPELINED = {
    "zb": ["parallel.pp=2", "parallel.schedule=zero-bubble"],
    "1f1b": ["parallel.pp=2", "parallel.schedule=1f1b"],
}


def _counting_deferrals(counts: Counter):
    """Wrap the defer-or-run-now step of the fp8 linears, the BitNet linears and the experts' GEMMs: count, per kind
    and answer of the store, the weight gradients."""
    import importlib

    from mcore.kernels import bitnet
    from mcore.kernels import low_precision_linear as lpl
    from mcore.parallel import expert_gemm

    grouped = importlib.import_module("mcore.kernels.grouped_gemm")  # the module, not mcore.kernels' function
    fp8_grouped = importlib.import_module("mcore.kernels.fp8_grouped_gemm")
    sites = [(lpl, "_now_or_deferred", "linear"), (bitnet, "now_or_deferred", "bitnet")]
    sites += [(module, "now_or_deferred", "experts") for module in (grouped, fp8_grouped, expert_gemm)]
    originals = [getattr(module, name) for module, name, _ in sites]

    def counting(original, kind):
        def call(defer, param, compute):
            if defer is None:
                counts[f"{kind} no store"] += 1
                return original(defer, param, compute)

            def asking(p, c):
                queued = defer(p, c)
                counts[f"{kind} {'deferred' if queued else 'now'}"] += 1
                return queued

            return original(asking, param, compute)

        return call

    for (module, name, kind), original in zip(sites, originals, strict=True):
        setattr(module, name, counting(original, kind))

    def restore():
        for (module, name, _), original in zip(sites, originals, strict=True):
            setattr(module, name, original)

    return restore


def _curves(run_dir) -> list[tuple[float, float]]:
    from tests.train.tiny import train_records

    return [(r["loss"], r["grad_norm"]) for _, r in sorted(train_records(run_dir).items())]


def _run(out: dict, key, run_dir: str, *overrides: str) -> None:
    from tests.train.tiny import train

    counts: Counter = Counter()
    restore = _counting_deferrals(counts)
    try:
        train(run_dir, *BATCHES, *overrides)
    finally:
        restore()
    out[key] = {"curve": _curves(run_dir), "counts": dict(counts)}


def _runs(rank: int, world: int, root: str, layouts: dict) -> dict:
    out = {}
    for recipe in RECIPES:
        for name, overrides in layouts.items():
            run_dir = f"{root}/{name}-{recipe}"
            _run(out, (name, recipe), run_dir, "train.precision=fp8", f"fp8.recipe={recipe}", *overrides)
    for model, model_overrides in DEFERRING.items():
        for name, overrides in layouts.items():
            if name != "1f1b":
                _run(out, (name, model), f"{root}/{name}-{model}", *model_overrides, *overrides)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("zb_deferred")
    single = run_workers(1, _runs, str(root / "single"), {"single": []})[0]
    pipelined = run_workers(2, _runs, str(root / "pp2"), PIPELINED)
    return single, pipelined


def _assert_trains_like_the_single_process(results, schedule: str, case: str) -> None:
    single, pipelined = results
    reference = single[("single", case)]["curve"]
    assert len(reference) == STEPS
    checked = 0
    for rank, per_rank in enumerate(pipelined):
        got = per_rank[(schedule, case)]["curve"]
        if not got:  # a rank that found no records (the metrics file is written by the logging rank)
            continue
        checked += 1
        for (loss, norm), (ref_loss, ref_norm) in zip(got, reference, strict=True):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, got, reference)
            assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), (rank, got, reference)
    assert checked, "no rank read the pipelined run's losses"


@pytest.mark.parametrize("schedule", list(PIPELINED))
@pytest.mark.parametrize("recipe", RECIPES)
def test_pp2_fp8_trains_like_the_single_process(results, recipe, schedule):
    _assert_trains_like_the_single_process(results, schedule, recipe)


@pytest.mark.parametrize("model", list(DEFERRING))
def test_pp2_zero_bubble_moe_and_bitnet_train_like_the_single_process(results, model):
    _assert_trains_like_the_single_process(results, "zb", model)


@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_bubble_defers_every_fp8_weight_gradient(results, recipe):
    _, pipelined = results
    for rank, per_rank in enumerate(pipelined):
        counts = per_rank[("zb", recipe)]["counts"]
        # both stages hold fp8 linears; each of their backwards (micro-batches x steps) queued its weight gradient
        assert counts == {"linear deferred": FP8_LINEARS_PER_STAGE * MICROBATCHES * STEPS}, (rank, counts)
        # 1F1B has no store: the same linears compute the weight gradient at once
        assert per_rank[("1f1b", recipe)]["counts"] == {"linear no store": counts["linear deferred"]}, rank


@pytest.mark.parametrize("model", list(DEFERRING))
def test_zero_bubble_defers_every_expert_and_bitnet_weight_gradient(results, model):
    single, pipelined = results
    backwards = MICROBATCHES * STEPS  # per stage: each of its layers runs one backward per micro-batch and step
    want = {
        "moe": {"experts deferred": EXPERT_WEIGHTS_PER_STAGE * backwards},
        "moe-fp8": {
            "experts deferred": EXPERT_WEIGHTS_PER_STAGE * backwards,
            "linear deferred": MOE_FP8_LINEARS_PER_STAGE * backwards,
        },
        "bitnet": {"bitnet deferred": FP8_LINEARS_PER_STAGE * backwards},  # qkv, o, gate_up, down (output kept)
    }[model]
    for rank, per_rank in enumerate(pipelined):
        assert per_rank[("zb", model)]["counts"] == want, (rank, model)
    # the single process (no schedule store) ran both stages' layers, each computing its gradient at once
    assert single[("single", model)]["counts"] == {k.replace("deferred", "no store"): 2 * n for k, n in want.items()}
