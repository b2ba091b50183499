"""The config sections of what a run writes: checkpoints (``checkpoint``) and logs (``log``)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore.train.config_checks import non_negative, positive


@dataclass
class CheckpointSection:
    """When and where checkpoints are written, and what to start from.

    ``dir`` defaults to ``<log.run_dir>/checkpoints``; a run resumes from its ``latest`` checkpoint when it
    exists. ``load`` names a checkpoint to start from otherwise (a full checkpoint resumes its step, data
    position and optimizer; a model-only checkpoint, or ``finetune: true``, loads weights and starts at
    step 0). ``save_interval: 0`` saves only at the end.
    """

    dir: str | None = None
    save_interval: int = 0
    save_at_end: bool = True
    keep_last: int = 2
    async_save: bool = False
    load: str | None = None
    finetune: bool = False
    load_optimizer: bool = True
    load_rng: bool = True

    def __post_init__(self) -> None:
        non_negative("checkpoint", "save_interval", self.save_interval)
        positive("checkpoint", "keep_last", self.keep_last)


@dataclass
class LogSection:
    """Console, JSONL, TensorBoard and plots; ``run_dir`` defaults to ``runs/<timestamp>``."""

    run_dir: str | None = None
    interval: int = 20
    progress_bar: bool = True
    tensorboard: bool = True
    plot: bool = True
    gpu_stats_interval: int = 100
    straggler_interval: int = 100

    def __post_init__(self) -> None:
        positive("log", "interval", self.interval)
        non_negative("log", "gpu_stats_interval", self.gpu_stats_interval)
        non_negative("log", "straggler_interval", self.straggler_interval)
