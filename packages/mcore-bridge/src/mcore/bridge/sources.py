"""What a SRC or DST argument names, and the staging that makes writing DST all-or-nothing."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mcore.bridge import hub
from mcore.bridge.errors import BridgeError
from mcore.bridge.hf import is_hf_dir
from mcore.train.checkpoint.reader import resolve_checkpoint_dir
from mcore.train.errors import CheckpointError


@dataclass(frozen=True)
class Source:
    kind: Literal["hf", "mcore"]
    path: Path  # local directory: the HF model, or the resolved mcore checkpoint directory
    given: str  # what the user wrote (a path or a hub id)


def resolve_source(src: str | os.PathLike) -> Source:
    """Classify SRC: a local HF directory, an mcore checkpoint (or a directory whose ``latest`` names one), or a
    Hugging Face hub id (fetched, or taken from the local cache when offline)."""
    text = str(src)
    path = Path(text).expanduser()
    if path.exists():
        if is_hf_dir(path):
            return Source("hf", path, text)
        try:
            return Source("mcore", resolve_checkpoint_dir(path), text)
        except CheckpointError as exc:
            raise BridgeError(
                f"{path} is neither a Hugging Face model directory (no config.json) nor an mcore checkpoint ({exc})"
            ) from None
    if hub.looks_like_hub_id(text):
        try:
            return Source("hf", hub.fetch(text), text)
        except BridgeError as exc:
            raise BridgeError(f"{text}: no such file or directory, and as a hub id: {exc}") from None
    raise BridgeError(f"{text}: no such file or directory, and not a Hugging Face hub id (owner/name)")


def check_destination(dst: Path, overwrite: bool, sources: list[Path]) -> None:
    """Refuse an existing DST without ``overwrite``, and a DST that is, contains or lies in a source."""
    if dst.exists() and not overwrite:
        raise BridgeError(f"{dst} already exists; pass --overwrite to replace it (nothing was written)")
    target = dst.resolve()
    for src in sources:
        s = src.resolve()
        if target == s or target in s.parents or s in target.parents:
            raise BridgeError(f"destination {dst} overlaps the source {src}; choose a separate directory")


@contextlib.contextmanager
def staged_directory(dst: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh path beside ``dst`` for the body to create; publish it as ``dst`` only if the body succeeds.

    On any error the temporary directory is removed and ``dst`` (if it existed) is untouched. With ``overwrite``
    an existing ``dst`` is moved aside, replaced by the new one, and then deleted.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    temp = dst.parent / f".{dst.name}.tmp-{token}"
    try:
        yield temp
        if not temp.is_dir():
            raise RuntimeError(f"the conversion did not create {temp}")
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    if dst.exists() or dst.is_symlink():
        if not overwrite:  # appeared while we were writing
            shutil.rmtree(temp, ignore_errors=True)
            raise BridgeError(f"{dst} appeared during the conversion; pass --overwrite to replace it")
        old = dst.parent / f".{dst.name}.old-{token}"
        os.replace(dst, old)
        os.replace(temp, dst)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        os.replace(temp, dst)
