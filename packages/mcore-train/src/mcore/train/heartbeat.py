"""Per-rank heartbeat files, so that a hang report names the rank that stopped and what the others wait in.

A rank blocked in a collective only knows that it waits; the rank that stopped (SIGSTOP, a frozen node, an
endless loop) cannot report at all. So every rank's watchdog thread writes a small JSON file beside the run,
``<run_dir>/heartbeat/rank00001.json``, once per poll: pid, host, step, phase, seconds since the last
progress and the ``torch.distributed`` call its main thread is in. A file that stops being rewritten means
that rank's whole process stopped (its watchdog thread too); a fresh file with a long idle time and no call
means a rank stuck in its own code; a call names the collective and the peers a waiting rank waits for.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Heartbeat:
    """One rank's last report. ``written`` and ``since_progress_s`` come from the writer's clock."""

    rank: int
    pid: int
    host: str
    step: int
    phase: str
    since_progress_s: float
    call: str | None
    written: float


class HeartbeatBoard:
    """The heartbeat files of one job: this rank writes its own and reads everyone's."""

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.path = self.directory / f"rank{rank:05d}.json"
        self._pid = os.getpid()
        self._host = socket.gethostname()

    def publish(self, step: int, phase: str, since_progress_s: float, call: str | None) -> None:
        """Replace this rank's file atomically (readers never see half a record). Never raises."""
        beat = Heartbeat(self.rank, self._pid, self._host, step, phase, since_progress_s, call, time.time())
        tmp = self.directory / f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(asdict(beat)), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full or vanished disk must not kill the watchdog thread

    def read(self, rank: int) -> Heartbeat | None:
        try:
            record = json.loads((self.directory / f"rank{rank:05d}.json").read_text(encoding="utf-8"))
            return Heartbeat(**record)
        except (OSError, ValueError, TypeError):
            return None

    def read_all(self) -> dict[int, Heartbeat | None]:
        return {rank: self.read(rank) for rank in range(self.world_size)}

    def remove_own(self) -> None:
        """Remove this rank's file (and the directory once every rank removed its own)."""
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other ranks' files are still there
            self.directory.rmdir()


@dataclass(frozen=True)
class Diagnosis:
    """What the heartbeats say: one line per rank, and the ranks that stopped making progress."""

    lines: list[str]
    stopped: list[int]
    frozen: list[Heartbeat]  # stopped ranks whose whole process no longer reports


def diagnose(beats: dict[int, Heartbeat | None], *, now: float, stale_after: float, started: float) -> Diagnosis:
    """Classify every rank of ``beats`` (see the module docstring).

    A rank whose file is older than ``stale_after`` seconds stopped as a whole process; one idle for
    ``stale_after`` outside ``torch.distributed`` stopped in its own code; one idle inside a call waits.
    ``started``: when this rank's watchdog began (older files are left from an earlier run).
    """
    lines, stopped, frozen = [], [], []
    for rank, beat in sorted(beats.items()):
        if beat is None or beat.written < started - stale_after:
            lines.append(
                f"rank {rank}: stopped making progress: no heartbeat in this run (it never got to training, or "
                "the run directory is not shared between hosts)"
            )
            stopped.append(rank)
            continue
        silent = max(now - beat.written, 0.0)
        idle = beat.since_progress_s + silent
        where = f"at step {beat.step}, phase '{beat.phase}'; pid {beat.pid} on host {beat.host}"
        if silent > stale_after:
            lines.append(
                f"rank {rank}: stopped making progress: its process has not reported for {silent:.0f} s (last {where})"
                ": it is stopped, frozen or dead"
            )
            stopped.append(rank)
            frozen.append(beat)
        elif idle < stale_after:
            lines.append(f"rank {rank}: making progress ({where})")
        elif beat.call is not None:
            lines.append(f"rank {rank}: waiting for {idle:.0f} s in {beat.call} ({where})")
        else:
            lines.append(
                f"rank {rank}: stopped making progress: no progress for {idle:.0f} s, not inside a torch.distributed "
                f"call ({where})"
            )
            stopped.append(rank)
    return Diagnosis(lines, stopped, frozen)
