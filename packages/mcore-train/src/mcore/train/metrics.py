"""Training metrics: a console line (and a progress bar with ETA), a JSONL file, TensorBoard when installed.

Only the logging rank (global rank 0) writes. Each record is one JSON object per line of
``<run_dir>/metrics.jsonl`` with at least ``step`` and ``kind`` (``train``, ``eval``, ``gpu``, ``event``);
``mcore-train plot`` reads it back.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from mcore.models.accounting import peak_bf16_flops

METRICS_FILE = "metrics.jsonl"


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of ``device`` in FLOP/s, or ``None`` when unknown (CPUs, GPUs not in
    ``mcore.models.accounting.PEAK_BF16_FLOPS``)."""
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: allocated CUDA memory on GPUs, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        # Linux reports ru_maxrss in KiB.
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


def _fmt_count(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def format_train_line(record: dict[str, Any], total_steps: int) -> str:
    """One console line for a ``train`` record (keys that are absent are left out)."""
    width = len(str(total_steps))
    parts = [f"step {record['step']:>{width}}/{total_steps}", f"loss {record['loss']:.4f}"]
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    parts.append(f"lr {record['lr']:.2e}")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{_fmt_count(record['tokens_per_s'])} tok/s")
    if record.get("tflops_per_gpu") is not None:
        per = "gpu" if record.get("device", "cuda") == "cuda" else "rank"  # a CPU process is no GPU
        parts.append(f"{record['tflops_per_gpu']:.2f} TFLOP/s/{per}")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if record.get("step_time_s") is not None:
        parts.append(f"{1000 * record['step_time_s']:.0f} ms/step")
    if record.get("peak_memory_gb") is not None:
        parts.append(f"mem {record['peak_memory_gb']:.2f} GB")
    if record.get("loss_scale") is not None:
        parts.append(f"scale {record['loss_scale']:.0f}")
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    if record.get("eta_s") is not None:
        parts.append(f"ETA {_fmt_duration(record['eta_s'])}")
    return " | ".join(parts)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class MetricsLogger:
    """Writes metric records to the console, ``metrics.jsonl`` and TensorBoard (rank 0 only).

    Args:
        run_dir: directory of the run (created if needed).
        total_steps: the run's last step (for the progress bar and the step column width).
        start_step: first step of this process (a resumed run starts later).
        enabled: False on every rank but the logging one.
        progress_bar: show a tqdm bar with ETA when the console is a terminal.
        tensorboard: also write TensorBoard event files when ``torch.utils.tensorboard`` works.
        stream: where console lines go.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        progress_bar: bool = True,
        tensorboard: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._file: TextIO | None = None
        self._tb: Any = None
        self._bar: tqdm | None = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            self._tb = _open_tensorboard(self.run_dir / "tensorboard")
        if progress_bar and self.stream.isatty():
            self._bar = tqdm(
                total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr, leave=False
            )

    def print(self, text: str) -> None:
        """A console line that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar."""
        if self._bar is not None:
            self._bar.update(steps)

    def log(self, record: dict[str, Any], *, console: str | None = None) -> None:
        """Append ``record`` (needs ``step`` and ``kind``) to the JSONL file and TensorBoard; print ``console``."""
        if not self.enabled:
            return
        if "step" not in record or "kind" not in record:
            raise ValueError(f"a metrics record needs 'step' and 'kind', got keys {sorted(record)}")
        clean = {k: _jsonable(v) for k, v in record.items()}
        clean.setdefault("time", time.time())
        if self._file is None:
            raise RuntimeError("MetricsLogger.log() called after close()")
        self._file.write(json.dumps(clean, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if key in ("step", "time", "kind") or not isinstance(value, int | float) or isinstance(value, bool):
                    continue
                self._tb.add_scalar(f"{clean['kind']}/{key}", value, clean["step"])
        if console is not None:
            self.print(console)
        if self._bar is not None and clean["kind"] == "train" and "loss" in clean:
            self._bar.set_postfix(loss=f"{clean['loss']:.4f}", refresh=False)

    def close(self) -> None:
        """Close the file, the TensorBoard writer and the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return value  # json writes NaN/Infinity, which Python's reader accepts
    return value


def _open_tensorboard(path: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except (ImportError, ModuleNotFoundError):
        return None
    return SummaryWriter(log_dir=str(path))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``<run_dir>/metrics.jsonl`` (a partially written last line is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    records = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
