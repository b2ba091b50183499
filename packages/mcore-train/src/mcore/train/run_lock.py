"""One live run per run directory: a lock file naming its owner, stale locks taken over.

Two runs writing the same ``checkpoints/`` and ``metrics.jsonl`` corrupt each other's resume state, which is
what happens when a command is started again while a previous one (or its orphaned workers) still trains.
:class:`RunLock` creates ``<run_dir>/mcore-run.lock`` exclusively (``O_CREAT | O_EXCL``), holding the owner's
pid, host and start time. A second run finding it refuses with a message naming that owner, unless the owner
is provably gone (same host, no such live process): then the lock is stale and is taken over, with a note.

Under ``mcore-train --nproc-per-node`` the launcher holds the lock and its workers (its child processes)
recognise it as their own. Releasing removes the lock file, and the run directory too when this lock created
it and the run left nothing in it (a refused start leaves no empty directories behind).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TextIO

from mcore.train.errors import UserError
from mcore.train.output_paths import CreatedDirs

LOCK_FILE = "mcore-run.lock"


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None without /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), so that a reused pid is told apart."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def process_alive(pid: int, started: int | None = None) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie (nor, given ``started``, a newer
    process that reuses the pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc (not Linux): kill(0) is all we know
    if started is not None and len(fields) > 19 and int(fields[19]) != started:
        return False
    return fields[0] != "Z"


def read_owner(path: Path) -> dict | None:
    """The owner record of lock file ``path``; ``None`` when it is unreadable or malformed."""
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int) or not isinstance(owner.get("host"), str):
        return None
    return owner


def _describe(owner: dict) -> str:
    since = owner.get("started")
    when = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if isinstance(since, float) else ""
    return f"pid {owner['pid']} on host {owner['host']}{when}"


class RunLock:
    """Exclusive ownership of a run directory by this process (see the module docstring).

    ``notes`` receives the line about a stale lock taken over. Use as a context manager or call
    :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.notes: list[str] = []
        self.held = False
        self._dirs = CreatedDirs()

    def acquire(self) -> RunLock:
        self._dirs.make(self.run_dir)
        try:
            for _ in range(3):  # a stale lock removed between our attempts: try again
                if self._try_create():
                    self.held = True
                    return self
                self._judge_existing()
            raise UserError(f"run directory {self.run_dir}: could not take the lock {self.path}; try again")
        except BaseException:
            self._dirs.remove_empty()
            raise

    def _try_create(self) -> bool:
        pid = os.getpid()
        record = {"pid": pid, "host": socket.gethostname(), "started": time.time(), "start_ticks": start_ticks(pid)}
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        return True

    def _judge_existing(self) -> None:
        """Refuse a live owner's lock; remove a stale one (the caller then creates ours)."""
        owner = read_owner(self.path)
        if owner is None:
            # Being written this instant by its owner, or damaged: give a writer a moment, then judge again.
            time.sleep(0.2)
            owner = read_owner(self.path)
        if owner is None:
            if not self.path.exists():
                return
            raise UserError(
                f"run directory {self.run_dir} has an unreadable lock file {self.path}; if no run uses this "
                "directory, delete that file and start again"
            )
        same_host = owner["host"] == socket.gethostname()
        ticks = owner.get("start_ticks")
        if same_host and process_alive(owner["pid"], ticks if isinstance(ticks, int) else None):
            raise UserError(
                f"run directory {self.run_dir} is in use by a live run ({_describe(owner)}); wait for it to end, "
                "stop it, or choose another log.run_dir"
            )
        if not same_host:
            raise UserError(
                f"run directory {self.run_dir} is locked by a run on another host ({_describe(owner)}); if that "
                f"run has ended, delete {self.path} and start again, or choose another log.run_dir"
            )
        if self._remove_stale(owner):
            self.notes.append(f"took over the stale lock of {_describe(owner)}, which no longer runs")

    def _remove_stale(self, owner: dict) -> bool:
        """Move the judged-stale lock aside; True if it was that lock (another run starting at the same time
        may have replaced it already: then its fresh lock is put back, and the caller judges again)."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # removed by the other starter
        moved = read_owner(aside)
        if moved != owner:  # (None: a lock being written this instant)
            with contextlib.suppress(OSError):
                os.link(aside, self.path)  # fails if yet another lock appeared meanwhile: that one stands
        aside.unlink(missing_ok=True)
        return moved == owner

    def release(self) -> None:
        if self.held:
            owner = read_owner(self.path)
            if owner is not None and owner["pid"] == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False
        self._dirs.remove_empty()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def held_by_parent(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir``'s lock belongs to this process's parent (the launcher of this worker)."""
    owner = read_owner(Path(run_dir) / LOCK_FILE)
    return owner is not None and owner["pid"] == os.getppid() and owner["host"] == socket.gethostname()


@contextlib.contextmanager
def run_dir_lock(run_dir: str | os.PathLike, *, enabled: bool = True, stream: TextIO | None = None) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block (on the rank that writes the run directory: ``enabled``), unless
    this process's launcher already holds it; a stale lock taken over is reported on ``stream``."""
    if not enabled or held_by_parent(run_dir):
        yield
        return
    with RunLock(run_dir) as lock:
        for note in lock.notes:
            print(f"mcore-train: note: {note}", file=stream or sys.stdout, flush=True)
        yield
