"""The training run: resume, step, log, evaluate, checkpoint, stop cleanly, and end with a sample.

``run_training(config, runtime)`` is what ``mcore-train`` (and each rank under ``--nproc-per-node`` or
``torchrun``) executes. A run resumes from ``<checkpoint dir>/latest`` when it exists; otherwise from
``checkpoint.load`` when set (a full checkpoint resumes its step, a model-only one fine-tunes from step 0).
``build_trainer(config, runtime)`` builds the trainer in that same start state, for scripts that run their own
steps (the benchmarks).
"""

from __future__ import annotations

import math
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
from mcore.train.checkpoint.hf_assets import read_hf_assets
from mcore.train.checkpoint.reader import CheckpointReader
from mcore.train.checkpoint.state import CheckpointSaver, check_model_matches, load_training_state
from mcore.train.config import Config, config_to_dict, dump_config
from mcore.train.datasets import RunData, build_run_data, microbatch_stream
from mcore.train.fault import HangWatchdog, NonFiniteGuard, StopSignal, TrainingDiverged
from mcore.train.gpu_stats import gather_gpu_stats, gather_step_times, straggler_report
from mcore.train.metrics import MetricsLogger, format_train_line, peak_flops, peak_memory_bytes
from mcore.train.output_paths import CreatedDirs
from mcore.train.runtime import Runtime
from mcore.train.trainer import Trainer, microbatch_to_device


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


