"""Megatron's indexed dataset format: ``PREFIX.bin`` (token ids back to back) and ``PREFIX.idx`` (the index).

``PREFIX.idx`` is little-endian: the 9 bytes ``MMIDIDX\\x00\\x00``; u64 version (1); u8 dtype code; u64 sequence
count ``n``; u64 document count ``d``; int32[n] sequence lengths (tokens); int64[n] byte offsets of the sequences
in ``.bin``; int64[d] document boundaries as sequence indices (``0, ..., n``); optionally int8[n] sequence modes
(multimodal data only). Files written here are read by ``megatron.core.datasets.indexed_dataset.IndexedDataset``
and files written by Megatron's ``IndexedDatasetBuilder`` are read here.
"""

from __future__ import annotations

import array
import os
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mcore.train.data.errors import DataError
from mcore.train.data.validation import check_index, check_span

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_OF_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_OF_CODE.items()}
# The writer stores token ids, so only the integer codes make sense for it.
_TOKEN_DTYPES = tuple(dtype for dtype in DTYPE_OF_CODE.values() if dtype.kind in "iu")


def bin_path(prefix: str | os.PathLike) -> str:
    """The path of the token file of the dataset at ``prefix``."""
    return os.fspath(prefix) + ".bin"


def idx_path(prefix: str | os.PathLike) -> str:
    """The path of the index file of the dataset at ``prefix``."""
    return os.fspath(prefix) + ".idx"


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The storage dtype Megatron chooses for a vocabulary: uint16 below 65,500 ids, else int32."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def resolve_token_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a numpy dtype, checked to be one of the integer dtypes the ``.idx`` format can name."""
    try:
        resolved = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype must name a numpy integer dtype such as 'uint16' or 'int32', got {dtype!r}") from exc
    if resolved not in _TOKEN_DTYPES:
        valid = ", ".join(str(d) for d in _TOKEN_DTYPES)
        raise ValueError(f"token dtype must be one of {valid} (the integer codes of the .idx format), got {resolved}")
    return resolved


class TokenDocuments(Protocol):
    """What sample building needs from a tokenized corpus; ``IndexedDataset`` and ``InMemoryIndexedDataset`` have it."""

    @property
    def sequence_lengths(self) -> np.ndarray: ...

    def __len__(self) -> int: ...

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


class IndexedDataset:
    """Memory-mapped reader of a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

    ``dataset[i]`` is the token array of sequence ``i`` (a read-only numpy view of the mapped file);
    ``dataset.get(i, offset, length)`` reads part of it. Pickling reopens the files by path, so the object can be
    sent to ``DataLoader`` worker processes without copying the data.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self._prefix = os.fspath(prefix)
        self._open()

    def _open(self) -> None:
        idx_file, bin_file = idx_path(self._prefix), bin_path(self._prefix)
        missing = [path for path in (bin_file, idx_file) if not os.path.isfile(path)]
        if missing:
            raise DataError(
                f"indexed dataset {self._prefix!r}: {' and '.join(missing)} not found (a dataset is the pair "
                "PREFIX.bin and PREFIX.idx, as written by `mcore-train preprocess`; pass the prefix without extension)"
            )
        idx_size = os.path.getsize(idx_file)
        if idx_size < _HEADER.size:
            raise DataError(f"{idx_file}: {idx_size} bytes is shorter than the {_HEADER.size}-byte .idx header")
        with open(idx_file, "rb") as f:
            magic, version, code, n, d = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{idx_file}: not a Megatron .idx file (first bytes {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise DataError(f"{idx_file}: .idx version {version} is not supported (expected {VERSION})")
        if code not in DTYPE_OF_CODE:
            raise DataError(f"{idx_file}: unknown dtype code {code} (valid codes: {sorted(DTYPE_OF_CODE)})")
        body = 4 * n + 8 * n + 8 * d
        if idx_size == _HEADER.size + body:
            has_modes = False
        elif idx_size == _HEADER.size + body + n:
            has_modes = True
        else:
            raise DataError(
                f"{idx_file}: {idx_size} bytes does not match its header ({n} sequences, {d} document boundaries "
                f"need {_HEADER.size + body} bytes, or {_HEADER.size + body + n} with modes); truncated or corrupt"
            )
        self._dtype = DTYPE_OF_CODE[code]
        mapped = np.memmap(idx_file, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self._lengths = np.frombuffer(mapped, dtype="<i4", count=n, offset=offset)
        offset += 4 * n
        self._pointers = np.frombuffer(mapped, dtype="<i8", count=n, offset=offset)
        offset += 8 * n
        self._doc_indices = np.frombuffer(mapped, dtype="<i8", count=d, offset=offset)
        offset += 8 * d
        self._modes = np.frombuffer(mapped, dtype=np.int8, count=n, offset=offset) if has_modes else None
        self._check_index(idx_file, n, d)

        bin_size = os.path.getsize(bin_file)
        if n > 0:
            ends = self._pointers + self._lengths.astype(np.int64) * self._dtype.itemsize
            if int(ends.max()) > bin_size or int(self._pointers.min()) < 0:
                raise DataError(
                    f"{bin_file}: {bin_size} bytes, but {idx_file} points up to byte {int(ends.max())}; the .bin file "
                    "is truncated or belongs to another index"
                )
        # np.memmap refuses empty files; an empty dataset has nothing to map.
        little = self._dtype.newbyteorder("<")
        self._tokens = np.memmap(bin_file, mode="r", dtype=little) if bin_size else np.empty(0, little)
        self._bin_bytes = bin_size

    def _check_index(self, idx_file: str, n: int, d: int) -> None:
        docs = self._doc_indices
        if d < 1 or docs[0] != 0 or docs[-1] != n:
            first = int(docs[0]) if d else None
            last = int(docs[-1]) if d else None
            raise DataError(
                f"{idx_file}: document boundaries must start at 0 and end at the sequence count {n}, "
                f"got {d} boundaries from {first} to {last}"
            )
        if d > 1 and bool((np.diff(docs) < 0).any()):
            raise DataError(f"{idx_file}: document boundaries are not non-decreasing")
        if n and int(self._lengths.min()) < 0:
            raise DataError(f"{idx_file}: negative sequence length {int(self._lengths.min())}")

    def __getstate__(self) -> dict[str, str]:
        return {"prefix": self._prefix}

    def __setstate__(self, state: dict[str, str]) -> None:
        self._prefix = state["prefix"]
        self._open()

    @property
    def prefix(self) -> str:
        """The path prefix this dataset was opened from."""
        return self._prefix

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype of the tokens."""
        return self._dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 ``[n]``: tokens per sequence."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 ``[n]``: byte offset of each sequence in ``.bin``."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 ``[documents + 1]``: document ``k`` is sequences ``document_indices[k]:document_indices[k + 1]``."""
        return self._doc_indices

    @property
    def sequence_modes(self) -> np.ndarray | None:
        """int8 ``[n]`` modes of multimodal data, or ``None`` when the file has none."""
        return self._modes

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return int(self._lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return int(self._lengths.shape[0])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``index`` (to its end when ``length`` is ``None``)."""
        i = check_index(index, len(self), f"sequences in {self._prefix!r}")
        length = check_span(i, int(self._lengths[i]), offset, length)
        start = int(self._pointers[i]) // self._dtype.itemsize + offset
        return np.asarray(self._tokens[start : start + length])

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self._prefix!r}, sequences={len(self)}, "
            f"documents={len(self._doc_indices) - 1}, dtype={self._dtype})"
        )


