"""The offload modes through mcore-train (one process, llama-tiny, fp32 on CPU): the losses of the plain run.

``train.activation_offload`` (attention and MLP, or whole layers with selective recompute) gives the plain run's
losses and gradient norms bit for bit; ``optim.offload_fraction`` (half, or all, of the optimizer states on the
host, stepped by torch's fused CPU AdamW) within fp32 rounding. Bad settings fail with the key and the fix.
"""

from __future__ import annotations

import pytest

from mcore.train.config import load_config
from mcore.train.errors import UserError
from tests.train.tiny import TINY, train, train_records

STEPS = ["train.steps=4"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    base = tmp_path_factory.mktemp("memory_modes")
    train(base / "plain", *STEPS)
    train(base / "selective", *STEPS, "train.recompute=selective")
    return base, train_records(base / "plain"), train_records(base / "selective")


@pytest.mark.parametrize(
    "extra,reference",
    [
        (["train.activation_offload=[attention,mlp]"], "plain"),
        (["train.activation_offload=[layer]", "train.recompute=selective"], "selective"),
    ],
)
def test_activation_offload_is_bitwise(plain, extra, reference):
    base, records = plain[0], {"plain": plain[1], "selective": plain[2]}[reference]
    run_dir = base / ("act_" + "_".join(e.split("=")[0].split(".")[-1] for e in extra) + reference)
    train(run_dir, *STEPS, *extra)
    got = train_records(run_dir)
    for step in range(1, 5):
        assert got[step]["loss"] == records[step]["loss"], step
        assert got[step]["grad_norm"] == records[step]["grad_norm"], step


def test_optimizer_offload_with_fp16_loss_scaling(plain):
    base = plain[0]
    train(base / "fp16", *STEPS, "train.precision=fp16")
    train(base / "fp16_offload", *STEPS, "train.precision=fp16", "optim.offload_fraction=0.5")
    ref, got = train_records(base / "fp16"), train_records(base / "fp16_offload")
    for step in range(1, 5):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-3), step


@pytest.mark.parametrize("fraction", ["0.5", "1.0"])
def test_optimizer_offload_trains_like_on_device(plain, fraction):
    base, records = plain[0], plain[1]
    run_dir = base / f"optim_offload_{fraction}"
    train(run_dir, *STEPS, f"optim.offload_fraction={fraction}")
    got = train_records(run_dir)
    for step in range(1, 5):
        assert got[step]["loss"] == pytest.approx(records[step]["loss"], rel=1e-6), step


def test_activation_offload_moves_the_saved_tensors_of_a_step():
    from mcore.train.datasets import build_run_data, microbatch_stream
    from mcore.train.runtime import init_runtime
    from mcore.train.trainer import Trainer, microbatch_to_device

    config = load_config(None, [*TINY, "train.activation_offload=[attention,mlp]"])
    runtime = init_runtime(config)
    trainer = Trainer(config, runtime)
    stream = microbatch_stream(build_run_data(config).train, config, consumed_samples=0, dp_rank=0, dp_size=1)
    batches = [microbatch_to_device(next(stream), runtime.device) for _ in range(trainer.num_microbatches)]
    trainer.train_step(batches)
    offload = trainer.activation_offload
    # two micro-batches x two layers x (attention, mlp): at least one saved tensor each
    assert offload.offloaded_tensors >= 2 * 2 * 2 and offload.offloaded_bytes > 0


@pytest.mark.parametrize(
    "extra,error,match",
    [
        (["train.activation_offload=[attn]"], UserError, "has no part 'attn'; choose from"),
        (["train.activation_offload=[mlp]", "train.recompute=full"], Exception, "use recompute=selective or none"),
        (["optim.offload_fraction=1.5"], Exception, r"optim.offload_fraction must lie in \[0, 1\]"),
        (
            ["optim.offload_fraction=0.5", "parallel.dp_shard=true"],
            Exception,
            "cannot be combined with parallel.dp_shard",
        ),
    ],
)
def test_bad_memory_settings(extra, error, match):
    from mcore.train.runtime import init_runtime
    from mcore.train.trainer import Trainer

    with pytest.raises(error, match=match):
        config = load_config(None, [*TINY, *extra])
        Trainer(config, init_runtime(config))
