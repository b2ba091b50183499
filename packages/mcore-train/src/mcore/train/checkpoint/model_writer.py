"""Write a model-only checkpoint from full tensors, one at a time (what ``mcore-bridge`` uses).

::

    with ModelCheckpointWriter("llama3-8b-mcore", model_config, dtype=torch.bfloat16) as writer:
        for name, tensor in converted_tensors():       # any order, each once
            writer.add(name, tensor)                   # full tensor, vocabulary unpadded or padded
    # finalize() runs on a clean exit of the ``with`` block

The checkpoint is written at layout tp=1, pp=1 (``model/tp00-pp00.safetensors`` + ``metadata.json``) and
loads at any tp/pp through resharding. Memory stays at one tensor: the expected names, shapes and
partitioning come from the model built on the ``meta`` device, so the file header is written first and
each tensor goes straight to its offset. The directory appears only when complete.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from mcore.train.checkpoint.directory import fsync_tree
from mcore.train.checkpoint.dtypes import dtype_name
from mcore.train.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    Layout,
    TensorMeta,
    shard_file,
    tensor_meta_of,
    write_json_atomic,
)
from mcore.train.checkpoint.safetensors_stream import SafetensorsStreamWriter


def expected_model_tensors(model_config: Any) -> dict[str, TensorMeta]:
    """Name -> :class:`TensorMeta` (layout tp=1, pp=1) of every parameter of the model ``model_config`` describes,
    then of its persistent buffers (the MoE expert biases)."""
    from mcore.models.gpt import GPTModel
    from mcore.parallel.param_attrs import persistent_buffers

    with torch.device("meta"):
        model = GPTModel(model_config, device=torch.device("meta"))
    tensors = [*model.named_parameters(), *persistent_buffers(model)]
    return {name: tensor_meta_of(param, tp_size=1) for name, param in tensors}


class ModelCheckpointWriter:
    """Stream full tensors into a model-only mcore checkpoint (see the module docstring).

    Args:
        path: checkpoint directory to create; it must not exist (nothing is ever overwritten).
        model_config: the ``TransformerConfig`` of the model (stored in ``metadata.json``).
        dtype: dtype the tensors are stored in (each added tensor is cast to it).
        iteration: recorded as the checkpoint's iteration (0 for a converted model).
    """

    def __init__(
        self, path: str | os.PathLike, model_config: Any, *, dtype: torch.dtype = torch.float32, iteration: int = 0
    ) -> None:
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"{self.path} already exists; choose a new directory (nothing is overwritten)")
        self.model_config = model_config
        self.dtype = dtype
        self.iteration = iteration
        self.expected = expected_model_tensors(model_config)
        self._tmp = self.path.with_name(f"{self.path.name}.tmp-{uuid.uuid4().hex[:12]}")
        (self._tmp / "model").mkdir(parents=True)
        specs = {name: (dtype, meta.shape) for name, meta in self.expected.items()}
        self._writer = SafetensorsStreamWriter(self._tmp / shard_file("model", 0, 0), specs)
        self._done = False

    @property
    def missing(self) -> list[str]:
        """Expected tensors not added yet."""
        return self._writer.missing

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add the full tensor ``name`` (global mcore name).

        A vocabulary-padded tensor may be given with ``vocab_size`` rows (it is padded with zeros) or
        already padded. Raises ``KeyError`` for an unknown name and ``ValueError`` for a wrong shape or a
        name added twice.
        """
        if self._done:
            raise RuntimeError("ModelCheckpointWriter.add() after finalize()")
        if name not in self.expected:
            import difflib

            close = difflib.get_close_matches(name, list(self.expected), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise KeyError(f"{name!r} is not a parameter of this model{hint}")
        meta = self.expected[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        shape = tuple(tensor.shape)
        if shape != meta.shape:
            dim = meta.vocab_padded_dim
            unpadded = list(meta.shape)
            if dim is not None:
                unpadded[dim] = meta.vocab_size
            if dim is None or shape != tuple(unpadded):
                allowed = f"{list(meta.shape)}" + (f" or {unpadded}" if dim is not None else "")
                raise ValueError(f"{name}: expected shape {allowed}, got {list(shape)}")
            full = torch.zeros(meta.shape, dtype=self.dtype)
            full.narrow(dim, 0, meta.vocab_size).copy_(tensor)
            tensor = full
        self._writer.write(name, tensor.detach().to(device="cpu", dtype=self.dtype))

    def finalize(self) -> Path:
        """Check every tensor was added, write ``metadata.json`` and publish the directory."""
        if self._done:
            return self.path
        missing = self.missing
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"cannot finalize {self.path}: {len(missing)} tensor(s) were never added: {shown}")
        self._writer.close()
        to_dict = getattr(self.model_config, "to_dict", None)
        metadata = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "iteration": self.iteration,
            "layout": Layout().to_dict(),
            "model_config": to_dict() if to_dict else dict(self.model_config),
            "train_config": None,
            "tensors": {
                name: dataclasses.replace(meta, dtype=dtype_name(self.dtype)).to_dict()
                for name, meta in self.expected.items()
            },
        }
        write_json_atomic(self._tmp / METADATA_FILE, metadata)
        fsync_tree(self._tmp)
        os.replace(self._tmp, self.path)
        self._done = True
        return self.path

    def abort(self) -> None:
        """Discard everything written so far."""
        self._writer.abort()
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._done = True

    def __enter__(self) -> ModelCheckpointWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
