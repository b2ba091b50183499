"""Fault tolerance: stop cleanly on SIGTERM/SIGINT, stop after repeated non-finite steps, report hangs.

- :class:`StopSignal` turns the first SIGTERM/SIGINT into a flag the loop checks between steps (it then
  saves a checkpoint and exits 0); a second SIGINT interrupts at once.
- :class:`NonFiniteGuard` counts consecutive skipped (NaN/Inf) steps and stops the run after ``K`` with
  a message naming the step and the last good checkpoint.
- :class:`HangWatchdog` is a daemon thread: when the loop makes no progress for ``timeout`` seconds it
  reports this rank, the step, the phase and the ``torch.distributed`` call it is blocked in, with the
  Python stack of every thread, then exits the process so that the elastic launcher can restart it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType

from mcore.train.errors import UserError


class TrainingDiverged(UserError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class StopSignal:
    """Records SIGTERM/SIGINT instead of dying mid-step; ``requested`` is then True.

    Use as a context manager around the loop; the previous handlers are restored on exit. Handlers can
    only be installed from the main thread; elsewhere this is a no-op that never requests a stop.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class NonFiniteGuard:
    """Stops training after ``max_consecutive`` steps in a row were skipped for a non-finite loss or grad."""

    def __init__(self, max_consecutive: int) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total_skipped = 0

    def update(self, step: int, finite: bool, last_checkpoint: str | None) -> None:
        """Record whether ``step`` was finite; raise :class:`TrainingDiverged` at the limit."""
        if finite:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total_skipped += 1
        if self.consecutive >= self.max_consecutive:
            where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved"
            raise TrainingDiverged(
                f"training diverged: the loss or gradient norm was NaN/Inf for {self.consecutive} steps in a row "
                f"(last at step {step}); {where}. Lower lr.max_lr, raise lr.warmup_steps or check the data, then "
                f"resume from that checkpoint (train.max_nonfinite_steps sets this limit)"
            )


def _blocking_call(frame: FrameType | None) -> str | None:
    """The innermost ``torch.distributed`` function on a stack, with the call site outside torch, if any."""
    stack = traceback.extract_stack(frame) if frame is not None else []

    def in_dist(entry: traceback.FrameSummary) -> bool:
        return "/torch/distributed/" in entry.filename.replace(os.sep, "/")

    inner = next((i for i in range(len(stack) - 1, -1, -1) if in_dist(stack[i])), None)
    if inner is None:
        return None
    outer = inner
    while outer > 0 and in_dist(stack[outer - 1]):
        outer -= 1
    caller = stack[outer - 1] if outer > 0 else None
    where = f" called from {caller.filename}:{caller.lineno} ({caller.name})" if caller else ""
    return f"torch.distributed {stack[inner].name}(){where}"


class HangWatchdog:
    """Reports (and by default ends) a rank that made no progress for ``timeout`` seconds.

    The loop calls :meth:`beat` with the current step and phase (``"forward-backward"``,
    ``"optimizer"``, ``"checkpoint"``, ...). ``on_hang`` receives the report; the default prints it with
    every thread's stack to stderr and exits with code 3.
    """

    def __init__(
        self,
        timeout: float,
        rank: int = 0,
        *,
        on_hang: Callable[[str], None] | None = None,
        poll_interval: float | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.rank = rank
        self.on_hang = on_hang or self._default_on_hang
        self._poll = poll_interval if poll_interval is not None else min(5.0, timeout / 4)
        self._last_beat = time.monotonic()
        self._step = 0
        self._phase = "start-up"
        self._watched = threading.main_thread()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.report: str | None = None

    def beat(self, step: int, phase: str) -> None:
        """Record progress: this rank reached ``phase`` of ``step`` now."""
        self._step = step
        self._phase = phase
        self._last_beat = time.monotonic()

    def start(self) -> HangWatchdog:
        """Start watching the calling thread."""
        self._watched = threading.current_thread()
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="mcore-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._poll * 2 + 1)

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            idle = time.monotonic() - self._last_beat
            if idle < self.timeout:
                continue
            frame = sys._current_frames().get(self._watched.ident)
            call = _blocking_call(frame)
            where = f"blocked in {call}" if call else "not inside a torch.distributed call"
            self.report = (
                f"hang watchdog: rank {self.rank} made no progress for {idle:.0f} s at step {self._step}, "
                f"phase '{self._phase}', {where}"
            )
            self.on_hang(self.report)
            return

    def _default_on_hang(self, report: str) -> None:
        print(f"mcore-train: {report}\nPython stacks of rank {self.rank}:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(3)
