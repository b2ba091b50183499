"""Tokenizers with one small interface: ``encode(text)``, ``decode(ids)``, ``vocab_size``, ``eod_id``.

- ``ByteTokenizer``: the UTF-8 bytes of the text (ids 0-255) plus three special tokens; needs no files. The
  embedded demo corpus uses it.
- ``HFTokenizer``: a Hugging Face ``tokenizers`` tokenizer from a local ``tokenizer.json`` (or a directory holding
  one) or from a Hub model id, fetched through ``huggingface_hub`` (served from the local cache when offline).

``load_tokenizer("byte")`` or ``load_tokenizer(path_or_id)`` picks one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mcore.train.errors import UserError

BYTE_TOKENIZER_NAME = "byte"
# Names Hugging Face tokenizers commonly give the end-of-document token, tried in this order when the tokenizer's
# config does not name its eos token.
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be found, loaded or used as asked."""


@runtime_checkable
class Tokenizer(Protocol):
    """The interface the data pipeline and the trainer use."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then ``eod`` (256), ``pad`` (257) and ``bos`` (258): ``vocab_size`` 259."""

    eod_id = 256
    pad_id = 257
    bos_id = 258
    vocab_size = 259
    _SPECIAL_TEXT = {256: "<|eod|>", 257: "<|pad|>", 258: "<|bos|>"}

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``; no special tokens are added."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as a uint16 array, without building a Python list (for large corpora)."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Bytes back to text; invalid UTF-8 (a sample cut inside a character) becomes U+FFFD.

        Special tokens are dropped, or written as ``<|eod|>``, ``<|pad|>``, ``<|bos|>`` when
        ``skip_special_tokens=False``.
        """
        values = [int(i) for i in ids]
        bad = [i for i in values if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ByteTokenizer ids are in [0, {self.vocab_size}), got {bad[:5]}")
        out: list[str] = []
        run = bytearray()
        for i in values:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens:
                out.append(self._SPECIAL_TEXT[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _resolve_local(path: Path) -> tuple[Path, Path | None]:
    """(tokenizer.json, tokenizer_config.json or None) for a file or a directory."""
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(
                f"tokenizer directory {str(path)!r} holds no tokenizer.json (only fast Hugging Face tokenizers "
                "are supported; save one with tokenizer.save_pretrained or tokenizers.Tokenizer.save)"
            )
    else:
        file = path
    config = file.parent / "tokenizer_config.json"
    return file, config if config.is_file() else None


def _download(
    repo_id: str, revision: str | None, cache_dir: str | None, local_files_only: bool
) -> tuple[Path, Path | None]:
    """(tokenizer.json, tokenizer_config.json or None) from the Hub or its local cache."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def fetch(filename: str) -> str:
        return hf_hub_download(
            repo_id, filename, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
        )

    try:
        file = Path(fetch("tokenizer.json"))
    except LocalEntryNotFoundError:
        raise TokenizerError(
            f"tokenizer {repo_id!r} is neither a local path nor in the Hugging Face cache, and it cannot be "
            "downloaded (offline, HF_HUB_OFFLINE=1, or local_files_only); download it while online or pass a "
            "local path to tokenizer.json"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise TokenizerError(
            f"tokenizer {repo_id!r}: no such local path, and the Hugging Face Hub has no such repository or "
            f"revision ({type(exc).__name__}); check the name, or log in for a gated/private repository"
        ) from None
    except EntryNotFoundError:
        raise TokenizerError(
            f"Hugging Face repository {repo_id!r} has no tokenizer.json (only fast tokenizers are supported)"
        ) from None
    except HFValidationError:
        raise TokenizerError(
            f"tokenizer {repo_id!r} is not an existing local path and not a valid Hugging Face repository id "
            "(expected 'org/name')"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise TokenizerError(f"tokenizer {repo_id!r}: download failed: {exc}") from None
    try:
        config: Path | None = Path(fetch("tokenizer_config.json"))
    except (LocalEntryNotFoundError, EntryNotFoundError, HfHubHTTPError, OSError):
        config = None  # optional: only consulted for the name of the eos token
    return file, config


def _eos_from_config(config: Path | None) -> str | None:
    if config is None:
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    eos = data.get("eos_token") if isinstance(data, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizers`` library) behind the common interface.

    ``name_or_path`` is a ``tokenizer.json`` file, a directory holding one, or a Hub repository id. The
    end-of-document token is ``eod_token`` when given, else the ``eos_token`` of ``tokenizer_config.json``, else
    the first present of ``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``, ``<|eos|>``.
    ``add_special_tokens`` follows Hugging Face (True: the tokenizer's post-processor may add e.g. BOS).
    """

    def __init__(
        self,
        name_or_path: str | os.PathLike,
        *,
        eod_token: str | None = None,
        add_special_tokens: bool = True,
        revision: str | None = None,
        cache_dir: str | None = None,
        local_files_only: bool = False,
    ) -> None:
        self.name = os.fspath(name_or_path)
        local = Path(self.name).expanduser()
        if local.exists():
            file, config = _resolve_local(local)
        elif not _HUB_ID.fullmatch(self.name) or self.name.endswith(".json"):
            raise TokenizerError(f"tokenizer path {self.name!r} not found (and it is no Hub id of the form 'org/name')")
        else:
            file, config = _download(self.name, revision, cache_dir, local_files_only)
        self.add_special_tokens = add_special_tokens
        self._load(file)
        self._eod_id = self._find_eod(eod_token, _eos_from_config(config))

    def _load(self, file: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tokenizer = RustTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception for malformed files
            raise TokenizerError(f"cannot load tokenizer file {str(file)!r}: {exc}") from None
        self.path = file

    def _find_eod(self, explicit: str | None, from_config: str | None) -> int | None:
        if explicit is not None:
            token_id = self._tokenizer.token_to_id(explicit)
            if token_id is None:
                raise TokenizerError(f"eod_token {explicit!r} is not in the vocabulary of tokenizer {self.name!r}")
            return token_id
        for candidate in ((from_config,) if from_config else ()) + _EOD_CANDIDATES:
            token_id = self._tokenizer.token_to_id(candidate)
            if token_id is not None:
                return token_id
        return None

    def __getstate__(self) -> dict[str, Any]:
        # Rebuilt from the resolved file in the receiving process: no Hub access there.
        return {"name": self.name, "path": str(self.path), "eod": self._eod_id, "special": self.add_special_tokens}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name = state["name"]
        self.add_special_tokens = state["special"]
        self._eod_id = state["eod"]
        self._load(Path(state["path"]))

    @property
    def vocab_size(self) -> int:
        """Ids in use, added tokens included (the model's embedding may be padded beyond it)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        """The end-of-document token id; raises ``TokenizerError`` when the tokenizer has none."""
        if self._eod_id is None:
            raise TokenizerError(
                f"tokenizer {self.name!r} has no recognizable end-of-document token; name it explicitly "
                "(eod_token=..., or --eod-token for preprocess)"
            )
        return self._eod_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode takes a str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs: Any) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` gives the ``ByteTokenizer``; anything else is passed to ``HFTokenizer`` with ``kwargs``."""
    if os.fspath(name_or_path) == BYTE_TOKENIZER_NAME:
        if kwargs:
            raise TypeError(f"the byte tokenizer takes no options, got {sorted(kwargs)}")
        return ByteTokenizer()
    return HFTokenizer(name_or_path, **kwargs)
