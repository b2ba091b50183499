"""The training run: resume, step, log, evaluate, checkpoint, stop cleanly, and end with a sample.

``run_training(config, runtime)`` is what ``mcore-train`` (and each rank under ``--nproc-per-node`` or
``torchrun``) executes. A run resumes from ``<checkpoint dir>/latest`` when it exists; otherwise from
``checkpoint.load`` when set (a full checkpoint resumes its step, a model-only one fine-tunes from step 0);
see :class:`~mcore.train.start.RunStart`. :func:`~mcore.train.start.build_trainer` builds the trainer in that
same start state, for scripts that run their own steps (the benchmarks).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from mcore.models.accounting import model_flops_per_token, parameter_counts
from mcore.models.generate import generate
from mcore.train.checkpoint.directory import CheckpointDirectory
from mcore.train.checkpoint.reader import CheckpointReader
from mcore.train.checkpoint.state import CheckpointSaver
from mcore.train.config import Config, config_to_dict, dump_config
from mcore.train.datasets import RunData, build_run_data, microbatch_stream
from mcore.train.evaluate import evaluate_loss, perplexity
from mcore.train.fault import HangWatchdog, NonFiniteGuard, StopSignal
from mcore.train.metrics import MetricsLogger, peak_flops
from mcore.train.output_paths import CreatedDirs
from mcore.train.run_log import IntervalSums, StragglerTimes, log_gpu_stats, log_interval
from mcore.train.runtime import Runtime
from mcore.train.start import RunStart, build_trainer
from mcore.train.trainer import StepOutput, Trainer, microbatch_to_device

__all__ = ["RunResult", "build_trainer", "resolve_run_dir", "run_training"]


@dataclass
class RunResult:
    """How a run ended: ``status`` is ``finished``, ``stopped`` (signal or ``stop_at_step``) or ``nothing-to-do``."""

    status: str
    iteration: int
    run_dir: Path
    last_checkpoint: Path | None
    final_loss: float | None = None
    val_loss: float | None = None
    sample: str | None = None
    notes: list[str] = field(default_factory=list)


def resolve_run_dir(config: Config, runtime: Runtime) -> Path:
    """``log.run_dir``, else ``runs/<torchelastic run id>`` (stable across restarts), else ``runs/<time>``."""
    if config.log.run_dir:
        return Path(config.log.run_dir)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    name = f"run-{run_id[:12]}" if run_id and run_id != "none" else datetime.now().strftime("%Y%m%d-%H%M%S")
    if runtime.distributed:
        box = [name]
        dist.broadcast_object_list(box, src=0, group=runtime.control_group)
        name = box[0]
    return Path("runs") / name


def run_training(
    config: Config, runtime: Runtime, *, stream: TextIO | None = None, load: CheckpointReader | None = None
) -> RunResult:
    """Train as ``config`` says on this rank; collective over every rank of the job.

    ``load``: the already opened ``checkpoint.load`` checkpoint (the CLI opens it once, to read its config as
    well); default: opened here when ``checkpoint.load`` is set.
    """
    stream = stream or sys.stdout
    is_main = runtime.is_logging_rank

    def say(text: str) -> None:
        if is_main:
            print(text, file=stream, flush=True)

    run_dir = resolve_run_dir(config, runtime)
    directory = CheckpointDirectory(config.checkpoint.dir or run_dir / "checkpoints")
    # Inputs first (data files, the checkpoint to start from), so that bad ones fail before any work.
    data = build_run_data(config)
    # CreatedDirs: the directories made here are removed again (when empty) if the start fails.
    with RunStart.open(config, directory=directory, load=load) as start, CreatedDirs() as made:
        if is_main:
            made.make(run_dir)
            made.make(directory.root)
            directory.remove_stale_temp_dirs()
            say("mcore-train: resolved config\n" + _indent(dump_config(config)))
        runtime.barrier()
        trainer = start.build(config, runtime)
    _print_header(config, runtime, trainer, run_dir, start.description, say)
    if is_main:  # only once the start state loaded: a failed start leaves the run directory untouched
        (run_dir / "config.yaml").write_text(dump_config(config), encoding="utf-8")
    for note in start.notes:
        say(f"note: {note}")

    stop_at = config.train.stop_at_step or config.train.steps
    if trainer.iteration >= stop_at:
        say(f"checkpoint is at step {trainer.iteration} and the run ends at step {stop_at}: nothing to train")
        return RunResult("nothing-to-do", trainer.iteration, run_dir, directory.latest(), notes=start.notes)
    run = _TrainingRun(
        config, runtime, start, data=data, run_dir=run_dir, directory=directory, stop_at=stop_at, say=say, stream=stream
    )
    return run.run()


class _TrainingRun:
    """The steps of one run from its start state to ``stop_at``, and what follows each step."""

    def __init__(
        self,
        config: Config,
        runtime: Runtime,
        start: RunStart,
        *,
        data: RunData,
        run_dir: Path,
        directory: CheckpointDirectory,
        stop_at: int,
        say: Any,
        stream: TextIO,
    ) -> None:
        if start.trainer is None:
            raise ValueError("the run's start state has no trainer yet: call RunStart.build first")
        self.cfg, self.runtime, self.data, self.run_dir = config, runtime, data, run_dir
        self.stop_at, self.say, self.notes = stop_at, say, start.notes
        self.trainer = trainer = start.trainer
        self.logger = MetricsLogger(
            run_dir,
            total_steps=config.train.steps,
            start_step=trainer.iteration,
            enabled=runtime.is_logging_rank,
            progress_bar=config.log.progress_bar,
            tensorboard=config.log.tensorboard,
            stream=stream,
        )
        self.saver = CheckpointSaver(
            trainer,
            directory,
            keep_last=config.checkpoint.keep_last,
            async_save=config.checkpoint.async_save,
            hf_assets=start.hf_assets,
        )
        self.guard = NonFiniteGuard(config.train.max_nonfinite_steps)
        g = trainer.groups
        self.batches = microbatch_stream(
            data.train, config, consumed_samples=trainer.consumed_samples, dp_rank=g.dp_rank, dp_size=g.dp_size
        )
        self.sums = IntervalSums(runtime.device)
        self.stragglers = StragglerTimes()
        self.flops_per_token = model_flops_per_token(config.model, config.data.seq_length)
        self.peak = peak_flops(runtime.device)
        self.skipped_steps = 0
        self.last_loss: float | None = None
        self.val_loss: float | None = None
        hang = config.train.hang_timeout
        self.watchdog = None
        if hang > 0:  # with peers, heartbeat files say which rank stopped and what the others wait in
            beats = run_dir / "heartbeat" if runtime.distributed else None
            self.watchdog = HangWatchdog(hang, runtime.rank, heartbeat_dir=beats, world_size=runtime.world_size)

    # ------------------------------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        trainer, status, sample = self.trainer, "finished", None
        if self.watchdog is not None:
            self.watchdog.start()
        try:
            with StopSignal() as stop:
                while trainer.iteration < self.stop_at:
                    if self._step_and_follow_up(trainer.iteration + 1, stop):
                        status = "stopped"
                        break
                status = self._final_save(status)
            if status == "finished":
                sample = self._finish()
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            self.logger.close()
        if self.runtime.is_logging_rank and status == "finished" and self.cfg.log.plot:
            _plot(self.run_dir, self.say)
        last = self.saver.last_committed
        self.say(f"done: step {trainer.iteration}, {status}" + (f"; last checkpoint {last}" if last else ""))
        return RunResult(
            status, trainer.iteration, self.run_dir, last, self.last_loss, self.val_loss, sample, self.notes
        )

    def _step_and_follow_up(self, step: int, stop: StopSignal) -> bool:
        """Train step ``step``, then log, evaluate and checkpoint as due; True when a stop signal ended the run."""
        out = self._train_step(step)
        self._beat(step, "bookkeeping")
        self.saver.poll()
        self.logger.advance()
        cfg = self.cfg
        if step % cfg.log.interval == 0 or step == self.stop_at:
            self._log(out)
        if cfg.log.straggler_interval and self.runtime.distributed and step % cfg.log.straggler_interval == 0:
            self.stragglers.report(self.runtime, self.logger, step)
        if cfg.log.gpu_stats_interval and self.runtime.device.type == "cuda" and step % cfg.log.gpu_stats_interval == 0:
            log_gpu_stats(self.runtime, self.logger, step)
        if self._evaluation_due(step):
            self._evaluate(step)
        if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0 and step < self.stop_at:
            self._save("interval")
        if not _stop_requested(stop, self.runtime):
            return False
        self.say(f"received signal {stop.received}: saving a checkpoint at step {step} and exiting")
        if self.sums.steps:  # the steps since the last log line
            self._log(out)
        return True

    def _train_step(self, step: int) -> StepOutput:
        trainer = self.trainer
        t0 = time.perf_counter()
        self._beat(step, "data loading")
        micro = [microbatch_to_device(next(self.batches), self.runtime.device) for _ in range(trainer.num_microbatches)]
        t1 = time.perf_counter()
        self._beat(step, "forward-backward and optimizer step")
        out = trainer.train_step(micro)
        self.sums.add(step, out.loss, out.grad_norm, out.finite, trainer.is_last_stage)
        self.sums.data_time += t1 - t0
        self.stragglers.add(time.perf_counter() - t0, t1 - t0)
        if out.finite is not None:
            self.skipped_steps += 0 if out.finite else 1
            self.guard.update(step, out.finite, self._last_checkpoint())
        return out

    def _final_save(self, status: str) -> str:
        """The checkpoint at the end of the steps (a stop, or ``save_at_end``); returns the run's status."""
        if status == "stopped" or self.stop_at < self.cfg.train.steps:
            status = "stopped"
            self._save("stop")
        elif self.cfg.checkpoint.save_at_end:
            self._save("end")
        self.saver.wait()
        return status

    def _finish(self) -> str | None:
        """After the last step of a finished run: a last evaluation (unless one just ran) and the sample."""
        trainer = self.trainer
        if self._evaluation_due(None) and trainer.iteration % self.cfg.train.eval_interval:
            self._evaluate(trainer.iteration)
        self._beat(trainer.iteration, "sample generation")
        if self.cfg.train.sample_tokens <= 0:
            return None
        return _sample(self.cfg, trainer, self.data, self.say, self.notes)

    # ------------------------------------------------------------------------------------------ follow-ups
    def _beat(self, step: int, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step, phase)

    def _last_checkpoint(self) -> str | None:
        return str(self.saver.last_committed) if self.saver.last_committed else None

    def _log(self, out: StepOutput) -> None:
        self.last_loss = log_interval(
            self.cfg,
            self.runtime,
            self.trainer,
            self.sums,
            self.logger,
            out,
            skipped_steps=self.skipped_steps,
            flops_per_token=self.flops_per_token,
            peak=self.peak,
            last_checkpoint=self._last_checkpoint(),
        )

    def _evaluation_due(self, step: int | None) -> bool:
        """Evaluation is on, and (with ``step``) due after it."""
        every = self.cfg.train.eval_interval
        return self.data.valid is not None and bool(every) and (step is None or step % every == 0)

    def _evaluate(self, step: int) -> None:
        total = self.cfg.train.eval_steps
        loss = evaluate_loss(
            self.trainer,
            self.cfg,
            self.data.valid,
            before_batch=lambda i: self._beat(step, f"evaluation batch {i + 1}/{total}"),
        )
        ppl = perplexity(loss)
        self.logger.log(
            {"kind": "eval", "step": step, "loss": loss, "perplexity": ppl},
            console=f"validation @ step {step}: loss {loss:.4f} | perplexity {ppl:.2f}",
        )
        self.val_loss = loss

    def _save(self, reason: str) -> None:
        self._beat(self.trainer.iteration, f"checkpoint save ({reason})")
        # Never checkpoint weights that a non-finite step already updated (when per-step skipping is off).
        self.sums.check_finite(self.runtime, self._last_checkpoint())
        self.saver.save(config_to_dict(self.cfg), {"skipped_steps": self.skipped_steps, "reason": reason})