class _Interval:
    """Device-side sums over the current log interval (read, and so synchronised, only when logging)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset(time.perf_counter())

    def reset(self, now: float) -> None:
        zero = dict(dtype=torch.float64, device=self.device)
        self.loss_sum = torch.zeros((), **zero)
        self.loss_count = torch.zeros((), **zero)
        self.bad_losses = torch.zeros((), **zero)
        self.grad_norm_sum = torch.zeros((), **zero)
        self.grad_norm_count = torch.zeros((), **zero)
        self.first_bad_step = torch.full((), -1, dtype=torch.int64, device=self.device)
        self.steps = 0
        self.data_time = 0.0
        self.start = now

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, applied: bool | None, last: bool) -> None:
        """Count one step; ``loss`` is meaningful on the last pipeline stage only, ``grad_norm`` everywhere."""
        loss_ok = torch.isfinite(loss)
        norm_ok = torch.isfinite(grad_norm)
        if applied is False:  # skipped by the optimizer: neither value describes an applied update
            norm_ok = torch.zeros_like(norm_ok)
        counted = loss_ok & norm_ok
        if last:
            self.loss_sum += torch.where(counted, loss.double(), 0.0)
            self.loss_count += counted.double()
            self.bad_losses += (~loss_ok).double()
        self.grad_norm_sum += torch.where(norm_ok, grad_norm.double(), 0.0)
        self.grad_norm_count += norm_ok.double()
        if applied is None:
            # Without the optimizer's per-step check a non-finite step is only seen here, on the device.
            nonfinite = ~norm_ok | (~loss_ok if last else torch.zeros_like(loss_ok))
            self.first_bad_step = torch.where(
                nonfinite & (self.first_bad_step < 0), torch.full_like(self.first_bad_step, step), self.first_bad_step
            )
        self.steps += 1


def run_training(config: Config, runtime: Runtime, *, stream: TextIO | None = None) -> RunResult:
    """Train as ``config`` says on this rank; collective over every rank of the job."""
    stream = stream or sys.stdout
    is_main = runtime.is_logging_rank

    def say(text: str) -> None:
        if is_main:
            print(text, file=stream, flush=True)

    run_dir = resolve_run_dir(config, runtime)
    directory = CheckpointDirectory(config.checkpoint.dir or run_dir / "checkpoints")
    # Inputs first (data files, the checkpoint to start from), so that bad ones fail before any work.
    data = build_run_data(config)
    start = choose_start(config, directory=directory)
    made = CreatedDirs()  # removed again (when empty) if the start fails
    try:
        if is_main:
            made.make(run_dir)
            made.make(directory.root)
            directory.remove_stale_temp_dirs()
            say("mcore-train: resolved config\n" + _indent(dump_config(config)))
        runtime.barrier()
        built = restore_trainer(config, runtime, start)
    except BaseException:
        made.remove_empty()
        raise
    finally:
        start.close()
    trainer, source, notes = built.trainer, built.description, built.notes
    _print_header(config, runtime, trainer, run_dir, source, say)
    if is_main:  # only once the start state loaded: a failed start leaves the run directory untouched
        (run_dir / "config.yaml").write_text(dump_config(config), encoding="utf-8")
    for note in notes:
        say(f"note: {note}")

    steps = config.train.steps
    stop_at = config.train.stop_at_step or steps
    if trainer.iteration >= stop_at:
        say(f"checkpoint is at step {trainer.iteration} and the run ends at step {stop_at}: nothing to train")
        return RunResult("nothing-to-do", trainer.iteration, run_dir, directory.latest(), notes=notes)
    return _train(config, runtime, built, data, run_dir, directory, stop_at, say, stream)


@dataclass
class StartPoint:
    """The checkpoint a run starts from (None: random weights), opened and checked against the model config.

    ``full_resume`` says whether it restores the whole training state (step, optimizer, data position, RNG) or
    only the weights (fine-tuning from step 0). Close it (or use it as a context manager) once the trainer is built.
    """

    reader: CheckpointReader | None
    full_resume: bool
    description: str

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def __enter__(self) -> StartPoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class BuiltTrainer:
    """A :class:`Trainer` in its start state, with what the run needs to know about where it came from.

    ``hf_assets`` holds the start checkpoint's ``hf/`` files (on global rank 0 only; None elsewhere and when the
    checkpoint has none): pass it to :class:`CheckpointSaver` so that every later checkpoint carries them.
    """

    trainer: Trainer
    description: str
    notes: list[str]
    hf_assets: dict[str, bytes] | None


def choose_start(
    config: Config, *, directory: CheckpointDirectory | None = None, load: str | os.PathLike | None = None
) -> StartPoint:
    """Open the checkpoint a run starts from, as ``mcore-train`` chooses it.

    ``directory``'s ``latest`` when there is one (the run restarts where it stopped); else ``load`` (default
    ``config.checkpoint.load``): a full checkpoint resumes its step unless ``checkpoint.finetune``, a model-only
    one gives the weights of a fine-tuning run from step 0; else random weights. Raises
    :class:`~mcore.train.errors.CheckpointError` when the checkpoint is unreadable or holds a different model.
    """
    load = load if load is not None else config.checkpoint.load
    latest = directory.latest() if directory is not None else None
    if latest is not None:
        reader, full, description = CheckpointReader(latest), True, f"resuming from {latest}"
    elif load:
        reader = CheckpointReader(load)
        if reader.has_optimizer_state and not config.checkpoint.finetune:
            full, description = True, f"resuming from {reader.path} (step {reader.iteration})"
        else:
            full, description = False, f"starting from the weights of {reader.path} (fine-tuning from step 0)"
    else:
        return StartPoint(None, False, "starting from random weights")
    try:
        check_model_matches(reader, config.model)
    except BaseException:
        reader.close()
        raise
    return StartPoint(reader, full, description)


def restore_trainer(config: Config, runtime: Runtime, start: StartPoint) -> BuiltTrainer:
    """Build the :class:`Trainer` from ``start``'s weights and, for a full resume, its training state.

    Collective over every rank. ``start`` stays open; the caller closes it.
    """
    trainer = Trainer(config, runtime, weights=start.reader)
    notes: list[str] = []
    hf_assets = None
    if start.reader is not None:
        if start.full_resume:
            notes = load_training_state(
                trainer,
                start.reader,
                load_optimizer=config.checkpoint.load_optimizer,
                load_rng=config.checkpoint.load_rng,
            )
        if runtime.rank == 0:
            hf_assets = read_hf_assets(start.reader.path)
    return BuiltTrainer(trainer, start.description, notes, hf_assets)


def build_trainer(
    config: Config,
    runtime: Runtime,
    *,
    load: str | os.PathLike | None = None,
    directory: CheckpointDirectory | None = None,
) -> BuiltTrainer:
    """The :class:`Trainer` of ``config`` in the state ``mcore-train`` would start it in.

    Starts from ``directory``'s ``latest`` checkpoint if given and present, else from ``load`` (default
    ``config.checkpoint.load``), else from random weights; see :func:`choose_start`. Collective over every rank.
    """
    with choose_start(config, directory=directory, load=load) as start:
        return restore_trainer(config, runtime, start)


def _train(
    config: Config,
    runtime: Runtime,
    built: BuiltTrainer,
    data: RunData,
    run_dir: Path,
    directory: CheckpointDirectory,
    stop_at: int,
    say: Any,
    stream: TextIO,
) -> RunResult:
    cfg = config
    trainer, notes = built.trainer, built.notes
    g = trainer.groups
    is_main = runtime.is_logging_rank
    seq = cfg.data.seq_length
    flops_per_token = model_flops_per_token(cfg.model, seq)
    peak = peak_flops(runtime.device)
    logger = MetricsLogger(
        run_dir,
        total_steps=cfg.train.steps,
        start_step=trainer.iteration,
        enabled=is_main,
        progress_bar=cfg.log.progress_bar,
        tensorboard=cfg.log.tensorboard,
        stream=stream,
    )
    saver = CheckpointSaver(
        trainer,
        directory,
        keep_last=cfg.checkpoint.keep_last,
        async_save=cfg.checkpoint.async_save,
        hf_assets=built.hf_assets,
    )
    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
    batches = microbatch_stream(
        data.train, cfg, consumed_samples=trainer.consumed_samples, dp_rank=g.dp_rank, dp_size=g.dp_size
    )
    interval = _Interval(runtime.device)
    straggler = {"step": 0.0, "data": 0.0, "n": 0}
    total_skipped = 0
    last_loss: float | None = None
    val_loss: float | None = None
    status = "finished"
    watchdog = None
    if cfg.train.hang_timeout > 0:  # with peers, heartbeats say which rank stopped and what the others wait in
        beats = run_dir / "heartbeat" if runtime.distributed else None
        timeout, world = cfg.train.hang_timeout, runtime.world_size
        watchdog = HangWatchdog(timeout, runtime.rank, heartbeat_dir=beats, world_size=world)

    def save(reason: str) -> None:
        if watchdog is not None:
            watchdog.beat(trainer.iteration, f"checkpoint save ({reason})")
        _check_finite_before_save(interval, runtime, saver)
        saver.save(config_to_dict(cfg), {"skipped_steps": total_skipped, "reason": reason})

    if watchdog is not None:
        watchdog.start()
    try:
        with StopSignal() as stop:
            while trainer.iteration < stop_at:
                step = trainer.iteration + 1
                t0 = time.perf_counter()
                if watchdog is not None:
                    watchdog.beat(step, "data loading")
                micro = [microbatch_to_device(next(batches), runtime.device) for _ in range(trainer.num_microbatches)]
                t1 = time.perf_counter()
                if watchdog is not None:
                    watchdog.beat(step, "forward-backward and optimizer step")
                out = trainer.train_step(micro)
                interval.add(step, out.loss, out.grad_norm, out.finite, trainer.is_last_stage)
                interval.data_time += t1 - t0
                straggler["step"] += time.perf_counter() - t0
                straggler["data"] += t1 - t0
                straggler["n"] += 1
                if out.finite is not None:
                    total_skipped += 0 if out.finite else 1
                    guard.update(step, out.finite, _last(saver))
                if watchdog is not None:
                    watchdog.beat(step, "bookkeeping")
                saver.poll()
                logger.advance()

                if step % cfg.log.interval == 0 or step == stop_at:
                    last_loss = _log_interval(
                        cfg, runtime, trainer, interval, logger, out, total_skipped, flops_per_token, peak, saver
                    )
                if cfg.log.straggler_interval and runtime.distributed and step % cfg.log.straggler_interval == 0:
                    _report_stragglers(runtime, straggler, logger, step)
                if (
                    cfg.log.gpu_stats_interval
                    and runtime.device.type == "cuda"
                    and step % cfg.log.gpu_stats_interval == 0
                ):
                    _log_gpu_stats(runtime, logger, step)
                if data.valid is not None and cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
                    val_loss = _evaluate(cfg, trainer, data, logger, step, watchdog)
                if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0 and step < stop_at:
                    save("interval")
                if _stop_requested(stop, runtime):
                    status = "stopped"
                    say(f"received signal {stop.received}: saving a checkpoint at step {step} and exiting")
                    if interval.steps:  # the steps since the last log line
                        last_loss = _log_interval(
                            cfg, runtime, trainer, interval, logger, out, total_skipped, flops_per_token, peak, saver
                        )
                    break
            if status == "stopped" or stop_at < cfg.train.steps:
                status = "stopped"
                save("stop")
            elif cfg.checkpoint.save_at_end:
                save("end")
            saver.wait()
        finished = status == "finished"
        if (
            finished
            and data.valid is not None
            and cfg.train.eval_interval
            and trainer.iteration % cfg.train.eval_interval
        ):
            val_loss = _evaluate(cfg, trainer, data, logger, trainer.iteration, watchdog)
        if watchdog is not None:
            watchdog.beat(trainer.iteration, "sample generation")
        sample = _sample(cfg, trainer, data, say, notes) if finished and cfg.train.sample_tokens > 0 else None
    finally:
        if watchdog is not None:
            watchdog.stop()
        logger.close()
    if is_main and status == "finished" and cfg.log.plot:
        _plot(run_dir, say)
    last = saver.last_committed
    say(f"done: step {trainer.iteration}, {status}" + (f"; last checkpoint {last}" if last else ""))
    return RunResult(status, trainer.iteration, run_dir, last, last_loss, val_loss, sample, notes)


# ------------------------------------------------------------------------------------------------ pieces
def _last(saver: CheckpointSaver) -> str | None:
    return str(saver.last_committed) if saver.last_committed else None


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
        f"layout: world {runtime.world_size} = tp {g.tp_size} x pp {g.pp_size} x dp {g.dp_size}"
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


def _check_finite_before_save(interval: _Interval, runtime: Runtime, saver: CheckpointSaver) -> None:
    """Never checkpoint weights that a non-finite step already updated (when per-step skipping is off)."""
    bad = interval.first_bad_step.clone().float()
    if runtime.distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=None)
    if bad.item() >= 0:
        raise TrainingDiverged(_unchecked_nonfinite_message(int(bad.item()), _last(saver)))


def _unchecked_nonfinite_message(step: int, last: str | None) -> str:
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
    return (
        f"training diverged: the loss or gradient norm was NaN/Inf at step {step}, and with "
        f"train.skip_nonfinite off that update was applied, so the weights are unusable; {where}. Resume from it "
        f"with train.skip_nonfinite=true (skips such steps) and/or a lower lr.max_lr"
    )


def _log_interval(
    cfg: Config,
    runtime: Runtime,
    trainer: Trainer,
    interval: _Interval,
    logger: MetricsLogger,
    out: Any,
    total_skipped: int,
    flops_per_token: float,
    peak: float | None,
    saver: CheckpointSaver,
) -> float | None:
    step = trainer.iteration
    sums = torch.stack([interval.loss_sum, interval.loss_count, interval.bad_losses])
    trainer.reduce_across_stages_and_replicas(sums)  # losses live on the last stage of every replica
    bad = interval.first_bad_step.clone()
    if runtime.distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank must agree to stop
    first_bad = int(bad.item())
    if first_bad >= 0:
        raise TrainingDiverged(_unchecked_nonfinite_message(first_bad, _last(saver)))
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    now = time.perf_counter()
    elapsed = max(now - interval.start, 1e-9)
    loss_sum, loss_count = float(sums[0].item()), float(sums[1].item())
    loss = loss_sum / loss_count if loss_count else float("nan")
    norm_count = float(interval.grad_norm_count.item())
    grad_norm = float(interval.grad_norm_sum.item()) / norm_count if norm_count else float("nan")
    tokens = interval.steps * cfg.train.global_batch_size * cfg.data.seq_length
    tokens_per_s = tokens / elapsed
    tflops = flops_per_token * tokens_per_s / runtime.world_size / 1e12
    record = {
        "kind": "train",
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": out.lr,
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": tflops,
        "device": runtime.device.type,
        "mfu": tflops * 1e12 / peak if peak else None,
        "step_time_s": elapsed / interval.steps,
        "data_time_s": interval.data_time / interval.steps,
        "peak_memory_gb": peak_memory_bytes(runtime.device) / 1e9,
        "loss_scale": out.loss_scale,
        "skipped_steps": total_skipped,
        "consumed_samples": trainer.consumed_samples,
        "eta_s": (cfg.train.steps - step) * elapsed / interval.steps,
    }
    logger.log(record, console=format_train_line(record, cfg.train.steps))
    interval.reset(time.perf_counter())
    return loss if math.isfinite(loss) else None


def _report_stragglers(runtime: Runtime, acc: dict[str, float], logger: MetricsLogger, step: int) -> None:
    n = max(acc["n"], 1)
    steps, datas = gather_step_times(acc["step"] / n, acc["data"] / n, runtime.control_group, runtime.world_size)
    report = straggler_report(steps, datas)
    record = {"kind": "straggler", "step": step, **report, "step_times_s": steps, "data_times_s": datas}
    line = (
        f"stragglers @ step {step}: median {1000 * report['median_step_s']:.0f} ms/step, slowest rank "
        f"{report['slowest_rank']} {1000 * report['slowest_step_s']:.0f} ms "
        f"(data {1000 * report['slowest_data_s']:.0f} ms)"
        + (f", flagged ranks {report['stragglers']}" if report["stragglers"] else "")
    )
    logger.log(record, console=line)
    acc.update(step=0.0, data=0.0, n=0)


def _log_gpu_stats(runtime: Runtime, logger: MetricsLogger, step: int) -> None:
    stats = gather_gpu_stats(runtime.device, runtime.control_group, runtime.world_size)
    record: dict[str, Any] = {"kind": "gpu", "step": step, "ranks": stats}
    first = stats[0]
    parts = [f"{k} {v:.0f}" for k, v in first.items() if k != "memory_total_gb"]
    logger.log(record, console=f"gpu @ step {step} (rank 0): " + ", ".join(parts))


def _evaluate(
    cfg: Config, trainer: Trainer, data: RunData, logger: MetricsLogger, step: int, watchdog: HangWatchdog | None
) -> float:
    g = trainer.groups
    stream = microbatch_stream(data.valid, cfg, consumed_samples=0, dp_rank=g.dp_rank, dp_size=g.dp_size)
    device = trainer.device

    def steps():
        for i in range(cfg.train.eval_steps):
            if watchdog is not None:
                watchdog.beat(step, f"evaluation batch {i + 1}/{cfg.train.eval_steps}")
            yield [microbatch_to_device(next(stream), device) for _ in range(trainer.num_microbatches)]

    loss = float(trainer.evaluate(steps()).item())
    ppl = math.exp(loss) if loss < 700 else float("inf")
    logger.log(
        {"kind": "eval", "step": step, "loss": loss, "perplexity": ppl},
        console=f"validation @ step {step}: loss {loss:.4f} | perplexity {ppl:.2f}",
    )
    return loss


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
