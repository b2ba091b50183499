"""The checkpoints directory of a run: atomic commit, the ``latest`` pointer, keeping the last K.

A checkpoint is written into ``iter_0000100.tmp-<uuid>/`` and becomes visible only when complete, by a
rename to ``iter_0000100/``; then ``latest`` is replaced atomically (temporary file + ``os.replace``),
then older checkpoints beyond ``keep_last`` are removed. A process killed at any point leaves either the
previous state or the new one: at worst a stray ``*.tmp-*`` directory, removed at the next start.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from mcore.train.checkpoint.format import ITER_DIR_RE, LATEST_FILE, METADATA_FILE, iter_dir_name
from mcore.train.errors import CheckpointError


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (so a rename after it publishes durable data)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(root))


class CheckpointDirectory:
    """``<root>/iter_*`` checkpoints and the ``latest`` file of one run."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def new_temp_dir(self, iteration: int, token: str | None = None) -> Path:
        """A fresh ``iter_XXXXXXX.tmp-<token>`` path (not created); all ranks must use the same token."""
        return self.root / f"{iter_dir_name(iteration)}.tmp-{token or uuid.uuid4().hex[:12]}"

    def final_dir(self, iteration: int) -> Path:
        return self.root / iter_dir_name(iteration)

    def commit(self, temp_dir: Path, iteration: int, keep_last: int | None = None) -> Path:
        """Publish a complete ``temp_dir`` as ``iter_<iteration>``, move ``latest`` to it, prune old ones."""
        final = self.final_dir(iteration)
        fsync_tree(temp_dir)
        if final.exists():
            # Same iteration saved twice (e.g. a finished run started again): keep the published one.
            shutil.rmtree(temp_dir, ignore_errors=True)
        else:
            os.replace(temp_dir, final)
            _fsync_dir(self.root)
        self._write_latest(final.name)
        if keep_last is not None:
            self.prune(keep_last)
        return final

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST_FILE}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.root / LATEST_FILE)
        _fsync_dir(self.root)

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, or ``None`` when there is no ``latest`` file.

        Raises :class:`CheckpointError` when ``latest`` exists but cannot be read or names a checkpoint that is
        missing or incomplete: resuming must never fall back to random weights silently.
        """
        path = self.root / LATEST_FILE
        if not os.path.lexists(path):
            return None
        try:
            name = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(self._broken_latest(f"{path} cannot be read ({exc})")) from None
        target = self.root / name
        if not ITER_DIR_RE.match(name):
            raise CheckpointError(self._broken_latest(f"{path} holds {name[:80]!r}, not a checkpoint name"))
        if not (target / METADATA_FILE).is_file():
            state = "is incomplete (no metadata.json)" if target.is_dir() else "does not exist"
            raise CheckpointError(self._broken_latest(f"{path} names the checkpoint {target}, which {state}"))
        return target

    def _broken_latest(self, problem: str) -> str:
        complete = [p.name for p in self.checkpoints() if (p / METADATA_FILE).is_file()]
        found = (
            f"complete checkpoints in {self.root}: {', '.join(complete)}"
            if complete
            else (f"{self.root} holds no complete checkpoint")
        )
        resume = f"to resume from one of them, write its name into {self.root / LATEST_FILE}; " if complete else ""
        return (
            f"{problem}; {found}. Nothing was started: {resume}to start from random weights on purpose, give a "
            f"new log.run_dir=DIR (or checkpoint.dir=DIR), or delete {self.root / LATEST_FILE}"
        )

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and ITER_DIR_RE.match(p.name)]
        return sorted(found, key=lambda p: int(ITER_DIR_RE.match(p.name).group(1)))

    def prune(self, keep_last: int) -> list[Path]:
        """Remove all but the newest ``keep_last`` checkpoints (never the one ``latest`` names)."""
        latest = self.latest()
        old = self.checkpoints()[:-keep_last] if keep_last > 0 else self.checkpoints()
        removed = []
        for path in old:
            if latest is not None and path.resolve() == latest.resolve():
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    def remove_stale_temp_dirs(self) -> list[Path]:
        """Remove ``*.tmp-*`` directories left by saves that never completed."""
        if not self.root.is_dir():
            return []
        stale = [p for p in self.root.iterdir() if p.is_dir() and ".tmp-" in p.name]
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        return stale
