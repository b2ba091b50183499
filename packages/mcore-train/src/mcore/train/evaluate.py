"""``mcore-train evaluate``: validation loss and perplexity of a checkpoint, as JSON."""

from __future__ import annotations

import math
from typing import Any

from mcore.train.checkpoint.reader import CheckpointReader
from mcore.train.config import Config
from mcore.train.datasets import build_run_data, microbatch_stream
from mcore.train.errors import UserError
from mcore.train.runtime import Runtime
from mcore.train.trainer import Trainer, microbatch_to_device


def run_evaluation(config: Config, runtime: Runtime, checkpoint: str) -> dict[str, Any]:
    """Load ``checkpoint`` (any layout) and evaluate it on ``train.eval_steps`` global batches of validation data.

    Collective over every rank; every rank returns the same result.
    """
    if config.train.eval_steps < 1:
        raise UserError("train.eval_steps must be >= 1 to evaluate (it sets how many global batches are used)")
    data = build_run_data(config, for_training=False)
    if data.valid is None:
        raise UserError(f"data.split={config.data.split!r} has no validation part; give it a share (e.g. '95,5,0')")
    with CheckpointReader(checkpoint) as reader:
        trainer = Trainer(config, runtime, weights=reader, with_optimizer=False)
        path, iteration = reader.path, reader.iteration
    g = trainer.groups
    stream = microbatch_stream(data.valid, config, consumed_samples=0, dp_rank=g.dp_rank, dp_size=g.dp_size)

    def steps():
        for _ in range(config.train.eval_steps):
            yield [microbatch_to_device(next(stream), runtime.device) for _ in range(trainer.num_microbatches)]

    loss = float(trainer.evaluate(steps()).item())
    samples = config.train.eval_steps * config.train.global_batch_size
    return {
        "checkpoint": str(path),
        "iteration": iteration,
        "val_loss": loss,
        "val_perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "samples": samples,
        "tokens": samples * config.data.seq_length,
    }
