"""A real-text corpus that exists on a machine without internet: the Python standard library's own sources.

The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (sorted by path, the ``test`` packages left out, one
document per file, up to ``max_bytes``) are written as JSONL and tokenized with mcore-train's byte tokenizer into a
Megatron ``.bin/.idx`` prefix (``mcore.train.preprocess``). Code and docstrings in English: text with real structure
that every Python install carries, the same for every run on one machine. ``describe`` says which text it was.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"test", "tests", "idle_test"} & set(p.parts))
    return [p for p in files if "site-packages" not in p.parts]


def build_corpus(out_dir: Path, max_bytes: int) -> tuple[str, dict[str, Any]]:
    """Write ``out_dir/stdlib.jsonl`` and its byte-tokenized ``out_dir/stdlib`` prefix; return (prefix, description)."""
    from mcore.train.preprocess import preprocess_jsonl
    from mcore.train.tokenizer import load_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl, prefix = out_dir / "stdlib.jsonl", out_dir / "stdlib"
    total = documents = 0
    with jsonl.open("w") as stream:
        for path in stdlib_files():
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            stream.write(json.dumps({"text": text}) + "\n")
            total, documents = total + len(text.encode()), documents + 1
            if total >= max_bytes:
                break
    if documents == 0:
        raise RuntimeError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
    stats = preprocess_jsonl(jsonl, prefix, load_tokenizer("byte"), append_eod=True, progress=False, overwrite=True)
    jsonl.unlink()  # the .bin/.idx hold the same text
    description = {
        "text": "Python standard library sources (.py, test packages excluded), byte tokenizer",
        "root": sysconfig.get_paths()["stdlib"],
        "documents": documents,
        "bytes": total,
        "tokens": stats.tokens,
    }
    return str(prefix), description
