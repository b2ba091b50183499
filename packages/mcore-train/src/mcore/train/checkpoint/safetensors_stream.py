"""Write a safetensors file one tensor at a time, in any order, with constant memory.

The safetensors header lists every tensor's dtype, shape and byte range and must come first, so the
writer takes the full list of tensors up front, writes the header, and then places each tensor's bytes
at its offset as it arrives. The result is a standard file that ``safetensors.safe_open`` reads.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from mcore.train.checkpoint.dtypes import TORCH_TO_SAFETENSORS


class SafetensorsStreamWriter:
    """A safetensors file whose tensors are declared first and written later, one at a time.

    Args:
        path: file to create (must not exist).
        specs: ``name -> (dtype, shape)`` of every tensor the file will hold.
        metadata: optional string-to-string ``__metadata__`` of the file.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self._specs = dict(specs)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name in sorted(self._specs):
            dtype, shape = self._specs[name]
            if dtype not in TORCH_TO_SAFETENSORS:
                raise TypeError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self._offsets[name] = (offset, offset + size)
            header[name] = {
                "dtype": TORCH_TO_SAFETENSORS[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
        self._data_start = 8 + len(raw)
        self._written: set[str] = set()
        self._fh = open(self.path, "xb")  # noqa: SIM115 - kept open across add() calls, closed in close()
        self._fh.write(len(raw).to_bytes(8, "little"))
        self._fh.write(raw)
        self._fh.truncate(self._data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one declared tensor (dtype and shape must match its declaration exactly)."""
        if name not in self._specs:
            raise KeyError(f"tensor {name!r} was not declared for {self.path}")
        if name in self._written:
            raise ValueError(f"tensor {name!r} was already written to {self.path}")
        dtype, shape = self._specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"tensor {name!r}: declared {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        begin, end = self._offsets[name]
        if data.nbytes != end - begin:
            raise AssertionError(f"byte size of {name!r} is {data.nbytes}, expected {end - begin}")
        self._fh.seek(self._data_start + begin)
        self._fh.write(memoryview(data))
        self._written.add(name)

    @property
    def missing(self) -> list[str]:
        """Declared tensors not written yet."""
        return sorted(set(self._specs) - self._written)

    def close(self) -> None:
        """Flush and fsync; raises ``ValueError`` if a declared tensor was never written."""
        if self._fh.closed:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if self.missing:
            raise ValueError(f"{self.path}: tensors declared but never written: {self.missing}")

    def abort(self) -> None:
        """Close without checks (the caller removes the file)."""
        if not self._fh.closed:
            self._fh.close()
