"""``mcore-train preprocess``: JSONL text to a Megatron ``.bin/.idx`` indexed dataset.

    mcore-train preprocess --input data.jsonl --tokenizer PATH_OR_HF_ID --output-prefix out --append-eod

Each non-blank line of the input is a JSON object; the text under ``--json-key`` becomes one document. Lines are
tokenized in worker processes (``--workers``) in chunks and written in input order, so the output does not
depend on the number of workers. The files appear only when complete (``IndexedDatasetWriter``).

``add_preprocess_arguments`` / ``run_preprocess`` plug into the ``mcore-train`` command line; ``main_preprocess``
runs standalone (``python -m mcore.train.preprocess``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from mcore.train.data.indexed import IndexedDatasetWriter, bin_path, idx_path, token_dtype_for_vocab
from mcore.train.errors import UserError
from mcore.train.output_paths import CreatedDirs, check_output_prefix
from mcore.train.tokenizer import BYTE_TOKENIZER_NAME, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

_LINE = tuple[int, bytes]  # (1-based line number, raw line)


class PreprocessError(UserError, ValueError):
    """Input that cannot be preprocessed: a missing file, a malformed line, a missing key."""


@dataclass(frozen=True)
class PreprocessStats:
    """What one preprocess run wrote."""

    documents: int
    skipped_empty: int
    tokens: int
    input_bytes: int
    seconds: float
    dtype: str


@dataclass(frozen=True)
class _ChunkResult:
    num_bytes: int
    documents: list[np.ndarray]
    error: str | None  # "LINE: message" for the first bad line of the chunk


def _encode_lines(
    tokenizer: Tokenizer, lines: list[_LINE], json_key: str, eod_id: int | None, dtype: np.dtype
) -> _ChunkResult:
    documents: list[np.ndarray] = []
    num_bytes = 0
    for line_no, raw in lines:
        num_bytes += len(raw)
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except UnicodeDecodeError as exc:
            return _ChunkResult(num_bytes, documents, f"{line_no}: not valid UTF-8 ({exc.reason} at byte {exc.start})")
        except json.JSONDecodeError as exc:
            return _ChunkResult(num_bytes, documents, f"{line_no}: invalid JSON ({exc.msg} at column {exc.colno})")
        if not isinstance(record, dict):
            kind = type(record).__name__
            return _ChunkResult(num_bytes, documents, f"{line_no}: expected a JSON object, got a JSON {kind}")
        if json_key not in record:
            keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
            return _ChunkResult(
                num_bytes, documents, f"{line_no}: no key {json_key!r} (keys: {keys}); pick one with --json-key"
            )
        text = record[json_key]
        if not isinstance(text, str):
            kind = type(text).__name__
            return _ChunkResult(num_bytes, documents, f"{line_no}: {json_key!r} holds a {kind}, expected a string")
        ids = tokenizer.encode(text)
        if eod_id is not None:
            ids = [*ids, eod_id]
        documents.append(np.asarray(ids, dtype=dtype))
    return _ChunkResult(num_bytes, documents, None)


# Per worker process only: set once by the pool initializer, so the tokenizer is loaded once per worker rather
# than sent with every chunk. The parent process never sets it.
_worker_args: tuple[Tokenizer, str, int | None, np.dtype] | None = None


def _init_worker(tokenizer: Tokenizer, json_key: str, eod_id: int | None, dtype: np.dtype) -> None:
    global _worker_args
    # Each worker is one process; the tokenizer's own thread pool would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_args = (tokenizer, json_key, eod_id, dtype)


def _encode_in_worker(lines: list[_LINE]) -> _ChunkResult:
    if _worker_args is None:
        raise RuntimeError("_encode_in_worker runs only in pool workers started with _init_worker")
    tokenizer, json_key, eod_id, dtype = _worker_args
    return _encode_lines(tokenizer, lines, json_key, eod_id, dtype)


def _read_chunks(stream: BinaryIO, chunk_size: int) -> Iterator[list[_LINE]]:
    chunk: list[_LINE] = []
    for line_no, raw in enumerate(stream, start=1):
        chunk.append((line_no, raw))
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _ordered_bounded_map(pool: Any, fn: Callable, items: Iterable, max_pending: int) -> Iterator:
    """``pool.imap`` that keeps at most ``max_pending`` tasks in flight (imap reads its input eagerly)."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _prepare_output(prefix: str, overwrite: bool) -> CreatedDirs:
    """Refuse existing outputs (without ``overwrite``) and an unwritable location; make the output folder,
    which the returned :class:`CreatedDirs` removes again (when empty) if the run fails."""
    existing = [p for p in (bin_path(prefix), idx_path(prefix)) if os.path.exists(p)]
    if existing and not overwrite:
        raise PreprocessError(f"output {existing[0]} already exists; pass --overwrite to replace it")
    check_output_prefix(prefix, "--output-prefix", PreprocessError)
    made = CreatedDirs()
    made.make(Path(prefix).parent)
    return made


