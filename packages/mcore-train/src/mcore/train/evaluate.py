"""Validation loss: :func:`evaluate_loss` (the training loop's evaluations and ``mcore-train evaluate``) and
:func:`run_evaluation`, the ``mcore-train evaluate`` command's result as JSON."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mcore.train.checkpoint.reader import CheckpointReader
from mcore.train.config import Config
from mcore.train.datasets import build_run_data, microbatch_stream
from mcore.train.errors import UserError
from mcore.train.runtime import Runtime
from mcore.train.start import new_trainer
from mcore.train.trainer import Trainer, microbatch_to_device


def evaluate_loss(
    trainer: Trainer,
    config: Config,
    dataset: torch.utils.data.Dataset,
    *,
    before_batch: Callable[[int], None] | None = None,
) -> float:
    """Mean loss over the first ``train.eval_steps`` global batches of ``dataset`` (the same samples each time).

    ``before_batch(i)`` is called before global batch ``i`` (the loop beats its hang watchdog there).
    Collective over every rank; every rank returns the same value.
    """
    g = trainer.groups
    stream = microbatch_stream(dataset, config, consumed_samples=0, dp_rank=g.dp_rank, dp_size=g.dp_size)

    def steps():
        for i in range(config.train.eval_steps):
            if before_batch is not None:
                before_batch(i)
            yield [microbatch_to_device(next(stream), trainer.device) for _ in range(trainer.num_microbatches)]

    return float(trainer.evaluate(steps()).item())


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def run_evaluation(config: Config, runtime: Runtime, checkpoint: str | CheckpointReader) -> dict[str, Any]:
    """Load ``checkpoint`` (a path or an open reader; any layout) and evaluate it on ``train.eval_steps``
    global batches of validation data. Collective over every rank; every rank returns the same result."""
    if config.train.eval_steps < 1:
        raise UserError("train.eval_steps must be >= 1 to evaluate (it sets how many global batches are used)")
    data = build_run_data(config, for_training=False)
    if data.valid is None:
        raise UserError(f"data.split={config.data.split!r} has no validation part; give it a share (e.g. '95,5,0')")
    if isinstance(checkpoint, CheckpointReader):
        trainer = new_trainer(config, runtime, weights=checkpoint, with_optimizer=False)
        path, iteration = checkpoint.path, checkpoint.iteration
    else:
        with CheckpointReader(checkpoint) as reader:
            trainer = new_trainer(config, runtime, weights=reader, with_optimizer=False)
            path, iteration = reader.path, reader.iteration
    loss = evaluate_loss(trainer, config, data.valid)
    samples = config.train.eval_steps * config.train.global_batch_size
    return {
        "checkpoint": str(path),
        "iteration": iteration,
        "val_loss": loss,
        "val_perplexity": perplexity(loss),
        "samples": samples,
        "tokens": samples * config.data.seq_length,
    }
