"""The on-disk format of an mcore checkpoint (docs/architecture.md, "mcore.train checkpoint format").

::

    iter_0000100/
      metadata.json                 format, version, iteration, layout, model_config, train_config, tensors
      model/tp00-pp00.safetensors   global parameter names, TP-local slices (padded vocab rows included)
      optim/tp00-pp00.safetensors   "<name>/master" (fp32), "<name>/exp_avg", "<name>/exp_avg_sq" (fp32 or bf16)
      train_state.json              step, consumed samples, data position, lr schedule, loss scaler
      rng/rank00000.safetensors     RNG states of each global rank

``tensors[name]["shape"]`` is the full shape *as saved*: the concatenation of the TP slices, so for a
vocab-padded tensor it includes the padding rows of the saved layout (``vocab_size`` gives the real
row count). Nothing in a checkpoint is pickled.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore.parallel.param_attrs import tp_split, vocab_padding
from mcore.train.checkpoint.dtypes import dtype_name
from mcore.train.errors import CheckpointError

FORMAT_NAME = "mcore"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
TRAIN_STATE_FILE = "train_state.json"
LATEST_FILE = "latest"
# Inside a checkpoint: the original Hugging Face config.json and tokenizer files, verbatim (written by mcore-bridge,
# carried by every training checkpoint saved from it, so that converting back needs no --hf-assets).
HF_ASSETS_DIR = "hf"
ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    """``iter_0000100`` for iteration 100."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def shard_file(kind: str, tp_rank: int, pp_rank: int) -> str:
    """Relative path of the ``model`` or ``optim`` shard of one (tp, pp) rank."""
    return f"{kind}/tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def rng_file(rank: int) -> str:
    """Relative path of the RNG states of one global rank."""
    return f"rng/rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class Layout:
    """The parallel layout a checkpoint was saved with."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "vpp", "dp"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layout.{key} must be a positive integer, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "vpp": self.vpp, "dp": self.dp}


@dataclass(frozen=True)
class TensorMeta:
    """What a checkpoint records about one parameter, enough to reshard it without the model.

    Attributes:
        shape: full shape as saved (TP slices concatenated, vocab padding of the saved layout included).
        dtype: dtype of the stored model tensor.
        partition_dim: dimension split over TP, or ``None`` when replicated.
        partition_blocks: sizes (along ``partition_dim``) of the blocks each split evenly over TP, or
            ``None`` for one block.
        vocab_padded_dim: dimension that holds padded vocabulary rows, or ``None``.
        vocab_size: number of real rows along ``vocab_padded_dim``.
    """

    shape: tuple[int, ...]
    dtype: str
    partition_dim: int | None = None
    partition_blocks: tuple[int, ...] | None = None
    vocab_padded_dim: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if any(not isinstance(s, int) or s < 0 for s in self.shape):
            raise ValueError(f"shape must be non-negative integers, got {self.shape}")
        if self.partition_dim is not None and not (0 <= self.partition_dim < len(self.shape)):
            raise ValueError(f"partition_dim {self.partition_dim} out of range for shape {self.shape}")
        if self.partition_blocks is not None:
            if self.partition_dim is None:
                raise ValueError("partition_blocks given for a tensor without partition_dim")
            if sum(self.partition_blocks) != self.shape[self.partition_dim]:
                raise ValueError(
                    f"partition_blocks {self.partition_blocks} do not sum to dim {self.partition_dim} "
                    f"of shape {self.shape}"
                )
        if (self.vocab_padded_dim is None) != (self.vocab_size is None):
            raise ValueError("vocab_padded_dim and vocab_size must be given together")
        if self.vocab_padded_dim is not None and self.vocab_size > self.shape[self.vocab_padded_dim]:
            raise ValueError(f"vocab_size {self.vocab_size} exceeds dim {self.vocab_padded_dim} of shape {self.shape}")

    @property
    def blocks(self) -> tuple[int, ...]:
        """Partition blocks along ``partition_dim`` (one block when none are declared)."""
        if self.partition_dim is None:
            return ()
        return self.partition_blocks or (self.shape[self.partition_dim],)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "partition_dim": self.partition_dim,
            "partition_blocks": list(self.partition_blocks) if self.partition_blocks is not None else None,
            "vocab_padded_dim": self.vocab_padded_dim,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorMeta:
        blocks = data.get("partition_blocks")
        return cls(
            shape=tuple(int(s) for s in data["shape"]),
            dtype=str(data["dtype"]),
            partition_dim=data.get("partition_dim"),
            partition_blocks=tuple(int(b) for b in blocks) if blocks is not None else None,
            vocab_padded_dim=data.get("vocab_padded_dim"),
            vocab_size=data.get("vocab_size"),
        )


def tensor_meta_of(param: torch.Tensor, tp_size: int) -> TensorMeta:
    """The :class:`TensorMeta` of a (possibly TP-sharded) parameter, from its mcore.parallel attributes."""
    shape = list(param.shape)
    partition_dim = None
    blocks = None
    split = tp_split(param)
    if split is not None:
        partition_dim = split.dim
        shape[partition_dim] *= tp_size
        if split.blocks is not None:
            blocks = split.blocks
            if sum(blocks) != shape[partition_dim]:
                raise ValueError(
                    f"partition_blocks {blocks} must sum to the full size {shape[partition_dim]} of dim "
                    f"{partition_dim} (local size {param.shape[partition_dim]} x tp {tp_size})"
                )
    vocab_dim, vocab_size = vocab_padding(param) or (None, None)
    return TensorMeta(
        shape=tuple(shape),
        dtype=dtype_name(param.dtype),
        partition_dim=partition_dim,
        partition_blocks=blocks,
        vocab_padded_dim=vocab_dim,
        vocab_size=vocab_size,
    )


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Read a JSON object, turning a missing or malformed file into a :class:`CheckpointError`."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found: {path} (is this a complete mcore checkpoint?)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{what} {path} is corrupt (invalid JSON: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is corrupt: expected a JSON object, got {type(data).__name__}")
    return data


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsync and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=False, allow_nan=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def validate_metadata(data: dict[str, Any], path: Path) -> None:
    """Check the keys and types of a parsed ``metadata.json``; raise :class:`CheckpointError` if wrong."""
    if data.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not an mcore checkpoint: format is {data.get('format')!r}, expected 'mcore'")
    if data.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {data.get('version')!r} is not supported (this mcore reads "
            f"version {FORMAT_VERSION})"
        )
    for key, kind in (("layout", dict), ("model_config", dict), ("tensors", dict), ("iteration", int)):
        if not isinstance(data.get(key), kind):
            raise CheckpointError(f"{path} is corrupt: '{key}' should be a {kind.__name__}, got {data.get(key)!r}")
    for name, meta in data["tensors"].items():
        try:
            TensorMeta.from_dict(meta)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path} is corrupt: bad entry for tensor {name!r}: {exc}") from None


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