def preprocess_jsonl(
    input_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    json_key: str = "text",
    append_eod: bool = False,
    workers: int = 1,
    chunk_size: int = 256,
    progress: bool = True,
    overwrite: bool = False,
) -> PreprocessStats:
    """Tokenize the JSONL file ``input_path`` into ``output_prefix.bin/.idx``; see the module docstring.

    Documents that come out empty (blank text without ``append_eod``) are skipped and counted. Raises
    ``PreprocessError`` for a missing input, a bad line (``file:line: ...``) or existing outputs without
    ``overwrite``; nothing is written then.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    source = Path(input_path)
    if not source.exists():
        raise PreprocessError(f"input file {str(source)!r} not found")
    if not source.is_file():
        raise PreprocessError(f"input {str(source)!r} is not a file (expected a JSONL file, one JSON object a line)")
    prefix = os.fspath(output_prefix)
    made = _prepare_output(prefix, overwrite)
    eod_id = tokenizer.eod_id if append_eod else None
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)

    started = time.perf_counter()
    total_bytes = source.stat().st_size
    documents = skipped = tokens = done_bytes = 0
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="preprocess", disable=not progress)
    pool = None
    try:
        with made, open(source, "rb") as stream, IndexedDatasetWriter(prefix, dtype) as writer:
            chunks = _read_chunks(stream, chunk_size)
            if workers == 1:
                results: Iterable[_ChunkResult] = (
                    _encode_lines(tokenizer, chunk, json_key, eod_id, dtype) for chunk in chunks
                )
            else:
                pool = multiprocessing.Pool(workers, _init_worker, (tokenizer, json_key, eod_id, dtype))
                results = _ordered_bounded_map(pool, _encode_in_worker, chunks, max_pending=4 * workers)
            for result in results:
                for ids in result.documents:
                    if ids.size == 0:
                        skipped += 1
                        continue
                    writer.add_document(ids)
                    documents += 1
                    tokens += int(ids.size)
                if result.error is not None:
                    raise PreprocessError(f"{source}:{result.error}")
                done_bytes += result.num_bytes
                bar.update(result.num_bytes)
                bar.set_postfix(docs=documents, refresh=False)
            if documents == 0:
                # An empty .bin cannot be memory-mapped (Megatron's reader fails on it) and trains nothing.
                raise PreprocessError(f"{source}: no non-empty documents under key {json_key!r}; nothing to write")
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return PreprocessStats(
        documents=documents,
        skipped_empty=skipped,
        tokens=tokens,
        input_bytes=done_bytes,
        seconds=time.perf_counter() - started,
        dtype=str(dtype),
    )


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``preprocess`` options to ``parser`` (the ``mcore-train preprocess`` subparser) and return it."""
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object a line")
    parser.add_argument("--output-prefix", required=True, help="write OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    parser.add_argument(
        "--tokenizer",
        default=BYTE_TOKENIZER_NAME,
        help="'byte' (UTF-8 bytes), a tokenizer.json, a directory holding one, or a Hugging Face Hub id "
        "(default: byte)",
    )
    parser.add_argument("--json-key", default="text", help="the key holding each document's text (default: text)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--eod-token", default=None, help="the eod token's text, when the tokenizer does not name one")
    parser.add_argument(
        "--workers",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) - 1)),
        help="tokenizer processes (default: cores - 1, at most 8)",
    )
    parser.add_argument("--chunk-size", type=int, default=256, help="lines per task sent to a worker (default: 256)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run_preprocess(args: argparse.Namespace) -> int:
    """Run ``preprocess`` from parsed arguments; prints a summary and returns 0. Bad input raises ``UserError``."""
    if args.workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {args.workers}")
    if args.chunk_size < 1:
        raise PreprocessError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    check_output_prefix(args.output_prefix, "--output-prefix", PreprocessError)  # before loading a tokenizer
    if args.tokenizer == BYTE_TOKENIZER_NAME:
        if args.eod_token is not None:
            raise PreprocessError("--eod-token applies to Hugging Face tokenizers; the byte tokenizer's eod is fixed")
        tokenizer: ByteTokenizer | HFTokenizer = ByteTokenizer()
    else:
        tokenizer = load_tokenizer(args.tokenizer, eod_token=args.eod_token)
    stats = preprocess_jsonl(
        args.input,
        args.output_prefix,
        tokenizer,
        json_key=args.json_key,
        append_eod=args.append_eod,
        workers=args.workers,
        chunk_size=args.chunk_size,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    skipped = f", skipped {stats.skipped_empty} empty" if stats.skipped_empty else ""
    print(
        f"preprocess: wrote {stats.documents} documents{skipped}, {stats.tokens} tokens ({stats.dtype}) to "
        f"{bin_path(args.output_prefix)} and {idx_path(args.output_prefix)} in {stats.seconds:.1f} s"
    )
    return 0


def main_preprocess(argv: list[str] | None = None) -> int:
    """Standalone entry point: parse ``argv``, run, and turn a ``UserError`` into one line on stderr (exit 2)."""
    parser = add_preprocess_arguments(
        argparse.ArgumentParser(prog="mcore-train preprocess", description=__doc__.split("\n\n")[0])
    )
    args = parser.parse_args(argv)
    try:
        return run_preprocess(args)
    except UserError as exc:
        print(f"mcore-train preprocess: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main_preprocess())