# ------------------------------------------------------------------------------------------------ pieces
def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.rstrip().splitlines())


def _print_header(config: Config, runtime: Runtime, trainer: Trainer, run_dir: Path, source: str, say: Any) -> None:
    counts = parameter_counts(config.model)
    g = trainer.groups
    say(
        f"model: {counts.total / 1e6:.2f}M parameters ({counts.non_embedding / 1e6:.2f}M without the embedding), "
        f"{config.model.num_hidden_layers} layers, hidden {config.model.hidden_size}, vocab {config.model.vocab_size}"
    )
    say(
        f"layout: world {runtime.world_size} = tp {g.tp_size}{f' x cp {g.cp_size}' if g.cp_size > 1 else ''} "
        f"x pp {g.pp_size} x dp {g.dp_size}"
        f"{f' (vpp {config.parallel.vpp})' if config.parallel.vpp > 1 else ''}; device {runtime.device}; "
        f"precision {trainer.precision}; {trainer.num_microbatches} micro-batch(es) of "
        f"{config.train.micro_batch_size} x {config.data.seq_length} tokens per rank and step; "
        f"global batch {config.train.global_batch_size}"
    )
    if trainer.pipeline_layout is not None:
        how = config.parallel.pipeline_layout if isinstance(config.parallel.pipeline_layout, str) else "given"
        say(f"pipeline layout ({how}): layers per virtual stage {trainer.pipeline_layout}")
    say(f"run directory: {run_dir}; {source}")