class IndexedDatasetWriter:
    """Writes a ``PREFIX.bin`` / ``PREFIX.idx`` pair, one document (one sequence) per ``add_document`` call.

    The files are written under temporary names next to the target and renamed by ``finalize()``, so a reader never
    sees a half-written dataset. Used as a context manager it finalizes on success and removes the temporary files
    when an exception escapes.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: Any = np.uint16) -> None:
        self._prefix = os.fspath(prefix)
        self._dtype = resolve_token_dtype(dtype)
        parent = Path(self._prefix).parent
        if not parent.is_dir():
            raise DataError(f"cannot write indexed dataset {self._prefix!r}: directory {str(parent)!r} does not exist")
        tag = f".tmp-{uuid.uuid4().hex}"
        self._tmp_bin = bin_path(self._prefix) + tag
        self._tmp_idx = idx_path(self._prefix) + tag
        self._lengths = array.array("q")
        self._file = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed by finalize() or abort()
        self._done = False
        info = np.iinfo(self._dtype)
        self._min, self._max = int(info.min), int(info.max)

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype of the tokens."""
        return self._dtype

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        """Tokens added so far."""
        return int(sum(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document of token ids (any integer sequence, array or CPU tensor) as one sequence."""
        if self._done:
            raise RuntimeError(f"indexed dataset writer for {self._prefix!r} is already finalized or aborted")
        values = np.asarray(tokens)
        if values.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {values.shape}")
        if values.size and values.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got dtype {values.dtype}")
        if values.size:
            low, high = int(values.min()), int(values.max())
            if low < self._min or high > self._max:
                raise ValueError(
                    f"token ids span [{low}, {high}], outside the range [{self._min}, {self._max}] of the storage "
                    f"dtype {self._dtype}; write with dtype=int32 for vocabularies of 65,500 ids or more"
                )
        if values.size > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {values.size} tokens exceeds the format's int32 sequence length")
        self._file.write(values.astype(self._dtype.newbyteorder("<"), copy=False).tobytes())
        self._lengths.append(int(values.size))

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        if self._done:
            raise RuntimeError(f"indexed dataset writer for {self._prefix!r} is already finalized or aborted")
        self._done = True
        try:
            self._file.close()
            lengths = np.frombuffer(self._lengths, dtype=np.int64) if self._lengths else np.zeros(0, np.int64)
            pointers = np.zeros(len(lengths), dtype="<i8")
            if len(lengths) > 1:
                np.cumsum(lengths[:-1] * self._dtype.itemsize, out=pointers[1:])
            documents = np.arange(len(lengths) + 1, dtype="<i8")
            with open(self._tmp_idx, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self._dtype], len(lengths), len(documents)))
                f.write(lengths.astype("<i4").tobytes())
                f.write(pointers.tobytes())
                f.write(documents.tobytes())
            # The .idx is renamed last: its presence marks the pair as complete.
            os.replace(self._tmp_bin, bin_path(self._prefix))
            os.replace(self._tmp_idx, idx_path(self._prefix))
        except BaseException:
            self._remove_temporaries()
            raise

    def abort(self) -> None:
        """Discard everything written; the target files are left as they were."""
        if self._done:
            return
        self._done = True
        self._file.close()
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
