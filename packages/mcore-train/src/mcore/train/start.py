"""Where a run starts: the checkpoint it resumes or fine-tunes from (or random weights), and the trainer built there.

One object, :class:`RunStart`, carries the start state from the checkpoint to the built trainer::

    with RunStart.open(config, directory=run_checkpoints) as start:   # opens the checkpoint once
        trainer = start.build(config, runtime)                        # weights, then the training state
    start.description, start.notes, start.hf_assets

:func:`build_trainer` does both for scripts that run their own steps (the benchmarks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mcore.train.checkpoint.directory import CheckpointDirectory
from mcore.train.checkpoint.hf_assets import read_hf_assets
from mcore.train.checkpoint.model_weights import check_model_matches
from mcore.train.checkpoint.reader import CheckpointReader
from mcore.train.checkpoint.state import load_training_state
from mcore.train.config import Config
from mcore.train.errors import UserError
from mcore.train.runtime import Runtime
from mcore.train.trainer import Trainer


def new_trainer(config: Config, runtime: Runtime, **kwargs: Any) -> Trainer:
    """``Trainer(config, runtime, **kwargs)``, with a ``ValueError`` of the model or the parallel layout (a
    layout the model cannot take, say) turned into a :class:`UserError`: one line from the CLI, not a traceback."""
    try:
        return Trainer(config, runtime, **kwargs)
    except ValueError as exc:
        raise UserError(f"cannot build this run's model: {exc}") from exc


@dataclass
class RunStart:
    """The start state of a run.

    ``checkpoint``: the open checkpoint to start from (``None``: random weights), already checked against the
    model config. ``full_resume``: it restores the whole training state (step, optimizer, data position, RNG),
    not only the weights (fine-tuning from step 0). After :meth:`build`: ``trainer``, ``notes`` to print, and
    ``hf_assets``, the checkpoint's ``hf/`` files (on global rank 0 only; ``None`` elsewhere and when it has
    none), which every later checkpoint of the run carries.
    """

    checkpoint: CheckpointReader | None
    full_resume: bool
    description: str
    owns_checkpoint: bool = True
    trainer: Trainer | None = None
    notes: list[str] = field(default_factory=list)
    hf_assets: dict[str, bytes] | None = None

    @classmethod
    def open(
        cls,
        config: Config,
        *,
        directory: CheckpointDirectory | None = None,
        load: str | os.PathLike | CheckpointReader | None = None,
    ) -> RunStart:
        """Choose and open the checkpoint a run starts from, as ``mcore-train`` chooses it.

        ``directory``'s ``latest`` when there is one (the run restarts where it stopped); else ``load``
        (default ``config.checkpoint.load``; an already open reader is used as is and left open): a full
        checkpoint resumes its step unless ``checkpoint.finetune``, a model-only one gives the weights of a
        fine-tuning run from step 0; else random weights. Raises :class:`~mcore.train.errors.CheckpointError`
        when the checkpoint is unreadable or holds a different model.
        """
        load = load if load is not None else config.checkpoint.load
        latest = directory.latest() if directory is not None else None
        owns = True
        if latest is not None:
            reader, full, description = CheckpointReader(latest), True, f"resuming from {latest}"
        elif load:
            owns = not isinstance(load, CheckpointReader)
            reader = CheckpointReader(load) if owns else load
            if reader.has_optimizer_state and not config.checkpoint.finetune:
                full, description = True, f"resuming from {reader.path} (step {reader.iteration})"
            else:
                full, description = False, f"starting from the weights of {reader.path} (fine-tuning from step 0)"
        else:
            return cls(None, False, "starting from random weights")
        start = cls(reader, full, description, owns_checkpoint=owns)
        try:
            check_model_matches(reader, config.model)
        except BaseException:
            start.close()
            raise
        return start

    def build(self, config: Config, runtime: Runtime) -> Trainer:
        """Build the :class:`Trainer` from this start's weights and, for a full resume, its training state.

        Collective over every rank. The checkpoint stays open; :meth:`close` (or the ``with`` block) closes it.
        """
        trainer = new_trainer(config, runtime, weights=self.checkpoint)
        if self.checkpoint is not None:
            if self.full_resume:
                self.notes = load_training_state(
                    trainer,
                    self.checkpoint,
                    load_optimizer=config.checkpoint.load_optimizer,
                    load_rng=config.checkpoint.load_rng,
                )
            if runtime.rank == 0:
                self.hf_assets = read_hf_assets(self.checkpoint.path)
        self.trainer = trainer
        return trainer

    def close(self) -> None:
        if self.checkpoint is not None and self.owns_checkpoint:
            self.checkpoint.close()

    def __enter__(self) -> RunStart:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_trainer(
    config: Config,
    runtime: Runtime,
    *,
    load: str | os.PathLike | None = None,
    directory: CheckpointDirectory | None = None,
) -> RunStart:
    """The :class:`RunStart` of ``config`` with its trainer built, in the state ``mcore-train`` would start it in.

    Starts from ``directory``'s ``latest`` checkpoint if given and present, else from ``load`` (default
    ``config.checkpoint.load``), else from random weights (see :meth:`RunStart.open`); the checkpoint is closed
    again. ``.trainer`` is the trainer, ``.notes`` what to print. Collective over every rank.
    """
    with RunStart.open(config, directory=directory, load=load) as start:
        start.build(config, runtime)
    return start
