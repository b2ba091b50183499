"""Output locations: checked before any work starts, created only once the inputs are valid.

A run that cannot write its run directory or checkpoints should say so in one line before it builds a model
or reads a large checkpoint, not with a traceback from deep inside. :func:`output_dir_problem` answers
"could this directory be created and written?" without leaving anything behind (it probes with a temporary
file, because permission bits say nothing for root or a read-only mount). :class:`CreatedDirs` makes the
directories of a run and removes again the ones it made if the start fails, so that a refused start leaves
no empty directories.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from mcore.train.errors import UserError

if TYPE_CHECKING:
    from mcore.train.config import Config


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (``.`` for a relative path none of whose parts exist)."""
    current = path
    while not os.path.lexists(current):
        parent = current.parent
        if parent == current:
            break
        current = parent
    return current


def output_dir_problem(path: str | os.PathLike) -> str | None:
    """Why directory ``path`` cannot be created or written into, or ``None`` when it can. Creates nothing."""
    target = Path(path)
    existing = _nearest_existing(target)
    if not existing.is_dir():
        if existing == target:
            return f"{target} exists and is a file, not a directory"
        return f"{existing} is a file, so no directory can be created below it"
    try:
        fd, probe = tempfile.mkstemp(prefix=".mcore-write-probe-", dir=existing)
    except OSError as exc:
        what = "the directory" if existing == target else f"its existing parent {existing}"
        return f"{what} is not writable ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(probe)
    return None


def check_output_dir(path: str | os.PathLike, what: str, error: type[Exception] = UserError) -> None:
    """Raise ``error`` naming ``what`` (e.g. ``log.run_dir``) and ``path`` unless that directory is writable."""
    problem = output_dir_problem(path)
    if problem is not None:
        raise error(f"{what} {path}: {problem}; choose a location you can write to (nothing was written)")


def check_output_prefix(prefix: str | os.PathLike, what: str, error: type[Exception] = UserError) -> None:
    """Like :func:`check_output_dir` for the directory that the files ``PREFIX.*`` go into."""
    problem = output_dir_problem(Path(prefix).parent)
    if problem is not None:
        raise error(f"{what} {prefix}: {problem}; choose a location you can write to (nothing was written)")


class CreatedDirs:
    """Make directories (with parents); if the ``with`` block raises, remove those made here that are empty.

    ``with CreatedDirs() as made: made.make(run_dir); ...`` leaves the file system as it was when the start
    fails, and keeps everything once it succeeds. Directories that existed before are never removed.
    """

    def __init__(self) -> None:
        self.created: list[Path] = []

    def make(self, path: str | os.PathLike) -> Path:
        target = Path(path)
        missing = []
        current = target
        while not os.path.lexists(current) and current.parent != current:
            missing.append(current)
            current = current.parent
        target.mkdir(parents=True, exist_ok=True)
        self.created += reversed(missing)  # outermost first
        return target

    def remove_empty(self) -> None:
        for path in reversed(self.created):  # innermost first
            with contextlib.suppress(OSError):
                path.rmdir()  # only succeeds on an empty directory
        self.created.clear()

    def __enter__(self) -> CreatedDirs:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.remove_empty()


def check_train_outputs(config: Config) -> None:
    """The run directory and checkpoint directory of a training config (see :func:`check_output_dir`)."""
    if config.log.run_dir:
        check_output_dir(config.log.run_dir, "log.run_dir")
    else:
        check_output_dir("runs", "the default run directory (set log.run_dir to choose one)")
    if config.checkpoint.dir:
        check_output_dir(config.checkpoint.dir, "checkpoint.dir")
    elif config.log.run_dir:
        check_output_dir(Path(config.log.run_dir) / "checkpoints", "the checkpoint directory of log.run_dir")
