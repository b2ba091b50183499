"""Read an mcore checkpoint one tensor at a time, at the saved layout or resharded to another.

Public API (used by mcore-bridge and by the training loop)::

    with CheckpointReader("runs/x/checkpoints") as ckpt:   # a checkpoint dir, or a dir with `latest`
        ckpt.metadata, ckpt.iteration, ckpt.layout, ckpt.model_config
        for name in ckpt.tensor_names():
            full = ckpt.read_full(name)      # full tensor, vocabulary padding removed

Nothing is unpickled: tensors come from safetensors through ``safe_open(...).get_slice``, so only the
requested ranges are read from disk.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mcore.train.checkpoint.format import (
    LATEST_FILE,
    METADATA_FILE,
    TRAIN_STATE_FILE,
    Layout,
    TensorMeta,
    read_json,
    rng_file,
    shard_file,
    validate_metadata,
)
from mcore.train.checkpoint.resharding import Target, plan_read
from mcore.train.errors import CheckpointError


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint directory that ``path`` names.

    ``path`` may be a checkpoint directory (it holds ``metadata.json``), a directory whose ``latest``
    file names one, a run directory whose ``checkpoints/latest`` does, or such a ``latest`` file itself.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path does not exist: {p}")
    if (p / METADATA_FILE).is_file():
        return p
    bases = (p.parent,) if p.is_file() and p.name == LATEST_FILE else (p, p / "checkpoints")
    for base in bases:
        latest = base / LATEST_FILE
        if latest.is_file():
            name = latest.read_text(encoding="utf-8").strip()
            target = base / name
            if not name or "/" in name or not (target / METADATA_FILE).is_file():
                raise CheckpointError(f"{latest} names {name!r}, which is not a complete checkpoint directory")
            return target
    raise CheckpointError(
        f"{p} is not an mcore checkpoint: it holds no {METADATA_FILE} and no '{LATEST_FILE}' file naming one"
    )


class CheckpointReader:
    """Read access to one checkpoint directory (see the module docstring).

    Args:
        path: a checkpoint directory, or a directory with a ``latest`` file (see
            :func:`resolve_checkpoint_dir`).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = resolve_checkpoint_dir(path)
        meta_path = self.path / METADATA_FILE
        self.metadata: dict[str, Any] = read_json(meta_path, "checkpoint metadata")
        validate_metadata(self.metadata, meta_path)
        try:
            self.layout = Layout(**self.metadata["layout"])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{meta_path} is corrupt: bad layout {self.metadata['layout']!r}: {exc}") from None
        self._metas = {name: TensorMeta.from_dict(m) for name, m in self.metadata["tensors"].items()}
        kinds = ["model"] + (["optim"] if (self.path / "optim").is_dir() else [])
        missing = [
            shard_file(kind, t, p)
            for kind in kinds
            for t in range(self.layout.tp)
            for p in range(self.layout.pp)
            if not (self.path / shard_file(kind, t, p)).is_file()
        ]
        if missing:
            raise CheckpointError(
                f"checkpoint {self.path} is incomplete: missing {', '.join(missing[:4])}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            )
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._index: dict[str, dict[str, int]] = {}

    # ----------------------------------------------------------------- description
    @property
    def iteration(self) -> int:
        """The training iteration the checkpoint was saved at (0 for a converted model)."""
        return int(self.metadata["iteration"])

    @property
    def model_config_dict(self) -> dict[str, Any]:
        """The model's configuration as stored (``TransformerConfig`` fields)."""
        return dict(self.metadata["model_config"])

    @property
    def model_config(self) -> Any:
        """The model's ``mcore.models.TransformerConfig``."""
        from mcore.models.config import TransformerConfig
        from mcore.train.typed_config import from_dict

        return from_dict(TransformerConfig, self.model_config_dict, "model_config")

    @property
    def train_config(self) -> dict[str, Any] | None:
        """The resolved training configuration of the run that saved it (``None`` for model-only)."""
        return self.metadata.get("train_config")

    @property
    def has_optimizer_state(self) -> bool:
        """True when the checkpoint holds optimizer state and a training state (a full checkpoint)."""
        return (self.path / "optim").is_dir() and (self.path / TRAIN_STATE_FILE).is_file()

    @property
    def train_state(self) -> dict[str, Any] | None:
        """Parsed ``train_state.json``, or ``None`` for a model-only checkpoint."""
        if not (self.path / TRAIN_STATE_FILE).is_file():
            return None
        return read_json(self.path / TRAIN_STATE_FILE, "training state")

    def tensor_names(self) -> list[str]:
        """Global names of the model tensors, in the order they were recorded."""
        return list(self._metas)

    def tensor_meta(self, name: str) -> TensorMeta:
        """Shape (as saved, padding included), dtype and partitioning of one tensor."""
        if name not in self._metas:
            raise CheckpointError(self._unknown(name))
        return self._metas[name]

    # ----------------------------------------------------------------- reading
    def read_full(
        self, name: str, *, padded: bool = False, kind: str = "model", key: str | None = None
    ) -> torch.Tensor:
        """The full (unsharded) tensor ``name``, on CPU, in its saved dtype.

        Args:
            name: global parameter name.
            padded: keep vocabulary padding rows (default: drop rows at or beyond ``vocab_size``).
            kind: ``"model"`` for weights, ``"optim"`` for optimizer state.
            key: the key inside the shard files (default ``name``; e.g. ``f"{name}/exp_avg"``).
        """
        meta = self.tensor_meta(name)
        target = Target(
            full_shape=meta.shape,
            partition_dim=meta.partition_dim,
            partition_blocks=meta.partition_blocks,
            tp_size=1,
            tp_rank=0,
            vocab_padded_dim=meta.vocab_padded_dim,
            vocab_size=meta.vocab_size,
        )
        full = self._read(name, meta, target, kind, key or name, None)
        if not padded and meta.vocab_padded_dim is not None:
            full = full.narrow(meta.vocab_padded_dim, 0, meta.vocab_size).contiguous()
        return full

    def read_local(
        self,
        name: str,
        target: Target,
        *,
        kind: str = "model",
        key: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The slice of ``name`` that a rank described by ``target`` holds, read from any saved TP size."""
        meta = self.tensor_meta(name)
        return self._read(name, meta, target, kind, key or name, dtype)

    def rng_state(self, rank: int) -> dict[str, torch.Tensor] | None:
        """RNG state tensors saved by global rank ``rank``, or ``None`` when that file does not exist."""
        path = self.path / rng_file(rank)
        if not path.is_file():
            return None
        handle = self._open(path)
        return {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - safe_open has no __iter__

    def close(self) -> None:
        """Close every open shard file."""
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals
    def _unknown(self, name: str) -> str:
        import difflib

        close = difflib.get_close_matches(name, list(self._metas), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"tensor {name!r} is not in checkpoint {self.path}{hint}"

    def _open(self, path: Path) -> Any:
        key = str(path)
        if key not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"checkpoint {self.path} is incomplete: {path.relative_to(self.path)} is missing")
            try:
                self._handles[key] = self._stack.enter_context(safe_open(key, framework="pt", device="cpu"))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: {exc}") from None
        return self._handles[key]

    def _pp_of(self, kind: str, key: str) -> int:
        """The pipeline rank whose shard files hold ``key``, from the files' headers."""
        if kind not in self._index:
            index: dict[str, int] = {}
            for pp in range(self.layout.pp):
                handle = self._open(self.path / shard_file(kind, 0, pp))
                for k in handle.keys():  # noqa: SIM118
                    index[k] = pp
            self._index[kind] = index
        if key not in self._index[kind]:
            raise CheckpointError(f"checkpoint {self.path} has no {kind} tensor {key!r}")
        return self._index[kind][key]

    def _read(
        self, name: str, meta: TensorMeta, target: Target, kind: str, key: str, dtype: torch.dtype | None
    ) -> torch.Tensor:
        if kind not in ("model", "optim"):
            raise ValueError(f"kind must be 'model' or 'optim', got {kind!r}")
        pp = self._pp_of(kind, key)
        plan = plan_read(name, meta, self.layout.tp, target)
        out: torch.Tensor | None = None
        for piece in plan.pieces:
            handle = self._open(self.path / shard_file(kind, piece.saved_tp_rank, pp))
            try:
                part = handle.get_slice(key)[piece.src]
            except SafetensorError as exc:
                raise CheckpointError(f"checkpoint {self.path}: cannot read {kind} tensor {key!r}: {exc}") from None
            expected = tuple(sl.stop - sl.start for sl in piece.dst)
            if tuple(part.shape) != expected:
                raise CheckpointError(
                    f"checkpoint {self.path}: {kind} tensor {key!r} in tp rank {piece.saved_tp_rank} has the wrong "
                    f"shape (read {list(part.shape)}, metadata implies {list(expected)}); the file is corrupt"
                )
            if out is None:
                out = torch.zeros(plan.local_shape, dtype=dtype or part.dtype)
            out[piece.dst] = part
        if out is None:  # every row is new padding: nothing to read
            out = torch.zeros(plan.local_shape, dtype=dtype or torch.float32)
        return out
