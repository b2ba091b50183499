"""Streaming reads of safetensors files: validated headers and one tensor at a time.

The safetensors library reads through a memory map whose touched pages stay resident while the file is open.
Conversion must stay within a memory budget of about two tensors, so this module parses the (documented, tiny)
header itself, validates it completely (a truncated download fails before anything is written), and reads one
tensor with a single ``readinto`` into its final buffer. Writing uses mcore-train's streaming writer.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore.bridge.dtypes import SAFETENSORS_TO_TORCH
from mcore.bridge.errors import BridgeError

_MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library enforces

if sys.byteorder != "little":  # safetensors stores little-endian data; we copy raw bytes
    raise ImportError("mcore.bridge reads and writes raw safetensors bytes and needs a little-endian machine")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in a safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute byte offset of the first element in the file
    nbytes: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorEntry]  # in file order
    metadata: dict[str, str] | None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate a safetensors header without touching the tensor data.

    Raises BridgeError for a file that is truncated, has a malformed header, an unknown dtype or offsets that do not
    tile the data section, so that a bad file fails the conversion before anything is written.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise BridgeError(f"{path}: truncated safetensors file ({size} bytes, fewer than the 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise BridgeError(
                f"{path}: truncated or corrupt safetensors file: header claims {header_len} bytes but the file has "
                f"{size} bytes; re-download or re-save it"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BridgeError(f"{path}: corrupt safetensors header ({exc}); re-download or re-save it") from None
    if not isinstance(header, dict):
        raise BridgeError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, expected an object)")
    metadata = header.pop("__metadata__", None)
    data_start = 8 + header_len
    entries: list[TensorEntry] = []
    for name, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise BridgeError(f"{path}: corrupt safetensors header entry for {name!r}: {info!r}") from None
        if code not in SAFETENSORS_TO_TORCH:
            raise BridgeError(
                f"{path}: tensor {name!r} has dtype {code!r}, which the bridge does not handle; "
                f"supported: {', '.join(SAFETENSORS_TO_TORCH)}"
            )
        dtype = SAFETENSORS_TO_TORCH[code]
        nbytes = _numel(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise BridgeError(
                f"{path}: tensor {name!r} of shape {list(shape)} {code} needs {nbytes} bytes but its offsets "
                f"[{begin}, {end}) span {end - begin}"
            )
        entries.append(TensorEntry(name, dtype, shape, path, data_start + begin, nbytes))
    entries.sort(key=lambda e: e.offset)
    expected = data_start
    for e in entries:
        if e.offset != expected:
            raise BridgeError(f"{path}: corrupt safetensors file: tensor {e.name!r} does not follow the previous one")
        expected += e.nbytes
    if expected != size:
        raise BridgeError(
            f"{path}: truncated safetensors file: its header describes {expected} bytes but the file has {size}; "
            "re-download or re-save it"
        )
    return SafetensorsHeader(path, {e.name: e for e in entries}, metadata)


class DerivedEntry(TensorEntry):
    """A tensor the bridge computes from stored ones (MXFP4 weights dequantized: ``mcore.bridge.mxfp4``); its
    ``read()`` returns it, and :func:`read_tensor` calls that."""

    def read(self) -> torch.Tensor:
        raise NotImplementedError


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """Read one tensor into a fresh buffer of exactly its size (no memory map, no intermediate copy)."""
    if isinstance(entry, DerivedEntry):
        return entry.read()
    buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
    if entry.nbytes:
        with open(entry.path, "rb", buffering=0) as f:
            f.seek(entry.offset)
            view = memoryview(buffer.numpy())
            done = 0
            while done < entry.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise BridgeError(f"{entry.path}: file ended while reading tensor {entry.name!r}; it is truncated")
                done += n
    return buffer.view(entry.dtype).reshape(entry.shape)


@dataclass(frozen=True)
class TensorSpec:
    """What will be written for one tensor before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize
