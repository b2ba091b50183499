"""Read and write Hugging Face model directories (config.json, safetensors shards, index, side files).

Reading parses only headers: tensors are read later, one at a time, by :func:`mcore.bridge.safetensors_io.read_tensor`.
Writing streams: :class:`HFWriter` plans the shards from the tensor list, then appends tensors as they arrive and
rebuilds ``model.safetensors.index.json`` from what was actually written.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mcore.bridge import mxfp4
from mcore.bridge.errors import BridgeError
from mcore.bridge.safetensors_io import TensorEntry, TensorSpec, read_header
from mcore.train.checkpoint.safetensors_stream import SafetensorsStreamWriter

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# weights in formats we do not read; never copied as side files (they would duplicate the model in another format)
_FOREIGN_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_FOREIGN_INDEXES = ("pytorch_model.bin.index.json", "tf_model.h5.index.json", "flax_model.msgpack.index.json")


@dataclass
class HFCheckpoint:
    """A Hugging Face model directory: its config, where each tensor lies, and the files to carry along."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorEntry]
    side_files: list[Path] = field(default_factory=list)  # tokenizer, generation config...: copied verbatim
    skipped: list[str] = field(default_factory=list)  # entries not carried, each with the reason

    @property
    def weight_files(self) -> list[Path]:
        return sorted({e.path for e in self.tensors.values()})


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise BridgeError(f"{path}: no {CONFIG_FILE}; expected a Hugging Face model directory")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BridgeError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise BridgeError(f"{file}: expected a JSON object, found a {type(config).__name__}")
    return config


def _weight_map(path: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index or the single-file layout."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise BridgeError(
                f"{index}: not a valid safetensors index ({exc!r}); expected a 'weight_map' object"
            ) from None
        if not isinstance(weight_map, dict):
            raise BridgeError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, expected an object")
        for shard in set(weight_map.values()):
            if not (path / shard).is_file():
                raise BridgeError(
                    f"{index} lists shard {shard!r}, which is missing from {path}; the download is incomplete"
                )
        return weight_map
    if (path / SINGLE_FILE).is_file():
        return {name: SINGLE_FILE for name in read_header(path / SINGLE_FILE).tensors}
    if any(path.glob("*.bin")) or any(path.glob("*.pth")):
        raise BridgeError(
            f"{path}: has only PyTorch pickle weights; the bridge reads safetensors (safe and streamable): re-save "
            "with model.save_pretrained(dir, safe_serialization=True)"
        )
    raise BridgeError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found; no weights to convert")


def read_hf_dir(path: str | os.PathLike) -> HFCheckpoint:
    """Open a Hugging Face model directory: validate every shard header, list tensors and side files."""
    path = Path(path)
    if not path.is_dir():
        raise BridgeError(f"{path}: not a directory; expected a Hugging Face model directory")
    config = read_config(path)
    weight_map = _weight_map(path)
    headers = {shard: read_header(path / shard) for shard in dict.fromkeys(weight_map.values())}
    tensors: dict[str, TensorEntry] = {}
    for name, shard in weight_map.items():
        entry = headers[shard].tensors.get(name)
        if entry is None:
            raise BridgeError(f"{path / INDEX_FILE} maps {name!r} to {shard}, which does not contain it")
        tensors[name] = entry
    for shard, header in headers.items():
        unlisted = [n for n in header.tensors if weight_map.get(n) != shard]
        if unlisted:
            raise BridgeError(
                f"{path / shard} holds tensors the index does not map to it ({', '.join(unlisted[:3])}); "
                "the index and shards disagree"
            )
    side_files, skipped = list_side_files(path, set(headers))
    tensors = mxfp4.dequantized_view(tensors, config, str(path / CONFIG_FILE))  # MXFP4 pairs read as bf16
    return HFCheckpoint(path, config, tensors, side_files, skipped)


def list_side_files(path: Path, weight_files: set[str] = frozenset()) -> tuple[list[Path], list[str]]:
    """Top-level files of an HF directory to carry verbatim (tokenizer, generation config, chat template, README),
    and the entries deliberately not carried, each with the reason. ``config.json`` and weights are excluded."""
    side_files, skipped = [], []
    for entry in sorted(path.iterdir()):
        name = entry.name
        if name in (CONFIG_FILE, INDEX_FILE) or name.startswith("."):
            continue
        if entry.is_dir():
            skipped.append(f"{name}/ (a directory; only top-level files are carried)")
        elif name.endswith(".safetensors"):
            if name not in weight_files:
                skipped.append(f"{name} (not referenced by the weight index)")
        elif name.endswith(_FOREIGN_WEIGHTS) or name in _FOREIGN_INDEXES:
            skipped.append(f"{name} (weights in another file format)")
        elif entry.is_file():
            side_files.append(entry)
    return side_files, skipped


def shard_plan(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets its own shard)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _shard_name(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class HFWriter:
    """Write the weights of a Hugging Face directory tensor by tensor, in the order of ``specs``.

    Shards are contiguous runs of ``specs``, so each shard is complete (and closed) before the next one opens.
    """

    def __init__(self, directory: str | os.PathLike, specs: list[TensorSpec], max_shard_bytes: int):
        self.directory = Path(directory)
        shards = shard_plan(specs, max_shard_bytes)
        self._file_of = {spec.name: _shard_name(i, len(shards)) for i, shard in enumerate(shards) for spec in shard}
        self._remaining = [len(shard) for shard in shards]
        self._shards = shards
        self._index = -1
        self._writer: SafetensorsStreamWriter | None = None
        self._written: dict[str, str] = {}
        self._params = 0
        self._bytes = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._writer is None or self._remaining[self._index] == 0:
            if self._writer is not None:
                self._writer.close()
            self._index += 1
            if self._index >= len(self._shards):
                raise ValueError(f"{self.directory}: tensor {name!r} written after all announced tensors")
            specs = {s.name: (s.dtype, s.shape) for s in self._shards[self._index]}
            # transformers refuses safetensors files whose metadata lacks format=pt
            path = self.directory / _shard_name(self._index, len(self._shards))
            self._writer = SafetensorsStreamWriter(path, specs, {"format": "pt"})
        if self._file_of.get(name) != self._writer.path.name:
            raise ValueError(f"{self.directory}: tensor {name!r} arrived out of the announced order")
        self._writer.write(name, tensor)
        self._written[name] = self._writer.path.name
        self._remaining[self._index] -= 1
        self._params += tensor.numel()
        self._bytes += tensor.numel() * tensor.element_size()

    def finish(self) -> None:
        """Close the last shard and, for several shards, write the index of what was written."""
        if self._writer is not None:
            self._writer.close()
        if self._index != len(self._shards) - 1 or any(self._remaining):
            raise ValueError(f"{self.directory}: closed before every announced tensor was written")
        if len(self._shards) > 1:
            index = {
                "metadata": {"total_parameters": self._params, "total_size": self._bytes},
                "weight_map": dict(sorted(self._written.items())),
            }
            write_json(self.directory / INDEX_FILE, index)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def write_config(directory: Path, config: dict[str, Any], original: Path | None = None) -> None:
    """Write ``config.json``; when it equals the original file's content, copy that file byte for byte."""
    if original is not None and original.is_file():
        try:
            same = json.loads(original.read_text(encoding="utf-8")) == config
        except (UnicodeDecodeError, json.JSONDecodeError):
            same = False
        if same:
            shutil.copyfile(original, directory / CONFIG_FILE)
            return
    write_json(directory / CONFIG_FILE, config)


def copy_side_files(files: list[Path], directory: Path) -> None:
    for f in files:
        shutil.copyfile(f, directory / f.name)