def _stop_requested(stop: StopSignal, runtime: Runtime) -> bool:
    """True on every rank when any rank received SIGTERM/SIGINT (agreed over the control group)."""
    if not runtime.distributed:
        return stop.requested
    flag = torch.tensor([1.0 if stop.requested else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=runtime.control_group)
    return bool(flag.item() > 0)


def _sample(cfg: Config, trainer: Trainer, data: RunData, say: Any, notes: list[str]) -> str | None:
    if trainer.groups.pp_size > 1 or cfg.parallel.sequence_parallel:
        note = "sample generation skipped: it needs pp=1 and no sequence parallelism"
        notes.append(note)
        say(note)
        return None
    tokenizer = data.tokenizer
    prompt = tokenizer.encode(cfg.train.sample_prompt) or [tokenizer.eod_id]
    room = cfg.model.max_position_embeddings - len(prompt)
    if room < 1:
        return None
    ids = torch.tensor([prompt], dtype=torch.long, device=trainer.device)
    gen = torch.Generator(device=trainer.device)
    gen.manual_seed(cfg.train.seed)  # equal on every TP rank, so they pick the same tokens
    out = generate(
        trainer.chunks[0],
        ids,
        min(cfg.train.sample_tokens, room),
        do_sample=True,
        temperature=0.8,
        top_p=0.9,
        eos_token_id=tokenizer.eod_id,
        generator=gen,
    )
    text = tokenizer.decode(out[0].tolist())
    say("sample: " + repr(text))
    return text


def _plot(run_dir: Path, say: Any) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # plotting is optional (pip install 'mcore-train[plot]')
    from mcore.train.plot import plot_run

    try:
        say(f"curves: {plot_run(run_dir)}")
    except Exception as exc:  # noqa: BLE001 - a failed plot must not fail a finished run
        say(f"note: could not draw curves: {exc}")
