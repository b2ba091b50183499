"""``fp8.param_gather`` in mcore-train on 2 gloo ranks (dp 2, ZeRO-1, tensor-wise fp8 on CPU).

Without clipping, the fp8 all-gather gives the losses of the ordinary bf16 (here fp32) parameter gather bit for
bit; the gradient norms agree to 1e-6, not exactly: the fp8 weights live in a buffer of their own, so the norm sums
its pieces in another order (with clipping on, that rounding moves the clip coefficient, and fp8 casts magnify a
one-ulp weight difference: 4e-6 after 12 steps). A run stopped at step 6 and resumed with it gives the straight
run's losses bit for bit (the checkpoint's weights gathered complete first), and the configurations it cannot serve
are one clear error each. (Block-wise needs K and N multiples of 128, more than this tiny model has: its gather is
tested in tests/parallel/test_fp8_param_gather.py.)
"""

from __future__ import annotations

import pytest

from mcore.train.config import load_config
from mcore.train.errors import UserError
from tests.helpers.distributed import run_workers
from tests.train.tiny import TINY, train, train_records

FP8 = ["train.precision=fp8", "fp8.recipe=tensorwise", "parallel.distributed_optimizer=true", "fp8.keep=[]"]


def _runs(rank: int, world: int, root: str) -> dict | None:
    runs = {
        "bf16-gather": [*FP8, "optim.clip_grad=0"],
        "fp8-gather": [*FP8, "optim.clip_grad=0", "fp8.param_gather=true"],
        "fp8-gather-overlap": [
            *FP8,
            "optim.clip_grad=0",
            "fp8.param_gather=true",
            "parallel.overlap_param_gather=true",
        ],
    }
    runs["fp8-gather-clipped"] = [*FP8, "fp8.param_gather=true"]  # the straight run of the resume
    for name, overrides in runs.items():
        train(f"{root}/{name}", *overrides)
    first, _ = train(f"{root}/resumed", *FP8, "fp8.param_gather=true", "train.stop_at_step=6")
    second, log = train(f"{root}/resumed", *FP8, "fp8.param_gather=true")
    if rank != 0:
        return None
    out = {name: train_records(f"{root}/{name}") for name in [*runs, "resumed"]}
    out["statuses"] = (first.status, second.iteration, "resuming from" in log)
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return run_workers(2, _runs, str(tmp_path_factory.mktemp("fp8_gather")))[0]


def _curve(records: dict) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for _, r in sorted(records.items())]


@pytest.mark.parametrize("name", ["fp8-gather", "fp8-gather-overlap"])
def test_fp8_gather_trains_exactly_as_the_ordinary_gather(records, name):
    reference = _curve(records["bf16-gather"])
    assert len(reference) == 12 and reference[-1][0] < reference[0][0]
    for got, ref in zip(_curve(records[name]), reference, strict=True):
        assert got[0] == ref[0] and abs(got[1] - ref[1]) <= 1e-6 * ref[1], (got, ref)


def test_stopped_and_resumed_equals_the_straight_run(records):
    assert records["statuses"] == ("stopped", 12, True)
    assert _curve(records["resumed"]) == _curve(records["fp8-gather-clipped"])


def _pipeline_runs(rank: int, world: int, root: str) -> dict | None:
    """4 ranks, pp 2 x dp 2 (llama-tiny's 2 layers, one per stage; the last stage's output layer kept in bf16):
    1F1B and zero bubble (the fp8 linears' weight gradients deferred), each with the ordinary and the fp8 gather."""
    pp = ["parallel.pp=2", "train.global_batch_size=8", "optim.clip_grad=0", *FP8]
    out = {}
    for schedule in ("1f1b", "zero-bubble"):
        for gather in ("false", "true"):
            name = f"{schedule}-{gather}"
            train(f"{root}/{name}", *pp, f"parallel.schedule={schedule}", f"fp8.param_gather={gather}")
            out[name] = train_records(f"{root}/{name}") if rank == 0 else None
    return out if rank == 0 else None


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_fp8_gather_under_pipeline_parallelism_trains_as_the_ordinary_gather(schedule, pipeline_records):
    reference = _curve(pipeline_records[f"{schedule}-false"])
    assert len(reference) == 12 and reference[-1][0] < reference[0][0]
    for got, ref in zip(_curve(pipeline_records[f"{schedule}-true"]), reference, strict=True):
        assert got[0] == ref[0] and abs(got[1] - ref[1]) <= 1e-6 * ref[1], (got, ref)


@pytest.fixture(scope="module")
def pipeline_records(tmp_path_factory):
    return run_workers(4, _pipeline_runs, str(tmp_path_factory.mktemp("fp8_gather_pp")))[0]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["fp8.param_gather=true"], r"needs train.precision=fp8 \(got auto.*parallel.distributed_optimizer=true"),
        (
            [
                "train.precision=fp8",
                "fp8.recipe=rowwise",
                "parallel.distributed_optimizer=true",
                "fp8.param_gather=true",
            ],
            r"needs fp8.recipe tensorwise, delayed or blockwise \(got rowwise\)",
        ),  # fmt: skip
        ([*FP8, "fp8.param_gather=true", "kernels.backend=te"], r"needs kernels.backend=auto \(got te"),
    ],
)
def test_what_it_cannot_serve_is_one_clear_error(overrides, match):
    with pytest.raises(UserError, match=match):
        load_config(None, [*TINY, *overrides])


def test_a_model_without_fp8_linears_is_one_clear_error(tmp_path):
    from mcore.train.runtime import init_runtime
    from mcore.train.trainer import Trainer

    keep_all = [*FP8[:-1], "fp8.keep=['*']", "fp8.param_gather=true"]
    config = load_config(None, [*TINY, f"log.run_dir={tmp_path}", *keep_all])
    with pytest.raises(UserError, match="every linear stays in high precision"):
        Trainer(config, init_runtime(config))
