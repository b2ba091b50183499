"""What the training loop logs: device-side sums over a log interval, the train line, stragglers, GPU stats.

Nothing here reads a device value except when a line is logged, so logging every ``log.interval`` steps is
the loop's only regular host synchronization besides the optimizer's non-finite check.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from mcore.models.accounting import mfu
from mcore.train.config import Config
from mcore.train.fault import TrainingDiverged
from mcore.train.gpu_stats import gather_gpu_stats, gather_step_times, straggler_report
from mcore.train.metrics import MetricsLogger, format_train_line, peak_memory_bytes
from mcore.train.runtime import Runtime
from mcore.train.trainer import StepOutput, Trainer


class IntervalSums:
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

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, finite: bool | None, last: bool) -> None:
        """Count one step; ``loss`` is meaningful on the last pipeline stage only, ``grad_norm`` everywhere."""
        loss_ok = torch.isfinite(loss)
        norm_ok = torch.isfinite(grad_norm)
        if finite is False:  # skipped by the optimizer: neither value describes an applied update
            norm_ok = torch.zeros_like(norm_ok)
        counted = loss_ok & norm_ok
        if last:
            self.loss_sum += torch.where(counted, loss.double(), 0.0)
            self.loss_count += counted.double()
            self.bad_losses += (~loss_ok).double()
        self.grad_norm_sum += torch.where(norm_ok, grad_norm.double(), 0.0)
        self.grad_norm_count += norm_ok.double()
        if finite is None:
            # Without the optimizer's per-step check a non-finite step is only seen here, on the device.
            nonfinite = ~norm_ok | (~loss_ok if last else torch.zeros_like(loss_ok))
            self.first_bad_step = torch.where(
                nonfinite & (self.first_bad_step < 0), torch.full_like(self.first_bad_step, step), self.first_bad_step
            )
        self.steps += 1

    def check_finite(self, runtime: Runtime, last_checkpoint: str | None) -> None:
        """Raise :class:`TrainingDiverged` on every rank when any rank saw an unchecked non-finite step."""
        bad = self.first_bad_step.clone()
        if runtime.distributed:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank must agree to stop
        if int(bad.item()) >= 0:
            raise TrainingDiverged(unchecked_nonfinite_message(int(bad.item()), last_checkpoint))


def unchecked_nonfinite_message(step: int, last: str | None) -> str:
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
    return (
        f"training diverged: the loss or gradient norm was NaN/Inf at step {step}, and with "
        f"train.skip_nonfinite off that update was applied, so the weights are unusable; {where}. Resume from it "
        f"with train.skip_nonfinite=true (skips such steps) and/or a lower lr.max_lr"
    )


def log_interval(
    cfg: Config,
    runtime: Runtime,
    trainer: Trainer,
    sums: IntervalSums,
    logger: MetricsLogger,
    out: StepOutput,
    *,
    skipped_steps: int,
    flops_per_token: float,
    peak: float | None,
    last_checkpoint: str | None,
) -> float | None:
    """Log the train line of the interval that ends now, reset the sums; return its mean loss (None: not finite)."""
    step = trainer.iteration
    losses = torch.stack([sums.loss_sum, sums.loss_count, sums.bad_losses])
    trainer.reduce_across_stages_and_replicas(losses)  # losses live on the last stage of every replica
    sums.check_finite(runtime, last_checkpoint)
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    elapsed = max(time.perf_counter() - sums.start, 1e-9)
    loss_sum, loss_count = float(losses[0].item()), float(losses[1].item())
    loss = loss_sum / loss_count if loss_count else float("nan")
    norm_count = float(sums.grad_norm_count.item())
    grad_norm = float(sums.grad_norm_sum.item()) / norm_count if norm_count else float("nan")
    tokens_per_s = sums.steps * cfg.train.global_batch_size * cfg.data.seq_length / elapsed
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
        "mfu": mfu(tokens_per_s, flops_per_token, runtime.world_size, peak) if peak else None,
        "step_time_s": elapsed / sums.steps,
        "data_time_s": sums.data_time / sums.steps,
        "peak_memory_gb": peak_memory_bytes(runtime.device) / 1e9,
        "loss_scale": out.loss_scale,
        "skipped_steps": skipped_steps,
        "consumed_samples": trainer.consumed_samples,
        "eta_s": (cfg.train.steps - step) * elapsed / sums.steps,
    }
    if out.moe:  # this rank's MoE layers, the interval's last micro-batch
        record.update({key: float(value.item()) for key, value in out.moe.items()})
    logger.log(record, console=format_train_line(record, cfg.train.steps))
    sums.reset(time.perf_counter())
    return loss if math.isfinite(loss) else None


class StragglerTimes:
    """Per-rank step and data times since the last straggler report."""

    def __init__(self) -> None:
        self.step = self.data = 0.0
        self.n = 0

    def add(self, step_s: float, data_s: float) -> None:
        self.step += step_s
        self.data += data_s
        self.n += 1

    def report(self, runtime: Runtime, logger: MetricsLogger, step: int) -> None:
        """Gather every rank's mean times, log who is slow (collective over the control group), reset."""
        n = max(self.n, 1)
        steps, datas = gather_step_times(self.step / n, self.data / n, runtime.control_group, runtime.world_size)
        report = straggler_report(steps, datas)
        record = {"kind": "straggler", "step": step, **report, "step_times_s": steps, "data_times_s": datas}
        line = (
            f"stragglers @ step {step}: median {1000 * report['median_step_s']:.0f} ms/step, slowest rank "
            f"{report['slowest_rank']} {1000 * report['slowest_step_s']:.0f} ms "
            f"(data {1000 * report['slowest_data_s']:.0f} ms)"
            + (f", flagged ranks {report['stragglers']}" if report["stragglers"] else "")
        )
        logger.log(record, console=line)
        self.__init__()


def log_gpu_stats(runtime: Runtime, logger: MetricsLogger, step: int) -> None:
    stats = gather_gpu_stats(runtime.device, runtime.control_group, runtime.world_size)
    record: dict[str, Any] = {"kind": "gpu", "step": step, "ranks": stats}
    first = stats[0]
    parts = [f"{k} {v:.0f}" for k, v in first.items() if k != "memory_total_gb"]
    logger.log(record, console=f"gpu @ step {step} (rank 0): " + ", ".join(parts))
