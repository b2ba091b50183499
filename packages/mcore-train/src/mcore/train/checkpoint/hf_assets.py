"""Carry a checkpoint's ``hf/`` directory (Hugging Face config.json and tokenizer files) into later checkpoints.

The files are read into memory once, when training starts from a checkpoint that has them, rather than copied
from that checkpoint at each save: the start checkpoint may be pruned by ``keep_last`` (or deleted) mid-run.
They are small (configs and tokenizers, a few MB at most).
"""

from __future__ import annotations

import os
from pathlib import Path

from mcore.train.checkpoint.format import HF_ASSETS_DIR
from mcore.train.errors import CheckpointError


def read_hf_assets(checkpoint_dir: str | os.PathLike) -> dict[str, bytes] | None:
    """The files under ``<checkpoint_dir>/hf/`` by POSIX path relative to it, or None when it has no ``hf/``."""
    root = Path(checkpoint_dir) / HF_ASSETS_DIR
    if not root.is_dir():
        return None
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files


def write_hf_assets(files: dict[str, bytes], checkpoint_dir: str | os.PathLike) -> None:
    """Write ``files`` (as :func:`read_hf_assets` returns them) into ``<checkpoint_dir>/hf/``, byte for byte."""
    root = Path(checkpoint_dir) / HF_ASSETS_DIR
    for name, data in files.items():
        target = root / name
        # Names come from a checkpoint on disk: refuse any that would escape hf/ rather than trust them.
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"HF asset name {name!r} is not a relative path inside {HF_ASSETS_DIR}/")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as fh:
            fh.write(data)
            # No fsync here: CheckpointDirectory.commit fsyncs the whole tree before the rename.
