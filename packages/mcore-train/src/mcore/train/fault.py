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
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from mcore.train.blocking_call import describe_blocking_call
from mcore.train.errors import UserError
from mcore.train.heartbeat import Diagnosis, HeartbeatBoard, diagnose


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


class HangWatchdog:
    """Reports (and by default ends) a rank that made no progress for ``timeout`` seconds.

    The loop calls :meth:`beat` with the current step and phase (``"forward-backward"``,
    ``"optimizer"``, ``"checkpoint"``, ...). ``on_hang`` receives the report; the default prints it with
    every thread's stack to stderr and exits with code 3.

    With ``heartbeat_dir`` (a directory every rank of the job can read: the run directory's ``heartbeat/``)
    the ranks publish their state (:mod:`mcore.train.heartbeat`) and the report names the rank that stopped
    making progress and what each other rank waits in. The default action then also ends stopped sibling
    workers on this host (SIGKILL), since a stopped process cannot act on the launcher's SIGTERM and the
    launcher would wait out its shutdown timeout.
    """

    def __init__(
        self,
        timeout: float,
        rank: int = 0,
        *,
        on_hang: Callable[[str], None] | None = None,
        poll_interval: float | None = None,
        heartbeat_dir: str | os.PathLike | None = None,
        world_size: int = 1,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.rank = rank
        self.on_hang = on_hang or self._default_on_hang
        self._poll = poll_interval if poll_interval is not None else min(2.0, timeout / 4)
        self.board = HeartbeatBoard(heartbeat_dir, rank, world_size) if heartbeat_dir is not None else None
        # Heartbeats go to a shared file system: at most every 30 s for long timeouts (thousands of ranks).
        self._publish_every = max(self._poll, min(30.0, timeout / 10))
        # A heartbeat file older than this belongs to a stopped process (its watchdog thread rewrites it).
        self._stale_after = 2 * self._publish_every + min(1.0, timeout / 4)
        self._last_publish = 0.0
        self._last_beat = time.monotonic()
        self._started = time.time()
        self._step = 0
        self._phase = "start-up"
        self._watched = threading.main_thread()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.report: str | None = None
        self.diagnosis: Diagnosis | None = None

    def beat(self, step: int, phase: str) -> None:
        """Record progress: this rank reached ``phase`` of ``step`` now."""
        self._step = step
        self._phase = phase
        self._last_beat = time.monotonic()

    def start(self) -> HangWatchdog:
        """Start watching the calling thread."""
        self._watched = threading.current_thread()
        self._last_beat = time.monotonic()
        self._started = time.time()
        if self.board is not None:  # at once: a rank that stops before its first poll is still on the board
            self.board.publish(self._step, self._phase, 0.0, None)
            self._last_publish = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="mcore-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._poll * 2 + 1)
        if self.board is not None:
            self.board.remove_own()

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            idle = time.monotonic() - self._last_beat
            call = None
            if idle >= self._poll:  # only a main thread that stalls is worth a look at its stack
                call = describe_blocking_call(sys._current_frames().get(self._watched.ident))
            if self.board is not None and time.monotonic() - self._last_publish >= self._publish_every - 1e-3:
                self.board.publish(self._step, self._phase, idle, call)
                self._last_publish = time.monotonic()
            if idle < self.timeout:
                continue
            where = f"blocked in {call}" if call else "not inside a torch.distributed call"
            self.report = (
                f"hang watchdog: rank {self.rank} made no progress for {idle:.0f} s at step {self._step}, "
                f"phase '{self._phase}', {where}"
            )
            if self.board is not None:
                self.report += self._peer_report()
            self.on_hang(self.report)
            return

    def _peer_report(self) -> str:
        beats = self.board.read_all()
        self.diagnosis = diagnose(beats, now=time.time(), stale_after=self._stale_after, started=self._started)
        stopped = self.diagnosis.stopped
        if stopped:
            head = f"\nrank(s) {', '.join(map(str, stopped))} stopped making progress; the state of every rank:"
        else:
            head = "\nno rank stopped reporting; every rank waits (mismatched collectives?); the state of every rank:"
        return head + "".join(f"\n  {line}" for line in self.diagnosis.lines)

    def _end_stopped_siblings(self) -> None:
        """SIGKILL stopped ranks that are, provably, sibling workers on this host (same parent process)."""
        if self.diagnosis is None:
            return
        for beat in self.diagnosis.frozen:
            if beat.host != socket.gethostname() or beat.pid == os.getpid() or _parent_of(beat.pid) != os.getppid():
                continue
            if os.getppid() <= 1:
                continue
            try:
                os.kill(beat.pid, signal.SIGKILL)
            except OSError:
                continue
            print(
                f"mcore-train: hang watchdog: ended rank {beat.rank} (pid {beat.pid}), which no longer responds",
                file=sys.stderr,
                flush=True,
            )

    def _default_on_hang(self, report: str) -> None:
        print(f"mcore-train: {report}\nPython stacks of rank {self.rank}:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        self._end_stopped_siblings()
        os._exit(3)


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (Linux /proc), or None."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
