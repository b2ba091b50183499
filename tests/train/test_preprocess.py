"""``preprocess``: JSONL -> .bin/.idx, read back by Megatron-Core's reader; bad input gives one clear error."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mcore.train.data import IndexedDataset
from mcore.train.errors import UserError
from mcore.train.preprocess import PreprocessError, add_preprocess_arguments, run_preprocess
from mcore.train.tokenizer import TokenizerError

WORDS = ["river", "stone", "lantern", "über", "東京", "quiet", "fox", "🙂", "mill", "and", "the", "a"]


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def _write_jsonl(path, texts: list[str], key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for k, text in enumerate(texts):
            f.write(json.dumps({"id": k, key: text, "meta": {"source": "test"}}, ensure_ascii=k % 2 == 0) + "\n")
            if k == 3:
                f.write("\n")  # blank lines are skipped
    return str(path)


def _run(*argv: str) -> int:
    parser = add_preprocess_arguments(argparse.ArgumentParser())
    return run_preprocess(parser.parse_args([*argv, "--no-progress"]))


def _megatron_docs(prefix: str) -> list[list[int]]:
    theirs = MegatronIndexedDataset(prefix)
    return [theirs[k].astype(np.int64).tolist() for k in range(len(theirs))]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_texts(0, 50), trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_byte_tokenizer_end_to_end_with_one_and_two_workers(tmp_path):
    texts = _texts(1, 300)
    source = _write_jsonl(tmp_path / "in.jsonl", texts)
    out1, out2 = str(tmp_path / "w1"), str(tmp_path / "w2")
    assert _run("--input", source, "--output-prefix", out1, "--append-eod", "--workers", "1") == 0
    assert _run("--input", source, "--output-prefix", out2, "--append-eod", "--workers", "2", "--chunk-size", "7") == 0
    expected = [list(text.encode("utf-8")) + [256] for text in texts]
    assert _megatron_docs(out1) == expected
    assert MegatronIndexedDataset(out1).index.dtype == np.uint16
    # The output does not depend on the number of workers or the chunking.
    for ext in (".bin", ".idx"):
        assert Path(out1 + ext).read_bytes() == Path(out2 + ext).read_bytes()
    ours = IndexedDataset(out1)
    assert [ours[k].tolist() for k in range(len(ours))] == expected


def test_hf_bpe_tokenizer_end_to_end(tmp_path, bpe_file):
    reference = Tokenizer.from_file(bpe_file)
    eod = reference.token_to_id("<|endoftext|>")
    texts = _texts(2, 120)
    source = _write_jsonl(tmp_path / "in.jsonl", texts, key="content")
    prefix = str(tmp_path / "bpe")
    argv = ["--input", source, "--output-prefix", prefix, "--tokenizer", bpe_file, "--json-key", "content"]
    assert _run(*argv, "--append-eod", "--workers", "2") == 0
    assert _megatron_docs(prefix) == [reference.encode(text).ids + [eod] for text in texts]
    # Without --append-eod the documents are the bare encodings.
    assert _run(*argv, "--overwrite", "--workers", "1") == 0
    assert _megatron_docs(prefix) == [reference.encode(text).ids for text in texts]


def test_large_vocabulary_is_stored_as_int32(tmp_path):
    vocab = {f"w{k}": k for k in range(70_000)}
    vocab["[UNK]"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    tok_file = str(tmp_path / "wordlevel.json")
    tok.save(tok_file)
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{k}" for k in rng.integers(0, 70_000, size=int(rng.integers(1, 30)))) for _ in range(50)]
    prefix = str(tmp_path / "big")
    source = _write_jsonl(tmp_path / "in.jsonl", texts)
    assert _run("--input", source, "--output-prefix", prefix, "--tokenizer", tok_file, "--append-eod") == 0
    assert MegatronIndexedDataset(prefix).index.dtype == np.int32
    eod = tok.token_to_id("</s>")
    assert _megatron_docs(prefix) == [[int(w[1:]) for w in text.split()] + [eod] for text in texts]


def _preprocess_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mcore.train.preprocess", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_cli_missing_input_exits_nonzero_with_one_line(tmp_path):
    result = _preprocess_cli("--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o"))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "nope.jsonl" in lines[0] and "not found" in lines[0]
    assert os.listdir(tmp_path) == []


def test_cli_success_shows_progress_and_summary(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", _texts(3, 20))
    result = _preprocess_cli("--input", source, "--output-prefix", str(tmp_path / "o"), "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "docs=20" in result.stderr and "B/s" in result.stderr  # the tqdm bar: bytes and documents
    assert "wrote 20 documents" in result.stdout


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "ok"', r"bad\.jsonl:3: invalid JSON"),
        ('{"body": "no text key"}', r"bad\.jsonl:3: no key 'text' \(keys: 'body'\); pick one with --json-key"),
        ('{"text": 42}', r"bad\.jsonl:3: 'text' holds a int, expected a string"),
        ('["a", "list"]', r"bad\.jsonl:3: expected a JSON object, got a JSON list"),
    ],
)
def test_bad_lines_name_file_and_line_and_write_nothing(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "first"}\n{"text": "second"}\n' + line + '\n{"text": "fourth"}\n', encoding="utf-8")
    for workers in ("1", "2"):
        with pytest.raises(PreprocessError, match=message):
            _run("--input", str(path), "--output-prefix", str(tmp_path / "out"), "--workers", workers)
    assert os.listdir(tmp_path) == ["bad.jsonl"]


def test_invalid_utf8_is_reported(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(PreprocessError, match=r"latin1\.jsonl:2: not valid UTF-8"):
        _run("--input", str(path), "--output-prefix", str(tmp_path / "out"))


def test_existing_output_needs_overwrite(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", _texts(4, 5))
    prefix = str(tmp_path / "o")
    assert _run("--input", source, "--output-prefix", prefix) == 0
    before = Path(prefix + ".bin").read_bytes()
    with pytest.raises(PreprocessError, match=r"o\.bin already exists; pass --overwrite"):
        _run("--input", source, "--output-prefix", prefix, "--append-eod")
    assert Path(prefix + ".bin").read_bytes() == before


def test_no_documents_and_no_eod_token_are_errors(tmp_path, bpe_file):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n\n', encoding="utf-8")
    with pytest.raises(PreprocessError, match="no non-empty documents"):
        _run("--input", str(empty), "--output-prefix", str(tmp_path / "o"))
    vocab = {"a": 0, "b": 1}
    plain = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    plain.save(str(tmp_path / "plain.json"))
    source = _write_jsonl(tmp_path / "in.jsonl", ["a b"])
    with pytest.raises(TokenizerError, match="--eod-token"):
        _run(
            "--input",
            source,
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer",
            str(tmp_path / "plain.json"),
            "--append-eod",
        )
    assert issubclass(PreprocessError, UserError) and issubclass(TokenizerError, UserError)
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl", "in.jsonl", "plain.json"]
