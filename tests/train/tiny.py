"""A tiny training configuration and helpers shared by the mcore.train tests."""

from __future__ import annotations

import io
import json
from pathlib import Path

from mcore.train.config import load_config
from mcore.train.loop import RunResult, run_training
from mcore.train.runtime import init_runtime

# llama-tiny (hidden 64, 2 layers, GQA, untied, vocab 320) on the embedded corpus: about 0.1 s per step.
# The CPU tests pin the device, so that they test fp32 on CPU also on a machine with a GPU.
TINY = [
    "train.device=cpu",
    "model=llama-tiny",
    "data.seq_length=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.steps=12",
    "lr.warmup_steps=2",
    "log.interval=1",
    "train.eval_interval=0",
    "train.sample_tokens=0",
    "train.hang_timeout=0",
    "log.plot=false",
    "log.tensorboard=false",
    "log.progress_bar=false",
    "log.straggler_interval=0",
]


def train(run_dir: Path | str, *overrides: str) -> tuple[RunResult, str]:
    """Run ``mcore-train`` in this process (joining torch.distributed if it is initialised); return its output."""
    config = load_config(None, [*TINY, f"log.run_dir={run_dir}", *overrides])
    runtime = init_runtime(config)
    out = io.StringIO()
    result = run_training(config, runtime, stream=out)
    return result, out.getvalue()


def train_keeping_trainer(run_dir: Path | str, *overrides: str):
    """``train``, returning the last ``Trainer`` the run built (to read its buffers and groups afterwards): its
    ``__init__`` is wrapped for the run, since ``run_training`` keeps the trainer to itself."""
    from mcore.train import trainer as trainer_module

    built = []
    original = trainer_module.Trainer.__init__

    def capture(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    trainer_module.Trainer.__init__ = capture
    try:
        train(run_dir, *overrides)
    finally:
        trainer_module.Trainer.__init__ = original
    return built[-1]


def train_records(run_dir: Path | str) -> dict[int, dict]:
    """The ``train`` records of a run's metrics.jsonl by step (a resumed run appends to the same file)."""
    records = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            records[record["step"]] = record
    return records
